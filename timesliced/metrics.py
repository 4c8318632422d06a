"""Prometheus metrics for one daemon.

Two kinds of series live in one :class:`~prometheus_client.CollectorRegistry`
per :class:`Metrics` (several daemons can share a process, so the global
registry is never touched):

- *live observations* the daemon pushes as things happen: how long each grant
  waited, how long each switch took, how long each backend move took and how
  many bytes it moved (histograms and a counter);
- *the daemon's picture*, read at scrape time from its ``status()`` document by
  a custom collector: queue depth, holder, state, per-GPU duty and memory,
  per-job GPU seconds, location and parked bytes, and each node's host memory
  budget for parked state. The scheduler already knows these, so they are never
  copied into gauges that could drift from it.

Labels are bounded: ``group`` and ``gpu`` come from the node's configuration,
``node`` from the cluster's members, ``kind`` and ``method`` from fixed sets,
and ``job`` is capped at ``max_jobs`` series (see :class:`Metrics`). No series
is ever labelled with a session, request, pid, ticket or cgroup path (a pool's
figures are in ``status``, not here).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric

from .core.location import Location
from .core.model import GroupState

log = logging.getLogger(__name__)

# From a grant that never waited (1 ms) to a whole-process restore of a large job (10 min).
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)

MOVE_KINDS = ("snapshot", "restore")

# Every state and location is exposed as 0 or 1, so that `sum by (location)` works and a
# change of state never leaves the old series to go stale.
GROUP_STATES = tuple(s.value for s in GroupState)
LOCATIONS = tuple(loc.value for loc in Location)

DEFAULT_MAX_JOBS = 512


class Metrics:
    """The Prometheus metrics of one daemon.

    ``status`` returns the daemon's status document (what ``Daemon.status()``
    returns); it is called once per scrape, from whatever thread calls
    :meth:`render` or ``registry.collect()``. ``node`` is the node's name, for
    ``timesliced_info``.

    Job series are capped at ``max_jobs`` jobs: the first ``max_jobs`` jobs of
    the status document (registration order, so a job's series do not come and
    go as others register) get series; the rest are left out, counted in
    ``timesliced_job_series_dropped`` and reported by one warning each time the
    cap is first exceeded. Dropping rather than summing them into one
    ``job="(other)"`` series keeps every exposed counter monotonic: an aggregate
    would go down whenever one of its jobs exited or took a freed place.

    Raises ``ValueError`` for ``max_jobs < 0``.
    """

    def __init__(
        self,
        status: Callable[[], Mapping[str, Any]],
        *,
        node: str,
        max_jobs: int = DEFAULT_MAX_JOBS,
    ) -> None:
        if max_jobs < 0:
            raise ValueError(f"max_jobs must be >= 0, not {max_jobs}")
        self.node = node
        self.registry = CollectorRegistry()
        self.acquire_wait = Histogram(
            "timesliced_acquire_wait_seconds",
            "Time each grant of a group's lock waited in the queue.",
            ["group"],
            buckets=BUCKETS,
            registry=self.registry,
        )
        self.switch_duration = Histogram(
            "timesliced_switch_duration_seconds",
            "Time each grant that moved job state spent switching (parking and restoring).",
            ["group"],
            buckets=BUCKETS,
            registry=self.registry,
        )
        self.move_duration = Histogram(
            "timesliced_move_duration_seconds",
            "Time each backend move (a snapshot or a restore of one job) took.",
            ["kind", "method"],
            buckets=BUCKETS,
            registry=self.registry,
        )
        self.move_bytes = Counter(
            "timesliced_move_bytes",
            "Bytes moved by backend moves.",
            ["kind", "method"],
            registry=self.registry,
        )
        # Registered before the counter below: the registry collects in registration order,
        # so a failing scrape already counts itself.
        self.collector = StatusCollector(
            status, node=node, max_jobs=max_jobs, on_error=lambda: self.status_errors.inc()
        )
        self.registry.register(self.collector)
        self.status_errors = Counter(
            "timesliced_status_errors",
            "Scrapes whose status document could not be read; those scrapes carry only the live series.",
            registry=self.registry,
        )

    def observe_grant(self, group: str, waited_s: float, switch_s: float, switched: bool) -> None:
        """Record one grant of ``group``'s lock.

        ``waited_s`` is how long the grant queued; ``switch_s`` how long its switch
        took, recorded only when ``switched`` (the grant moved job state).
        Raises ``ValueError`` for a negative or non-finite duration.
        """
        _check_duration("waited_s", waited_s)
        if switched:
            _check_duration("switch_s", switch_s)
        self.acquire_wait.labels(group).observe(waited_s)
        if switched:
            self.switch_duration.labels(group).observe(switch_s)

    def observe_move(self, kind: str, method: str, nbytes: int, seconds: float) -> None:
        """Record one backend move: a ``snapshot`` or ``restore`` by ``method``.

        Raises ``ValueError`` for an unknown ``kind``, an empty ``method``, a
        negative ``nbytes`` or a negative or non-finite ``seconds``.
        """
        if kind not in MOVE_KINDS:
            raise ValueError(f"kind must be one of {', '.join(MOVE_KINDS)}, not {kind!r}")
        if not method:
            raise ValueError("method must be a parking method's name")
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, not {nbytes}")
        _check_duration("seconds", seconds)
        self.move_duration.labels(kind, method).observe(seconds)
        self.move_bytes.labels(kind, method).inc(nbytes)

    def forget_group(self, group: str) -> None:
        """Drop ``group``'s live series (a group removed from the node). Unknown groups are ignored."""
        self.acquire_wait.remove(group)
        self.switch_duration.remove(group)

    def render(self, accept_header: str | None) -> tuple[bytes, str]:
        """The exposition for a scrape with ``accept_header``: ``(body, content_type)``.

        Plain Prometheus text unless the scraper asks for OpenMetrics.
        """
        encoder, content_type = choose_encoder(accept_header or "")
        return encoder(self.registry), content_type


