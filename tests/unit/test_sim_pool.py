"""The sim backend's pool of warm parked-file buffers: its accounts, reuse, crash recovery and a full tmpfs."""

from __future__ import annotations

import asyncio
import ctypes
import errno
import os
import random
import shutil
from pathlib import Path
from typing import Any

import pytest

from timesliced import errors
from timesliced.backends import sim
from timesliced.backends.base import MoveResult
from timesliced.backends.sim import SimBackend
from timesliced.backends.sim_buffers import Buffer, BufferPool
from timesliced.sim import layout
from timesliced.sim.layout import RegionInfo, parked_dir
from timesliced.sim.region import SimRegion

from ..helpers.sims import PAGE, Sims

KiB = 1 << 10


def buffer(folder: Path, name: str, size: int, byte: bytes = b"\0") -> Buffer:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_bytes(byte * size)
    return Buffer.open(path)


def in_folder(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in folder.iterdir()}


# --- the pool on its own ---------------------------------------------------------------------------


def test_the_pool_keeps_buffers_up_to_its_limit_and_lets_the_oldest_go_first(root: Path) -> None:
    pool = BufferPool(root / "pool", limit=300 * KiB)
    for i, size in enumerate((100 * KiB, 200 * KiB)):
        pool.give(buffer(root / "parked", f"{i}.bin", size))
    assert pool.bytes == 300 * KiB and sorted(in_folder(pool.folder).values()) == [100 * KiB, 200 * KiB]
    pool.give(buffer(root / "parked", "2.bin", 50 * KiB))  # over the limit: the oldest (100 KiB) goes
    assert pool.bytes == 250 * KiB and sorted(in_folder(pool.folder).values()) == [50 * KiB, 200 * KiB]
    pool.give(buffer(root / "parked", "3.bin", 400 * KiB))  # bigger than the limit: deleted, nothing else goes
    assert pool.bytes == 250 * KiB and len(in_folder(pool.folder)) == 2
    assert not list((root / "parked").iterdir())  # every buffer given was moved into the pool or deleted
    assert pool.describe() == {"held": 250 * KiB, "limit": 300 * KiB, "taken": 0, "missed": 0}
    assert pool.drop() == 250 * KiB and pool.bytes == 0 and not in_folder(pool.folder)


def test_a_take_cuts_the_smallest_buffer_that_fits_to_size_and_renames_it(root: Path) -> None:
    pool = BufferPool(root / "pool", limit=1 << 20)
    pool.give(buffer(root / "parked", "big.bin", 500 * KiB, b"b"))
    pool.give(buffer(root / "parked", "fit.bin", 200 * KiB, b"f"))
    fit_inode = next(p.stat().st_ino for p in pool.folder.iterdir() if p.stat().st_size == 200 * KiB)
    dest = root / "parked" / "0.bin.tmp"
    got = pool.take(150 * KiB, dest)
    assert got is not None and got.path == dest and got.size == 150 * KiB
    assert dest.stat().st_size == 150 * KiB and dest.stat().st_ino == fit_inode  # the same pages, cut
    ctypes.memmove(got.address, b"x" * 10, 10)  # what is copied through the mapping is in the file
    assert dest.read_bytes()[:11] == b"x" * 10 + b"f"
    assert pool.bytes == 500 * KiB and pool.describe()["taken"] == 1
    got.close()


def test_a_take_that_finds_nothing_big_enough_gives_back_as_much_as_it_needs(root: Path) -> None:
    pool = BufferPool(root / "pool", limit=1 << 20)
    for i in range(3):
        pool.give(buffer(root / "parked", f"{i}.bin", 100 * KiB))
    assert pool.take(150 * KiB, root / "parked" / "x.bin.tmp") is None
    # The park writes 150 KiB of new pages: two buffers (200 KiB) went first, so the pool and the
    # parked state never hold more than admission counted.
    assert pool.bytes == 100 * KiB and len(in_folder(pool.folder)) == 1 and pool.describe()["missed"] == 1


