"""The GPU check's frame (tests/gpu/runner.py): stage results, the one JSON document, the exit status.

The children are a stand-in here; tests/integration/test_gpu_check_cleanup.py
stops real process groups.
"""

from __future__ import annotations

import io
import json
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from tests.gpu import procs, runner
from tests.gpu.runner import Abort, Run, StageFailed, problems

STAGES = ["one", "two", "three"]


class Children:
    """What Run asks of procs.Children, recorded."""

    def __init__(self, survivors: list[int] | None = None) -> None:
        self.calls: list[str] = []
        self.left = survivors or []

    def kill_all(self, grace: float = 3.0) -> list[int]:
        self.calls.append("kill_all")
        return [4242]

    def sweep(self) -> list[int]:
        self.calls.append("sweep")
        return []

    def survivors(self) -> list[int]:
        return self.left


def execute(body: Callable[[Run], None], children: Children | None = None, **kw: Any) -> tuple[int, dict, str]:
    out = io.StringIO()
    run = Run(deadline_s=kw.pop("deadline_s", 60), children=children or Children(), stages=STAGES, out=out, **kw)  # type: ignore[arg-type]
    code = run.execute(body)
    text = out.getvalue()
    return code, json.loads(text), text


def test_every_stage_ok_is_exit_0_with_one_document() -> None:
    children = Children()

    def body(run: Run) -> None:
        for name in STAGES:
            with run.stage(name, budget_s=10) as entry:
                entry["detail"] = name

    code, doc, text = execute(body, children)
    assert code == 0 and doc["ok"] is True and doc["stage"] is None and doc["error"] is None
    assert problems(doc) == []
    assert list(doc["stages"]) == [*STAGES, "cleanup"]
    assert doc["stages"]["two"] == {
        "ok": True,
        "error": None,
        "seconds": doc["stages"]["two"]["seconds"],
        "budget_s": 10,
        "detail": "two",
    }
    assert doc["stages"]["cleanup"]["ok"] is True and doc["stages"]["cleanup"]["stopped_groups"] == [4242]
    assert children.calls == ["kill_all", "sweep"]
    assert text.count("\n") == text.strip().count("\n") + 1  # one document, printed once


def test_a_failed_stage_is_named_at_the_top_and_the_next_stage_still_runs() -> None:
    def body(run: Run) -> None:
        with run.stage("one"):
            pass
        with run.stage("two"):
            raise StageFailed("the copy was wrong")
        with run.stage("three") as entry:
            entry["ran"] = True

    code, doc, _ = execute(body)
    assert code == 1 and doc["ok"] is False
    assert (doc["stage"], doc["error"]) == ("two", "the copy was wrong")
    assert doc["stages"]["three"]["ran"] is True and doc["stages"]["three"]["ok"] is True
    assert problems(doc) == []


def test_an_exception_in_a_stage_is_its_error_with_a_traceback() -> None:
    def body(run: Run) -> None:
        with run.stage("one"):
            {}["missing"]

    code, doc, _ = execute(body)
    assert code == 1 and doc["stage"] == "one" and doc["error"] == "KeyError: 'missing'"
    assert "Traceback" in doc["stages"]["one"]["traceback"]


def test_abort_stops_the_check_with_its_code_and_marks_the_rest_not_reached() -> None:
    def body(run: Run) -> None:
        with run.stage("one"):
            raise Abort("no GPU: NVML lists no GPU", code=2)
        raise AssertionError("not reached")

    code, doc, _ = execute(body)
    assert code == 2 and doc["stage"] == "one" and doc["error"] == "no GPU: NVML lists no GPU"
    assert doc["stages"]["two"]["ok"] is None and "stopped at one" in doc["stages"]["two"]["skipped"]
    assert doc["stages"]["cleanup"]["ok"] is True
    assert problems(doc) == []


def test_skipped_optional_stages_keep_the_check_ok_and_required_ones_fail_it() -> None:
    def optional(run: Run) -> None:
        run.skip("one", "needs about 80s but 20s are left", required=False)

    code, doc, _ = execute(optional)
    assert (
        code == 0
        and doc["ok"]
        and doc["stages"]["one"]
        == {
            "ok": None,
            "error": None,
            "seconds": None,
            "skipped": "needs about 80s but 20s are left",
        }
    )

    def required(run: Run) -> None:
        run.skip("one", "needs about 80s but 20s are left", required=True)

    code, doc, _ = execute(required)
    assert code == 1 and doc["stage"] == "one" and doc["error"] == "not run: needs about 80s but 20s are left"
    assert problems(doc) == []


def test_a_bug_outside_any_stage_fails_the_check_and_still_cleans_up() -> None:
    children = Children()

    def body(run: Run) -> None:
        raise RuntimeError("oops")

    code, doc, _ = execute(body, children)
    assert code == 1 and not doc["ok"]
    assert doc["errors"] == ["the check itself failed: RuntimeError: oops"] and doc["error"] == doc["errors"][0]
    assert children.calls == ["kill_all", "sweep"]
    assert problems(doc) == []