class StatusCollector:
    """A custom collector: the daemon's status document as Prometheus families.

    A scrape whose ``status()`` raises, or returns a document this collector
    cannot read, yields nothing at all (never half a picture), calls
    ``on_error`` and logs; the registry's other collectors are unaffected.
    """

    def __init__(
        self,
        status: Callable[[], Mapping[str, Any]],
        *,
        node: str,
        max_jobs: int,
        on_error: Callable[[], None] = lambda: None,
    ) -> None:
        self._status = status
        self._node = node
        self._max_jobs = max_jobs
        self._on_error = on_error
        self._failing = False  # log a run of failing scrapes once, not once per scrape
        self._over_cap = False  # likewise the job cap

    def describe(self) -> Iterator[Metric]:
        """The families without samples, so the registry can check names without calling ``status()``."""
        return iter(_Families().all())

    def collect(self) -> Iterator[Metric]:
        try:
            families = self._families(self._status())
        except Exception:
            self._on_error()
            if not self._failing:
                log.exception("metrics: the daemon's status could not be read; its series are left out")
            else:
                log.debug("metrics: the daemon's status still cannot be read", exc_info=True)
            self._failing = True
            return iter(())
        if self._failing:
            log.info("metrics: the daemon's status can be read again")
            self._failing = False
        return iter(families)

    def _families(self, status: Mapping[str, Any]) -> list[Metric]:
        """Every family, fully built before any is yielded."""
        f = _Families()
        info = {
            "node": self._node,
            "version": str(status.get("version", "")),
            "backend": str(status.get("backend", "")),
        }
        f.info.add_metric([], info)
        f.connections.add_metric([], float(status.get("connections", 0)))
        for event, n in sorted((status.get("counters") or {}).items()):
            f.connection_events.add_metric([event], float(n))
        f.uptime.add_metric([], float(status.get("uptime_s", 0.0)))
        for g in status.get("groups", ()):
            _add_group(f, g)
        members = list((status.get("cluster") or {}).get("members") or [])
        for h in status.get("host") or ():
            _add_host(f, h, members)
        look = (status.get("cluster") or {}).get("dns")
        if look is not None and look.get("listed") is not None:  # under --dns, once the name was looked at
            f.dns_members_differ.add_metric([], 1.0 if look["differs"] else 0.0)
        pool = (status.get("host_memory") or {}).get("sim_pool")
        if pool is not None:  # a node with a simulated GPU
            f.sim_pool.add_metric([], float(pool["held"]))
            f.sim_pool_limit.add_metric([], float(pool["limit"]))
        for job, held in ((status.get("parking") or {}).get("sim_held") or {}).items():
            f.sim_held.add_metric([job, "true" if held["unfinished"] else "false"], float(held["bytes"]))
        _add_gpus(f, status.get("devices") or (), (status.get("telemetry") or {}).get("gpus") or ())
        jobs = list(status.get("jobs", ()))
        kept, dropped = jobs[: self._max_jobs], len(jobs) - self._max_jobs
        for job in kept:
            _add_job(f, job)
        f.jobs_dropped.add_metric([], float(max(dropped, 0)))
        if dropped > 0 and not self._over_cap:
            log.warning(
                "metrics: %d jobs exceed the cap of %d job series; their series are left out", dropped, self._max_jobs
            )
        self._over_cap = dropped > 0
        return f.all()


