"""The GPU check's frame: stages that report ``ok`` or their error, one deadline, one JSON document, a clean exit.

:class:`Run` knows nothing of GPUs; ``check.py`` gives it the stages. It

- records every stage under ``stages`` as ``{"ok": true|false|null, "error": ...,
  "seconds": ..., "budget_s": ...}`` (``null``: skipped, with ``skipped`` saying
  why; a stage never reached says so too), and names the first stage that
  failed at the top (``stage``, ``error``);
- ends with a ``cleanup`` stage on every path (normal end, a failing stage, a
  bug in the check, SIGTERM/SIGINT/SIGHUP): every process group the check
  started is stopped, every process that carries its marker is killed, and a
  check given by the stages (NVML's process list) must find the GPU as it was;
- runs a watchdog at the total deadline that does the same from its own
  thread, prints the document with what it has, and ends the process (exit 1),
  whatever the main thread is stuck in;
- prints the document once, last, on stdout: exit 0 when every stage passed,
  the stage's code when one aborted the check (2: no usable GPU), else 1.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import IO, Any

try:
    from . import budget, procs
except ImportError:  # run as a script: this directory is on sys.path
    import budget  # type: ignore[no-redef]
    import procs  # type: ignore[no-redef]

SIGNAL_GRACE_S = 20.0  # after a stop signal, the cleanup has this long before the watchdog ends it
KILL_GRACE_S = 3.0


class StageFailed(Exception):
    """The stage failed; the message is its ``error``. The check goes on with the next stage."""


class Abort(Exception):
    """The stage failed and nothing after it can run; ``code`` is the exit status (2: no usable GPU)."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def _entry(**fields: Any) -> dict[str, Any]:
    return {"ok": None, "error": None, "seconds": None, **fields}


