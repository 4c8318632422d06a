"""GPU telemetry: duty cycles, memory over time and the bytes each switch moved.

Pure parts (no I/O, no clock; every call takes ``now``):

- :class:`DutyWindow`: one GPU's duty cycle and memory over a sliding window.
- :class:`MoveLog`: the recent snapshots and restores, with per-job summaries.

The asyncio shell, :class:`Telemetry`, samples a source every ``interval``
seconds and feeds the windows. A source is either

- an open :class:`~timesliced.nvml.Nvml` (real GPUs): duty is NVML's utilization,
  sampled in a worker thread so the event loop never blocks; or
- a :class:`SimGpuSource` (simulated GPUs): memory comes from the daemon's own
  figures and duty is the fraction of time a lock holder held the GPU, which the
  daemon reports with :meth:`Telemetry.record_held` / :meth:`Telemetry.record_busy`.

All times are on one monotonic clock (``time.monotonic``, which is also what the
default asyncio loop's ``loop.time()`` reads).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .backends.base import DeviceInfo
from .nvml import GpuSample, Nvml
from .util.stats import median

log = logging.getLogger(__name__)

_MAX_LOGGED = 256  # distinct error messages remembered for log-once; beyond that they are logged again


# --- duty windows (pure) -------------------------------------------------------------------


class _Feed(enum.Enum):
    SAMPLES = "samples"
    TRANSITIONS = "transitions"


class DutyWindow:
    """Duty cycle and memory use of one GPU over time. Pure: every call takes ``now``.

    Duty is the fraction of time the GPU was busy. A window is fed one of two ways,
    never both (mixing raises ``ValueError``):

    - :meth:`observe`: a measured duty (0..1) for the time since the previous
      observation, as a sampler sees it. The first observation covers no time. A
      gap longer than ``max_gap`` is not filled in: the observation then counts
      for the last ``max_gap`` seconds only, and the rest is a hole in the record.
    - :meth:`set_busy`: busy/idle transitions. A state holds until the next
      transition, so a query at ``now`` counts the time since the last
      transition in the current state.

    Averages divide busy time by the time with data in the window, so a window
    that began recording ten seconds ago averages over those ten seconds.

    Bounded: spans and memory points older than ``history`` seconds are dropped,
    and at most ``max_spans`` / ``max_points`` are kept (oldest dropped first).
    Times of each kind of input must not decrease (``ValueError``).
    """

    def __init__(
        self, *, history: float = 600.0, max_gap: float = 5.0, max_spans: int = 4096, max_points: int = 4096
    ) -> None:
        if history <= 0 or max_gap <= 0:
            raise ValueError(f"history and max_gap must be positive, not {history} and {max_gap}")
        if max_spans < 1 or max_points < 2:
            raise ValueError(f"max_spans must be >= 1 and max_points >= 2, not {max_spans} and {max_points}")
        self.history = history
        self.max_gap = max_gap
        # Closed spans (start, end, duty), in time order, never overlapping.
        self._spans: deque[tuple[float, float, float]] = deque(maxlen=max_spans)
        self._feed: _Feed | None = None
        # samples: time and duty of the latest observation;
        # transitions: start and duty (1.0 / 0.0) of the open span, which runs until "now".
        self._fed_at: float | None = None
        self._duty = 0.0
        # Memory as a step function: (time, bytes) where the value changed.
        self._memory: deque[tuple[float, int]] = deque(maxlen=max_points)
        self._memory_at: float | None = None

    # --- inputs ------------------------------------------------------------------------

    def observe(self, duty: float, now: float, memory_used: int | None = None) -> None:
        """A sampled duty (0..1) for the period since the previous observation, and optionally memory."""
        if not 0.0 <= duty <= 1.0:
            raise ValueError(f"duty must be within 0..1, not {duty}")
        self._check_duty(_Feed.SAMPLES, now)
        if memory_used is not None:
            self._check_memory(memory_used, now)
        self._feed = _Feed.SAMPLES
        if self._fed_at is not None:
            self._add_span(max(self._fed_at, now - self.max_gap), now, duty)
        self._fed_at, self._duty = now, duty
        if memory_used is not None:
            self.set_memory(memory_used, now)
        self._prune(now)

    def set_busy(self, busy: bool, now: float) -> None:
        """The GPU became busy (``True``) or idle at ``now``; repeating the current state changes nothing."""
        self._check_duty(_Feed.TRANSITIONS, now)
        self._feed = _Feed.TRANSITIONS
        state = 1.0 if busy else 0.0
        if self._fed_at is not None:
            if state == self._duty:
                return
            self._add_span(self._fed_at, now, self._duty)
        self._fed_at, self._duty = now, state
        self._prune(now)

    def set_memory(self, used: int, now: float) -> None:
        """Device memory in use at ``now``, in bytes."""
        self._check_memory(used, now)
        self._memory_at = now
        if not self._memory or self._memory[-1][1] != used:
            self._memory.append((now, used))
        self._prune(now)

    # --- queries -----------------------------------------------------------------------

    @property
    def fed_at(self) -> float | None:
        """Time of the latest sample, or of the latest state change; None before any duty input."""
        return self._fed_at

    def duty_now(self, now: float) -> float | None:
        """The current duty: the latest sample (None once older than ``max_gap``) or the current state."""
        if self._fed_at is None:
            return None
        if self._feed is _Feed.SAMPLES and now - self._fed_at > self.max_gap:
            return None
        return self._duty

    def mean_duty(self, now: float, window: float) -> float | None:
        """Mean duty over ``[now - window, now]``; None when nothing in it has data."""
        busy, covered = self._integrate(now - _positive(window, "window"), now)
        return busy / covered if covered > 0 else None

    def coverage(self, now: float, window: float) -> float:
        """Seconds of ``[now - window, now]`` that have duty data."""
        return self._integrate(now - _positive(window, "window"), now)[1]

    def duty_series(self, now: float, window: float, step: float) -> list[tuple[float, float | None]]:
        """(start, mean duty) of consecutive ``step``-long slots ending at ``now``, oldest first."""
        n = math.ceil(_positive(window, "window") / _positive(step, "step") - 1e-9)
        if n > 100_000:
            raise ValueError(f"window / step gives {n} slots; at most 100000")
        out: list[tuple[float, float | None]] = []
        for i in range(n, 0, -1):
            lo = now - i * step
            busy, covered = self._integrate(lo, lo + step)
            out.append((lo, busy / covered if covered > 0 else None))
        return out

    def memory_now(self) -> int | None:
        """The latest memory figure, or None."""
        return self._memory[-1][1] if self._memory else None

    def memory_series(self, now: float, window: float) -> list[tuple[float, int]]:
        """Memory in use over ``[now - window, now]`` as (time, bytes) steps, oldest first.

        Each value holds until the next point; when a value was already in force at
        the window's start, the series begins with it at ``now - window``.
        """
        lo = now - _positive(window, "window")
        out: list[tuple[float, int]] = []
        before: int | None = None
        for t, used in self._memory:
            if t < lo:
                before = used
            elif t <= now:
                out.append((t, used))
        if before is not None and (not out or out[0][0] > lo):
            out.insert(0, (lo, before))
        return out

    # --- internals ---------------------------------------------------------------------

    def _check_duty(self, feed: _Feed, now: float) -> None:
        if self._feed is not None and self._feed is not feed:
            raise ValueError(f"this window is fed {self._feed.value}; it cannot also take {feed.value}")
        if self._fed_at is not None and now < self._fed_at:
            raise ValueError(f"time went backwards: {now} after {self._fed_at}")

    def _check_memory(self, used: int, now: float) -> None:
        if used < 0:
            raise ValueError(f"memory used must be >= 0, not {used}")
        if self._memory_at is not None and now < self._memory_at:
            raise ValueError(f"time went backwards: {now} after {self._memory_at}")

    def _add_span(self, start: float, end: float, duty: float) -> None:
        if end <= start:
            return
        if self._spans:
            a, b, d = self._spans[-1]
            if b == start and d == duty:
                self._spans[-1] = (a, end, duty)
                return
        self._spans.append((start, end, duty))

    def _prune(self, now: float) -> None:
        horizon = now - self.history
        while self._spans and self._spans[0][1] <= horizon:
            self._spans.popleft()
        # Keep the last point before the horizon: it is the value in force there.
        while len(self._memory) >= 2 and self._memory[1][0] <= horizon:
            self._memory.popleft()

    def _integrate(self, lo: float, hi: float) -> tuple[float, float]:
        """(busy seconds, seconds with data) within ``[lo, hi]``."""
        busy = covered = 0.0
        if self._feed is _Feed.TRANSITIONS and self._fed_at is not None:
            a = max(self._fed_at, lo)
            if hi > a:
                busy += (hi - a) * self._duty
                covered += hi - a
        for a, b, duty in reversed(self._spans):
            if b <= lo:
                break
            if a >= hi:
                continue
            d = min(b, hi) - max(a, lo)
            busy += d * duty
            covered += d
        return busy, covered


def _positive(value: float, name: str) -> float:
    if not value > 0:
        raise ValueError(f"{name} must be positive, not {value}")
    return value


# --- simulated GPUs ------------------------------------------------------------------------


@dataclass(frozen=True)
class SimGpuSource:
    """The figures of simulated GPUs, which only the daemon knows.

    ``memory_used(gpu)`` returns the bytes allocated on ``gpu`` now (for the sim
    backend: capacity minus ``free_bytes(gpu)``); ``processes(gpu)``, if given,
    returns pid -> bytes on it. Both are called on the event loop (they read the
    daemon's own state), never in a thread, and must not block.

    Utilization is not simulated: the sim duty cycle is lock-holding time, fed
    through :meth:`Telemetry.record_held` / :meth:`Telemetry.record_busy`.
    """

    devices: tuple[DeviceInfo, ...]
    memory_used: Callable[[int], int]
    processes: Callable[[int], Mapping[int, int]] | None = None

    def sample(self) -> list[GpuSample]:
        out = []
        for d in self.devices:
            used = int(self.memory_used(d.index))
            procs = dict(self.processes(d.index)) if self.processes is not None else {}
            out.append(
                GpuSample(
                    index=d.index,
                    name=d.name,
                    uuid=d.uuid,
                    memory_total=d.capacity,
                    memory_used=used,
                    memory_free=max(d.capacity - used, 0),
                    utilization_gpu=None,
                    utilization_memory=None,
                    processes=procs,
                )
            )
        return out


# --- the asyncio shell ---------------------------------------------------------------------


class Telemetry:
    """Samples GPU figures every ``interval`` seconds and keeps duty windows per GPU.

    ``source`` is an :class:`~timesliced.nvml.Nvml` (real GPUs), a
    :class:`SimGpuSource`, or ``None``. An ``Nvml`` that is not available makes the
    source ``"none"`` with its reason. Telemetry does not close the ``Nvml``: its
    owner does, after :meth:`run` has ended.

    ``window`` is the span of ``duty_window`` in :meth:`describe`; windows keep
    ``history`` seconds. ``clock`` gives ``now`` for samples and for calls that
    leave it out; it must be the clock of the ``now`` values the daemon passes.
    """

    def __init__(
        self,
        source: Nvml | SimGpuSource | None = None,
        *,
        interval: float = 1.0,
        window: float = 60.0,
        history: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        _positive(interval, "interval")
        if history < _positive(window, "window"):
            raise ValueError(f"history ({history}) must be at least window ({window})")
        self.interval = interval
        self.window = window
        self.history = history
        self.clock = clock
        self.source: str  # "nvml", "sim" or "none"
        self.reason: str  # why the source is "none"
        self._nvml: Nvml | None = None
        self._sim: SimGpuSource | None = None
        self.driver: str | None = None
        self.cuda: str | None = None
        devices: Sequence[DeviceInfo] = ()
        if isinstance(source, Nvml):
            if source.available:
                self._nvml, self.source, self.reason = source, "nvml", ""
                self.driver, self.cuda = source.driver_version or None, source.cuda_version or None
                devices = source.devices()
            else:
                self.source, self.reason = "none", source.reason
        elif isinstance(source, SimGpuSource):
            self._sim, self.source, self.reason = source, "sim", ""
            devices = source.devices
        else:
            self.source, self.reason = "none", "no GPU source"
        self._devices: dict[int, DeviceInfo] = {d.index: d for d in devices}
        # Sampled sources may report a duty 2 samples apart after a stall; allow a few intervals.
        gap = max(5.0, 3 * interval)
        self._windows = {i: DutyWindow(history=history, max_gap=gap) for i in self._devices}
        self.latest: dict[int, GpuSample] = {}
        self.sampled_at: float | None = None
        self.error: str | None = None  # why the latest sample failed; None once one succeeds
        self._logged: set[str] = set()

    # --- running -----------------------------------------------------------------------

    async def run(self) -> None:
        """Sample every ``interval`` seconds until cancelled; returns at once without a source.

        A failing sample is logged (once per distinct error) and retried at the next
        tick; the previous figures stay in place, and :meth:`describe` shows the error.
        """
        if self._nvml is None and self._sim is None:
            log.info("GPU telemetry is off: %s", self.reason)
            return
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            try:
                await self.refresh()
            except Exception as exc:  # a sampling failure never stops telemetry; cancellation passes
                self._sample_failed(exc)
            next_at += self.interval
            now = loop.time()
            if next_at < now:  # a slow sample: skip the ticks it missed rather than catch up
                next_at = now + self.interval
            await asyncio.sleep(next_at - now)

    async def refresh(self) -> list[GpuSample]:
        """Take one sample now, feed it to the windows and return it. Raises what the source raised."""
        if self._nvml is not None:
            samples = await asyncio.to_thread(self._nvml.sample)
        elif self._sim is not None:
            samples = self._sim.sample()
        else:
            return []
        self.ingest(samples, self.clock())
        return samples

    def ingest(self, samples: Sequence[GpuSample], now: float) -> None:
        """Take ``samples`` taken at ``now`` as the latest figures and feed them to the windows."""
        for s in samples:
            w = self._window(s.index)
            if s.memory_used is not None:
                w.set_memory(s.memory_used, now)
            if s.utilization_gpu is not None and self.source == "nvml":
                # NVML reports whole percents; clamp in case a driver strays outside 0..100.
                w.observe(min(max(s.utilization_gpu, 0), 100) / 100, now)
            for problem in s.errors:
                self._log_once(f"GPU {s.index}: {problem}")
        self.latest = {s.index: s for s in samples}
        self.sampled_at = now
        if self.error is not None:
            log.info("GPU sampling works again")
            self.error = None

    # --- simulated GPUs ----------------------------------------------------------------

    def record_busy(self, gpu: int, busy: bool, now: float | None = None) -> None:
        """Simulated GPUs: whether a lock holder holds ``gpu`` from ``now`` on.

        ``busy`` is whether *any* holder holds the GPU (when groups share a GPU, pass
        the OR). Repeating the current state is free, so the daemon may call this
        after every scheduler step. Ignored unless the source is ``"sim"``: real GPUs'
        duty comes from the driver. Raises ``ValueError`` for a GPU the source lacks.
        """
        if self.source != "sim":
            return
        w = self._windows.get(gpu)
        if w is None:
            raise ValueError(f"no simulated GPU {gpu}")
        t = self.clock() if now is None else now
        # The daemon's ``now`` and this clock may be read a hair apart (some event loops cache
        # their time per pass); a transition never moves the record backwards.
        w.set_busy(busy, t if w.fed_at is None else max(t, w.fed_at))

    def record_held(self, held: Collection[int], now: float | None = None) -> None:
        """Simulated GPUs: exactly the GPUs in ``held`` are held by a lock holder now."""
        if self.source != "sim":
            return
        t = self.clock() if now is None else now
        for gpu in self._windows:
            self.record_busy(gpu, gpu in held, t)

    # --- reading -----------------------------------------------------------------------

    def duty(self, gpu: int) -> DutyWindow:
        """The window of ``gpu`` (``KeyError`` if unknown)."""
        return self._windows[gpu]

    def describe(self, now: float | None = None) -> dict[str, Any]:
        """Plain data for the daemon's status and the dashboard (JSON- and msgpack-safe: string keys)."""
        t = self.clock() if now is None else now
        gpus = []
        for index in sorted(set(self._devices) | set(self.latest)):
            info = self._devices.get(index)
            s = self.latest.get(index)
            w = self._window(index)
            gpus.append(
                {
                    "index": index,
                    "name": s.name if s else (info.name if info else ""),
                    "uuid": s.uuid if s else (info.uuid if info else ""),
                    "memory_total": s.memory_total if s else (info.capacity if info else None),
                    "memory_used": s.memory_used if s else None,
                    "memory_free": s.memory_free if s else None,
                    "utilization_gpu": s.utilization_gpu if s else None,
                    "utilization_memory": s.utilization_memory if s else None,
                    "duty_now": w.duty_now(t),
                    "duty_window": w.mean_duty(t, self.window),
                    "window_s": self.window,
                    "processes": {str(pid): n for pid, n in sorted(s.processes.items())} if s else {},
                    "errors": list(s.errors) if s else [],
                }
            )
        return {
            "source": self.source,
            "reason": self.reason or None,
            "driver": self.driver,
            "cuda": self.cuda,
            "interval_s": self.interval,
            "age_s": t - self.sampled_at if self.sampled_at is not None else None,
            "error": self.error,
            "gpus": gpus,
        }

    # --- internals ---------------------------------------------------------------------

    def _window(self, gpu: int) -> DutyWindow:
        w = self._windows.get(gpu)
        if w is None:
            w = self._windows[gpu] = DutyWindow(history=self.history, max_gap=max(5.0, 3 * self.interval))
        return w

    def _sample_failed(self, exc: Exception) -> None:
        self.error = f"{exc.__class__.__name__}: {exc}"
        self._log_once(f"GPU sampling failed: {self.error}", exc)

    def _log_once(self, message: str, exc: Exception | None = None) -> None:
        if message in self._logged:
            return
        if len(self._logged) >= _MAX_LOGGED:
            self._logged.clear()
        self._logged.add(message)
        log.warning("%s (logged once; retrying every %.3gs)", message, self.interval, exc_info=exc)


# --- switches (pure) -----------------------------------------------------------------------


class MoveKind(enum.Enum):
    SNAPSHOT = "snapshot"
    RESTORE = "restore"


@dataclass(frozen=True)
class MoveRecord:
    """One snapshot or restore of one job on this node."""

    at: float
    job: str
    kind: MoveKind
    nbytes: int
    seconds: float

    @property
    def gbps(self) -> float:
        """Gigabytes (1e9 bytes) per second; 0 for a move that took no measurable time."""
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "at": self.at,
            "job": self.job,
            "kind": self.kind.value,
            "nbytes": self.nbytes,
            "seconds": self.seconds,
            "gbps": self.gbps,
        }