class _Families:
    """One empty family per name; a scrape fills them in."""

    def __init__(self) -> None:
        self.info = InfoMetricFamily("timesliced", "The daemon.", labels=[])
        self.connections = GaugeMetricFamily("timesliced_connections", "Open client connections.")
        self.uptime = GaugeMetricFamily("timesliced_uptime_seconds", "Seconds since the daemon started.")
        self.connection_events = CounterMetricFamily(
            "timesliced_connection_events",
            "Client connections accepted and refused, protocol errors, internal errors, failed token proofs "
            "(auth_failures) and connections closed for silence (leases_expired).",
            labels=["event"],
        )

        def group_gauge(name: str, doc: str, *labels: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=["group", *labels])

        def group_counter(name: str, doc: str) -> CounterMetricFamily:
            return CounterMetricFamily(name, doc, labels=["group"])

        self.queue_depth = group_gauge("timesliced_group_queue_depth", "Jobs waiting for the group's lock.")
        self.holder = group_gauge("timesliced_group_holder", "1 for the job holding the group's lock.", "job")
        self.state = group_gauge("timesliced_group_state", "1 for the group's current state, 0 for others.", "state")
        self.fence = group_gauge("timesliced_group_fence", "The group's fencing token (the latest grant's).")
        self.draining = group_gauge("timesliced_group_draining", "1 while an administrator drains the group.")
        self.grants = group_counter("timesliced_group_grants", "Grants of the group's lock.")
        self.switches = group_counter("timesliced_group_switches", "Grants that moved job state.")
        self.bytes_moved = group_counter("timesliced_group_bytes_moved", "Bytes parked and restored for the group.")
        self.deferred = group_counter(
            "timesliced_group_deferred_snapshots", "Times the group's next switch had to wait for memory."
        )
        self.preemptions = group_counter(
            "timesliced_group_preemptions", "Holders parked past the group's maximum slice and queued again."
        )
        self.overdue = group_gauge(
            "timesliced_group_overdue_seconds", "How long the holder has kept the group past its maximum slice."
        )

        def gpu_gauge(name: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=["gpu"])

        self.duty = gpu_gauge("timesliced_gpu_duty_ratio", "The GPU's duty cycle now (0..1).")
        self.duty_window = gpu_gauge("timesliced_gpu_duty_window_ratio", "The GPU's mean duty cycle over the window.")
        self.mem_used = gpu_gauge("timesliced_gpu_memory_used_bytes", "Device memory in use.")
        self.mem_total = gpu_gauge("timesliced_gpu_memory_total_bytes", "Device memory in all.")

        self.gpu_seconds = CounterMetricFamily(
            "timesliced_job_gpu_seconds",
            "GPU seconds the job held (held time times the group's GPUs).",
            labels=["job", "group"],
        )
        self.job_bytes = CounterMetricFamily(
            "timesliced_job_bytes_moved", "Bytes parked and restored for the job.", labels=["job"]
        )
        self.location = GaugeMetricFamily(
            "timesliced_job_location",
            "1 for where the job's device state is now, 0 for others.",
            labels=["job", "location"],
        )
        self.faulted = GaugeMetricFamily("timesliced_job_faulted", "1 if the job is faulted.", labels=["job"])
        self.parked_bytes = GaugeMetricFamily(
            "timesliced_job_parked_bytes", "Host memory the job's parked state takes now.", labels=["job"]
        )
        self.park_refused = GaugeMetricFamily(
            "timesliced_job_park_refused",
            "1 while the job's last park failed with its state intact and is not tried again yet.",
            labels=["job"],
        )
        self.over_declared = GaugeMetricFamily(
            "timesliced_job_over_declared_bytes",
            "The most device memory the job was measured to hold past its declaration on any GPU (0: within it).",
            labels=["job"],
        )

        def host_gauge(name: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=["node"])

        self.host_budget = host_gauge(
            "timesliced_host_budget_bytes", "Host memory all parked state on the node may take (parks beyond it wait)."
        )
        self.host_parked = host_gauge("timesliced_host_parked_bytes", "Host memory parked state takes on the node.")
        self.host_reserved = host_gauge(
            "timesliced_host_reserved_bytes", "Host memory the parks under way on the node are expected to take."
        )
        self.host_room = host_gauge(
            "timesliced_host_room_bytes", "What the node's host could still take at its last reading, margin kept."
        )
        self.host_limit = host_gauge("timesliced_host_limit_bytes", "The node's --host-memory-limit, where one is set.")
        self.sim_pool = GaugeMetricFamily(
            "timesliced_sim_pool_bytes",
            "Host memory the simulated GPU keeps as warm buffers for the next parks (counted as room for parked state)",
        )
        self.sim_pool_limit = GaugeMetricFamily(
            "timesliced_sim_pool_limit_bytes", "The most the simulated GPU keeps as warm buffers (--sim-pool)."
        )
        self.sim_held = GaugeMetricFamily(
            "timesliced_sim_held_bytes",
            "Simulated device memory a parked job holds because its park's last writes failed (its control file's; "
            "unfinished=true: its parked copy's too); free once a write lands.",
            labels=["job", "unfinished"],
        )
        self.dns_members_differ = GaugeMetricFamily(
            "timesliced_cluster_dns_members_differ",
            "1 while the --dns name lists other members than this daemon started with: restart every daemon.",
        )
        self.jobs_dropped = GaugeMetricFamily(
            "timesliced_job_series_dropped", "Jobs left out of the job series by the cap on their number."
        )

    def all(self) -> list[Metric]:
        return [m for m in vars(self).values() if isinstance(m, Metric)]