def test_a_stop_signal_ends_the_stage_cleans_up_and_fails() -> None:
    children = Children()

    def body(run: Run) -> None:
        with run.stage("one"):
            raise procs.Interrupted(signal.SIGTERM)

    code, doc, _ = execute(body, children)
    assert code == 1
    assert doc["stages"]["one"]["error"] == "interrupted by SIGTERM: the check stopped here"
    assert doc["errors"][0].startswith("interrupted by SIGTERM; every process the check started was stopped")
    assert "not reached" in doc["stages"]["two"]["skipped"]
    assert children.calls == ["kill_all", "sweep"]


def test_a_plain_keyboard_interrupt_is_handled_like_a_stop_signal() -> None:
    children = Children()

    def body(run: Run) -> None:
        with run.stage("one"):
            raise KeyboardInterrupt

    code, doc, _ = execute(body, children)
    assert code == 1 and doc["stages"]["one"]["error"] == "interrupted: the check stopped here"
    assert children.calls == ["kill_all", "sweep"] and problems(doc) == []


@pytest.mark.parametrize(
    ("survivors", "gpu", "why"),
    [([77], None, "still run after SIGKILL: [77]"), ([], "NVML still lists processes", "NVML still lists")],
)
def test_the_cleanup_fails_when_something_is_left(survivors: list[int], gpu: str | None, why: str) -> None:
    def body(run: Run) -> None:
        run.gpu_check = lambda: gpu

    code, doc, _ = execute(body, Children(survivors))
    assert code == 1 and doc["stage"] == "cleanup" and why in doc["error"]


def test_the_watchdog_kills_everything_and_prints_what_there_is(monkeypatch: pytest.MonkeyPatch) -> None:
    exits: list[int] = []
    monkeypatch.setattr(runner.os, "_exit", exits.append)
    children = Children()
    out = io.StringIO()
    run = Run(deadline_s=60, children=children, stages=STAGES, out=out)  # type: ignore[arg-type]
    with run.stage("one"):
        pass
    with run.stage("two"):
        run._on_deadline()  # as the watchdog thread would, while the stage runs
    doc = json.loads(out.getvalue())
    assert exits == [1]
    assert doc["stages"]["two"]["error"] == "cut short: the check's deadline passed"
    assert "passed during two: every process it started was killed" in doc["errors"][0]
    assert doc["stages"]["cleanup"]["by"] == "watchdog" and doc["stages"]["cleanup"]["ok"] is True
    assert doc["stages"]["three"]["ok"] is None and "deadline passed" in doc["stages"]["three"]["skipped"]
    assert children.calls == ["kill_all", "sweep"]
    assert problems(doc) == []
    run.finish(1)  # the main thread finishing too prints nothing more
    assert out.getvalue().count('"stages"') == 1


def test_a_stop_signal_moves_the_watchdog_up() -> None:
    run = Run(deadline_s=600, children=Children(), stages=STAGES, out=io.StringIO())  # type: ignore[arg-type]
    run.watchdog = procs.Watchdog(run.deadline, lambda: None)
    run._on_signal(signal.SIGTERM)
    assert run.watchdog.deadline <= time.monotonic() + runner.SIGNAL_GRACE_S


# --- the watchdog ---------------------------------------------------------------------------


def test_the_watchdog_fires_at_its_deadline_and_not_when_cancelled() -> None:
    fired = threading.Event()
    dog = procs.Watchdog(time.monotonic() + 0.05, fired.set).start()
    assert fired.wait(5) and dog.fired

    quiet = threading.Event()
    dog = procs.Watchdog(time.monotonic() + 0.2, quiet.set).start()
    dog.cancel()
    assert not quiet.wait(0.4) and not dog.fired


def test_the_watchdog_can_be_moved_up() -> None:
    fired = threading.Event()
    dog = procs.Watchdog(time.monotonic() + 600, fired.set).start()
    dog.move(time.monotonic() + 0.05)
    assert fired.wait(5)


# --- the shape checker can fail ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("broken", "why"),
    [
        (lambda d: d.pop("stages"), "'stages' is not an object"),
        (lambda d: d["stages"].pop("cleanup"), "no cleanup stage"),
        (lambda d: d["stages"]["two"].update(ok=False, error=None), "failed without an error"),
        (lambda d: d["stages"]["two"].update(ok=None), "neither a result nor a reason"),
        (lambda d: d["stages"]["two"].update(ok="yes"), "'ok' is not true, false or null"),
        (lambda d: d["stages"]["one"].update(ok=False, error="x"), "'ok' is true, but a stage failed"),
        (lambda d: d.update(ok=False, stage="two") or d["stages"]["one"].update(ok=False, error="x"), "not the first"),
        (lambda d: d["stages"]["one"].pop("seconds"), "no 'seconds'"),
    ],
)
def test_problems_catches_a_broken_document(broken: Callable[[dict], Any], why: str) -> None:
    _, doc, _ = execute(lambda run: None)
    doc["stages"].update(
        one={"ok": True, "error": None, "seconds": 1.0}, two={"ok": True, "error": None, "seconds": 1.0}
    )
    assert problems(doc) == []
    broken(doc)
    assert any(why in p for p in problems(doc)), problems(doc)