@dataclass(frozen=True)
class JobMoves:
    """What the snapshots and restores of one job added up to.

    Counts and totals cover every move recorded since the job was first seen;
    ``median_gbps`` covers the moves still in the log that moved bytes in
    measurable time (None when there are none).
    """

    count: int
    snapshots: int
    restores: int
    nbytes: int
    seconds: float
    median_gbps: float | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "count": self.count,
            "snapshots": self.snapshots,
            "restores": self.restores,
            "nbytes": self.nbytes,
            "seconds": self.seconds,
            "median_gbps": self.median_gbps,
        }


@dataclass
class _Totals:
    count: int = 0
    snapshots: int = 0
    restores: int = 0
    nbytes: int = 0
    seconds: float = 0.0


class MoveLog:
    """The latest ``maxlen`` moves, and running totals for at most ``max_jobs`` jobs (least recent dropped)."""

    def __init__(self, maxlen: int = 1024, max_jobs: int = 256) -> None:
        if maxlen < 1 or max_jobs < 1:
            raise ValueError(f"maxlen and max_jobs must be >= 1, not {maxlen} and {max_jobs}")
        self._records: deque[MoveRecord] = deque(maxlen=maxlen)
        self._totals: OrderedDict[str, _Totals] = OrderedDict()  # least recently moved first
        self._max_jobs = max_jobs

    def record(self, job: str, kind: MoveKind | str, nbytes: int, seconds: float, now: float) -> MoveRecord:
        """Log that ``kind`` ("snapshot" / "restore") of ``job`` moved ``nbytes`` in ``seconds``, ending at ``now``."""
        kind = MoveKind(kind)
        if nbytes < 0 or seconds < 0:
            raise ValueError(f"nbytes and seconds must be >= 0, not {nbytes} and {seconds}")
        rec = MoveRecord(now, job, kind, int(nbytes), float(seconds))
        self._records.append(rec)
        totals = self._totals.pop(job, None) or _Totals()
        totals.count += 1
        if kind is MoveKind.SNAPSHOT:
            totals.snapshots += 1
        else:
            totals.restores += 1
        totals.nbytes += rec.nbytes
        totals.seconds += rec.seconds
        self._totals[job] = totals
        while len(self._totals) > self._max_jobs:
            self._totals.popitem(last=False)
        return rec

    def forget(self, job: str) -> None:
        """Drop ``job``'s totals and records (a job that left for good)."""
        self._totals.pop(job, None)
        kept = [r for r in self._records if r.job != job]
        self._records.clear()
        self._records.extend(kept)

    def recent(self, job: str | None = None, limit: int | None = None) -> list[MoveRecord]:
        """The logged moves, oldest first, of ``job`` or of all jobs; the last ``limit`` only if given."""
        out = [r for r in self._records if job is None or r.job == job]
        if limit is None:
            return out
        return out[-limit:] if limit > 0 else []

    def summary(self, job: str) -> JobMoves | None:
        totals = self._totals.get(job)
        if totals is None:
            return None
        rates = sorted(r.gbps for r in self._records if r.job == job and r.nbytes > 0 and r.seconds > 0)
        return JobMoves(totals.count, totals.snapshots, totals.restores, totals.nbytes, totals.seconds, median(rates))

    def summaries(self) -> dict[str, JobMoves]:
        out = {}
        for job in self._totals:
            s = self.summary(job)
            if s is not None:
                out[job] = s
        return out

    def describe(self, limit: int = 50) -> dict[str, Any]:
        """Plain data: the last ``limit`` moves and every job's summary."""
        return {
            "recent": [r.to_dict() for r in self.recent(limit=limit)],
            "jobs": {job: s.to_dict() for job, s in self.summaries().items()},
        }
