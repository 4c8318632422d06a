"""The simulated GPU backend: paging, parking, clients in other processes, crash recovery."""

from __future__ import annotations

import asyncio
import errno
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack  # type: ignore[import-untyped]
import pytest

from timesliced import errors
from timesliced.backends import sim
from timesliced.backends.base import MoveResult
from timesliced.backends.sim import SimBackend
from timesliced.sim.layout import RegionInfo, job_key, read_ctl
from timesliced.sim.region import SimRegion

PAGE = 64 << 10
MiB = 1 << 20
REPO = Path(__file__).resolve().parents[2]


class Sims:
    """Backends and client handles of one test, all closed when it ends."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._backends: list[SimBackend] = []
        self._regions: list[SimRegion] = []

    def backend(self, **settings: Any) -> SimBackend:
        """A backend on the test's root; by default 2 GPUs of 32 pages and unlimited bandwidth."""
        settings = {"gpus": 2, "capacity": 32 * PAGE, "page_size": PAGE, "bandwidth": 0, **settings}
        b = SimBackend(self.root, **settings)
        self._backends.append(b)
        return b

    def open(self, info: RegionInfo) -> SimRegion:
        r = SimRegion.open(info)
        self._regions.append(r)
        return r

    def close(self) -> None:
        for r in self._regions:
            r.close()
        for b in self._backends:
            b.close()


@pytest.fixture
def root(tmp_path: Path) -> Iterator[Path]:
    """A fresh sim root on tmpfs where there is one, like production."""
    base = Path("/dev/shm")
    path = base / f"timesliced-test-{uuid.uuid4().hex[:12]}" if base.is_dir() else tmp_path / "sim"
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def sims(root: Path) -> Iterator[Sims]:
    s = Sims(root)
    yield s
    s.close()


def blake(data: bytes | bytearray) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def extents_of(info: RegionInfo) -> tuple[tuple[int, int], ...]:
    _, slot, _ = read_ctl(Path(info.ctl_path))
    return next(r.extents for r in slot.regions if r.region == info.region)


def run_child(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), *args], env=env, capture_output=True, text=True, timeout=60
    )


# --- allocation ----------------------------------------------------------------------


def test_alloc_rounds_up_to_pages_and_hands_out_zeroed_memory(sims: Sims) -> None:
    b = sims.backend()
    assert [d.name for d in b.devices()] == ["sim-gpu0", "sim-gpu1"]
    assert b.rounded(0) == 0 and b.rounded(1) == PAGE and b.rounded(PAGE) == PAGE and b.rounded(PAGE + 1) == 2 * PAGE

    info = b.alloc("a", 1, PAGE + 1)
    assert (info.region, info.gpu, info.nbytes, info.page_size) == (1, 1, PAGE + 1, PAGE)
    assert b.footprint("a") == {1: 2 * PAGE}
    assert b.free_bytes(1) == 30 * PAGE and b.free_bytes(0) == 32 * PAGE
    assert b.job_state("a") == "resident" and b.job_state("nobody") == "unknown"
    assert RegionInfo.from_wire(msgpack.unpackb(msgpack.packb(info.to_wire()))) == info

    r = sims.open(info)
    assert r.read() == bytes(PAGE + 1)
    r.fill(b"\xff")
    pages = extents_of(info)
    assert b.free("a", info.region) == 2 * PAGE
    again = b.alloc("a", 1, 2 * PAGE)
    assert again.region == 2  # ids are never reused ...
    assert extents_of(again) == pages  # ... but pages are, and they come back zeroed
    assert sims.open(again).read() == bytes(2 * PAGE)


def test_bad_sizes_and_settings_are_value_errors(sims: Sims, root: Path) -> None:
    b = sims.backend()
    for n in (0, -1):
        with pytest.raises(ValueError):
            b.alloc("a", 0, n)
    with pytest.raises(ValueError):
        SimBackend(root / "x", gpus=1, capacity=PAGE + 1, page_size=PAGE)
    with pytest.raises(ValueError):
        SimBackend(root / "y", gpus=1, capacity=1000 * 10, page_size=1000)


def test_out_of_memory_says_requested_free_and_capacity(sims: Sims) -> None:
    b = sims.backend()
    b.alloc("a", 0, 30 * PAGE)
    with pytest.raises(errors.OutOfMemory) as caught:
        b.alloc("b", 0, 3 * PAGE)
    message = str(caught.value)
    assert str(3 * PAGE) in message and str(2 * PAGE) in message and str(32 * PAGE) in message
    assert caught.value.details["free"] == 2 * PAGE
    assert b.free_bytes(0) == 2 * PAGE and b.job_state("b") == "unknown"
    b.alloc("b", 0, 2 * PAGE)  # exactly what is left still fits