def test_a_buffer_kept_in_place_is_taken_there_by_the_next_park_at_that_path(root: Path) -> None:
    pool = BufferPool(root / "pool", limit=1 << 20)
    kept = buffer(root / "parked" / "a", "1.bin", 100 * KiB, b"k")
    inode = kept.path.stat().st_ino
    pool.keep(kept)  # a restore's file: it stays where it is, the pool's
    assert pool.bytes == 100 * KiB and not in_folder(pool.folder)
    pool.give(buffer(root / "parked", "smaller.bin", 90 * KiB))  # a smaller buffer would be chosen otherwise
    got = pool.take(100 * KiB, root / "parked" / "a" / "1.bin")
    assert got is kept and got.path.stat().st_ino == inode and pool.bytes == 90 * KiB  # no rename
    got.close()
    elsewhere = buffer(root / "parked" / "b", "1.bin", 100 * KiB)
    pool.keep(elsewhere)
    (root / "parked" / "c").mkdir()
    got = pool.take(95 * KiB, root / "parked" / "c" / "1.bin")  # another job's park: the smallest that fits
    assert got is elsewhere and got.path == root / "parked" / "c" / "1.bin" and not in_folder(root / "parked" / "b")
    got.close()


def test_a_buffer_kept_where_a_park_writes_a_bigger_file_is_deleted_first(root: Path) -> None:
    pool = BufferPool(root / "pool", limit=1 << 20)
    path = root / "parked" / "a" / "1.bin"
    pool.keep(buffer(path.parent, path.name, 50 * KiB))
    pool.give(buffer(root / "parked", "big.bin", 200 * KiB))
    got = pool.take(100 * KiB, path)  # the kept one is too small: gone, the big one renamed over its place
    assert got is not None and got.size == 100 * KiB and path.stat().st_size == 100 * KiB and pool.bytes == 0
    got.close()
    pool.keep(Buffer.open(path))
    assert pool.take(300 * KiB, path) is None  # nothing fits: the park makes a new file there
    assert not path.exists() and pool.bytes == 0


def test_the_pool_forgets_what_it_kept_in_a_folder_or_at_one_path(root: Path) -> None:
    pool = BufferPool(root / "pool", limit=1 << 20)
    folder = root / "parked" / "a"
    for name in ("1.bin", "2.bin"):
        pool.keep(buffer(folder, name, 10 * KiB))
    pool.give(buffer(root / "parked", "other.bin", 10 * KiB))
    pool.forget(folder, folder / "1.bin")  # a region freed
    assert in_folder(folder) == {"2.bin": 10 * KiB} and pool.bytes == 20 * KiB
    pool.forget(folder)  # the job reclaimed
    assert in_folder(folder) == {} and pool.bytes == 10 * KiB and len(in_folder(pool.folder)) == 1


def test_a_pool_of_limit_zero_keeps_nothing_and_a_negative_one_is_refused(root: Path) -> None:
    pool = BufferPool(root / "pool", limit=0)
    pool.give(buffer(root / "parked", "0.bin", 100 * KiB))
    assert pool.bytes == 0 and not in_folder(pool.folder) and not list((root / "parked").iterdir())
    with pytest.raises(ValueError, match="pool limit must be >= 0"):
        BufferPool(root / "pool", limit=-1)


# --- the pool in the backend -----------------------------------------------------------------------


def fill(sims: Sims, info: RegionInfo, seed: int) -> bytes:
    data = random.Random(seed).randbytes(info.nbytes)
    sims.open(info).write(data)
    return data


def holds(regions: list[tuple[RegionInfo, bytes]]) -> bool:
    for info, data in regions:
        with SimRegion.open(info) as region:
            if region.read() != data:
                return False
    return True


def test_a_restore_leaves_its_files_in_the_pool_and_the_next_park_writes_into_them(sims: Sims) -> None:
    b = sims.backend(pool=1 << 20)
    a = [(info := b.alloc("a", 0, n), fill(sims, info, n)) for n in (5 * PAGE + 3, 2 * PAGE)]
    asyncio.run(b.snapshot("a"))
    assert b.pool.describe() == {"held": 0, "limit": 1 << 20, "taken": 0, "missed": 2}  # nothing warm yet
    asyncio.run(b.restore("a"))
    parked = parked_dir(b.root, "a")
    assert holds(a) and b.pool.bytes == 7 * PAGE + 3  # both files, kept where they are
    assert not in_folder(b.pool.folder) and len(in_folder(parked)) == 2
    inodes = {p.stat().st_ino for p in parked.iterdir()}
    asyncio.run(b.snapshot("a"))
    assert b.pool.describe()["taken"] == 2 and b.pool.bytes == 0 and not in_folder(b.pool.folder)
    assert {p.stat().st_ino for p in parked.iterdir()} == inodes  # the very same files hold the parked copy
    assert sorted(p.stat().st_size for p in parked.iterdir()) == [2 * PAGE, 5 * PAGE + 3]
    assert b.verify("a") == "parked"
    asyncio.run(b.restore("a"))
    assert holds(a)
    b.close()
    assert not in_folder(b.pool.folder) and not in_folder(parked)  # a daemon that stops gives the pool's memory back


