"""Reading the host's memory for parked state, on fake /proc and /sys trees (``daemon/host_memory.py``).

The trees hold what the kernel documents for each file (proc(5), cgroups(7), cgroup-v1 and -v2
memory controllers), so each reading is checked against figures worked out by hand.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from timesliced.daemon.host_memory import GiB, HostMemory, JobPlace, MiB, default_margin

KB = 1024
V2_MOUNTS = """\
22 28 0:20 / /proc rw,nosuid,nodev,noexec,relatime shared:12 - proc proc rw
26 28 0:24 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate
27 28 0:25 / /dev/shm rw,nosuid,nodev shared:5 - tmpfs tmpfs rw,size=1048576k
"""
V1_MOUNTS = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
36 31 0:33 / /sys/fs/cgroup/cpu\\040acct rw,relatime - cgroup cgroup rw,cpu,cpuacct
"""


def write(root: Path, path: str, text: str) -> None:
    target = root / path.lstrip("/")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)


def meminfo(root: Path, total: int, available: int | None) -> None:
    lines = [f"MemTotal:       {total // KB} kB", "MemFree:          1024 kB"]
    if available is not None:
        lines.append(f"MemAvailable:   {available // KB} kB")
    write(root, "/proc/meminfo", "\n".join(lines) + "\nShmem:  8880 kB\nHugePages_Total:       0\n")


def v2_cgroup(root: Path, path: str, *, limit: int | None, current: int, inactive_file: int = 0) -> None:
    base = f"/sys/fs/cgroup{path}"
    write(root, f"{base}/memory.max", "max\n" if limit is None else f"{limit}\n")
    write(root, f"{base}/memory.current", f"{current}\n")
    write(root, f"{base}/memory.stat", f"anon 1000\nfile {inactive_file * 2}\ninactive_file {inactive_file}\n")


class FakeStat:
    def __init__(self, size: int, free: int) -> None:
        self.f_frsize, self.f_blocks, self.f_bavail = 4096, size // 4096, free // 4096


def statvfs(size: int, free: int) -> object:
    return lambda path: FakeStat(size, free)


@pytest.fixture
def v2_host(tmp_path: Path) -> Path:
    """A 64 GiB host, the daemon in a service's cgroup of 4 GiB, an offload job in another of 8 GiB."""
    meminfo(tmp_path, 64 * GiB, 40 * GiB)
    write(tmp_path, "/proc/self/mountinfo", V2_MOUNTS)
    write(tmp_path, "/proc/self/cgroup", "0::/system.slice/timesliced.service\n")
    write(tmp_path, "/proc/4242/cgroup", "0::/user.slice/trainer.scope\n")
    v2_cgroup(tmp_path, "/system.slice", limit=None, current=5 * GiB)
    v2_cgroup(tmp_path, "/system.slice/timesliced.service", limit=4 * GiB, current=3 * GiB, inactive_file=512 * MiB)
    v2_cgroup(tmp_path, "/user.slice", limit=None, current=5 * GiB)
    v2_cgroup(tmp_path, "/user.slice/trainer.scope", limit=8 * GiB, current=6 * GiB)
    return tmp_path


def test_the_host_room_is_what_is_available_less_the_margin(v2_host: Path) -> None:
    probe = HostMemory(limit=None, margin=None, sim_dir=None, root=v2_host)
    reading = probe.read([], now=5.0)
    margin = default_margin(64 * GiB, 512 * MiB)
    assert margin == int(3.2 * GiB)  # a twentieth of the host
    assert reading.notice.room == 40 * GiB - margin
    assert reading.notice.limit is None and reading.errors == []
    assert reading.notice.source["host"] == "MemAvailable 40.0 GiB less a margin of 3.2 GiB"