def _add_group(f: _Families, g: Mapping[str, Any]) -> None:
    name = str(g["group"])
    f.queue_depth.add_metric([name], float(len(g.get("queue", ()))))
    if g.get("holder") is not None:
        f.holder.add_metric([name, str(g["holder"])], 1.0)
    state = str(g["state"])
    for s in _with(GROUP_STATES, state):
        f.state.add_metric([name, s], 1.0 if s == state else 0.0)
    f.fence.add_metric([name], float(g.get("fence", 0)))
    f.draining.add_metric([name], 1.0 if g.get("draining") else 0.0)
    f.grants.add_metric([name], float(g.get("grants", 0)))
    f.switches.add_metric([name], float(g.get("switches", 0)))
    f.bytes_moved.add_metric([name], float(g.get("bytes_moved", 0)))
    f.deferred.add_metric([name], float(g.get("deferred", 0)))
    f.preemptions.add_metric([name], float(g.get("preemptions", 0)))
    if g.get("overdue_s") is not None:
        f.overdue.add_metric([name], float(g["overdue_s"]))


def _add_gpus(f: _Families, devices: Iterable[Mapping[str, Any]], telemetry: Iterable[Mapping[str, Any]]) -> None:
    """Telemetry's figures where it has them, else the scheduler's accounting of each device."""
    by_device = {int(d["index"]): d for d in devices}
    by_sample = {int(t["index"]): t for t in telemetry}
    for index in sorted(set(by_device) | set(by_sample)):
        d, t = by_device.get(index, {}), by_sample.get(index, {})
        gpu = [str(index)]
        for family, value in (
            (f.duty, t.get("duty_now")),
            (f.duty_window, t.get("duty_window")),
            (f.mem_used, _first(t.get("memory_used"), d.get("used"))),
            (f.mem_total, _first(t.get("memory_total"), d.get("capacity"))),
        ):
            if value is not None:
                family.add_metric(gpu, float(value))


def _add_job(f: _Families, job: Mapping[str, Any]) -> None:
    name = str(job["job"])
    f.gpu_seconds.add_metric([name, str(job.get("group", ""))], float(job.get("gpu_seconds", 0.0)))
    f.job_bytes.add_metric([name], float(job.get("bytes_moved", 0)))
    location = str(job["location"])
    for loc in _with(LOCATIONS, location):
        f.location.add_metric([name, loc], 1.0 if loc == location else 0.0)
    f.faulted.add_metric([name], 1.0 if job.get("faulted") else 0.0)
    if "parked_bytes" in job:  # the leader's figures: a follower's jobs have none
        f.parked_bytes.add_metric([name], float(job["parked_bytes"]))
        f.park_refused.add_metric([name], 1.0 if job.get("park_refused") else 0.0)
        if job.get("declared"):  # jobs that declared their memory only: the label set stays the jobs'
            f.over_declared.add_metric([name], float(job.get("over_declared_bytes", 0)))


def _add_host(f: _Families, h: Mapping[str, Any], members: list[str]) -> None:
    slot = int(h["slot"])
    node = [members[slot] if 0 <= slot < len(members) else str(slot)]
    f.host_budget.add_metric(node, float(h["budget"]))
    f.host_parked.add_metric(node, float(h["parked"]))
    f.host_reserved.add_metric(node, float(h["reserved"]))
    f.host_room.add_metric(node, float(h["room"]))
    if h.get("limit") is not None:
        f.host_limit.add_metric(node, float(h["limit"]))


def _with(known: tuple[str, ...], value: str) -> tuple[str, ...]:
    """``known``, and ``value`` after them if it is new (a state this module predates)."""
    return known if value in known else (*known, value)


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def _check_duration(name: str, value: float) -> None:
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite duration >= 0, not {value!r}")
