"""The simulated GPU backend: paging, parking, failures and recovery (other processes: tests/integration)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import os
import random
import threading
from pathlib import Path

import msgpack  # type: ignore[import-untyped]
import pytest

from timesliced import errors
from timesliced.backends import sim
from timesliced.backends.base import MoveResult
from timesliced.backends.sim import SimBackend
from timesliced.sim.layout import RegionInfo, job_key, read_ctl
from timesliced.sim.region import SimRegion

from ..helpers.sims import PAGE, Sims, blake, extents_of

MiB = 1 << 20


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
    # in human units, with the exact request: 3, 2 and 32 pages of 64 KiB
    assert "cannot allocate 192.0 KiB (196608 bytes)" in message and "128.0 KiB of 2.0 MiB free" in message
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
    # The device keeps the pages mapped for the next restore (warm copies, no page faults) ...
    assert arena.stat().st_blocks * 512 >= 10 * PAGE
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
    assert [p.name for p in (b.root / "parked" / job_key("a")).iterdir()] == ["1.bin"]  # the pool's now, kept there
    assert b.pool.bytes == 10 * PAGE and b.verify("a") == "resident"
    assert asyncio.run(b.restore("a")).nbytes == 0  # already resident
    assert asyncio.run(b.snapshot("nobody")) == asyncio.run(b.restore("nobody")) == MoveResult(0, 0.0)
    asyncio.run(b.snapshot("a"))
    asyncio.run(b.reclaim("a"))
    assert arena.stat().st_blocks == 0  # ... and a job that leaves gives them back to the host


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
    bandwidth = 64 * MiB
    b = sims.backend(bandwidth=bandwidth)
    sims.open(b.alloc("a", 0, 16 * PAGE)).fill(b"z")
    sims.open(b.alloc("a", 1, 16 * PAGE)).fill(b"z")
    b._tails["snapshot"].lead = b._tails["restore"].lead = sim._TAIL_MAX_S  # their schedules run 1 ms early
    for _ in range(3):  # and still no move ends before the model says
        for move in (b.snapshot, b.restore):
            result = asyncio.run(move("a"))
            assert result.nbytes == 32 * PAGE
            assert result.seconds >= result.nbytes / bandwidth
    assert 0 < b._tails["snapshot"].lead <= sim._TAIL_MAX_S and 0 < b._tails["restore"].lead <= sim._TAIL_MAX_S


def test_what_a_move_learns_of_its_commit_is_a_running_mean_kept_small() -> None:
    tail = sim._Tail()
    tail.learn(100e-6)
    assert tail.lead == pytest.approx(30e-6)
    for _ in range(50):
        tail.learn(100e-6)
    assert tail.lead == pytest.approx(100e-6)
    tail.learn(5.0)  # one stalled commit moves runs early by at most the cap
    assert tail.lead == sim._TAIL_MAX_S
    tail.learn(-1.0)
    assert 0 <= tail.lead < sim._TAIL_MAX_S


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


@pytest.mark.parametrize("kind", ["snapshot", "swap"])
def test_a_move_cancelled_before_a_thread_takes_it_up_still_lets_the_job_go(sims: Sims, kind: str) -> None:
    """The work of a move releases its claim: it runs even when its caller was cancelled while it queued."""
    b = sims.backend()
    b.alloc("a", 0, PAGE)
    b.alloc("p", 0, PAGE)
    asyncio.run(b.snapshot("p"))

    async def main() -> None:
        loop = asyncio.get_running_loop()
        loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(1))  # its one thread busy, as under load
        gate = threading.Event()
        busy = loop.run_in_executor(None, gate.wait)
        move = asyncio.ensure_future(b.snapshot("a") if kind == "snapshot" else b.swap("a", "p"))
        await asyncio.sleep(0)  # the move claims the job and queues its work
        move.cancel()  # the daemon's op timeout, say
        with pytest.raises(asyncio.CancelledError):
            await move
        gate.set()
        await busy
        async with asyncio.timeout(10):  # waited for ever on the old code: the claim was never released
            await b.snapshot("a")
        assert b.job_state("a") == "parked"

    asyncio.run(main())


def test_a_backend_closed_with_no_jobs_state_left_removes_its_files(sims: Sims) -> None:
    """Nothing to come back to: the arenas and folders go, so a stopped daemon holds no host memory."""
    b = sims.backend()
    b.alloc("a", 0, 4 * PAGE)
    asyncio.run(b.snapshot("a"))
    asyncio.run(b.reclaim("a"))
    (b.root / "notes.txt").write_text("not the simulated GPU's")
    b.close()
    assert sorted(p.name for p in b.root.iterdir()) == ["daemon.lock", "notes.txt"]  # not its own: kept
    (b.root / "notes.txt").unlink()
    sims.backend().close()
    assert [p.name for p in b.root.iterdir()] == ["daemon.lock"]  # the lock stays for whoever starts next


def test_a_backend_closed_with_a_jobs_state_keeps_every_file(sims: Sims) -> None:
    b = sims.backend()
    b.alloc("a", 0, 4 * PAGE)
    b.alloc("b", 1, 4 * PAGE)
    asyncio.run(b.snapshot("b"))
    asyncio.run(b.reclaim("a"))
    b.close()
    assert {"gpu0.arena", "gpu1.arena", "jobs", "parked"} <= {p.name for p in b.root.iterdir()}
    assert sims.backend().recovered_jobs() == {"b": ("parked", {1: 4 * PAGE})}


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
    assert b.verify("a") == "faulted"  # what an operator's resume asks first: the copy is not whole
    with pytest.raises(errors.BackendError) as caught:
        asyncio.run(b.restore("a"))
    assert not errors.state_intact(caught.value)  # its parked copy is damaged: the job is faulted
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

    def disk_full(*args: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(sim, "_pwrite_all", disk_full)
    with pytest.raises(errors.InsufficientHostMemory, match="no room for the parked copy of job 'a'") as caught:
        asyncio.run(b.snapshot("a"))
    assert errors.state_intact(caught.value) and caught.value.details == {"job": "a", "needed": 5 * PAGE}
    assert " free); the job stays resident, whole" in caught.value.message
    assert b.job_state("a") == "resident" and b.verify("a") == "resident" and r.checksum() == digest
    assert b.free_bytes(0) == 27 * PAGE and not (b.root / "parked" / job_key("a")).exists()
    monkeypatch.undo()
    assert asyncio.run(b.snapshot("a")).nbytes == 5 * PAGE


def test_a_snapshot_that_cannot_write_its_control_file_is_refused_whole(
    sims: Sims, monkeypatch: pytest.MonkeyPatch
) -> None:
    b = sims.backend()
    r = sims.open(b.alloc("a", 0, 2 * PAGE))
    r.fill(b"kept")

    def fails(self: object, slot: object) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(sim.CtlWriter, "commit", fails)
    with pytest.raises(errors.ParkRefused, match="was not started: cannot write control file") as caught:
        asyncio.run(b.snapshot("a"))
    assert errors.state_intact(caught.value)
    monkeypatch.undo()
    assert b.job_state("a") == "resident" and r.read(4) == b"kept"


def test_a_restore_without_room_on_the_gpu_is_refused_with_its_parked_copy_whole(sims: Sims) -> None:
    b = sims.backend()
    a = sims.open(b.alloc("a", 0, 20 * PAGE))
    a.fill(b"mine")
    asyncio.run(b.snapshot("a"))
    b.alloc("b", 0, 20 * PAGE)  # takes the room A needs back
    with pytest.raises(errors.RestoreRefused, match="cannot restore job 'a'") as caught:
        asyncio.run(b.restore("a"))
    assert errors.state_intact(caught.value) and caught.value.details["gpu"] == 0
    assert b.job_state("a") == "parked"
    b.free("b", 1)
    asyncio.run(b.restore("a"))
    assert a.read(8) == b"minemine"


def failing_fallocate(monkeypatch: pytest.MonkeyPatch, code: int) -> list[str]:
    """``posix_fallocate`` fails with ``code`` on the simulated GPUs' arenas (parked files are left alone)."""
    fallocate, failed = sim._fallocate, []

    def fails(fd: int, offset: int, length: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        if os.path.basename(path).startswith("gpu"):
            failed.append(path)
            raise OSError(code, os.strerror(code))
        fallocate(fd, offset, length)

    monkeypatch.setattr(sim, "_fallocate", fails)
    return failed


@pytest.mark.parametrize(
    "code", [errno.EBADF, errno.EIO, errno.EINVAL, errno.EOPNOTSUPP, errno.EFBIG], ids=errno.errorcode.get
)
def test_device_pages_the_file_system_will_not_allocate_are_a_backend_error_not_a_lack_of_memory(
    sims: Sims, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    b = sims.backend()
    failed = failing_fallocate(monkeypatch, code)
    with pytest.raises(errors.BackendError) as caught:
        b.alloc("a", 0, 3 * PAGE)
    assert failed and not isinstance(caught.value, errors.InsufficientHostMemory)
    name = errno.errorcode[code]
    assert f"{b.root / 'gpu0.arena'}: {name} (" in caught.value.message and "supports fallocate" in caught.value.message
    assert b.free_bytes(0) == 32 * PAGE and b.job_state("a") == "unknown"  # nothing taken
    monkeypatch.undo()
    assert b.alloc("a", 0, 3 * PAGE).nbytes == 3 * PAGE


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT], ids=errno.errorcode.get)
def test_device_pages_without_room_are_a_lack_of_host_memory(
    sims: Sims, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    b = sims.backend()
    failing_fallocate(monkeypatch, code)
    with pytest.raises(errors.InsufficientHostMemory, match=r"no room in .* simulated device pages") as caught:
        b.alloc("a", 0, 3 * PAGE)
    assert errors.state_intact(caught.value) and b.free_bytes(0) == 32 * PAGE


@pytest.mark.parametrize("swap", [False, True], ids=["restore", "swap"])
def test_a_restore_onto_pages_the_file_system_will_not_allocate_is_refused_whole(
    sims: Sims, monkeypatch: pytest.MonkeyPatch, swap: bool
) -> None:
    b = sims.backend()
    a = sims.open(b.alloc("a", 1, 3 * PAGE))
    a.fill(b"mine")
    asyncio.run(b.snapshot("a"))
    b._backed[1][:] = bytes(32)  # as if gpu 1's pages had been given back to the host since
    if swap:
        b.alloc("b", 0, PAGE)
    failing_fallocate(monkeypatch, errno.EIO)
    result = asyncio.run(b.swap("b", "a")).restore if swap else None
    if not swap:
        with pytest.raises(errors.RestoreRefused) as caught:
            asyncio.run(b.restore("a"))
        result = caught.value
    assert isinstance(result, errors.RestoreRefused) and errors.state_intact(result)
    assert "EIO" in result.message and "stays parked, whole" in result.message
    assert b.job_state("a") == b.verify("a") == "parked" and b.free_bytes(1) == 32 * PAGE  # no page leaked
    monkeypatch.undo()
    asyncio.run(b.restore("a"))
    assert a.read(8) == b"minemine"


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
    with pytest.raises(ValueError, match=r"capacity=4\.0 MiB \(4194304 bytes\), page_size=64\.0 KiB \(65536 bytes\)"):
        sims.backend(capacity=64 * PAGE)  # the sizes it was made with and those asked for, in human units
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


# --- what a restore leaves past a region's bytes, and a snapshot killed at its commits -------------


def tail_of(b: SimBackend, info: RegionInfo) -> bytes:
    """The arena's bytes from the end of the region to the end of its last page."""
    first, count = extents_of(info)[-1]
    end = (first + count) * PAGE
    used = info.nbytes - sum(n for _, n in extents_of(info)[:-1]) * PAGE - (count - 1) * PAGE
    return (b.root / f"gpu{info.gpu}.arena").read_bytes()[end - PAGE + used : end]


@pytest.mark.parametrize("swap", [False, True])
def test_a_restore_into_pages_that_held_more_zeroes_its_last_page_past_its_bytes(sims: Sims, swap: bool) -> None:
    b = sims.backend(gpus=1, capacity=4 * PAGE)
    big = b.alloc("big", 0, 2 * PAGE)  # pages 0-1, written to the last byte
    sims.open(big).fill(b"\xff")
    small = b.alloc("small", 0, PAGE + 100)  # pages 2-3
    sims.open(small).fill(b"\x01")
    asyncio.run(b.snapshot("small"))
    if swap:
        b.alloc("filler", 0, 2 * PAGE)  # no free page: the swap's restore takes the park's
        asyncio.run(b.swap("big", "small"))
    else:
        asyncio.run(b.snapshot("big"))
        asyncio.run(b.restore("small"))
    assert {p for first, n in extents_of(small) for p in range(first, first + n)} & {0, 1}  # some of big's pages
    assert sims.open(small).read() == b"\x01" * (PAGE + 100)
    assert tail_of(b, small) == bytes(PAGE - 100)
    asyncio.run(b.snapshot("small"))  # and back into pages whose tails are zero: nothing to zero, still zeros
    asyncio.run(b.restore("small"))
    assert tail_of(b, small) == bytes(PAGE - 100)


@pytest.mark.parametrize("swap", [False, True])
def test_a_restore_into_punched_pages_leaves_its_bytes_to_be_zeroed_by_the_next(sims: Sims, swap: bool) -> None:
    """Pages given back to the host read zeros; a restore's copy into them is what the next restore must zero."""
    b = sims.backend(gpus=1, capacity=4 * PAGE)
    big = b.alloc("big", 0, 2 * PAGE)
    sims.open(big).fill(b"\xff")
    small = b.alloc("small", 0, PAGE + 100)
    sims.open(small).fill(b"\x01")
    asyncio.run(b.snapshot("small"))
    asyncio.run(b.snapshot("big"))
    b.alloc("gone", 0, PAGE)
    asyncio.run(b.reclaim("gone"))  # every free page is given back to the host: all four read zeros
    asyncio.run(b.restore("big"))  # pages 0-1 hold big's bytes again
    if swap:
        b.alloc("filler", 0, 2 * PAGE)
        asyncio.run(b.swap("big", "small"))
    else:
        asyncio.run(b.snapshot("big"))
        asyncio.run(b.restore("small"))
    assert {p for first, n in extents_of(small) for p in range(first, first + n)} & {0, 1}
    assert tail_of(b, small) == bytes(PAGE - 100)


@pytest.mark.parametrize("write_late", [False, True])
def test_a_daemon_killed_at_a_commit_of_a_snapshot_leaves_the_job_whole(
    sims: Sims, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, write_late: bool
) -> None:
    """The parked files carry no mark of being whole: PARKED is committed only once every byte is in them.

    ``write_late`` breaks that order on purpose (each chunk reaches its file only after the next commit),
    to show that the check sees it.
    """
    import shutil

    from timesliced.sim import layout

    monkeypatch.setattr(sim, "_CHUNK", 3 * PAGE + 4096)
    b = sims.backend()
    data = {}
    for gpu, n in ((0, 7 * PAGE + 5), (1, 2 * PAGE)):
        info = b.alloc("a", gpu, n)
        data[info.region] = random.Random(n).randbytes(n)
        sims.open(info).write(data[info.region])
    crashes: list[Path] = []
    late: list[tuple[Path, bytes, int]] = []
    commit = layout.CtlWriter.commit

    def crash_copy() -> None:
        crashes.append(tmp_path / f"crash-{len(crashes)}")
        shutil.copytree(b.root, crashes[-1])

    def at_commit(self: layout.CtlWriter, slot: layout.SlotData) -> None:
        crash_copy()
        commit(self, slot)
        crash_copy()
        while late:
            path, chunk, pos = late.pop(0)
            fd = os.open(path, os.O_WRONLY)  # the park may have closed its own descriptor by now
            os.pwrite(fd, chunk, pos)
            os.close(fd)

    def written_late(self: sim._ParkFile, src: memoryview, address: int, pos: int) -> None:
        late.append((self.path, bytes(src), pos))

    monkeypatch.setattr(layout.CtlWriter, "commit", at_commit)
    if write_late:
        monkeypatch.setattr(sim._ParkFile, "write", written_late)
    asyncio.run(b.snapshot("a"))
    monkeypatch.undo()
    lost = []
    for root in crashes:
        adopted = SimBackend(root, gpus=2, capacity=32 * PAGE, page_size=PAGE, bandwidth=0)
        try:
            assert adopted.job_state("a") in ("resident", "parked"), root.name
            asyncio.run(adopted.restore("a"))
            for info in adopted.regions("a"):
                with SimRegion.open(info) as region:
                    if region.read() != data[info.region]:
                        lost.append(root.name)
        finally:
            adopted.close()
    assert len(crashes) == 4  # before and after PARKING, before and after PARKED
    assert bool(lost) == write_late, lost