def test_a_swap_parks_into_the_pool_and_leaves_the_restored_files_in_it(sims: Sims) -> None:
    b = sims.backend(pool=1 << 20)
    jobs = {job: [(info := b.alloc(job, 0, 10 * PAGE), fill(sims, info, i))] for i, job in enumerate("xy")}
    asyncio.run(b.snapshot("y"))
    asyncio.run(b.snapshot("x"))
    asyncio.run(b.restore("x"))  # the pool now holds x's file
    for out, in_ in (("x", "y"), ("y", "x"), ("x", "y")):
        done = asyncio.run(b.swap(out, in_))
        assert isinstance(done.park, MoveResult) and isinstance(done.restore, MoveResult)
        assert holds(jobs[in_]) and b.job_state(out) == "parked" and b.verify(out) == "parked"
        assert b.pool.bytes == 10 * PAGE  # the park took one buffer, the restore gave one
    assert b.pool.describe()["taken"] == 3


def test_a_restore_from_a_file_cut_short_behind_its_mapping_fails_instead_of_crashing(sims: Sims) -> None:
    b = sims.backend(pool=1 << 20)
    info = b.alloc("a", 0, 6 * PAGE)
    data = fill(sims, info, 1)
    asyncio.run(b.snapshot("a"))
    asyncio.run(b.restore("a"))
    asyncio.run(b.snapshot("a"))  # into the pool buffer, which stays mapped while parked
    victim = parked_dir(b.root, "a") / f"{info.region}.bin"
    os.truncate(victim, PAGE)  # a copy through the mapping past the file's end would be SIGBUS
    with pytest.raises(errors.BackendError, match="has 65536 bytes, expected 393216"):
        asyncio.run(b.restore("a"))
    assert b.job_state("a") == "parked" and b.verify("a") == "faulted"
    del data


def test_a_reclaimed_or_freed_parked_job_is_unmapped_with_its_files(sims: Sims) -> None:
    b = sims.backend(pool=1 << 20)
    first, second = b.alloc("a", 0, 3 * PAGE), b.alloc("a", 0, 4 * PAGE)
    asyncio.run(b.snapshot("a"))
    asyncio.run(b.restore("a"))
    asyncio.run(b.snapshot("a"))
    assert len(b._parked_bufs) == 2
    b.free("a", first.region)
    assert list(b._parked_bufs) == [("a", second.region)]
    asyncio.run(b.reclaim("a"))
    assert not b._parked_bufs and not parked_dir(b.root, "a").exists()