def test_unknown_gpu(sims: Sims) -> None:
    b = sims.backend()
    for gpu in (2, -1):
        with pytest.raises(errors.UnknownDevice):
            b.alloc("a", gpu, PAGE)


def test_job_names_can_be_any_string(sims: Sims) -> None:
    b = sims.backend()
    names = ["../../etc/passwd", "", "ü ñ/\\:*?", "a" * 500, ".hidden"]
    keys = {job_key(n) for n in names}
    assert len(keys) == len(names) and all("/" not in k and not k.startswith(".") for k in keys)
    for name in names:
        info = b.alloc(name, 0, PAGE)
        assert Path(info.ctl_path).parent == b.root / "jobs"
        sims.open(info).write(name.encode()[:PAGE])
    assert asyncio.run(b.snapshot(names[0])).nbytes == PAGE


# --- client access -------------------------------------------------------------------


def test_write_read_fill_checksum_across_scattered_pages(sims: Sims) -> None:
    b = sims.backend()
    spacers = [b.alloc("other", 0, PAGE) for _ in range(6)]
    for s in spacers[::2]:
        b.free("other", s.region)  # holes at pages 0, 2, 4
    info = b.alloc("a", 0, 5 * PAGE - 7)
    assert extents_of(info) == ((0, 1), (2, 1), (4, 1), (6, 2))
    r = sims.open(info)

    expected = bytearray(info.nbytes)
    rng = random.Random(1)
    for offset, size in [(0, 10), (PAGE - 3, 9), (PAGE * 2 - 1, PAGE + 2), (info.nbytes - 5, 5)]:
        data = rng.randbytes(size)
        r.write(data, offset)
        expected[offset : offset + size] = data
    assert r.read() == expected
    assert r.read(PAGE + 4, PAGE - 2) == expected[PAGE - 2 : 2 * PAGE + 2]
    buf = bytearray(3 * PAGE)
    assert r.readinto(buf, 7) == len(buf) and buf == expected[7 : 7 + len(buf)]
    assert r.checksum() == blake(expected)

    pattern = b"0123456"
    r.fill(pattern)
    expected = bytearray((pattern * (info.nbytes // 7 + 1))[: info.nbytes])
    assert r.read() == expected and r.checksum() == blake(expected)

    with pytest.raises(ValueError):
        r.write(b"xx", info.nbytes - 1)
    with pytest.raises(ValueError):
        r.read(1, -1)
    with pytest.raises(ValueError):
        r.read(info.nbytes + 1)
    with pytest.raises(ValueError):
        r.fill(b"")

    maps = Path("/proc/self/maps")
    mapped = maps.read_text().count(info.arena_path) if maps.exists() else 0
    twin = sims.open(info)  # a second handle shares the process's mappings
    assert twin.read(10) == expected[:10]
    if maps.exists():
        assert maps.read_text().count(info.arena_path) == mapped
    r.close()
    with pytest.raises(ValueError):
        r.read(1)


def test_client_in_another_process_writes_real_shared_bytes(sims: Sims) -> None:
    b = sims.backend()
    info = b.alloc("a", 0, 3 * PAGE + 11)
    script = """
        import json, sys
        from timesliced import errors
        from timesliced.sim.layout import RegionInfo
        from timesliced.sim.region import SimRegion
        with SimRegion.open(RegionInfo.from_wire(json.loads(sys.argv[1]))) as r:
            if sys.argv[2] == "write":
                r.fill(b"child!")
                r.write(b"MARK", 1000)
                print(r.checksum())
            else:
                try:
                    r.read(4, 1000)
                except errors.NotResident as exc:
                    print("NotResident:", exc)
    """
    wire = json.dumps(info.to_wire())
    done = run_child(script, wire, "write")
    assert done.returncode == 0, done.stderr
    expected = bytearray((b"child!" * info.nbytes)[: info.nbytes])
    expected[1000:1004] = b"MARK"
    r = sims.open(info)
    assert r.read() == expected and done.stdout.strip() == blake(expected)

    asyncio.run(b.snapshot("a"))
    done = run_child(script, wire, "read")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("NotResident:") and "parked in host memory" in done.stdout


def test_control_file_grows_under_open_clients(sims: Sims) -> None:
    b = sims.backend(capacity=512 * PAGE)
    info = b.alloc("a", 0, PAGE)
    first = sims.open(info)
    first.write(b"first")
    ctl = Path(info.ctl_path)
    size = ctl.stat().st_size
    infos = [b.alloc("a", 0, PAGE) for _ in range(400)]  # far more rows than the first table had room for
    assert ctl.stat().st_size > size
    last = sims.open(infos[-1])
    last.write(b"last")
    assert first.read(5) == b"first" and last.read(4) == b"last"
    for info in infos[:-1]:
        b.free("a", info.region)
    assert first.read(5) == b"first" and last.read(4) == b"last"
    assert [i.region for i in b.regions("a")] == [1, 401]


def test_a_reader_in_another_process_never_sees_a_torn_table(sims: Sims) -> None:
    b = sims.backend(capacity=256 * PAGE)
    info = b.alloc("a", 0, 3 * PAGE)
    watched = sims.open(info)
    watched.fill(b"steady")
    digest = watched.checksum()
    script = """
        import json, sys, time
        from timesliced.sim.layout import RegionInfo
        from timesliced.sim.region import SimRegion
        with SimRegion.open(RegionInfo.from_wire(json.loads(sys.argv[1]))) as r:
            print("ready", flush=True)
            reads, end = 0, time.monotonic() + float(sys.argv[2])
            while time.monotonic() < end:
                assert r.read(6) == b"steady"
                assert r.checksum() == sys.argv[3]
                reads += 1
            print(reads)
    """
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    args = [sys.executable, "-c", textwrap.dedent(script), json.dumps(info.to_wire()), "0.6", digest]
    with subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as child:
        assert child.stdout is not None and child.stderr is not None
        assert child.stdout.readline().strip() == "ready", child.stderr.read()
        churn = 0
        while child.poll() is None:  # reshape the job's table as fast as we can while the child reads
            regions = [b.alloc("a", 0, PAGE) for _ in range(20)]
            for info in regions:
                b.free("a", info.region)
            churn += 1
        out, err = child.communicate()
    assert child.returncode == 0, err
    assert int(out) > 0 and churn > 0, (out, churn)


# --- parking -------------------------------------------------------------------------


def test_snapshot_returns_device_memory_and_blocks_access(sims: Sims) -> None:
    b = sims.backend()
    info = b.alloc("a", 0, 10 * PAGE)
    r = sims.open(info)
    r.fill(b"abc")
    digest = r.checksum()
    arena = Path(info.arena_path)
    assert arena.stat().st_blocks * 512 >= 10 * PAGE

    moved = asyncio.run(b.snapshot("a"))
    assert moved.nbytes == 10 * PAGE and moved.seconds >= 0
    assert b.free_bytes(0) == 32 * PAGE
    assert arena.stat().st_blocks == 0  # the host got the RAM back, not just the allocator
    assert b.job_state("a") == "parked" and b.footprint("a") == {0: 10 * PAGE}
    assert (b.root / "parked" / job_key("a") / "1.bin").stat().st_size == 10 * PAGE
    with pytest.raises(errors.NotResident, match="parked in host memory; acquire the lock"):
        r.read(1)
    with pytest.raises(errors.NotResident):
        r.write(b"x")
    with pytest.raises(errors.NotResident):
        b.alloc("a", 0, PAGE)
    assert asyncio.run(b.snapshot("a")).nbytes == 0  # already parked

    assert asyncio.run(b.restore("a")).nbytes == 10 * PAGE
    assert r.checksum() == digest and b.free_bytes(0) == 22 * PAGE
    assert not (b.root / "parked" / job_key("a")).exists()
    assert asyncio.run(b.restore("a")).nbytes == 0  # already resident
    assert asyncio.run(b.snapshot("nobody")) == asyncio.run(b.restore("nobody")) == MoveResult(0, 0.0)


def test_restore_places_bytes_exactly_on_other_pages(sims: Sims) -> None:
    b = sims.backend()
    rng = random.Random(2)
    infos = [b.alloc("a", 0, 7 * PAGE + 3), b.alloc("a", 0, 5 * PAGE - 1)]
    data = [rng.randbytes(i.nbytes) for i in infos]
    for info, blob in zip(infos, data, strict=True):
        sims.open(info).write(blob)
    before = [extents_of(i) for i in infos]
    asyncio.run(b.snapshot("a"))

    others = [b.alloc("b", 0, PAGE) for _ in range(32)]
    for o in others[::2]:
        b.free("b", o.region)  # sixteen one-page holes
    asyncio.run(b.restore("a"))
    after = [extents_of(i) for i in infos]
    assert after != before and all(n == 1 for ext in after for _, n in ext)
    for info, blob in zip(infos, data, strict=True):
        assert sims.open(info).read() == blob
    assert b.free_bytes(0) == 3 * PAGE  # 16 holes - 8 - 5 pages


def test_fifty_switches_between_jobs_that_do_not_fit_together(sims: Sims) -> None:
    b = sims.backend()
    rng = random.Random(3)
    sizes = {"a": [11 * PAGE - 5, 8 * PAGE], "b": [15 * PAGE + 1, 4 * PAGE]}  # 19 + 20 pages > 32
    b.alloc("bystander", 0, PAGE)
    regions: dict[str, list[tuple[SimRegion, bytearray]]] = {}
    for job in ("a", "b"):
        if job == "b":
            asyncio.run(b.snapshot("a"))
        regions[job] = []
        for n in sizes[job]:
            r = sims.open(b.alloc(job, 0, n))
            blob = bytearray(rng.randbytes(n))
            r.write(blob)
            regions[job].append((r, blob))

    current = "b"
    for _ in range(50):
        nxt = "a" if current == "b" else "b"
        asyncio.run(b.snapshot(current))
        asyncio.run(b.restore(nxt))
        for r, blob in regions[nxt]:
            assert r.checksum() == blake(blob)
            offset = rng.randrange(len(blob) - 100)
            patch = rng.randbytes(100)
            r.write(patch, offset)
            blob[offset : offset + 100] = patch
        current = nxt
    assert b.free_bytes(0) == 32 * PAGE - PAGE - sum(b.footprint(current).values())


def test_snapshot_of_one_job_and_restore_of_another_run_together(sims: Sims) -> None:
    b = sims.backend(capacity=64 * PAGE, bandwidth=256 * MiB)
    x = sims.open(b.alloc("x", 0, 20 * PAGE))
    y = sims.open(b.alloc("y", 0, 20 * PAGE))
    x.fill(b"x")
    y.fill(b"y")
    asyncio.run(b.snapshot("y"))

    async def both() -> tuple[MoveResult, MoveResult]:
        return await asyncio.gather(b.snapshot("x"), b.restore("y"))

    assert [m.nbytes for m in asyncio.run(both())] == [20 * PAGE, 20 * PAGE]
    assert y.read() == b"y" * (20 * PAGE) and b.job_state("x") == "parked"
    asyncio.run(b.restore("x"))
    assert x.read() == b"x" * (20 * PAGE)


def test_moves_take_at_least_nbytes_over_bandwidth(sims: Sims) -> None:
    bandwidth = 32 * MiB
    b = sims.backend(bandwidth=bandwidth)
    sims.open(b.alloc("a", 0, 16 * PAGE)).fill(b"z")
    sims.open(b.alloc("a", 1, 16 * PAGE)).fill(b"z")
    for move in (b.snapshot, b.restore):
        result = asyncio.run(move("a"))
        assert result.nbytes == 32 * PAGE
        assert result.seconds >= result.nbytes / bandwidth


def test_free_drops_regions_whether_resident_or_parked(sims: Sims) -> None:
    b = sims.backend()
    keep, drop, parked = (b.alloc("a", 0, PAGE + 1) for _ in range(3))
    r = sims.open(drop)
    assert b.free("a", drop.region) == 2 * PAGE
    with pytest.raises(errors.UnknownRegion):
        r.read(1)
    with pytest.raises(errors.UnknownRegion):
        b.free("a", drop.region)
    with pytest.raises(errors.UnknownRegion):
        b.free("nobody", 1)
    asyncio.run(b.snapshot("a"))
    assert b.free("a", parked.region) == 2 * PAGE
    assert not (b.root / "parked" / job_key("a") / f"{parked.region}.bin").exists()
    assert b.footprint("a") == {0: 2 * PAGE}
    asyncio.run(b.restore("a"))
    assert sims.open(keep).read() == bytes(PAGE + 1)


def test_reclaim_forgets_the_job_entirely(sims: Sims) -> None:
    b = sims.backend()
    live = sims.open(b.alloc("live", 0, 4 * PAGE))
    b.alloc("live", 1, 4 * PAGE)
    b.alloc("parked", 0, 4 * PAGE)
    asyncio.run(b.snapshot("parked"))
    for job in ("live", "parked", "nobody"):
        asyncio.run(b.reclaim(job))
        assert b.job_state(job) == "unknown" and b.footprint(job) == {}
    assert b.free_bytes(0) == b.free_bytes(1) == 32 * PAGE
    assert list((b.root / "jobs").iterdir()) == [] and list((b.root / "parked").iterdir()) == []
    with pytest.raises(errors.UnknownRegion, match="reclaimed"):
        live.read(1)
    assert b.alloc("live", 0, PAGE).region == 1  # a new job of the same name starts afresh


# --- failures ------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["delete", "truncate"])
def test_failed_restore_leaves_the_job_parked_without_leaking_pages(sims: Sims, damage: str) -> None:
    b = sims.backend()
    infos = [b.alloc("a", 0, 6 * PAGE), b.alloc("a", 1, 6 * PAGE)]
    asyncio.run(b.snapshot("a"))
    folder = b.root / "parked" / job_key("a")
    victim = folder / f"{infos[1].region}.bin"
    if damage == "delete":
        victim.unlink()
    else:
        os.truncate(victim, PAGE)
    with pytest.raises(errors.BackendError):
        asyncio.run(b.restore("a"))
    assert b.job_state("a") == "parked"
    assert b.free_bytes(0) == b.free_bytes(1) == 32 * PAGE
    assert (folder / f"{infos[0].region}.bin").exists()
    with pytest.raises(errors.NotResident):
        sims.open(infos[0]).read(1)
    asyncio.run(b.reclaim("a"))
    assert not folder.exists()


def test_failed_snapshot_leaves_the_job_resident(sims: Sims, monkeypatch: pytest.MonkeyPatch) -> None:
    b = sims.backend()
    r = sims.open(b.alloc("a", 0, 5 * PAGE))
    r.fill(b"keep")
    digest = r.checksum()

    def disk_full(fd: int, data: memoryview) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(sim, "_write_all", disk_full)
    with pytest.raises(errors.BackendError, match="No space"):
        asyncio.run(b.snapshot("a"))
    assert b.job_state("a") == "resident" and r.checksum() == digest
    assert b.free_bytes(0) == 27 * PAGE and not (b.root / "parked" / job_key("a")).exists()
    monkeypatch.undo()
    assert asyncio.run(b.snapshot("a")).nbytes == 5 * PAGE


def test_a_timed_out_snapshot_rolls_back(sims: Sims) -> None:
    b = sims.backend(bandwidth=8 * MiB)
    r = sims.open(b.alloc("a", 0, 32 * PAGE))  # 2 MiB: a quarter of a second at this bandwidth
    r.fill(b"slow")

    async def scenario() -> MoveResult:
        with pytest.raises((TimeoutError, asyncio.TimeoutError)):
            await asyncio.wait_for(b.snapshot("a"), 0.02)
        return await b.restore("a")  # waits for the abandoned snapshot to unwind

    assert asyncio.run(scenario()).nbytes == 0  # it never left the device
    assert b.job_state("a") == "resident" and r.read(8) == b"slowslow"
    assert not (b.root / "parked" / job_key("a")).exists()


# --- restarts and crashes --------------------------------------------------------------


def test_one_daemon_per_root(sims: Sims) -> None:
    sims.backend()
    with pytest.raises(errors.BackendError, match="in use"):
        sims.backend()


def test_restart_adopts_state_and_refuses_other_settings(sims: Sims) -> None:
    b = sims.backend()
    info = b.alloc("a", 1, 3 * PAGE)
    r = sims.open(info)
    r.fill(b"survivor")
    b.close()
    for bad in ({"capacity": 64 * PAGE}, {"page_size": 2 * PAGE}, {"gpus": 3}):
        with pytest.raises(ValueError, match="same settings"):
            sims.backend(**bad)
    b = sims.backend()
    assert b.recovered_jobs() == {"a": ("resident", {1: 3 * PAGE})}
    assert r.read(8) == b"survivor"  # clients keep their mappings across a daemon restart
    asyncio.run(b.snapshot("a"))
    with pytest.raises(errors.NotResident):
        r.read(1)
    assert b.alloc("b", 1, 29 * PAGE).region == 1  # the pages really were returned


def test_a_commit_cut_short_keeps_the_previous_table(sims: Sims) -> None:
    b = sims.backend()
    info = b.alloc("a", 0, 2 * PAGE)
    sims.open(info).fill(b"kept")
    b.close()
    ctl = Path(info.ctl_path)
    header, slot, _ = read_ctl(ctl)
    # What a daemon killed mid-commit leaves: an odd generation and a half-written idle slot.
    idle_offset = header.slots[1 - header.committed][0] or len(ctl.read_bytes())
    with ctl.open("r+b") as f:
        f.seek(8)
        f.write((header.gen + 1).to_bytes(8, "little"))
        f.seek(idle_offset)
        f.write(b"\xee" * 64)
    assert read_ctl(ctl)[1] == slot

    b = sims.backend()
    assert b.recovered_jobs() == {"a": ("resident", {0: 2 * PAGE})}
    assert read_ctl(ctl)[0].gen % 2 == 0
    assert sims.open(info).read(8) == b"keptkept"


CRASH_CHILD = """
    import asyncio, json, os, signal, sys
    from timesliced.backends.sim import SimBackend
    from timesliced.sim.region import SimRegion
    root, mode = sys.argv[1], sys.argv[2]
    b = SimBackend(root, gpus=2, capacity=32 * 65536, page_size=65536, bandwidth=0)
    out = {}
    def make(job, gpu, n, pattern):
        info = b.alloc(job, gpu, n)
        with SimRegion.open(info) as r:
            r.fill(pattern)
            out[f"{job}/{info.region}"] = [info.to_wire(), r.checksum()]
    if mode == "after-snapshot":
        make("parked-job", 0, 5 * 65536 + 1, b"p0")
        make("parked-job", 1, 3 * 65536, b"p1")
        asyncio.run(b.snapshot("parked-job"))
        make("live-job", 0, 4 * 65536, b"live")
        print(json.dumps(out), flush=True)
    else:  # kill it in the middle of a move
        make("moving-job", 0, 24 * 65536, b"mv")
        if mode == "mid-restore":
            asyncio.run(b.snapshot("moving-job"))
        b.bandwidth = 6e6  # 1.5 MiB now takes about a quarter of a second to move
        print(json.dumps(out), flush=True)
        asyncio.run((b.snapshot if mode == "mid-snapshot" else b.restore)("moving-job"))
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_parked_and_resident_jobs_survive_a_killed_daemon(sims: Sims, root: Path) -> None:
    done = run_child(CRASH_CHILD, str(root), "after-snapshot")
    assert done.returncode == -signal.SIGKILL, done.stderr
    regions = {k: (RegionInfo.from_wire(w), digest) for k, (w, digest) in json.loads(done.stdout).items()}
    strays = [
        root / "parked" / job_key("parked-job") / "9.bin.tmp",
        root / "parked" / job_key("live-job") / "1.bin",
        root / "parked" / "gone-1234",
        root / "jobs" / "half.ctl.tmp",
    ]
    strays[2].mkdir()
    for path in strays[:2] + strays[3:]:
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(b"partial")

    b = sims.backend()
    assert b.recovered_jobs() == {
        "parked-job": ("parked", {0: 6 * PAGE, 1: 3 * PAGE}),
        "live-job": ("resident", {0: 4 * PAGE}),
    }
    assert not any(p.exists() for p in strays)
    assert b.free_bytes(0) == 28 * PAGE and b.free_bytes(1) == 32 * PAGE
    assert sims.open(regions["live-job/1"][0]).checksum() == regions["live-job/1"][1]
    asyncio.run(b.restore("parked-job"))
    for key in ("parked-job/1", "parked-job/2"):
        info, digest = regions[key]
        assert sims.open(info).checksum() == digest
    assert b.alloc("live-job", 0, PAGE).region == 2  # region ids carry on where they were


@pytest.mark.parametrize("mode", ["mid-snapshot", "mid-restore"])
def test_a_daemon_killed_mid_move_leaves_one_complete_copy(sims: Sims, root: Path, mode: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    args = [sys.executable, "-c", textwrap.dedent(CRASH_CHILD), str(root), mode]
    with subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as child:
        assert child.stdout is not None and child.stderr is not None
        line = child.stdout.readline()  # printed just before the move starts
        time.sleep(0.1)
        child.kill()
        _, err = child.communicate()
    assert line, err
    wire, digest = json.loads(line)["moving-job/1"]
    info = RegionInfo.from_wire(wire)

    b = sims.backend()
    state, footprint = b.recovered_jobs()["moving-job"]
    assert state in ("resident", "parked") and footprint == {0: 24 * PAGE}
    assert b.free_bytes(0) == (8 if state == "resident" else 32) * PAGE
    assert not list((root / "parked").rglob("*.tmp"))
    if state == "parked":
        asyncio.run(b.restore("moving-job"))
    assert sims.open(info).checksum() == digest