class Run:
    """One run of the check: its report, its deadline, its children and its one JSON document."""

    def __init__(
        self,
        *,
        deadline_s: float,
        children: procs.Children,
        stages: Sequence[str] = (),
        compact: bool = False,
        out: IO[str] | None = None,
        progress: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        reserve_s: float = budget.CLEANUP_RESERVE_S,
    ) -> None:
        self.clock = clock
        self.started = clock()
        self.deadline_s = deadline_s
        self.deadline = self.started + deadline_s
        self.children = children
        self.planned = list(stages)  # the stages this run means to have, for "not reached"
        self.compact = compact
        self.out = out if out is not None else sys.stdout
        self._progress = progress
        self.reserve_s = reserve_s
        self.report: dict[str, Any] = {
            "ok": False,
            "stage": None,
            "error": None,
            "stages": {},
            "errors": [],
            "budget": {"deadline_s": deadline_s, "reserve_s": reserve_s},
            "seconds": None,
        }
        self.current: str | None = None
        # Set by a stage: () -> why the GPU is not as the check found it, or None. Run in the cleanup.
        self.gpu_check: Callable[[], str | None] | None = None
        self.quiet = threading.Event()  # set while the cleanup runs: signals are only noted
        self.at_exit: list[Callable[[], None]] = []  # run by the watchdog before it ends the process
        self._lock = threading.RLock()
        self._emitted = False
        self.watchdog: procs.Watchdog | None = None

    # --- time ---------------------------------------------------------------------------

    def now(self) -> float:
        return self.clock()

    def left(self) -> float:
        return self.deadline - self.clock()

    def slot(self, spec: budget.StageSpec, later: Sequence[budget.StageSpec] = (), **kw: Any) -> budget.Slot:
        return budget.slot(spec, now=self.clock(), deadline=self.deadline, later=later, reserve_s=self.reserve_s, **kw)

    def progress(self, message: str) -> None:
        if self._progress is not None:
            self._progress(f"[gpu-check {self.clock() - self.started:5.1f}s] {message}")

    # --- stages -------------------------------------------------------------------------

    @contextlib.contextmanager
    def stage(self, name: str, *, budget_s: float | None = None) -> Iterator[dict[str, Any]]:
        """Run a stage: yields its entry, for details. Ends ``ok`` unless it raised or set ``ok`` false.

        :class:`StageFailed` and any other ``Exception`` are recorded and
        swallowed (the next stage runs); :class:`Abort` and a stop signal are
        recorded and passed on.
        """
        entry = _entry()
        if budget_s is not None:
            entry["budget_s"] = round(budget_s, 1)
        with self._lock:
            self.report["stages"][name] = entry
            self.current = name
        self.progress(f"{name}: start" + (f" (at most {budget_s:.0f}s)" if budget_s is not None else ""))
        t0 = self.clock()
        try:
            yield entry
        except StageFailed as exc:
            entry.update(ok=False, error=str(exc))
        except Abort as exc:
            entry.update(ok=False, error=str(exc))
            raise
        except KeyboardInterrupt as exc:  # procs.Interrupted: a stop signal
            entry.update(ok=False, error=f"{str(exc) or 'interrupted'}: the check stopped here")
            raise
        except Exception as exc:
            entry.update(ok=False, error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc(limit=6))
        else:
            if entry["ok"] is None:
                entry["ok"] = True
            elif entry["ok"] is False and not entry["error"]:
                entry["error"] = "failed"
        finally:
            entry["seconds"] = round(self.clock() - t0, 2)
            with self._lock:
                self.current = None
            self.progress(f"{name}: {'ok' if entry['ok'] else 'FAILED: ' + str(entry['error'])}")

    def skip(self, name: str, why: str, *, required: bool) -> None:
        """Record a stage that is not started: a required one fails with ``why``, an optional one is skipped."""
        entry = _entry(skipped=why)
        if required:
            entry.update(ok=False, error=f"not run: {why}")
        with self._lock:
            self.report["stages"][name] = entry
        self.progress(f"{name}: {'not run' if required else 'skipped'}: {why}")

    # --- the whole run ------------------------------------------------------------------

    def execute(self, body: Callable[[Run], None]) -> int:
        """Run ``body(self)``, then the cleanup, then print the document; the exit status."""
        self.watchdog = procs.Watchdog(self.deadline, self._on_deadline, self.clock).start()
        code: int | None = None
        with procs.on_signals(self._on_signal, self.quiet) as seen:
            try:
                body(self)
            except Abort as exc:
                code = exc.code
                self._not_reached(f"the check stopped at {self._failed_stage() or 'an earlier stage'}")
            except KeyboardInterrupt as exc:  # procs.Interrupted: a stop signal
                code = 1
                why = str(exc) or "interrupted"
                self.report["errors"].append(f"{why}; every process the check started was stopped")
                self._not_reached(why)
            except Exception as exc:
                code = 1
                self.report["errors"].append(f"the check itself failed: {type(exc).__name__}: {exc}")
                self.report["traceback"] = traceback.format_exc(limit=8)
                self._not_reached("the check itself failed")
            self.quiet.set()
            self.cleanup()
            self.watchdog.cancel()
            if seen:
                self.report["signals"] = [signal.Signals(s).name for s in seen]
            return self.finish(code)

    def _on_signal(self, signum: int) -> None:
        if self.watchdog is not None:
            self.watchdog.move(min(self.watchdog.deadline, self.clock() + SIGNAL_GRACE_S))

    def _not_reached(self, why: str) -> None:
        with self._lock:
            for name in self.planned:
                self.report["stages"].setdefault(name, _entry(skipped=f"not reached: {why}"))

    def cleanup(self) -> None:
        """Stop every group, kill every marked process, and check the GPU is as it was; the ``cleanup`` stage."""
        with self.stage("cleanup") as entry:
            entry["stopped_groups"] = self.children.kill_all(KILL_GRACE_S)
            entry["killed"] = self.children.sweep()
            left = self.children.survivors()
            entry["survivors"] = left
            problems = []
            if left:
                problems.append(f"processes of this check still run after SIGKILL: {left}")
            if self.gpu_check is not None:
                why = self.gpu_check()
                if why:
                    problems.append(why)
            if problems:
                raise StageFailed("; ".join(problems))

    def _on_deadline(self) -> None:
        """The watchdog: the deadline passed. Kill everything, print what there is, end the process."""
        where = self.current or "the cleanup"
        try:
            killed = self.children.kill_all(1.0)
            swept = self.children.sweep()
            with self._lock:
                current = self.report["stages"].get(self.current or "")
                if current is not None and current.get("ok") is None:
                    current.update(ok=False, error="cut short: the check's deadline passed")
                self.report["errors"].append(
                    f"the check's deadline ({self.deadline_s:.0f}s) passed during {where}: every process it "
                    "started was killed"
                )
                self.report["stages"]["cleanup"] = _entry(
                    ok=not self.children.survivors(), stopped_groups=killed, killed=swept, by="watchdog"
                )
                self._not_reached(f"the deadline passed during {where}")
        finally:
            self.finish(1)
            for fn in self.at_exit:
                with contextlib.suppress(Exception):
                    fn()
            os._exit(1)

    def _failed_stage(self) -> str | None:
        for name, entry in self.report["stages"].items():
            if entry.get("ok") is False:
                return str(name)
        return None

    def finish(self, code: int | None) -> int:
        """Fill in ``ok``, ``stage``, ``error`` and ``seconds``, print the document (once); the exit status."""
        with self._lock:
            stages = self.report["stages"]
            failed = self._failed_stage()
            ok = code is None and failed is None and not self.report["errors"]
            ok = ok and all(e.get("ok") is not None or e.get("skipped") for e in stages.values())
            self.report["ok"] = ok
            self.report["stage"] = failed
            self.report["error"] = stages[failed]["error"] if failed else (self.report["errors"] or [None])[0]
            self.report["seconds"] = round(self.clock() - self.started, 1)
            status = 0 if ok else (code if code is not None else 1)
            self._emit()
        return status

    def _emit(self) -> None:
        if self._emitted:
            return
        self._emitted = True
        text = None
        for _ in range(3):  # the watchdog may print while the main thread still writes
            try:
                text = json.dumps(self.report, indent=None if self.compact else 2, default=str)
                break
            except RuntimeError:
                time.sleep(0.05)
        if text is None:
            text = json.dumps({k: self.report.get(k) for k in ("ok", "stage", "error", "errors", "seconds")})
        print(text, file=self.out, flush=True)