def test_a_rolled_back_park_leaves_the_pool_no_buffer_whose_file_it_removed(
    sims: Sims, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A park that fails part way removes its job's folder, where the pool keeps what that job's restores
    left: the pool must forget them, or a later park of the job writes into a file already unlinked."""
    b = sims.backend(capacity=32 * PAGE)
    b.alloc("a", 0, 4 * PAGE)
    a2 = b.alloc("a", 0, PAGE)
    data = random.Random(1).randbytes(PAGE)
    with SimRegion.open(a2) as r:
        r.write(data)
    asyncio.run(b.snapshot("a"))
    b.alloc("d", 0, 2 * PAGE)
    b.alloc("d", 0, 2 * PAGE)
    asyncio.run(b.snapshot("d"))
    asyncio.run(b.restore("d"))
    asyncio.run(b.restore("a"))  # a/1.bin and a/2.bin stay in a's folder, as the pool's
    b.alloc("c", 0, 4 * PAGE)
    asyncio.run(b.snapshot("c"))  # takes a/1.bin, the one buffer of 4 pages
    opened = SimBackend._open_parked
    calls = []

    def fails_once(self: SimBackend, *args: Any, **kwargs: Any) -> int:
        calls.append(1)
        if len(calls) == 1:  # a's region 1 finds no buffer that fits: its new file fails, not for room
            raise OSError(errno.EMFILE, "Too many open files")
        return opened(self, *args, **kwargs)

    monkeypatch.setattr(SimBackend, "_open_parked", fails_once)
    with pytest.raises(errors.ParkRefused):
        asyncio.run(b.snapshot("a"))
    monkeypatch.undo()
    assert calls and all(os.path.exists(buf.name) for buf in b.pool._free)
    asyncio.run(b.restore("c"))
    asyncio.run(b.snapshot("a"))
    asyncio.run(b.restore("a"))  # failed on the old code: a/2.bin's copy had gone with its unlinked file
    with SimRegion.open(a2) as r:
        assert r.read() == data


def test_the_bytes_pooled_stay_under_the_limit_over_many_switches(sims: Sims) -> None:
    b = sims.backend(pool=12 * PAGE, capacity=64 * PAGE)
    jobs = {job: [(info := b.alloc(job, 0, n * PAGE), fill(sims, info, n))] for job, n in (("p", 5), ("q", 9))}
    jobs["r"] = [(info := b.alloc("r", 0, 2 * PAGE), fill(sims, info, 2)), (b.alloc("r", 0, 3 * PAGE), b"")]
    jobs["r"][1] = (jobs["r"][1][0], fill(sims, jobs["r"][1][0], 3))
    rng = random.Random(7)
    for _ in range(30):
        job = rng.choice(sorted(jobs))
        asyncio.run(b.snapshot(job))
        assert b.pool.bytes <= 12 * PAGE
        asyncio.run(b.restore(job))
        assert b.pool.bytes <= 12 * PAGE and holds(jobs[job])
        kept = [in_folder(parked_dir(b.root, j)) for j in jobs if parked_dir(b.root, j).exists()]  # all resident
        assert sum(in_folder(b.pool.folder).values()) + sum(sum(k.values()) for k in kept) == b.pool.bytes


# --- a full tmpfs ----------------------------------------------------------------------------------


def warm_pool(sims: Sims) -> tuple[SimBackend, list[tuple[RegionInfo, bytes]]]:
    """A backend whose pool holds four buffers of 2 pages; job "c" (one region of 3 pages) is resident."""
    b = sims.backend(pool=1 << 20)
    for _ in range(4):
        b.alloc("w", 0, 2 * PAGE)
    asyncio.run(b.snapshot("w"))
    asyncio.run(b.restore("w"))
    assert b.pool.bytes == 8 * PAGE
    info = b.alloc("c", 0, 3 * PAGE)
    return b, [(info, fill(sims, info, 3))]


def full_while_pooled(b: SimBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tmpfs is full (``ENOSPC`` for new pages) for as long as ``b``'s pool holds anything."""
    fallocate = sim._fallocate

    def fallocate_unless_pooled(fd: int, offset: int, length: int) -> None:
        if b.pool.bytes:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        fallocate(fd, offset, length)

    monkeypatch.setattr(sim, "_fallocate", fallocate_unless_pooled)


def test_a_tmpfs_full_of_the_pool_gives_the_pool_back_and_the_park_goes_on(
    sims: Sims, monkeypatch: pytest.MonkeyPatch
) -> None:
    b, c = warm_pool(sims)
    full_while_pooled(b, monkeypatch)
    asyncio.run(b.snapshot("c"))  # no buffer fits 3 pages: two go back, then the rest for the room
    assert b.job_state("c") == "parked" and b.pool.bytes == 0
    asyncio.run(b.restore("c"))
    assert holds(c)


def test_a_tmpfs_still_full_without_the_pool_refuses_the_park_whole(
    sims: Sims, monkeypatch: pytest.MonkeyPatch
) -> None:
    b, c = warm_pool(sims)

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(sim, "_fallocate", full)
    with pytest.raises(errors.InsufficientHostMemory, match="no room for the parked copy of job 'c'") as caught:
        asyncio.run(b.snapshot("c"))
    assert errors.state_intact(caught.value)
    assert b.job_state("c") == "resident" and holds(c) and b.pool.bytes == 0
    assert not parked_dir(b.root, "c").exists()
    monkeypatch.undo()
    asyncio.run(b.snapshot("c"))  # the room is back: the same park just works
    assert b.job_state("c") == "parked"


def test_device_pages_on_a_tmpfs_full_of_the_pool_get_the_pool_back(
    sims: Sims, monkeypatch: pytest.MonkeyPatch
) -> None:
    b, _ = warm_pool(sims)
    full_while_pooled(b, monkeypatch)
    info = b.alloc("d", 1, 4 * PAGE)  # gpu 1's pages were never allocated: they need room
    assert info.nbytes == 4 * PAGE and b.pool.bytes == 0


# --- a daemon killed part way --------------------------------------------------------------------------


@pytest.mark.slow
def test_a_daemon_killed_at_any_instant_of_moves_through_the_pool_leaves_each_job_whole(
    sims: Sims, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Copy the whole root (what a killed daemon leaves) at every chunk, commit and rename of pool buffers."""
    monkeypatch.setattr(sim, "_CHUNK", 3 * PAGE + 4096)
    b = sims.backend(pool=4 << 20, capacity=48 * PAGE)
    data: dict[str, dict[int, bytes]] = {"a": {}, "b": {}}
    for job, sizes in (("a", (12 * PAGE + 7, 8 * PAGE)), ("b", (16 * PAGE - 5, 3 * PAGE))):
        for n in sizes:
            info = b.alloc(job, 0, n)
            data[job][info.region] = fill(sims, info, n)
    for move in (b.snapshot, b.restore):  # both jobs' files are the pool's now
        for job in ("a", "b"):
            asyncio.run(move(job))
    asyncio.run(b.snapshot("b"))  # into its own files: a's stay pooled for a's park below
    assert b.pool.describe()["taken"] == 2 and b.pool.bytes == 20 * PAGE + 7
    crashes: list[Path] = []

    def crash_copy() -> None:
        dest = tmp_path / f"crash-{len(crashes)}"
        shutil.copytree(b.root, dest)
        crashes.append(dest)

    commit, rename, advance = layout.CtlWriter.commit, Buffer.rename, sim._Pacer.advance
    sleep_until = sim._Swap._sleep_until

    def at_commit(self: layout.CtlWriter, slot: layout.SlotData) -> None:
        crash_copy()
        commit(self, slot)
        crash_copy()

    def at_rename(self: Buffer, path: Path) -> None:
        crash_copy()
        rename(self, path)
        crash_copy()

    def at_chunk(self: sim._Pacer, nbytes: int) -> None:
        crash_copy()
        advance(self, nbytes)

    def at_step(self: sim._Swap, due: float) -> None:
        crash_copy()
        sleep_until(self, due)

    monkeypatch.setattr(layout.CtlWriter, "commit", at_commit)
    monkeypatch.setattr(Buffer, "rename", at_rename)
    monkeypatch.setattr(sim._Pacer, "advance", at_chunk)
    monkeypatch.setattr(sim._Swap, "_sleep_until", at_step)
    asyncio.run(b.snapshot("a"))  # a lone park into pool buffers
    asyncio.run(b.restore("a"))  # a lone restore, whose files go back to the pool
    assert isinstance(asyncio.run(b.swap("a", "b")).park, MoveResult)  # and a swap through the pool
    monkeypatch.undo()
    assert len(crashes) > 40
    for root in crashes:
        adopted = SimBackend(root, gpus=2, capacity=48 * PAGE, page_size=PAGE, bandwidth=0)
        try:
            assert not in_folder(root / layout.POOL_NAME), root.name  # the pool holds no state: emptied
            states = sorted(adopted.job_state(job) for job in data)
            assert states in (["parked", "resident"], ["parked", "parked"]), (root.name, states)
            for job, other in (("a", "b"), ("b", "a")):  # each in turn on the device: every byte is back
                asyncio.run(adopted.snapshot(other))
                asyncio.run(adopted.restore(job))
                regions = [(info, data[job][info.region]) for info in adopted.regions(job)]
                assert holds(regions), (root.name, job)
        finally:
            adopted.close()


def test_files_a_restore_left_the_pool_are_no_parked_state_to_start_up_or_to_sim_clean(
    sims: Sims, tmp_path: Path
) -> None:
    from timesliced.sim import clean

    b = sims.backend(pool=1 << 20)
    for job in ("kept", "parked"):
        b.alloc(job, 0, 3 * PAGE)
        asyncio.run(b.snapshot(job))
    asyncio.run(b.restore("kept"))  # its file stays in its folder, the pool's
    assert in_folder(parked_dir(b.root, "kept")) == {"1.bin": 3 * PAGE}
    for copy in ("for-start-up", "for-clean"):  # what a daemon killed now leaves
        shutil.copytree(b.root, tmp_path / copy)
    adopted = SimBackend(tmp_path / "for-start-up", gpus=2, capacity=32 * PAGE, page_size=PAGE, bandwidth=0)
    try:
        assert adopted.job_state("kept") == "resident" and adopted.job_state("parked") == "parked"
        assert not parked_dir(adopted.root, "kept").exists() and adopted.pool.bytes == 0
        assert in_folder(parked_dir(adopted.root, "parked")) == {"1.bin": 3 * PAGE}
    finally:
        adopted.close()
    done = clean.clean(tmp_path / "for-clean")
    assert (done.jobs, done.parked) == (2, 1)
