"""Reading how much host memory parked state may take on this node (the shell of ``core/host.py``).

Parked state lives in host memory, counted where the kernel charges it:

- ``cuda-checkpoint``: the driver copies device memory into the job's own process; ``offload``
  copies it into pinned buffers of the job's processes; ``vllm`` and ``sglang`` (sleep level 1)
  move weights into the engine's processes. All of it counts against host memory and against the
  memory cgroup of the job's processes.
- ``sim``: parked regions are files in the simulated GPU's directory (by default under
  ``/dev/shm``). On a tmpfs they are shared memory: they count against host memory, against the
  tmpfs's size, and against the memory cgroup of the process that writes them, the daemon's.

The figures, as the kernel documents them:

- ``/proc/meminfo`` ``MemAvailable`` (proc(5), since Linux 3.14): "an estimate of how much memory
  is available for starting new applications, without swapping". tmpfs pages are ``Shmem`` and are
  not in it, so parked files already written are not counted twice.
- cgroup v2 (Documentation/admin-guide/cgroup-v2.rst): ``memory.max`` is "max" (no limit) or a
  byte count, and every ancestor's limit applies too; ``memory.current`` is what the cgroup and its
  descendants use, page cache included; ``memory.stat`` ``inactive_file`` is page cache the kernel
  reclaims first, so it is not counted as used.
- cgroup v1 (Documentation/admin-guide/cgroup-v1/memory.rst): ``memory.limit_in_bytes`` (a value
  near 2**63 means no limit), ``memory.usage_in_bytes``, and ``memory.stat``
  ``hierarchical_memory_limit`` (the tightest limit of the cgroup and its ancestors) and
  ``total_inactive_file``.
- ``/proc/PID/cgroup`` (cgroups(7)): one line per hierarchy, ``ID:CONTROLLERS:PATH``; v2's is
  ``0::PATH``. ``/proc/self/mountinfo`` (proc(5)) says where each hierarchy is mounted: field 4 is
  the mount's root within the hierarchy, field 5 its mount point, and after `` - `` the file system
  type (``cgroup2``, or ``cgroup`` with the controllers among the super options).
- ``statvfs(2)`` of the simulated GPU's directory: ``f_bavail * f_frsize`` bytes are free.

The simulated GPU keeps the files of restored jobs as a pool of warm buffers for the next parks
(``backends/sim_buffers.py``). Their pages are the daemon's tmpfs pages, so they are not in
``MemAvailable``, not free on the tmpfs and charged to the daemon's cgroup; but a park takes them
before any new page (and a park that finds none big enough gives as much of the pool back first),
so they are room for parked state: each reading adds what the pool holds (``pooled``) to the host's
room, the tmpfs's free bytes and the daemon's cgroup's room.

A margin is kept free on the host and in each cgroup: a twentieth of its size, at least 512 MiB on
the host (64 MiB in a cgroup) and at most 8 GiB; the job's own growth, the kernel and the page cache
need room besides the parked state. ``--host-memory-margin`` sets one for the host and every
cgroup. The tmpfs gets none: when it fills, a write fails with ``ENOSPC`` (the park is refused,
the job stays whole), and no process is killed.

Every figure is read fresh at each reading (a handful of small pseudo-files, well under a
millisecond); one that cannot be read is left out and named in ``error``, never guessed.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from ..cluster.asks import HostRead
from ..util.parse import human_size
from ..wire import status as schema

MiB = 1 << 20
GiB = 1 << 30
V1_UNLIMITED = 1 << 62  # cgroup v1 writes no limit as PAGE_COUNTER_MAX pages: anything this large is none


def default_margin(size: int, floor: int) -> int:
    """What is kept free of parked state in memory of ``size`` bytes."""
    return max(floor, min(size // 20, 8 * GiB))


@dataclass(frozen=True)
class Cgroup:
    """A memory cgroup as read now: its tightest limit and the room under it (``room`` None: no limit)."""

    path: str
    version: int
    limit: int | None
    used: int
    room: int | None
    figures: str  # the numbers, for errors and status

    def describe(self) -> schema.Cgroup:
        return {"path": self.path, "version": self.version, "limit": self.limit, "used": self.used, "room": self.room}


@dataclass(frozen=True)
class JobPlace:
    """What the reading needs of one job of this node."""

    name: str
    method: str
    pids: tuple[int, ...]
    size: int = 0  # the host bytes its park is expected to take, as measured (its device memory); 0: unknown


@dataclass
class Reading:
    """One reading of the host: what status shows and what the scheduler is told."""

    notice: HostRead
    available: int | None
    total: int | None
    margin: int
    limit: int | None
    cgroup: Cgroup | None
    tmpfs: schema.Tmpfs | None
    jobs: dict[str, list[str]]
    at: float
    errors: list[str] = field(default_factory=list)


class HostMemory:
    """Reads the host's figures for parked state. ``root`` prefixes every absolute path (a test's fake tree)."""

    def __init__(
        self,
        *,
        limit: int | None,
        margin: int | None,
        sim_dir: Path | None,
        root: Path = Path("/"),
        self_pid: int | None = None,
        statvfs: Callable[[str], os.statvfs_result] = os.statvfs,
        pool: Callable[[], schema.SimPool] | None = None,
    ) -> None:
        self.limit = limit
        self.margin = margin
        self.sim_dir = sim_dir
        self.root = root
        self.self_pid = self_pid
        self.statvfs = statvfs
        self.pool = pool  # the simulated GPU's pool of warm buffers, where there is one
        self.last: Reading | None = None

    # --- one reading -------------------------------------------------------------------

    def read(self, jobs: Iterable[JobPlace], now: float) -> Reading:
        """Read every figure now; a figure that cannot be read is left out and named in ``errors``."""
        problems: list[str] = []
        pooled = self.pool()["held"] if self.pool is not None else 0
        total, available = self._meminfo(problems)
        margin = self.margin if self.margin is not None else default_margin(total or 0, 512 * MiB)
        room = max(0, available - margin) + pooled if available is not None else 0
        source = {"host": self._host_figures(available, margin) + self._pooled(pooled)}
        mounts = self._mounts(problems)
        own = self._cgroup("self" if self.self_pid is None else str(self.self_pid), mounts, problems)
        pools: dict[str, int] = {}
        if own is not None and own.room is not None:
            pools[f"cgroup:{own.path}"] = own.room + pooled  # the daemon's cgroup is charged for the pool
            source[f"cgroup:{own.path}"] = own.figures + self._pooled(pooled)
        tmpfs = self._tmpfs(mounts, problems)
        if tmpfs is not None:
            pools[f"tmpfs:{tmpfs['path']}"] = tmpfs["free"] + pooled
            source[f"tmpfs:{tmpfs['path']}"] = (
                f"tmpfs {tmpfs['path']}: {human_size(tmpfs['free'])} of {human_size(tmpfs['size'])} free"
                + self._pooled(pooled)
            )
        members: dict[str, tuple[str, ...]] = {}
        sizes: dict[str, int] = {}
        seen: dict[str, Cgroup | None] = {}
        for job in jobs:
            mine: list[str] = []
            if job.method == "sim":
                # Its parked files are written by the daemon: its cgroup and the tmpfs count them.
                if own is not None and own.room is not None:
                    mine.append(f"cgroup:{own.path}")
                if tmpfs is not None:
                    mine.append(f"tmpfs:{tmpfs['path']}")
            else:
                for pid in job.pids:
                    key = str(pid)
                    if key not in seen:
                        seen[key] = self._cgroup(key, mounts, problems, quiet=True)
                    group = seen[key]
                    if group is None or group.room is None:
                        continue
                    name = f"cgroup:{group.path}"
                    pools[name] = group.room
                    source[name] = group.figures
                    if name not in mine:
                        mine.append(name)
                if job.size:
                    sizes[job.name] = job.size
            if mine:
                members[job.name] = tuple(mine)
        notice = HostRead(room, self.limit, pools, members, sizes, source)
        reading = Reading(
            notice,
            available,
            total,
            margin,
            self.limit,
            own,
            tmpfs,
            {name: list(p) for name, p in members.items()},
            now,
            problems,
        )
        self.last = reading
        return reading

    def describe(self, now: float) -> schema.HostReading:
        r = self.last
        if r is None:
            return {
                "available": None,
                "total": None,
                "margin": self.margin or 0,
                "limit": self.limit,
                "room": 0,
                "cgroup": None,
                "tmpfs": None,
                "sim_pool": self.pool() if self.pool is not None else None,
                "jobs": {},
                "pools": {},
                "age_s": None,
                "error": None,
            }
        return {
            "available": r.available,
            "total": r.total,
            "margin": r.margin,
            "limit": r.limit,
            "room": r.notice.room,
            "cgroup": r.cgroup.describe() if r.cgroup is not None else None,
            "tmpfs": r.tmpfs,
            "sim_pool": self.pool() if self.pool is not None else None,
            "jobs": r.jobs,
            "pools": dict(r.notice.pools),
            "age_s": max(0.0, now - r.at),
            "error": "; ".join(r.errors) or None,
        }

    # --- the figures -------------------------------------------------------------------

    def _path(self, absolute: str) -> Path:
        return self.root / absolute.lstrip("/")

    @staticmethod
    def _pooled(pooled: int) -> str:
        return f", plus {human_size(pooled)} of the simulated GPU's warm buffers for parks" if pooled else ""

    def _host_figures(self, available: int | None, margin: int) -> str:
        shown = human_size(available) if available is not None else "unknown"
        text = f"MemAvailable {shown} less a margin of {human_size(margin)}"
        return text + (f"; --host-memory-limit {human_size(self.limit)}" if self.limit is not None else "")

    def _meminfo(self, problems: list[str]) -> tuple[int | None, int | None]:
        try:
            text = self._path("/proc/meminfo").read_text()
        except OSError as exc:
            problems.append(f"cannot read /proc/meminfo: {exc.strerror or exc}")
            return None, None
        values: dict[str, int] = {}
        for line in text.splitlines():
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                values[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
        if "MemAvailable" not in values:
            problems.append("/proc/meminfo has no MemAvailable (a kernel older than 3.14)")
        return values.get("MemTotal"), values.get("MemAvailable")

    def _mounts(self, problems: list[str]) -> list[tuple[str, str, str, set[str]]]:
        """(root, mount point, file system type, super options) of every mount, from mountinfo."""
        try:
            text = self._path("/proc/self/mountinfo").read_text()
        except OSError as exc:
            problems.append(f"cannot read /proc/self/mountinfo: {exc.strerror or exc}")
            return []
        mounts = []
        for line in text.splitlines():
            left, sep, right = line.partition(" - ")
            fields, tail = left.split(), right.split()
            if not sep or len(fields) < 5 or len(tail) < 3:
                continue
            mounts.append((_unescape(fields[3]), _unescape(fields[4]), tail[0], set(tail[2].split(","))))
        return mounts

    def _cgroup(
        self, pid: str, mounts: list[tuple[str, str, str, set[str]]], problems: list[str], *, quiet: bool = False
    ) -> Cgroup | None:
        """The memory cgroup of process ``pid`` as read now; None when it is in none (or it cannot be read)."""
        try:
            lines = self._path(f"/proc/{pid}/cgroup").read_text().splitlines()
        except OSError as exc:
            if not quiet:
                problems.append(f"cannot read /proc/{pid}/cgroup: {exc.strerror or exc}")
            return None
        v1 = v2 = None
        for line in lines:
            _, controllers, path = [*line.split(":", 2), "", ""][:3]
            if controllers == "" and line.startswith("0::"):
                v2 = path
            elif "memory" in controllers.split(","):
                v1 = path
        if v1 is not None:  # the memory controller is on a v1 hierarchy: that one limits
            mount = next((m for m in mounts if m[2] == "cgroup" and "memory" in m[3]), None)
            return self._cgroup_at(v1, mount, 1, problems) if mount is not None else None
        if v2 is not None:
            mount = next((m for m in mounts if m[2] == "cgroup2"), None)
            return self._cgroup_at(v2, mount, 2, problems) if mount is not None else None
        return None

    def _cgroup_at(
        self, path: str, mount: tuple[str, str, str, set[str]], version: int, problems: list[str]
    ) -> Cgroup | None:
        mount_root, mount_point = mount[0], mount[1]
        inside = os.path.relpath(path, mount_root) if path.startswith(mount_root) else None
        if inside is None or inside.startswith(".."):
            return None  # its cgroup is outside what is mounted here (another cgroup namespace)
        top = self._path(mount_point)
        here = top if inside == "." else top / inside
        levels = [here, *[p for p in here.parents if p == top or top in p.parents]]
        tightest: tuple[int, int, int] | None = None  # (room, limit, used) of the level with the least room
        for level in levels:
            figures = _level(level, version)
            if figures is None:
                continue
            limit, used = figures
            if limit is None:
                continue
            margin = self.margin if self.margin is not None else default_margin(limit, 64 * MiB)
            room = limit - used - margin
            if tightest is None or room < tightest[0]:
                tightest = (room, limit, used)
        if tightest is None:
            here_figures = _level(here, version)
            in_use = here_figures[1] if here_figures is not None else 0
            return Cgroup(path, version, None, in_use, None, f"cgroup {path}: no memory limit")
        room, limit, in_use = tightest
        text = f"cgroup {path}: {human_size(in_use)} of its {human_size(limit)} limit in use, less a margin"
        return Cgroup(path, version, limit, in_use, max(0, room), text)

    def _tmpfs(self, mounts: list[tuple[str, str, str, set[str]]], problems: list[str]) -> schema.Tmpfs | None:
        """The tmpfs the simulated GPU parks its jobs on; None when there is no sim dir or it is not a tmpfs."""
        if self.sim_dir is None:
            return None
        where = str(self.sim_dir)
        best = max(
            (m for m in mounts if where == m[1] or where.startswith(m[1].rstrip("/") + "/")),
            key=lambda m: len(m[1]),
            default=None,
        )
        if best is None or best[2] != "tmpfs":
            return None  # parked files on a disk take no host memory but page cache
        try:
            st = self.statvfs(where)  # the directory itself: the backend writes there, whatever ``root`` is
        except OSError as exc:
            problems.append(f"cannot statvfs {where}: {exc.strerror or exc}")
            return None
        return {"path": best[1], "size": st.f_blocks * st.f_frsize, "free": st.f_bavail * st.f_frsize}


def _level(directory: Path, version: int) -> tuple[int | None, int] | None:
    """(limit or None, used less inactive file pages) of one cgroup directory; None if it has no such files."""
    limit_file, used_file = (
        ("memory.max", "memory.current")
        if version == 2
        else (
            "memory.limit_in_bytes",
            "memory.usage_in_bytes",
        )
    )
    try:
        raw_used = (directory / used_file).read_text().strip()
    except OSError:
        return None  # the root of a v2 hierarchy has neither file
    stat = _stat(directory / "memory.stat")
    try:
        raw_limit = (directory / limit_file).read_text().strip()
    except OSError:
        raw_limit = "max"
    limit: int | None = None if raw_limit == "max" else int(raw_limit)
    if version == 1:
        hierarchical = stat.get("hierarchical_memory_limit")
        if hierarchical is not None and (limit is None or hierarchical < limit):
            limit = hierarchical
        if limit is not None and limit >= V1_UNLIMITED:
            limit = None
    reclaimable = stat.get("inactive_file" if version == 2 else "total_inactive_file", stat.get("inactive_file", 0))
    return limit, max(0, int(raw_used) - reclaimable)


def _stat(path: Path) -> dict[str, int]:
    try:
        text = path.read_text()
    except OSError:
        return {}
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if value.strip().isdigit():
            out[key] = int(value.strip())
    return out


def _unescape(text: str) -> str:
    """mountinfo writes space, tab, newline and backslash in paths as octal escapes (``\\040``)."""
    out, i = [], 0
    while i < len(text):
        if text[i] == "\\" and text[i + 1 : i + 4].isdigit():
            out.append(chr(int(text[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(text[i])
            i += 1
    return "".join(out)