# --- the document's shape ---------------------------------------------------------------------

TOP_KEYS = ("ok", "stage", "error", "stages", "errors", "budget", "seconds")


def problems(doc: Any) -> list[str]:
    """What is wrong with the shape of a check's document ([]: nothing); the tests hold every document to it."""
    if not isinstance(doc, dict):
        return [f"the document is a {type(doc).__name__}, not an object"]
    out = [f"no {key!r}" for key in TOP_KEYS if key not in doc]
    if not isinstance(doc.get("ok"), bool):
        out.append("'ok' is not true or false")
    stages = doc.get("stages")
    if not isinstance(stages, dict) or not stages:
        return [*out, "'stages' is not an object of stages"]
    if "cleanup" not in stages:
        out.append("no cleanup stage")
    failed = [name for name, e in stages.items() if isinstance(e, dict) and e.get("ok") is False]
    for name, entry in stages.items():
        if not isinstance(entry, dict):
            out.append(f"stage {name!r} is not an object")
            continue
        ok, error = entry.get("ok"), entry.get("error")
        if ok not in (True, False, None) or "ok" not in entry:
            out.append(f"stage {name!r}: 'ok' is not true, false or null")
        if ok is False and not (isinstance(error, str) and error):
            out.append(f"stage {name!r} failed without an error")
        if ok is True and error is not None:
            out.append(f"stage {name!r} is ok but has an error")
        if ok is None and not entry.get("skipped"):
            out.append(f"stage {name!r} has neither a result nor a reason it was skipped")
        if "seconds" not in entry:
            out.append(f"stage {name!r} has no 'seconds'")
    if doc.get("ok") and (failed or doc.get("errors")):
        out.append("'ok' is true, but a stage failed or there are errors")
    if failed and doc.get("stage") != failed[0]:
        out.append(f"'stage' is {doc.get('stage')!r}, not the first failed stage {failed[0]!r}")
    if failed and doc.get("error") != stages[failed[0]].get("error"):
        out.append("'error' is not the first failed stage's error")
    return out