def test_without_a_margin_given_each_cgroup_keeps_a_twentieth(v2_host: Path) -> None:
    reading = HostMemory(limit=None, margin=None, sim_dir=None, root=v2_host).read([], now=0.0)
    used = 3 * GiB - 512 * MiB
    assert reading.notice.pools == {"cgroup:/system.slice/timesliced.service": 4 * GiB - used - 4 * GiB // 20}


def test_the_margin_has_a_floor_and_a_ceiling() -> None:
    assert default_margin(4 * GiB, 512 * MiB) == 512 * MiB
    assert default_margin(2048 * GiB, 512 * MiB) == 8 * GiB
    assert default_margin(4 * GiB, 64 * MiB) == 4 * GiB // 20


def test_the_daemons_cgroup_is_a_pool_with_its_reclaimable_cache_left_out(v2_host: Path) -> None:
    probe = HostMemory(limit=None, margin=1 * GiB, sim_dir=None, root=v2_host)
    reading = probe.read([JobPlace("sim-job", "sim", (1,))], now=0.0)
    pool = "cgroup:/system.slice/timesliced.service"
    used = 3 * GiB - 512 * MiB  # inactive file pages are reclaimed before anything is killed
    assert reading.notice.pools[pool] == 4 * GiB - used - 1 * GiB  # the margin given is kept in a cgroup too
    assert reading.notice.members == {"sim-job": (pool,)}  # its parked files are written by the daemon
    assert reading.cgroup is not None and reading.cgroup.limit == 4 * GiB and reading.cgroup.used == used
    assert reading.notice.source[pool] == (
        "cgroup /system.slice/timesliced.service: 2.5 GiB of its 4.0 GiB limit in use, less a margin"
    )


def test_a_process_parked_in_place_counts_against_its_own_cgroup(v2_host: Path) -> None:
    probe = HostMemory(limit=None, margin=0, sim_dir=None, root=v2_host)
    reading = probe.read([JobPlace("trainer", "offload", (4242,), size=3 * GiB)], now=0.0)
    pool = "cgroup:/user.slice/trainer.scope"
    assert reading.notice.members == {"trainer": (pool,)}
    assert reading.notice.pools[pool] == 8 * GiB - 6 * GiB
    assert reading.notice.sizes == {"trainer": 3 * GiB}


def test_an_ancestors_tighter_limit_applies(v2_host: Path) -> None:
    v2_cgroup(v2_host, "/user.slice", limit=7 * GiB, current=int(6.5 * GiB))
    reading = HostMemory(limit=None, margin=0, sim_dir=None, root=v2_host).read(
        [JobPlace("trainer", "cuda-checkpoint", (4242,))], now=0.0
    )
    assert reading.notice.pools["cgroup:/user.slice/trainer.scope"] == 7 * GiB - int(6.5 * GiB)


def test_a_cgroup_without_a_limit_is_no_pool(v2_host: Path) -> None:
    v2_cgroup(v2_host, "/user.slice/trainer.scope", limit=None, current=6 * GiB)
    reading = HostMemory(limit=None, margin=0, sim_dir=None, root=v2_host).read(
        [JobPlace("trainer", "offload", (4242,))], now=0.0
    )
    assert "trainer" not in reading.notice.members and "cgroup:/user.slice/trainer.scope" not in reading.notice.pools


def test_the_sim_tmpfs_is_a_pool_of_its_free_space(v2_host: Path) -> None:
    probe = HostMemory(
        limit=2 * GiB,
        margin=0,
        sim_dir=Path("/dev/shm/timesliced-0-abc"),
        root=v2_host,
        statvfs=statvfs(1 * GiB, 300 * MiB),  # type: ignore[arg-type]
    )
    reading = probe.read([JobPlace("sim-job", "sim", (1,))], now=0.0)
    assert reading.notice.pools["tmpfs:/dev/shm"] == 300 * MiB
    assert reading.notice.members["sim-job"] == ("cgroup:/system.slice/timesliced.service", "tmpfs:/dev/shm")
    assert reading.notice.limit == 2 * GiB
    assert reading.tmpfs == {"path": "/dev/shm", "size": 1 * GiB, "free": 300 * MiB}
    doc = probe.describe(now=1.5)
    assert doc["tmpfs"] == reading.tmpfs and doc["age_s"] == 1.5 and doc["limit"] == 2 * GiB


def test_the_sim_pool_of_warm_buffers_counts_as_room_everywhere_its_pages_are_charged(v2_host: Path) -> None:
    held = {"held": 200 * MiB, "limit": 1 * GiB, "taken": 2, "missed": 1}
    probe = HostMemory(
        limit=None,
        margin=0,
        sim_dir=Path("/dev/shm/timesliced-0-abc"),
        root=v2_host,
        statvfs=statvfs(1 * GiB, 300 * MiB),  # type: ignore[arg-type]
        pool=lambda: held,  # type: ignore[arg-type,return-value]
    )
    reading = probe.read([JobPlace("sim-job", "sim", (1,))], now=0.0)
    # The pool's pages are tmpfs pages of the daemon: out of MemAvailable, not free on the tmpfs, in the
    # daemon's cgroup. A park takes them first, so each of the three gets them back as room.
    assert reading.notice.room == 40 * GiB + 200 * MiB
    assert reading.notice.pools["tmpfs:/dev/shm"] == 500 * MiB
    own = 4 * GiB - (3 * GiB - 512 * MiB)  # limit - used (inactive file pages left out), no margin
    assert reading.notice.pools["cgroup:/system.slice/timesliced.service"] == own + 200 * MiB
    assert reading.tmpfs == {"path": "/dev/shm", "size": 1 * GiB, "free": 300 * MiB}  # the figure as read
    assert "plus 200.0 MiB of the simulated GPU's warm buffers" in reading.notice.source["tmpfs:/dev/shm"]
    assert probe.describe(now=1.0)["sim_pool"] == held
    held["held"] = 0  # an empty pool adds nothing, and says nothing
    again = probe.read([JobPlace("sim-job", "sim", (1,))], now=2.0)
    assert again.notice.room == 40 * GiB and again.notice.pools["tmpfs:/dev/shm"] == 300 * MiB
    assert "warm buffers" not in again.notice.source["host"]
    assert HostMemory(limit=None, margin=0, sim_dir=None, root=v2_host).describe(now=0.0)["sim_pool"] is None


def test_a_sim_dir_on_a_disk_is_no_tmpfs_pool(v2_host: Path) -> None:
    probe = HostMemory(limit=None, margin=0, sim_dir=Path("/var/lib/timesliced/sim"), root=v2_host)
    assert probe.read([], now=0.0).tmpfs is None


def test_cgroup_v1(tmp_path: Path) -> None:
    meminfo(tmp_path, 24 * GiB, 20 * GiB)
    write(tmp_path, "/proc/self/mountinfo", V1_MOUNTS)
    write(tmp_path, "/proc/self/cgroup", "9:name=systemd:/\n5:cpu,cpuacct:/\n4:memory:/process_api/abc\n0::/\n")
    base = "/sys/fs/cgroup/memory/process_api/abc"
    write(tmp_path, f"{base}/memory.limit_in_bytes", f"{9223372036854771712}\n")  # no limit of its own
    write(tmp_path, f"{base}/memory.usage_in_bytes", f"{3 * GiB}\n")
    stat = f"cache 1\nhierarchical_memory_limit {6 * GiB}\ninactive_file 9\ntotal_inactive_file {1 * GiB}\n"
    write(tmp_path, f"{base}/memory.stat", stat)
    reading = HostMemory(limit=None, margin=0, sim_dir=None, root=tmp_path).read([], now=0.0)
    assert reading.cgroup is not None and reading.cgroup.version == 1
    assert reading.cgroup.limit == 6 * GiB and reading.cgroup.used == 2 * GiB
    assert reading.notice.pools == {"cgroup:/process_api/abc": 4 * GiB}


def test_cgroup_v1_without_any_limit(tmp_path: Path) -> None:
    meminfo(tmp_path, 24 * GiB, 20 * GiB)
    write(tmp_path, "/proc/self/mountinfo", V1_MOUNTS)
    write(tmp_path, "/proc/self/cgroup", "4:memory:/\n")
    write(tmp_path, "/sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n")
    write(tmp_path, "/sys/fs/cgroup/memory/memory.usage_in_bytes", f"{GiB}\n")
    reading = HostMemory(limit=None, margin=0, sim_dir=None, root=tmp_path).read([], now=0.0)
    assert reading.cgroup is not None and reading.cgroup.limit is None and reading.notice.pools == {}


def test_what_cannot_be_read_is_named_never_guessed(tmp_path: Path) -> None:
    reading = HostMemory(limit=None, margin=0, sim_dir=None, root=tmp_path).read(
        [JobPlace("gone", "offload", (99999,))], now=0.0
    )
    assert reading.notice.room == 0 and reading.available is None  # nothing known: nothing more may park
    assert any("cannot read /proc/meminfo" in e for e in reading.errors)
    assert any("cannot read /proc/self/mountinfo" in e for e in reading.errors)
    assert reading.errors[0] == f"cannot read /proc/meminfo: {os.strerror(2)}"


def test_an_old_kernel_without_mem_available_is_named(tmp_path: Path) -> None:
    meminfo(tmp_path, 8 * GiB, None)
    reading = HostMemory(limit=None, margin=0, sim_dir=None, root=tmp_path).read([], now=0.0)
    assert "/proc/meminfo has no MemAvailable (a kernel older than 3.14)" in reading.errors


def test_a_cgroup_outside_the_mounted_hierarchy_is_none(v2_host: Path) -> None:
    write(v2_host, "/proc/self/mountinfo", V2_MOUNTS.replace(" / /sys/fs/cgroup ", " /other /sys/fs/cgroup "))
    assert HostMemory(limit=None, margin=0, sim_dir=None, root=v2_host).read([], now=0.0).cgroup is None


def test_mountinfo_escapes_are_read(tmp_path: Path) -> None:
    meminfo(tmp_path, 8 * GiB, 4 * GiB)
    write(tmp_path, "/proc/self/mountinfo", "27 28 0:25 / /mnt/sim\\040dir rw - tmpfs tmpfs rw\n")
    probe = HostMemory(
        limit=None,
        margin=0,
        sim_dir=Path("/mnt/sim dir/x"),
        root=tmp_path,
        statvfs=statvfs(GiB, GiB),  # type: ignore[arg-type]
    )
    assert probe.read([], now=0.0).tmpfs == {"path": "/mnt/sim dir", "size": GiB, "free": GiB}


def test_before_any_reading_status_shows_none() -> None:
    doc = HostMemory(limit=5, margin=7, sim_dir=None).describe(now=0.0)
    assert doc["age_s"] is None and doc["limit"] == 5 and doc["margin"] == 7 and doc["room"] == 0
