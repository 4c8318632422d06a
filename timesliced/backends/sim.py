"""The simulated GPU backend: device memory is a shared file, parking copies it out.

This is the backend wherever there is no GPU. It behaves like the real thing
where it matters to the rest of the daemon: clients write real bytes into
shared memory, a snapshot copies them to host files and gives the device
pages back, a restore puts them (possibly on other pages) back, and moves
take time in proportion to their size. The file formats live in
``timesliced.sim.layout``, which clients map too (``timesliced.sim.region``).

Crash consistency: every state change is ordered so that a daemon killed at
any instant leaves either a complete parked copy or a complete device copy,
with the control file saying which; a new ``SimBackend`` on the same root
adopts what it finds.
"""

from __future__ import annotations

import array
import asyncio
import concurrent.futures
import contextlib
import ctypes
import dataclasses
import errno
import fcntl
import logging
import mmap
import os
import shutil
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Coroutine, Iterable
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from timesliced import errors
from timesliced.backends.base import DeviceInfo, JobTarget, MoveResult, SwapResult, job_name
from timesliced.backends.sim_buffers import Buffer, BufferPool
from timesliced.sim import COPY_CHUNK, DEFAULT_BANDWIDTH, DEFAULT_POOL, SWAP_THREAD_MIN
from timesliced.sim.clean import clean
from timesliced.sim.layout import (
    FAULTED,
    LOCK_NAME,
    PARKED,
    PARKING,
    POOL_NAME,
    RECLAIMED,
    RESIDENT,
    STATE_NAMES,
    CtlWriter,
    Extent,
    RegionInfo,
    RegionRecord,
    SlotData,
    arena_path,
    ctl_path,
    job_key,
    parked_dir,
    read_ctl,
)
from timesliced.util.parse import exact_size, human_size
from timesliced.wire import status as schema

log = logging.getLogger(__name__)

# Bytes copied between bandwidth checks and abort checks. Large, so that the per-chunk cost (a system call
# and the pacer's clock read, some microseconds) stays well under 1% of a chunk's copy time even at the
# machine's warm copy ceiling (32 MiB is about 3 ms at 10 GB/s), yet an abandoned move stops within a few
# milliseconds.
_CHUNK = COPY_CHUNK
_T = TypeVar("_T")
_HELPER_MIN = SWAP_THREAD_MIN
_MADV_REMOVE: int | None = getattr(mmap, "MADV_REMOVE", None)


class _Aborted(Exception):
    """The caller of a move gave up on it (cancelled or closed); roll it back."""


class _Allocator:
    """The free pages of one simulated device, as a byte per page (0 free, 1 used)."""

    def __init__(self, npages: int) -> None:
        self._used = bytearray(npages)
        self.free_pages = npages

    def take(self, npages: int) -> tuple[Extent, ...] | None:
        """The lowest free pages, as few runs as the free space allows; None if too few."""
        if npages > self.free_pages:
            return None
        runs: list[Extent] = []
        pos = 0
        while npages:
            start = self._used.find(0, pos)
            end = self._used.find(1, start)
            n = min(npages, (len(self._used) if end < 0 else end) - start)
            self._used[start : start + n] = b"\x01" * n
            runs.append((start, n))
            npages -= n
            pos = start + n
        self.free_pages -= sum(n for _, n in runs)
        return tuple(runs)

    def give(self, extents: tuple[Extent, ...]) -> None:
        for start, n in extents:
            self._used[start : start + n] = bytes(n)
            self.free_pages += n

    def claim(self, extents: tuple[Extent, ...]) -> bool:
        """Mark exactly these pages used (adopting a job at start-up); False if any is taken."""
        for i, (start, n) in enumerate(extents):
            if n <= 0 or start + n > len(self._used) or any(self._used[start : start + n]):
                self.give(extents[:i])
                return False
            self._used[start : start + n] = b"\x01" * n
            self.free_pages -= n
        return True

    def free_runs(self) -> list[Extent]:
        runs, pos = [], 0
        while (start := self._used.find(0, pos)) >= 0:
            end = self._used.find(1, start)
            end = len(self._used) if end < 0 else end
            runs.append((start, end - start))
            pos = end
        return runs


class _Move:
    """One snapshot, restore or reclaim in flight; at most one per job."""

    def __init__(self) -> None:
        self.abort = threading.Event()
        self.done = threading.Event()

    async def wait(self) -> None:
        # Polling keeps waiters off the thread pool, which the moves themselves need.
        while not self.done.is_set():
            await asyncio.sleep(0.005)


@dataclasses.dataclass
class _Job:
    name: str
    ctl: CtlWriter
    state: int
    epoch: int
    next_region: int
    regions: dict[int, RegionRecord]
    move: _Move | None = None
    folder: Path = dataclasses.field(init=False)  # its parked files' folder (``parked_dir``), worked out once
    # Whether this backend made ``folder`` (and removed it not since). A restore leaves it, holding only
    # files of the pool (``BufferPool.keep``), for the job's next park: making it again cost a swap some
    # 10 us of its 170 at 6 GB/s. Reclaim removes it.
    has_folder: bool = False
    # Pages its committed control file still lists that the job let go of: a swap's park whose last
    # commits failed (``_Swap._park_holding``) or whose writes did (``SimBackend._park_unfinished``).
    # Start-up finishes such a park from the pages the file lists (``_finish_handed_park``), so they
    # stay out of the allocator, holding the job's bytes, until a commit of the job lands (``_update``:
    # its own next move, or another job's restore that needs the pages, ``_complete_others``) or it is
    # reclaimed.
    held: list[RegionRecord] = dataclasses.field(default_factory=list)
    # The held pages hold bytes the parked files lack: a swap's park whose writes failed after it handed
    # pages over (``SimBackend._park_unfinished``). The job is parked, whole, but no commit of it may land
    # before those bytes are on the host (the file says ``PARKING`` and lists the pages): its next
    # restore completes the copy first (``_complete_park``), and nothing else writes the file meanwhile.
    unfinished: bool = False

    def parked_path(self, region: int) -> str:
        """Where region ``region``'s parked copy is (a string: a move opens it without building ``Path`` objects)."""
        return f"{self.folder}/{region}.bin"

    def bind(self, root: Path) -> _Job:
        self.folder = parked_dir(root, self.name)
        return self

    def make_folder(self) -> None:
        """Create the parked folder unless it is there (``os.mkdir``: ``Path.mkdir`` costs a move microseconds more)."""
        if not self.has_folder:
            with contextlib.suppress(FileExistsError):
                os.mkdir(f"{self.folder}", 0o700)
            self.has_folder = True

    def remove_folder(self, pool: BufferPool) -> None:
        """Remove the parked folder and what is in it (a park rolled back), the pool's buffers kept there too.

        The pool forgets them first: a buffer it still listed would be handed to a later park as a file
        that no longer exists, whose copy would then be lost with its mapping.
        """
        pool.forget(self.folder)
        self.has_folder = False
        shutil.rmtree(self.folder, ignore_errors=True)


class _Pacer:
    """Holds a copy to the modelled bandwidth and stops it when its caller gives up.

    The move is due at ``start + moved / bandwidth``; after each chunk the pacer sleeps until the
    chunk's due time, so a copy that runs faster than the model (the usual case below the machine's
    copy ceiling) ends on the model's time, and the move's fixed costs (control file commits, opening
    files) are taken out of the sleep instead of being added to it. ``start`` is when the move began.
    What follows the last byte (the commit) is taken out too: the schedule runs ``lead`` seconds
    early, ``lead`` being what that tail took in the moves before (``_Tail``).
    """

    def __init__(self, bandwidth: float, abort: threading.Event, start: float | None = None, lead: float = 0.0) -> None:
        self._bandwidth = bandwidth
        self._abort = abort
        self._start = (time.perf_counter() if start is None else start) - lead
        self.moved = 0
        self.copied_at = 0.0  # when the last chunk's wait ended: the tail starts there

    def advance(self, nbytes: int) -> None:
        self.moved += nbytes
        if self._abort.is_set():
            raise _Aborted
        if self._bandwidth:
            _wait_until(self._start + self.moved / self._bandwidth, self._abort)
        self.copied_at = time.perf_counter()


class _Tail:
    """What one kind of move takes after its last byte is copied (the commit), learnt from the moves before.

    A running mean, so one slow commit (a loaded machine) moves it little, kept under ``_TAIL_MAX_S``
    so that a stall never makes moves run early by much: a small move at a fast model is otherwise
    late by its fixed costs (some 60-150 us here), a fifth of a 1 MiB move's time at 2 GB/s.
    """

    def __init__(self) -> None:
        self.lead = 0.0

    def learn(self, seconds: float) -> None:
        self.lead = min(_TAIL_MAX_S, max(0.0, 0.7 * self.lead + 0.3 * seconds))


_TAIL_MAX_S = 1e-3
_NEVER = threading.Event()  # an abort nobody sets: a wait that only time ends


# How long before a due time a paced copy stops sleeping and spins. A sleeping thread wakes some
# 40-90 us late here (the kernel's default timer slack of 50 us plus the wake-up), often more on a
# loaded machine: a 1 MiB move, 130 us at 8 GB/s, would take half as long again. Spinning for the last
# 200 us holds the GIL for that long at most, once per chunk.
_SPIN_S = 200e-6


def _wait_until(due: float, abort: threading.Event, other: threading.Event | None = None) -> None:
    """Return at ``due`` (``time.perf_counter``); raise ``_Aborted`` as soon as ``abort`` (or ``other``) is set."""
    while (left := due - time.perf_counter()) > 0:
        if abort.is_set() or (other is not None and other.is_set()):
            raise _Aborted
        if left > _SPIN_S and abort.wait(left - _SPIN_S):
            raise _Aborted
    if abort.is_set() or (other is not None and other.is_set()):
        raise _Aborted


_fallocate = os.posix_fallocate  # a seam for tests: a full tmpfs fails here with ENOSPC
_NO_ROOM = (errno.ENOSPC, errno.EDQUOT)  # what of ``posix_fallocate``'s errors is a lack of room (``_back``)


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


class _ParkFile:
    """Where one region's parked copy is being written: a warm pool buffer, or a new file.

    Into a pool buffer a chunk is one memory copy at the machine's warm copy rate; into a new file
    it is a ``pwrite``, the kernel filling the pages ``posix_fallocate`` allocated (faster than a
    copy through a mapping of new pages, which faults each 4 KiB page in: ``timesliced bench copy``,
    fresh ``write`` against fresh ``mmap``). Both let go of the GIL while they copy.

    The file has its final name, ``<region>.bin``, from the start: what says a parked copy is whole
    is the job's control file (``PARKED``, or a region whose pages were all handed over by a swap),
    committed only after the copy's last byte is written, never the file's name (a rename once the
    copy was complete cost a 1 MiB move some 15 us of its 170 at 6 GB/s). A daemon killed before
    that commit leaves the file to start-up, which removes it (the job is resident) or finishes it
    from the device pages the control file still lists (``SimBackend._finish_handed_park``).
    """

    def __init__(self, path: str, buf: Buffer | None, fd: int | None) -> None:
        self.path = path
        self.buf = buf
        self.fd = fd

    def write(self, src: memoryview, address: int, pos: int) -> None:
        """Copy ``src`` (at ``address`` in memory) to ``pos`` of the file."""
        if self.buf is not None:
            ctypes.memmove(self.buf.address + pos, address, len(src))
        else:
            assert self.fd is not None
            _pwrite_all(self.fd, src, pos)

    def close(self) -> None:
        """Close the file's descriptor; a buffer stays mapped (the restore reads it warm)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class SimBackend:
    """Simulated GPUs backed by shared files under ``root``; see the module docstring."""

    name = "sim"

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        gpus: int,
        capacity: int,
        page_size: int = 2 << 20,
        bandwidth: float = DEFAULT_BANDWIDTH,
        pool: int = DEFAULT_POOL,
    ) -> None:
        if gpus < 1:
            raise ValueError(f"gpus must be at least 1, not {gpus}")
        if page_size <= 0 or page_size % mmap.PAGESIZE:
            raise ValueError(f"page_size must be a positive multiple of {mmap.PAGESIZE}, not {page_size}")
        if capacity <= 0 or capacity % page_size:
            raise ValueError(f"capacity ({capacity}) must be a positive multiple of page_size ({page_size})")
        if capacity // page_size >= 1 << 32:
            raise ValueError(f"capacity / page_size must be under 2**32 pages, not {capacity // page_size}")
        if bandwidth < 0:
            raise ValueError(f"bandwidth must be >= 0 (0 = unlimited), not {bandwidth}")
        if pool < 0:
            raise ValueError(f"pool must be >= 0 bytes (0: no pool of parked-file buffers), not {pool}")
        self.root = Path(root).absolute()
        self.gpus = gpus
        self.capacity = capacity
        self.page_size = page_size
        self.bandwidth = bandwidth
        self._lock = threading.Lock()
        self._jobs: dict[str, _Job] = {}
        self._recovered: dict[str, tuple[str, dict[int, int]]] = {}
        self._arenas: list[mmap.mmap] = []
        self._views: list[memoryview] = []
        self._anchors: list[ctypes.c_char] = []  # pin each arena's mapping: copies use its address
        self._addresses: list[int] = []
        self._parked_bufs: dict[tuple[str, int], Buffer] = {}  # (job, region) -> its parked file, mapped
        self._helper: concurrent.futures.ThreadPoolExecutor | None = None  # a swap's second copying thread
        self._tails = {kind: _Tail() for kind in ("snapshot", "restore", "swap")}
        self._allocators = [_Allocator(capacity // page_size) for _ in range(gpus)]
        # A byte per page: 1 where the arena file's pages are allocated (``_back``) and not punched since,
        # so ``_back`` skips them: ``posix_fallocate`` over allocated pages still walks every 4 KiB page,
        # some 8 ms per 256 MiB, which a restore into kept pages would pay on its model's time.
        self._backed = [bytearray(capacity // page_size) for _ in range(gpus)]
        # Per page, a bound on the bytes from its start that may be non-zero: past it the page reads
        # zeros. Only the daemon writes a page past what its region covers (clients' accesses are held
        # to ``nbytes``), so a restore zeroes only ``[its bytes in the page, bound)`` of its last page:
        # nothing, when the page's last holder covered no more of it (a 1 MiB region's 2 MiB page
        # handed to another 1 MiB region), instead of a memset of the rest of the page on every
        # restore (some 35 us for 1 MiB, a fifth of a 1 MiB move's time at 6 GB/s). ``_punch`` sets
        # it to 0; ``_inked`` raises it before anything writes; unknown pages (start-up) have the page size.
        self._ink = [array.array("Q", [page_size]) * (capacity // page_size) for _ in range(gpus)]
        self._can_punch = _MADV_REMOVE is not None
        # One daemon per root, its lock taken before anything there is touched: the lock dies with its
        # process, so a crashed daemon never blocks a new one.
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            lock_fd = os.open(self.root / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
        except FileNotFoundError:  # `timesliced sim clean` removed the root meanwhile
            raise errors.BackendError(
                f"sim root {self.root} was removed as this daemon started; start it again"
            ) from None
        self._unlock = weakref.finalize(self, os.close, lock_fd)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._unlock()
            raise errors.BackendError(
                f"sim root {self.root} is in use by another daemon (or is being cleaned); stop that daemon "
                "or wait for the clean, or give this one another --state-dir or --sim-dir"
            ) from None
        try:
            for d in (self.root / "jobs", self.root / "parked"):
                d.mkdir(mode=0o700, exist_ok=True)
            self.pool = BufferPool(self.root / POOL_NAME, pool)
        except BaseException:
            self._unlock()
            raise
        self._started = False  # until then, state found here may be another configuration's: close keeps it
        try:
            self._start_up()
        except BaseException:
            self.close()
            raise
        self._started = True

    # --- queries ---------------------------------------------------------------------

    def devices(self) -> list[DeviceInfo]:
        return [DeviceInfo(i, self.capacity, f"sim-gpu{i}") for i in range(self.gpus)]

    def rounded(self, nbytes: int) -> int:
        """``nbytes`` rounded up to whole pages: what an allocation really takes."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, not {nbytes}")
        return -(-nbytes // self.page_size) * self.page_size

    def free_bytes(self, gpu: int) -> int:
        """Device memory of ``gpu`` that no region holds."""
        self._check_gpu(gpu)
        with self._lock:
            return self._allocators[gpu].free_pages * self.page_size

    def footprint(self, job: str) -> dict[int, int]:
        """Rounded bytes per GPU of the job's regions, whether on the device or parked."""
        with self._lock:
            j = self._jobs.get(job)
            out: dict[int, int] = {}
            for r in j.regions.values() if j else ():
                out[r.gpu] = out.get(r.gpu, 0) + self.rounded(r.nbytes)
            return out

    def job_state(self, job: str) -> str:
        """One of resident, parked, faulted or unknown; a job mid-snapshot is still resident."""
        with self._lock:
            j = self._jobs.get(job)
            if j is None:
                return "unknown"
            return "resident" if j.state == PARKING else STATE_NAMES[j.state]

    def verify(self, job: str) -> str:
        """``job_state``, with a parked job's files checked: ``faulted`` if one is missing or cut short.

        What an operator's resume asks before it clears a fault: a parked copy that cannot be
        restored whole is not a cause that has gone.
        """
        with self._lock:
            j = self._jobs.get(job)
            if j is None:
                return "unknown"
            if j.state == PARKED and j.move is None:
                for r in j.regions.values():
                    try:
                        if os.stat(j.parked_path(r.region)).st_size != r.nbytes:
                            return "faulted"
                    except OSError:
                        return "faulted"
            return "resident" if j.state == PARKING else STATE_NAMES[j.state]

    def held(self) -> dict[str, schema.SimHeld]:
        """The parked jobs that hold device pages (``_Job.held``): bytes, and whether the park is unfinished."""
        with self._lock:
            return {
                j.name: {
                    "bytes": sum(n for r in j.held for _, n in r.extents) * self.page_size,
                    "unfinished": j.unfinished,
                }
                for j in self._jobs.values()
                if j.held
            }

    def regions(self, job: str) -> list[RegionInfo]:
        """The job's regions, so a daemon can hand them to clients again after a restart."""
        with self._lock:
            j = self._jobs.get(job)
            return [self._info(job, r) for r in j.regions.values()] if j else []

    def recovered_jobs(self) -> dict[str, tuple[str, dict[int, int]]]:
        """Jobs adopted from the root at start-up: job -> (state, footprint)."""
        return dict(self._recovered)

    # --- allocation ------------------------------------------------------------------

    def alloc(self, job: str, gpu: int, nbytes: int) -> RegionInfo:
        """Give ``job`` a new zeroed region of ``nbytes`` on ``gpu`` (rounded up to pages)."""
        self._check_open()
        if nbytes <= 0:
            raise ValueError(f"nbytes must be positive, not {nbytes}")
        self._check_gpu(gpu)
        npages = self.rounded(nbytes) // self.page_size
        with self._lock:
            j = self._jobs.get(job)
            if j is not None and j.state != RESIDENT:
                raise errors.NotResident(
                    f"job {job!r} is not on the device ({STATE_NAMES[j.state]}); restore it before allocating",
                    job=job,
                )
            extents = self._allocators[gpu].take(npages)
            if extents is None:
                free = self._allocators[gpu].free_pages * self.page_size
                raise errors.OutOfMemory(
                    f"cannot allocate {exact_size(nbytes)} ({human_size(npages * self.page_size)} in pages) on gpu "
                    f"{gpu}: {human_size(free)} of {human_size(self.capacity)} free",
                    gpu=gpu,
                    requested=nbytes,
                    free=free,
                    capacity=self.capacity,
                )
            try:
                self._punch(gpu, extents)  # new pages read as zeros
                self._back(gpu, extents)  # and the job may write them without a SIGBUS
                self._inked(gpu, extents, nbytes)  # where the job's writes may land
                if j is None:
                    j = self._new_job(job)
                record = RegionRecord(j.next_region, gpu, nbytes, extents)
                self._update(j, next_region=j.next_region + 1, regions={**j.regions, record.region: record})
            except BaseException:
                self._allocators[gpu].give(extents)
                raise
            return self._info(job, record)

    def free(self, job: str, region: int) -> int:
        """Drop one region, on the device or parked; returns its rounded size."""
        with self._lock:
            j = self._jobs.get(job)
            record = j.regions.get(region) if j else None
            if j is None or record is None:
                raise errors.UnknownRegion(f"job {job!r} has no region {region}", job=job, region=region)
            if j.move is not None:
                raise errors.BackendError(f"job {job!r} is being moved; free region {region} after the move")
            if j.unfinished:  # its commit would say the park is whole, the bytes in the held pages lost
                raise errors.BackendError(
                    f"job {job!r} is parked with part of its parked copy still in device memory; restore it "
                    f"(which completes the copy), then free region {region}"
                )
            self._update(j, regions={k: v for k, v in j.regions.items() if k != region})
            self._release_pages(record)
            self._unmap_parked(job, region)
            self.pool.forget(j.folder, Path(j.parked_path(region)))  # a file a restore left the pool
            with contextlib.suppress(FileNotFoundError):
                os.unlink(j.parked_path(region))
        return self.rounded(record.nbytes)

    # --- moves -----------------------------------------------------------------------

    async def snapshot(self, job: JobTarget | str) -> MoveResult:
        """Park the job: copy its regions to host files, then free its device pages.

        A job that is unknown or already parked moves nothing. If the caller
        is cancelled (a timeout) the copy stops and the job stays resident,
        unless the move had already committed; ``job_state`` tells which.
        """
        return await self._move(job_name(job), self._snapshot)

    async def restore(self, job: JobTarget | str) -> MoveResult:
        """Put a parked job back on its devices (on whichever pages are free), then drop the host copy."""
        return await self._move(job_name(job), self._restore)

    async def reclaim(self, job: JobTarget | str) -> None:
        """Forget the job: stop any move, free its pages, delete its parked files and control file."""
        job = job_name(job)
        while True:
            with self._lock:
                j = self._jobs.get(job)
                if j is None:
                    return
                busy = j.move
                if busy is None:
                    j.move = claim = _Move()
                    break
                busy.abort.set()
            await busy.wait()
        try:
            with self._lock:
                old = list(j.regions.values())
                self._update(j, strict=False, state=RECLAIMED, epoch=j.epoch + 1, regions={})
                old += j.held  # what that write, failing, left listed: the file goes below anyway
                j.held = []
                for record in old:
                    self._release_pages(record)
                self._unmap_parked(job)
                del self._jobs[job]
                for gpu, allocator in enumerate(self._allocators):  # what moves kept mapped goes back too
                    self._punch(gpu, tuple(allocator.free_runs()))
                # Clear the job's paths now, so a new job of the same name can start at once.
                ctl_path(self.root, job).unlink(missing_ok=True)
                j.ctl.close()
                j.has_folder = False
                self.pool.forget(j.folder)  # files its restores left the pool, in its folder
                trash = self._discard(j.folder)
            if trash is not None:
                await asyncio.to_thread(shutil.rmtree, trash, True)
        finally:
            claim.done.set()

    async def aclose(self) -> None:
        await asyncio.to_thread(self.close)

    def close(self) -> None:
        """Stop moves in flight and unmap; parked files and control files stay for the next start.

        With no job's state left (every job reclaimed, or none ever allocated) nothing is there to come
        back to: the arenas, control files, parked files and pool are removed, so a daemon that stops
        (or fails to start) holds no host memory after it. The root and its lock file stay, so every
        daemon that starts there meanwhile takes the same lock.
        """
        with self._lock:
            moves = [j.move for j in self._jobs.values() if j.move is not None]
        for m in moves:
            m.abort.set()
        for m in moves:
            m.done.wait(timeout=60)
        if self._helper is not None:
            self._helper.shutdown(wait=not any(not m.done.is_set() for m in moves))
            self._helper = None
        if all(m.done.is_set() for m in moves):
            # Copies address the mappings directly: unpin and unmap them only with no copy running. A
            # move still running after the wait keeps them mapped (the arena's close below fails on
            # its pin) to the process's end, so it can never write into unmapped memory.
            with self._lock:
                bufs, self._parked_bufs = list(self._parked_bufs.values()), {}
            for buf in bufs:
                buf.close()
            self.pool.close()
            self._anchors = []
            for j in list(self._jobs.values()):  # and no commit: a descriptor closed under one could be reused
                j.ctl.close()
        self._addresses = []
        for view in self._views:
            view.release()
        for arena in self._arenas:
            # A slice kept alive elsewhere (say, by a traceback) may still point in; it unmaps when that goes.
            with contextlib.suppress(BufferError):
                arena.close()
        self._views, self._arenas = [], []
        idle = self._started and not self._jobs and all(m.done.is_set() for m in moves)
        self._started = False  # a second close leaves the root alone: another daemon may hold it by then
        self._unlock()
        if idle:
            with contextlib.suppress(errors.BackendError):  # a daemon started on the root meanwhile: it is its
                clean(self.root, keep_root=True)

    # --- swap: a park and a restore streamed at once -----------------------------------

    async def swap(self, out: JobTarget | str, in_: JobTarget | str) -> SwapResult:
        """Park ``out`` and restore ``in_`` at once, chunk by chunk, the restore taking the pages the park frees.

        The model is full duplex: each direction runs at ``bandwidth``, so a swap of A out and B in
        takes about max(A, B) / bandwidth. The park copies the outgoing job's regions to host files
        in order; each chunk's pages, once their bytes are in the host file, are handed over (the
        outgoing job's control file stops listing them) and the restore copies the incoming job's
        bytes into them. A daemon killed at any instant leaves the outgoing job resident (nothing
        handed over yet) or finishable as parked (its host files hold what was handed over, its
        device pages the rest; start-up completes the park), and the incoming job parked (its
        parked files are only read) or resident (committed). Jobs not in the states a swap needs
        (``out`` resident, ``in_`` parked) are moved one after the other as a lone snapshot and
        restore would move them, as is ``in_`` when its own park was left unfinished (``_Job.unfinished``):
        only its lone restore completes that.

        Raises ``ValueError`` for one job swapped with itself, ``RestoreRefused`` when the incoming
        job would not fit even in the room the outgoing one frees, and ``ParkRefused`` or
        ``InsufficientHostMemory`` when the park cannot start: in each case nothing moved.
        """
        a_name, b_name = job_name(out), job_name(in_)
        if a_name == b_name:
            raise ValueError(f"a swap needs two jobs, not {a_name!r} twice")
        self._check_open()
        while True:
            with self._lock:
                a, b = self._jobs.get(a_name), self._jobs.get(b_name)
                busy = next((j.move for j in (a, b) if j is not None and j.move is not None), None)
                # A parked copy left unfinished is completed by a lone restore (``_complete_park``) only.
                streamable = (
                    a is not None and b is not None and a.state == RESIDENT and b.state == PARKED and not b.unfinished
                )
                if busy is None and a is not None and b is not None and streamable:
                    a.move, b.move = claims = (_Move(), _Move())
                    break
            if busy is None:  # nothing to stream: the halves go one after the other, as lone moves
                return SwapResult(await _outcome(self.snapshot(a_name)), await _outcome(self.restore(b_name)))
            await busy.wait()
        return await _to_the_end(claims, self._swap, a, b, claims)

    def _helper_thread(self) -> concurrent.futures.ThreadPoolExecutor:
        """The thread a swap's park copies in while the restore copies in the swap's own: one for the backend.

        Started once and kept, since starting a thread per swap cost about a millisecond, which a
        swap of a few MiB at a fast model cannot spare. Up to four swaps (of other jobs) copy at once;
        the executor starts its threads only as they are needed.
        """
        with self._lock:
            if self._helper is None:
                self._helper = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="timesliced-swap")
            return self._helper

    def _swap(self, a: _Job, b: _Job, claims: tuple[_Move, _Move]) -> SwapResult:
        try:
            return _Swap(self, a, b, claims).run()
        finally:
            self._finish(a, claims[0])
            self._finish(b, claims[1])

    async def _move(self, job: str, work: Callable[[_Job, _Move], MoveResult]) -> MoveResult:
        self._check_open()
        while True:
            with self._lock:
                j = self._jobs.get(job)
                if j is None:
                    return MoveResult(0, 0.0)
                busy = j.move
                if busy is None:
                    j.move = claim = _Move()
                    break
            await busy.wait()
        return await _to_the_end((claim,), work, j, claim)

    def _snapshot(self, j: _Job, move: _Move) -> MoveResult:
        start = time.perf_counter()
        try:
            with self._lock:
                if j.state == PARKED:
                    return MoveResult(0, 0.0)
                self._raise_if_faulted(j)
                try:
                    self._update(j, state=PARKING, epoch=j.epoch + 1)  # clients stop touching it now
                except errors.BackendError as exc:  # nothing changed: the job runs on, whole
                    raise errors.ParkRefused(f"snapshot of job {j.name!r} was not started: {exc.message}") from exc
                records = list(j.regions.values())
            files: list[_ParkFile] = []
            try:
                pacer = self._write_parked(j, records, move, start, files)
                with self._lock:
                    parked = {k: dataclasses.replace(r, extents=()) for k, r in j.regions.items()}
                    self._update(j, state=PARKED, epoch=j.epoch + 1, regions=parked)
            except BaseException as exc:
                self._give_back(files)  # warm pages stay warm for the next park
                j.remove_folder(self.pool)
                with self._lock:
                    self._update(j, strict=False, state=RESIDENT, epoch=j.epoch + 1)
                self._reraise("snapshot", j, exc)
            self._keep_mapped(j.name, records, files)
            with self._lock:  # only now, with the host copy committed, can the pages go
                for record in records:
                    self._release_pages(record, keep=True)
            end = self._no_earlier_than_the_model("snapshot", pacer, start)
            return MoveResult(pacer.moved, end - start)
        finally:
            self._finish(j, move)

    def _restore(self, j: _Job, move: _Move) -> MoveResult:
        start = time.perf_counter()
        try:
            with self._lock:
                if j.state == RESIDENT:
                    return MoveResult(0, 0.0)
                self._raise_if_faulted(j)
            self._give_back_held(j)  # raises RestoreRefused for an unfinished park: the job stays parked, whole
            self._complete_others(j)
            with self._lock:
                try:
                    placed = self._take_pages(j)
                except errors.OutOfMemory as exc:  # nothing was touched: the parked copy is whole
                    raise errors.RestoreRefused(exc.message, **exc.details) from exc
            bufs: dict[int, Buffer] = {}
            try:
                pacer = self._read_parked(j, placed, move, start, bufs)
                with self._lock:
                    self._commit_restored(j, {r.region: r for r in placed})
            except BaseException as exc:
                with self._lock:
                    for record in placed:
                        self._release_pages(record, keep=True)
                    for region, buf in bufs.items():  # the parked copy stays, and stays mapped
                        self._parked_bufs[(j.name, region)] = buf
                self._reraise("restore", j, exc)
            # the job is on the device: what follows is cleaning up
            end = self._no_earlier_than_the_model("restore", pacer, start)
            self._recycle(bufs.values())
            return MoveResult(pacer.moved, end - start)
        finally:
            self._finish(j, move)

    def _take_pages(self, j: _Job) -> list[RegionRecord]:
        """New pages for every region of a parked job, all or nothing (under the lock)."""
        placed: list[RegionRecord] = []
        for r in j.regions.values():
            extents = self._allocators[r.gpu].take(self.rounded(r.nbytes) // self.page_size)
            if extents is None:
                for done in placed:
                    self._allocators[done.gpu].give(done.extents)
                free = self._allocators[r.gpu].free_pages * self.page_size
                raise errors.OutOfMemory(
                    f"cannot restore job {j.name!r}: region {r.region} needs {exact_size(self.rounded(r.nbytes))} "
                    f"on gpu {r.gpu}, {human_size(free)} of {human_size(self.capacity)} free{self._held_on(r.gpu)}",
                    gpu=r.gpu,
                    requested=r.nbytes,
                    free=free,
                    capacity=self.capacity,
                )
            placed.append(dataclasses.replace(r, extents=extents))
            try:
                self._back(r.gpu, extents)
            except errors.TimeslicedError as exc:  # nothing written: the parked copy is whole
                for done in placed:
                    self._allocators[done.gpu].give(done.extents)
                _refuse_restore(j.name, exc)
        for record in placed:
            self._zero_tail(record)
        return placed

    def _write_parked(
        self, j: _Job, records: list[RegionRecord], move: _Move, start: float, files: list[_ParkFile]
    ) -> _Pacer:
        """Copy the regions to their parked files (appended to ``files`` as they open), paced."""
        j.make_folder()
        pacer = _Pacer(self.bandwidth, move.abort, start, self._tails["snapshot"].lead)
        try:
            for r in records:
                files.append(self._park_file(j, r))
            for r, f in zip(records, files, strict=True):
                pos = 0
                base = self._addresses[r.gpu]
                for offset, n in self._chunks(r):
                    f.write(self._views[r.gpu][offset : offset + n], base + offset, pos)
                    pos += n
                    pacer.advance(n)
        finally:
            for f in files:
                f.close()
        return pacer

    def _no_earlier_than_the_model(self, kind: str, pacer: _Pacer, start: float) -> float:
        """Learn the move's tail, and hold its end to the model's time if the tail came short of its lead.

        The state is committed already: only the caller's return waits. Returns the end.
        """
        if not (self.bandwidth and pacer.moved):
            return time.perf_counter()
        self._tails[kind].learn(time.perf_counter() - pacer.copied_at)
        _wait_until(start + pacer.moved / self.bandwidth, _NEVER)
        return time.perf_counter()

    def _park_file(self, j: _Job, r: RegionRecord) -> _ParkFile:
        """Where region ``r`` of job ``j`` is parked: a warm buffer from the pool, else a new file."""
        folder, path = j.folder, j.parked_path(r.region)
        buf = self.pool.take(r.nbytes, path)
        if buf is not None:
            return _ParkFile(path, buf, None)
        try:
            return _ParkFile(path, None, self._open_parked(folder, r, reserve=True))
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT) or not self.pool.drop():
                raise
        return _ParkFile(path, None, self._open_parked(folder, r, reserve=True))  # once more, the pool given back

    def _open_parked(self, folder: Path, r: RegionRecord, *, reserve: bool) -> int:
        """A new ``<region>.bin``; with ``reserve``, all its room taken now.

        Parks reserve: ``posix_fallocate`` fails with ``ENOSPC`` before a byte is copied, so a full
        tmpfs refuses the park whole (and a swap's park, which must not fail once it has handed
        pages over to the restore, cannot fail for room part way). Allocating first and then
        ``pwrite`` into the allocated pages costs about what ``pwrite`` allocating them as it goes
        does (3.1-4.2 against 3.3-3.4 GB/s here, 256 MiB to 1 GiB). The room the files take is
        exactly the job's parked state.
        """
        fd = os.open(folder / f"{r.region}.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            if r.nbytes and reserve:
                _fallocate(fd, 0, r.nbytes)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _keep_mapped(self, job: str, records: list[RegionRecord], files: list[_ParkFile]) -> None:
        """Keep the parked files written into pool buffers mapped: the restore reads them warm."""
        with self._lock:
            for r, f in zip(records, files, strict=False):
                if f.buf is not None:
                    self._parked_bufs[(job, r.region)] = f.buf

    def _give_back(self, files: list[_ParkFile]) -> None:
        """A park rolled back: its pool buffers go back to the pool (their files are nobody's now)."""
        for f in files:
            f.close()
            if f.buf is not None:
                self.pool.give(f.buf)

    def _recycle(self, bufs: Iterable[Buffer]) -> None:
        """A restore committed: its parked files, mapped, become the pool's (or are deleted past its limit).

        They stay where they are: the job's next park takes them there (``BufferPool.keep``).
        """
        for buf in bufs:
            self.pool.keep(buf)

    def _unmap_parked(self, job: str, region: int | None = None) -> None:
        """Unmap the job's parked files (one region's, or all) before they are deleted (under the lock)."""
        for key in [k for k in self._parked_bufs if k[0] == job and region in (None, k[1])]:
            self._parked_bufs.pop(key).close()

    def _parked_buffer(self, j: _Job, r: RegionRecord) -> Buffer:
        """Region ``r``'s parked file, mapped: kept from its park, or mapped now (a file an earlier daemon wrote).

        Raises ``BackendError`` when the file is missing or not the region's size.
        """
        with self._lock:
            buf = self._parked_bufs.pop((j.name, r.region), None)
        path = j.parked_path(r.region)
        try:
            # The file's size, not the mapping's: a copy past the end of a file cut short behind the
            # mapping's back would be killed by SIGBUS.
            size = os.stat(path).st_size
            if size != r.nbytes:
                raise errors.BackendError(f"parked copy {path} has {size} bytes, expected {r.nbytes}")
            return buf if buf is not None else Buffer.open(path)
        except BaseException as exc:
            if buf is not None:
                buf.close()
            if isinstance(exc, OSError):
                raise errors.BackendError(f"cannot map parked copy {path}: {exc}") from None
            raise

    def _read_parked(
        self, j: _Job, placed: list[RegionRecord], move: _Move, start: float, bufs: dict[int, Buffer]
    ) -> _Pacer:
        """Copy the parked files (mapped, added to ``bufs`` as they are) into the placed pages, paced.

        A mapping of the parked file with its page tables populated: one memory copy per chunk,
        which runs faster than ``read(2)`` through the page cache (``timesliced bench copy``); a
        file this daemon parked into a pool buffer is mapped already.
        """
        pacer = _Pacer(self.bandwidth, move.abort, start, self._tails["restore"].lead)
        for r in placed:
            buf = bufs[r.region] = self._parked_buffer(j, r)
            pos, base = 0, self._addresses[r.gpu]
            for offset, n in self._chunks(r):
                ctypes.memmove(base + offset, buf.address + pos, n)
                pos += n
                pacer.advance(n)
        return pacer

    def _chunks(self, r: RegionRecord) -> list[tuple[int, int]]:
        """(arena offset, length) pieces covering the region's ``nbytes`` in order."""
        out: list[tuple[int, int]] = []
        left = r.nbytes
        for page, count in r.extents:
            start = page * self.page_size
            end = start + min(count * self.page_size, left)
            left -= end - start
            out.extend((pos, min(_CHUNK, end - pos)) for pos in range(start, end, _CHUNK))
        return out

    def _finish(self, j: _Job, move: _Move) -> None:
        with self._lock:
            if j.move is move:
                j.move = None
        move.done.set()

    def _reraise(self, kind: str, j: _Job, exc: BaseException) -> NoReturn:
        """Raise a rolled-back move's error as the error callers expect.

        A snapshot is rolled back whole (the device copy was only read; the partial parked files
        are gone), so its failure says the job's state is intact: ``InsufficientHostMemory`` when
        the parked copy found no room (``ENOSPC`` or ``EDQUOT`` on its file system, a tmpfs that is
        full), else ``ParkRefused``. A restore that failed part way may have met a damaged parked
        copy: a ``BackendError``, and the job is faulted.
        """
        if isinstance(exc, (_Aborted, OSError)):
            # Drop the copy loop's frames: they hold slices of the arena, which would keep it mapped.
            exc = exc.with_traceback(None)
            why = "was abandoned by its caller" if isinstance(exc, _Aborted) else f"failed: {exc}"
            if kind != "snapshot":
                raise errors.BackendError(f"{kind} of job {j.name!r} {why}") from exc
            if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
                needed = sum(r.nbytes for r in j.regions.values())
                raise errors.InsufficientHostMemory(
                    f"no room for the parked copy of job {j.name!r} ({exact_size(needed)}) in {self.root / 'parked'} "
                    f"({self._space()}); the job stays resident, whole. Free space there (a bigger tmpfs, fewer "
                    "parked jobs)",
                    job=j.name,
                    needed=needed,
                ) from exc
            raise errors.ParkRefused(f"{kind} of job {j.name!r} {why}; the job stays resident, whole") from exc
        if kind == "snapshot" and isinstance(exc, errors.BackendError) and not errors.state_intact(exc):
            raise errors.ParkRefused(f"{exc.message}; the job stays resident, whole") from exc
        raise exc

    def _space(self) -> str:
        """What the parked files' file system has free, for an error."""
        try:
            st = os.statvfs(self.root / "parked")
        except OSError as exc:
            return f"its file system cannot be read: {exc.strerror}"
        return f"{human_size(st.f_bavail * st.f_frsize)} of {human_size(st.f_blocks * st.f_frsize)} free"

    # --- state and control files -----------------------------------------------------

    def _new_job(self, job: str) -> _Job:
        path = ctl_path(self.root, job)
        slot = SlotData(RESIDENT, 0, 1, ())
        try:
            writer = CtlWriter.create(
                path, job, gpus=self.gpus, capacity=self.capacity, page_size=self.page_size, slot=slot
            )
        except OSError as exc:
            raise errors.BackendError(f"cannot create control file {path}: {exc}") from exc
        j = self._jobs[job] = _Job(job, writer, RESIDENT, 0, 1, {}).bind(self.root)
        return j

    def _update(self, j: _Job, *, strict: bool = True, **changes: Any) -> None:
        """Apply ``changes`` to the job and publish them in its control file (under the lock).

        Strict updates are all-or-nothing: if the file cannot be written the
        job keeps its old values and BackendError is raised. Rollbacks are not
        strict: the daemon's own view must move on even if the file lags. A write
        that lands gives back the pages the job held for the file (``_Job.held``).
        """
        old = {name: getattr(j, name) for name in changes}
        for name, value in changes.items():
            setattr(j, name, value)
        slot = SlotData(j.state, j.epoch, j.next_region, tuple(j.regions.values()))
        try:
            j.ctl.commit(slot)
        except OSError as exc:
            if strict:
                for name, value in old.items():
                    setattr(j, name, value)
                raise errors.BackendError(f"cannot write control file {j.ctl.path}: {exc}") from exc
            return
        if j.held:  # the file lists only what the job holds now: what it let go of can go
            held, j.held = j.held, []
            for record in held:
                self._release_pages(record, keep=True)

    def _commit_restored(self, j: _Job, regions: dict[int, RegionRecord]) -> None:
        """Commit a restore whose every byte is on the device: the job is resident on ``regions`` (under the lock).

        Raises ``RestoreRefused`` when the control file cannot be written: nothing was committed, the
        job is still parked and its parked copy, only read, whole; the caller gives the pages back.
        """
        try:
            self._update(j, state=RESIDENT, epoch=j.epoch + 1, regions=regions)
        except errors.BackendError as exc:
            raise errors.RestoreRefused(
                f"restore of job {j.name!r} was not committed: {exc.message}; the job stays parked, whole. Check "
                f"that the file system of {self.root} takes writes (its free space, its health), then restore again"
            ) from exc

    def _complete_park(self, j: _Job) -> None:
        """Complete the park a swap left unfinished (``_Job.unfinished``) and commit it, before the job's restore.

        The copy start-up makes of such a park (``_write_listed``), from the pages the job holds; the
        commit (``PARKED``, no page listed) that lands gives them back. Raises ``RestoreRefused`` when a
        write or the commit fails: the pages were only read, so the job stays parked, whole, holding them.
        """
        try:
            self._write_listed(j, j.held)
            with self._lock:
                self._update(j, state=PARKED, epoch=j.epoch + 1)
                j.unfinished = False
        except (OSError, errors.BackendError) as exc:
            exc = exc.with_traceback(None)  # the copy's frames hold slices of the arena
            with self._lock:
                nbytes = sum(n for r in j.held for _, n in r.extents) * self.page_size
            raise errors.RestoreRefused(
                f"restore of job {j.name!r} was not started: the rest of its parked copy, {human_size(nbytes)} in "
                f"the device memory it holds, could not be completed in {j.folder} ({exc}); the job stays parked, "
                f"whole. Check the health and free space of the file system of {self.root} ({self._space()}), "
                "then restore again",
                job=j.name,
            ) from exc
        log.info("job %r: the parked copy its swap left unfinished is complete", j.name)

    def _complete_others(self, *moving: _Job) -> None:
        """Before a restore takes pages: complete what other parked jobs left undone, freeing the pages they hold.

        A job holds pages (``_Job.held``) when its park was left unfinished (its copy is completed and
        committed, ``_complete_park``) or when only the park's last commit failed (the commit is tried
        again). The scheduler counts those pages as free (the jobs are parked), and granted this
        restore on that count; left held, they would refuse it until their own jobs came back. Each
        such job is claimed as a move (one that is moving is left alone); one whose copy or commit
        still fails keeps its pages, parked and whole, and the restore takes what else is free.
        """
        with self._lock:
            others = [o for o in self._jobs.values() if o.held and o.move is None and o not in moving]
            claims = [(o, _Move()) for o in others]
            for o, claim in claims:
                o.move = claim
        for o, claim in claims:
            try:
                self._give_back_held(o)
            except errors.BackendError as exc:
                log.info("job %r still holds simulated device memory: %s", o.name, exc.message)
            finally:
                self._finish(o, claim)

    def _give_back_held(self, j: _Job) -> None:
        """Complete what a parked job's park left undone, so that the pages it holds go back (``j`` claimed as a move).

        A park left unfinished is completed and committed (``_complete_park``, which raises
        ``RestoreRefused`` while its copy cannot be completed); one whose only failure was its last
        commit has that commit tried again, and keeps its pages, whole, while the file takes no write
        (its restore's own commit tries once more).
        """
        if j.unfinished:
            self._complete_park(j)
            return
        if not j.held:
            return
        try:
            with self._lock:
                self._update(j)  # the commit its park could not land: the pages it lists go back
        except errors.BackendError as exc:
            log.info("job %r keeps the simulated device memory its control file lists: %s", j.name, exc.message)

    def _held_on(self, gpu: int) -> str:
        """What of ``gpu`` parked jobs hold (``_Job.held``), as a clause of a refusal; "" if none (under the lock)."""
        held = {
            j.name: n
            for j in self._jobs.values()
            if (n := sum(c for r in j.held if r.gpu == gpu for _, c in r.extents) * self.page_size)
        }
        if not held:
            return ""
        names = ", ".join(f"{name!r} {human_size(n)}" for name, n in held.items())
        return (
            f"; parked jobs hold more ({names}) until their control files (or, for a park left unfinished, their "
            f"parked files) take writes: check the file system of {self.root} ({self._space()}); the restore is "
            "tried again at the job's next grant"
        )

    def _info(self, job: str, r: RegionRecord) -> RegionInfo:
        return RegionInfo(
            r.region,
            r.gpu,
            r.nbytes,
            str(ctl_path(self.root, job)),
            str(arena_path(self.root, r.gpu)),
            self.page_size,
        )

    def _release_pages(self, r: RegionRecord, *, keep: bool = False) -> None:
        """Return a region's pages (if it has any) to the allocator, and to the host unless ``keep`` (under the lock).

        A move keeps the pages it frees (``keep``): the next restore on this device takes them, and
        copying into pages that are mapped already runs at the machine's warm copy rate, where pages
        given back to the host must be faulted in again at a fraction of it (``timesliced bench
        copy``). The simulated device's memory is then held on the host up to its high-water mark,
        as a real GPU's memory is always there; a freed region or a reclaimed job gives its pages back.
        Kept pages hold stale bytes: ``alloc`` zeroes what it hands out, a restore overwrites its
        pages and zeroes the tail of its last page.
        """
        if r.extents:
            if not keep:
                self._punch(r.gpu, r.extents)
            self._allocators[r.gpu].give(r.extents)

    def _zero_tail(self, r: RegionRecord) -> None:
        """Zero what a region's pages hold past its ``nbytes`` (a restore writes everything before).

        Only the last page can hold anything there, and of it only the bytes below its ink bound
        (``_ink``): nothing at all when the page's earlier holder covered no more of it.
        """
        self._inked(r.gpu, r.extents, r.nbytes)  # what the restore writes, before it writes it
        tail = r.nbytes % self.page_size
        if not (tail and r.extents):
            return
        first, count = r.extents[-1]
        last = first + count - 1
        ink = self._ink[r.gpu]
        if ink[last] > tail:
            at = last * self.page_size
            ctypes.memset(self._addresses[r.gpu] + at + tail, 0, ink[last] - tail)  # no buffer of zeros to make
            ink[last] = tail

    def _inked(self, gpu: int, extents: Iterable[Extent], nbytes: int) -> None:
        """Raise the ink bound of pages ``extents`` that ``nbytes`` bytes, laid on them in order, may cover."""
        ink, page = self._ink[gpu], self.page_size
        for first, count in extents:
            if nbytes <= 0:
                return
            full = min(count, nbytes // page)
            if full:
                ink[first : first + full] = array.array("Q", [page]) * full
            if full < count and nbytes - full * page > 0:
                p = first + full
                ink[p] = max(ink[p], min(page, nbytes - full * page))
            nbytes -= count * page

    def _back(self, gpu: int, extents: tuple[Extent, ...]) -> None:
        """Allocate the file system's pages behind ``extents`` of ``gpu``'s arena before they are written.

        The arena is a sparse file: writing through its mapping into a page the file system cannot
        allocate (a full tmpfs) kills the writer with SIGBUS, the daemon or a job alike.
        ``posix_fallocate`` fails with ``ENOSPC`` instead, and costs little on pages that are there
        already. Raises ``InsufficientHostMemory`` when the file system has no room, ``BackendError``
        for any other failure; either way nothing was written.

        ``os.posix_fallocate`` raises ``OSError`` with the error number ``posix_fallocate(3)`` returns
        (it sets no ``errno``), and retries ``EINTR`` itself. The page's errors: ``ENOSPC`` (not enough
        space on the file system), ``EBADF`` (not a descriptor open for writing), ``EFBIG`` (past the
        largest file), ``EINVAL`` (a bad offset or length, or a file system that does not support the
        operation), ``ENODEV`` (not a regular file), ``ESPIPE`` (a pipe), ``EOPNOTSUPP`` (a C library
        that does not emulate it on such a file system, as musl), and from ``fallocate(2)`` beneath it
        ``EIO``. Only ``ENOSPC`` and ``EDQUOT`` (a quota's limit, which the page does not list but a
        file system with quotas returns: tmpfs since Linux 6.6, ext4, XFS) are a lack of room; the rest
        say the root's file system cannot hold the arena, which no freed memory would change.
        """
        backed = self._backed[gpu]
        todo = _runs([p for p in _pages(extents) if not backed[p]])
        if not todo:
            return
        path = arena_path(self.root, gpu)
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            raise self._unbacked(gpu, path, exc) from None
        try:
            for page, count in todo:
                try:
                    _fallocate(fd, page * self.page_size, count * self.page_size)
                except OSError as exc:
                    if exc.errno not in _NO_ROOM or not self.pool.drop():
                        raise
                    _fallocate(fd, page * self.page_size, count * self.page_size)  # the pool given back
                backed[page : page + count] = b"\x01" * count
        except OSError as exc:
            if exc.errno not in _NO_ROOM:
                raise self._unbacked(gpu, path, exc) from None
            nbytes = sum(n for _, n in extents) * self.page_size
            raise errors.InsufficientHostMemory(
                f"no room in {self.root} for {exact_size(nbytes)} of gpu {gpu}'s simulated device pages "
                f"({os.strerror(exc.errno or 0)}): free space there (a bigger tmpfs, fewer parked jobs)",
                gpu=gpu,
            ) from None
        finally:
            os.close(fd)

    def _unbacked(self, gpu: int, path: Path, exc: OSError) -> errors.BackendError:
        """The error for an arena whose pages its file system would not allocate, for a cause other than room."""
        name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
        return errors.BackendError(
            f"cannot allocate gpu {gpu}'s simulated device pages in {path}: {name} ({exc.strerror}). The file "
            f"system of {self.root} does not take the arena as it should; nothing was written. Check that it is "
            "mounted and healthy and supports fallocate (a tmpfs does; give --sim-dir one), then try again",
            gpu=gpu,
        )

    def _punch(self, gpu: int, extents: tuple[Extent, ...]) -> None:
        """Zero pages, handing their memory back to the host where the file system can."""
        for page, count in extents:
            start, length = page * self.page_size, count * self.page_size
            if self._can_punch and _MADV_REMOVE is not None:
                try:
                    self._arenas[gpu].madvise(_MADV_REMOVE, start, length)
                    self._backed[gpu][page : page + count] = bytes(count)
                    self._ink[gpu][page : page + count] = array.array("Q", [0]) * count
                    continue
                except OSError:
                    self._can_punch = False  # e.g. a file system without hole punching
            for pos in range(start, start + length, _CHUNK):
                n = min(_CHUNK, start + length - pos)
                self._views[gpu][pos : pos + n] = bytes(n)
            self._ink[gpu][page : page + count] = array.array("Q", [0]) * count

    def _discard(self, folder: Path) -> Path | None:
        """Move a parked folder out of the way (instantly) so it can be deleted at leisure."""
        trash = folder.with_name(f".trash-{folder.name}-{uuid.uuid4().hex[:8]}")
        try:
            folder.rename(trash)
        except FileNotFoundError:
            return None
        return trash

    def _raise_if_faulted(self, j: _Job) -> None:
        if j.state == FAULTED:
            raise errors.JobFaulted(f"job {j.name!r} is faulted; its device state is lost", job=j.name)

    def _check_open(self) -> None:
        if not self._arenas:
            raise errors.BackendError(f"the sim backend on {self.root} is closed")

    def _check_gpu(self, gpu: int) -> None:
        if not 0 <= gpu < self.gpus:
            raise errors.UnknownDevice(f"gpu {gpu} does not exist; this node has gpus 0..{self.gpus - 1}", gpu=gpu)

    # --- start-up: adopt what a previous daemon left -----------------------------------

    def _start_up(self) -> None:
        self.pool.clear_strays()
        jobs_dir = self.root / "jobs"
        for stray in jobs_dir.glob("*.tmp"):
            stray.unlink(missing_ok=True)
        found = []
        for path in sorted(jobs_dir.glob("*.ctl")):
            try:
                found.append((path, *read_ctl(path)))
            except (OSError, ValueError) as exc:
                raise ValueError(f"cannot read control file {path}: {exc}") from exc
        for path, header, _, _ in found:
            if (header.gpus, header.capacity, header.page_size) != (self.gpus, self.capacity, self.page_size):
                raise ValueError(
                    f"sim root {self.root} holds job state made with gpus={header.gpus}, "
                    f"capacity={exact_size(header.capacity)}, page_size={exact_size(header.page_size)} "
                    f"({path.name}); this backend has gpus={self.gpus}, capacity={exact_size(self.capacity)}, "
                    f"page_size={exact_size(self.page_size)}. "
                    "Start it with the same settings, or on a fresh root."
                )
        fresh = [self._open_arena(gpu, keep=bool(found)) for gpu in range(self.gpus)]
        for path, header, slot, size in found:
            if slot.state == RECLAIMED:  # the previous daemon died while forgetting it
                path.unlink(missing_ok=True)
                continue  # its parked folder, if any, is now nobody's and goes below
            regions = {r.region: r for r in slot.regions}
            j = _Job(header.job, CtlWriter.adopt(path, header, size), slot.state, slot.epoch, slot.next_region, regions)
            self._jobs[j.name] = j.bind(self.root)
            state = self._adopted_state(j, fresh)
            if j.unfinished:  # parked, whole, holding its listed pages: the file already says what is so
                self._recovered[j.name] = (STATE_NAMES[PARKED], self.footprint(j.name))
                continue
            if state != slot.state or header.gen % 2:
                if state != RESIDENT:
                    j.regions = {k: dataclasses.replace(r, extents=()) for k, r in j.regions.items()}
                self._update(j, state=state, epoch=j.epoch + 1)
            self._recovered[j.name] = (STATE_NAMES[state], self.footprint(j.name))
        self._clean_parked()
        for gpu, allocator in enumerate(self._allocators):
            self._punch(gpu, tuple(allocator.free_runs()))

    def _open_arena(self, gpu: int, *, keep: bool) -> bool:
        """Map one device's arena; True if it was created empty (its old contents, if any, are gone)."""
        path = arena_path(self.root, gpu)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            size = os.fstat(fd).st_size
            if size != self.capacity:
                if size and keep:
                    raise ValueError(
                        f"{path} is {exact_size(size)} but this backend has capacity={exact_size(self.capacity)}; "
                        "the sim root was made with other settings. Start it with the same settings, or on a fresh "
                        "root."
                    )
                os.ftruncate(fd, 0)
                os.ftruncate(fd, self.capacity)
            self._arenas.append(mmap.mmap(fd, self.capacity))
            self._views.append(memoryview(self._arenas[-1]))
            self._anchors.append(ctypes.c_char.from_buffer(self._arenas[-1]))
            self._addresses.append(ctypes.addressof(self._anchors[-1]))
        finally:
            os.close(fd)
        return size != self.capacity

    def _adopted_state(self, j: _Job, fresh: list[bool]) -> int:
        """What an adopted job really is: its pages claimed if resident, its files checked if parked."""
        if j.state == PARKING and any(
            sum(n for _, n in r.extents) < self.rounded(r.nbytes) // self.page_size for r in j.regions.values()
        ):
            return self._finish_handed_park(j, fresh)
        if j.state in (RESIDENT, PARKING):
            intact = all(
                r.gpu < self.gpus
                and not fresh[r.gpu]
                and sum(n for _, n in r.extents) == self.rounded(r.nbytes) // self.page_size
                for r in j.regions.values()
            )
            if not (intact and self._claim_all(j.regions.values())):
                return FAULTED
            return RESIDENT  # a snapshot cut short: the device copy is still the complete one
        if j.state == PARKED:
            for r in j.regions.values():
                path = Path(j.parked_path(r.region))
                if not path.is_file() or path.stat().st_size != r.nbytes or r.gpu >= self.gpus:
                    return FAULTED
            return PARKED
        return FAULTED

    def _finish_handed_park(self, j: _Job, fresh: list[bool]) -> int:
        """Complete the park of a job a swap was moving out when the daemon died; PARKED, or FAULTED.

        Its control file lists, per region, only the pages not yet handed over; the rest is in the
        region's host file already (``_write_listed``, which copies those pages there). A region with
        no page listed was written whole. A job whose listed pages are gone (a new arena) or whose
        handed-over part has no host file is faulted. One whose copy cannot be written (the file
        system still failing) is parked, unfinished, holding its listed pages, as the daemon before
        left it (``SimBackend._park_unfinished``): its next restore completes the copy.
        """
        listed: list[RegionRecord] = []
        for r in j.regions.values():
            final = Path(j.parked_path(r.region))
            pages = self.rounded(r.nbytes) // self.page_size
            left = sum(n for _, n in r.extents)
            try:
                if not left:  # handed over whole: only once its last byte was on the host
                    if final.is_file() and final.stat().st_size == r.nbytes:
                        continue
                    return FAULTED
                if r.gpu >= self.gpus or fresh[r.gpu] or (left < pages and not final.is_file()):
                    return FAULTED  # a handed-over prefix with no host copy, or device pages that are gone
            except OSError:
                return FAULTED
            listed.append(r)
        try:
            self._write_listed(j, listed)
        except OSError as exc:  # the file system still fails: parked as the daemon before left it, if the pages are
            if not self._claim_all(listed):
                return FAULTED
            self._park_unfinished(j, listed, exc)
        return PARKED

    def _claim_all(self, records: Iterable[RegionRecord]) -> bool:
        """Take every record's pages from the allocators (start-up), or none of them: False."""
        claimed: list[RegionRecord] = []
        for r in records:
            if not self._allocators[r.gpu].claim(r.extents):
                for done in claimed:
                    self._allocators[done.gpu].give(done.extents)
                return False
            claimed.append(r)
        return True

    def _park_unfinished(self, j: _Job, listed: Iterable[RegionRecord], exc: Exception) -> None:
        """``j`` parked, whole, its copy unfinished: ``listed`` (the regions whose pages hold its last bytes) held.

        Nothing is committed: its control file says ``PARKING`` and lists those pages, which is what
        start-up finishes as a park (``_finish_handed_park``). They stay the job's (``_Job.held``),
        neither free nor a restore's, and no commit of the job lands before a restore has completed the
        copy from them (``_complete_park``). A swap's park whose completion failed (``_Swap._fail_a``),
        and a start-up whose copy of such a park failed, leave a job so.
        """
        with self._lock:
            j.held.extend(listed)
            j.regions = {k: dataclasses.replace(v, extents=()) for k, v in j.regions.items()}
            j.state, j.unfinished = PARKED, True
            nbytes = sum(n for v in j.held for _, n in v.extents) * self.page_size
        log.warning(
            "job %r is parked, whole, but its parked copy could not be completed (%s): %s of its bytes stay in the "
            "simulated device memory it holds, and its next restore (or a daemon's start) completes the copy first. "
            "Check the health and free space of the file system of %s (%s)",
            j.name,
            exc,
            human_size(nbytes),
            self.root,
            self._space(),
        )

    def _write_listed(self, j: _Job, records: Iterable[RegionRecord]) -> None:
        """Complete a park that handed pages over: copy the device pages each region still lists into its host file.

        A region's listed pages are its last ones, holding its bytes from ``handed * page_size`` on;
        everything before is in the host file ``<region>.bin`` already, written before those pages
        were handed over. So the host file plus the listed pages are the whole region. A region none
        of whose pages were handed over is copied whole, whatever its file holds. Start-up finishes a
        killed daemon's park so (``_finish_handed_park``), a restore the park a swap left unfinished
        (``_complete_park``). Raises ``OSError`` when a file cannot be written; the pages are only read.
        """
        j.folder.mkdir(mode=0o700, exist_ok=True)
        for r in records:
            pos = (self.rounded(r.nbytes) // self.page_size - sum(n for _, n in r.extents)) * self.page_size
            path = j.parked_path(r.region)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
            f = _ParkFile(path, None, fd)  # the park's own writer: one copy, and one seam for tests
            try:
                os.ftruncate(fd, r.nbytes)
                base = self._addresses[r.gpu]
                for page, count in r.extents:
                    at = page * self.page_size
                    n = min(count * self.page_size, r.nbytes - pos)
                    f.write(self._views[r.gpu][at : at + n], base + at, pos)
                    pos += n
            finally:
                f.close()

    def _clean_parked(self) -> None:
        """Remove host copies nobody owns: partial files, and leftovers of finished moves."""
        by_key = {job_key(name): j for name, j in self._jobs.items()}
        for folder in (self.root / "parked").iterdir():
            j = by_key.get(folder.name)
            if not folder.is_dir():
                folder.unlink(missing_ok=True)
            elif j is None or j.state not in (PARKED, FAULTED):
                shutil.rmtree(folder, ignore_errors=True)
            else:
                keep = {f"{r}.bin" for r in j.regions}
                for f in folder.iterdir():
                    if f.is_dir():
                        shutil.rmtree(f, ignore_errors=True)
                    elif f.name not in keep:
                        f.unlink()


async def _to_the_end(claims: Iterable[_Move], work: Callable[..., _T], *args: Any) -> _T:
    """``work(*args)`` in a worker thread, which runs it to its end even when the caller is cancelled.

    The work releases the ``claims`` of its move (``_finish``), so it must run whatever happens to its
    caller: ``asyncio.to_thread`` would drop work that no thread had started yet when its caller was
    cancelled (the default executor's threads are shared, so that happens under load), leaving the
    job claimed for good. A cancelled caller sets its claims' abort, so the work ends at once.
    """
    done = asyncio.get_running_loop().run_in_executor(None, work, *args)
    try:
        return await asyncio.shield(done)
    except asyncio.CancelledError:
        for claim in claims:
            claim.abort.set()
        done.add_done_callback(_leave_unread)
        raise


def _leave_unread(done: asyncio.Future[Any]) -> None:
    """What work its caller left ends in is the backend's to log (``_reraise``), not asyncio's."""
    if not done.cancelled():
        done.exception()


async def _outcome(move: Coroutine[Any, Any, MoveResult]) -> MoveResult | Exception:
    try:
        return await move
    except Exception as exc:
        return exc


def _refuse_restore(job: str, exc: errors.TimeslicedError) -> NoReturn:
    """Raise for a restore whose pages ``_back`` could not allocate: nothing went into them, the parked copy is whole.

    Lack of room is ``InsufficientHostMemory`` already, a state-intact error; any other failure is
    refused the same way (``RestoreRefused``), not left to fault the job.
    """
    if errors.state_intact(exc):
        raise exc
    raise errors.RestoreRefused(
        f"restore of job {job!r} found no usable device pages: {exc.message}; the job stays parked, whole"
    ) from exc


def _runs(pages: list[int]) -> tuple[Extent, ...]:
    """Pages in order as runs of consecutive pages."""
    runs: list[Extent] = []
    for page in pages:
        if runs and runs[-1][0] + runs[-1][1] == page:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((page, 1))
    return tuple(runs)


def _pages(extents: tuple[Extent, ...]) -> list[int]:
    return [p for start, n in extents for p in range(start, start + n)]


class _Swap:
    """One swap in its worker thread: the outgoing job ``a`` parks while the incoming job ``b`` restores.

    Two cursors, one per direction, each paced by its own due time (``start + moved / bandwidth``);
    the loop always advances the direction that is due first and can go on (the restore waits when
    no page is free yet). See ``SimBackend.swap`` for the crash-consistency argument.
    """

    def __init__(self, sim: SimBackend, a: _Job, b: _Job, claims: tuple[_Move, _Move]) -> None:
        self.sim, self.a, self.b = sim, a, b
        self.abort = claims[0].abort
        self.other_abort = claims[1].abort
        self.start = time.perf_counter()
        self.lead = sim._tails["swap"].lead  # the schedule runs early by what the commits took before
        self.copied_at = 0.0  # when the later direction's commit step began (its due time reached)
        self.page = sim.page_size
        self.pool: dict[int, list[int]] = {}  # gpu -> pages the park handed over, not yet taken
        # the park: region by region, chunk by chunk
        self.a_records: list[RegionRecord] = []
        self.a_files: list[_ParkFile] = []
        self.a_index = self.a_pos = self.a_piece = self.a_moved = 0
        self.a_handed: dict[int, int] = {}  # region -> pages handed over (a prefix of its pages)
        self.a_result: MoveResult | Exception | None = None
        # the restore
        self.b_records = list(b.regions.values())
        self.b_placed: dict[int, list[int]] = {r.region: [] for r in self.b_records}
        self.b_index = self.b_pos = self.b_moved = 0
        self.b_src: Buffer | None = None  # the region being restored's parked file, mapped
        self.b_bufs: dict[int, Buffer] = {}  # region -> its parked file, once read from
        self.b_result: MoveResult | Exception | None = None
        self.b_cleaned = False

    # --- the whole swap ---------------------------------------------------------------------

    def run(self) -> SwapResult:
        self._begin()  # raises when nothing moved
        self.helper = self.sim._helper_thread()
        try:
            while self.a_result is None or self.b_result is None:
                ready = []  # (due, bytes moved, side): the direction due first, the one behind on a tie
                if self.a_result is None:
                    ready.append((self._due(self.a_moved), self.a_moved, 0))
                if self.b_result is None and self._b_can_go():
                    ready.append((self._due(self.b_moved), self.b_moved, 1))
                if not ready:  # the park is done, and the restore finds no page to go on with
                    self._fail_b(self._no_pages())
                    continue
                due, _, side = min(ready)
                self._sleep_until(due)
                if len(ready) == 2 and max(d for d, _, _ in ready) <= time.perf_counter():
                    self._step_a(beside=self._step_b_or_fail)  # both due: both directions at once
                elif side == 0:
                    self._step_a()
                else:
                    self._step_b_or_fail()
            if self.sim.bandwidth and self.copied_at and not isinstance(self.a_result, Exception):
                self.sim._tails["swap"].learn(time.perf_counter() - self.copied_at)
            self._clean_up_b()  # in the time the model leaves, where it leaves any
            self._not_before_the_model()
        except BaseException as exc:
            if self.b_result is None:
                self._fail_b(self._stopped(exc))
            if self.a_result is None:
                self._fail_a(exc)
            if not isinstance(exc, (Exception, _Aborted)):
                raise
        finally:
            for f in self.a_files:
                f.close()
        self._clean_up_b()
        if isinstance(self.a_result, MoveResult):
            self.sim._keep_mapped(self.a.name, self.a_records, self.a_files)
        else:  # rolled back (its buffers went back to the pool) or faulted: nothing of it stays mapped
            for f in self.a_files:
                if f.buf is not None:
                    f.buf.close()
        with self.sim._lock:  # a restore that failed: its parked copy stays, and stays mapped for the next try
            for region, buf in self.b_bufs.items():
                self.sim._parked_bufs[(self.b.name, region)] = buf
        with self.sim._lock:  # pages handed over that the restore did not need are free device memory
            for gpu, pages in self.pool.items():
                self.sim._allocators[gpu].give(_runs(pages))
            self.pool.clear()
        assert self.a_result is not None and self.b_result is not None
        return SwapResult(self.a_result, self.b_result)

    def _not_before_the_model(self) -> None:
        """Hold the swap's end to the model's time, and each direction's to its own.

        The schedule runs early by the commits' learnt ``lead``; commits that took less than that
        leave the swap early: it waits the rest (both directions are committed: only the return
        waits), and a direction's time is the model's if it committed before.
        """
        bw = self.sim.bandwidth
        if not bw:
            return
        _wait_until(self.start + max(self.a_moved, self.b_moved) / bw, _NEVER)
        if isinstance(self.a_result, MoveResult):
            self.a_result = dataclasses.replace(self.a_result, seconds=max(self.a_result.seconds, self.a_moved / bw))
        if isinstance(self.b_result, MoveResult):
            self.b_result = dataclasses.replace(self.b_result, seconds=max(self.b_result.seconds, self.b_moved / bw))

    def _due(self, moved: int) -> float:
        return self.start - self.lead + (moved / self.sim.bandwidth if self.sim.bandwidth else 0.0)

    def _sleep_until(self, due: float) -> None:
        _wait_until(due, self.abort, self.other_abort)

    def _begin(self) -> None:
        """Check that the incoming job fits in free pages plus the outgoing job's, then start the park."""
        sim, a, b = self.sim, self.a, self.b
        sim._give_back_held(b)  # its own held pages count as free to the scheduler, as do others'
        sim._complete_others(a, b)
        with sim._lock:
            need: dict[int, int] = {}
            for r in b.regions.values():
                need[r.gpu] = need.get(r.gpu, 0) + sim.rounded(r.nbytes) // self.page
            for gpu, pages in need.items():
                room = sim._allocators[gpu].free_pages + sum(
                    n for r in a.regions.values() if r.gpu == gpu for _, n in r.extents
                )
                if pages > room:
                    raise errors.RestoreRefused(
                        f"cannot swap job {b.name!r} in for {a.name!r}: it needs {exact_size(pages * self.page)} on "
                        f"gpu {gpu}, which has {human_size(room * self.page)} free once {a.name!r} is parked; both "
                        "jobs stay where they are",
                        gpu=gpu,
                        requested=pages * self.page,
                        free=room * self.page,
                        capacity=sim.capacity,
                    )
            try:
                sim._update(a, state=PARKING, epoch=a.epoch + 1)  # its clients stop touching it now
            except errors.BackendError as exc:
                raise errors.ParkRefused(f"swap of job {a.name!r} was not started: {exc.message}") from exc
            self.a_records = list(a.regions.values())
        try:
            a.make_folder()
            for r in self.a_records:  # every file's room taken now: the park cannot fail for it part way
                self.a_files.append(sim._park_file(a, r))
        except BaseException as exc:
            self._roll_back_a()
            sim._reraise("snapshot", a, exc)

    # --- the park -----------------------------------------------------------------------------

    def _step_a(self, beside: Callable[[], None] | None = None) -> None:
        """Copy the park's next chunk to its host file, hand over the pages it covered; the last one commits the park.

        ``beside`` runs in this thread while the helper thread writes the chunk: ``pwrite`` lets go
        of the GIL, so the two directions' copies run at once, as on a full-duplex link.
        """
        sim, a = self.sim, self.a
        if self.a_index == len(self.a_records):  # a job with no regions: only the commit
            self.copied_at = time.perf_counter()
            with sim._lock:
                sim._update(a, state=PARKED, epoch=a.epoch + 1)  # every region's extents are empty by now
            self.a_result = MoveResult(self.a_moved, time.perf_counter() - self.start)
            if beside is not None:
                beside()
            return
        r = self.a_records[self.a_index]
        offset, n = sim._chunks(r)[self.a_piece]
        args = (sim._views[r.gpu][offset : offset + n], sim._addresses[r.gpu] + offset, self.a_pos)
        if n < _HELPER_MIN or beside is None:
            self.a_files[self.a_index].write(*args)
            if beside is not None:
                beside()
        else:
            write = self.helper.submit(self.a_files[self.a_index].write, *args)
            try:
                beside()
            finally:
                write.result()  # the chunk is on the host (or its error is raised) before its pages go
        # The cursor passes a chunk only once it is on the host, and a region before its last hand-over:
        # a park that goes on after an error (``_fail_a``) writes again what was not written, and never
        # past the region's end.
        self.a_piece += 1
        self.a_pos += n
        self.a_moved += n
        if self.a_pos < r.nbytes:
            self._hand_over(r, self.a_pos // self.page)
            return
        last = self.a_index + 1 == len(self.a_records)
        self.a_index, self.a_pos, self.a_piece = self.a_index + 1, 0, 0
        self._hand_over(r, len(_pages(r.extents)), parked=last)
        if last:
            self.a_result = MoveResult(self.a_moved, time.perf_counter() - self.start)

    def _hand_over(self, r: RegionRecord, upto: int, *, parked: bool = False) -> None:
        """Give the restore region ``r``'s first ``upto`` pages, their bytes being on the host now.

        ``parked``: ``r`` is the park's last region, written whole, so the same control-file write
        also commits the park (``PARKED``). Crash safety needs no write in between: a daemon killed
        before this write leaves ``r``'s last pages listed (start-up copies them to the host file
        and finishes the park, ``_finish_handed_park``), one killed after it a parked job whose files
        were all written before the write; the handed-over table alone, with the job still
        ``PARKING``, would say no more about where the bytes are than the ``PARKED`` one. So a swap's
        park commits twice in all (``PARKING``, then this), and its restore once.

        A commit that fails hands nothing over: the pages stay listed, and the job's. While no page
        was handed over it raises (the park rolls back, the job whole on the device); after, the park
        must go on, since its only whole copy is the host one with the pages it still lists, so the
        error is not raised: a later commit hands these pages over with its own, and the last one,
        listing no page of any region, gives every page still listed to the restore. If that one fails
        too, ``_park_holding`` parks the job all the same.
        """
        sim, a = self.sim, self.a
        handed = self.a_handed.get(r.region, 0)
        if upto <= handed and not parked:
            return
        pages = _pages(r.extents)
        if parked:
            self.copied_at = time.perf_counter()
        with sim._lock:
            if parked:  # every region's bytes are on the host: the table lists no page
                regions = {k: dataclasses.replace(v, extents=()) for k, v in a.regions.items()}
                freed = [(v.gpu, _pages(v.extents)) for v in a.regions.values()]
                changes: dict[str, Any] = {"state": PARKED, "epoch": a.epoch + 1}
            else:
                now = a.regions[r.region]
                regions = {**a.regions, r.region: RegionRecord(now.region, now.gpu, now.nbytes, _runs(pages[upto:]))}
                freed, changes = [(r.gpu, pages[handed:upto])], {}
            try:
                sim._update(a, regions=regions, **changes)
            except errors.BackendError as exc:
                if not any(self.a_handed.values()):
                    raise
                if parked:
                    self._park_holding(exc)
                return
            for gpu, given in freed:
                self.pool.setdefault(gpu, []).extend(given)
        self.a_handed[r.region] = max(upto, handed)

    def _park_holding(self, exc: errors.BackendError) -> None:
        """The park's last commit failed with its every byte on the host: park the job all the same (under the lock).

        Its control file says ``PARKING``, its pages listed hold the job's bytes, the host files the
        rest (here, all of it): what start-up finishes as a park (``_finish_handed_park``). So the job
        is parked whole, in this daemon and in the next; the commit is tried once more, and while it
        has not landed the pages it lists stay the job's (``_Job.held``), neither free nor the restore's.
        """
        sim, a = self.sim, self.a
        a.held.extend(v for v in a.regions.values() if v.extents)
        parked = {k: dataclasses.replace(v, extents=()) for k, v in a.regions.items()}
        sim._update(a, strict=False, state=PARKED, epoch=a.epoch + 1, regions=parked)
        if a.held:
            nbytes = sum(n for v in a.held for _, n in v.extents) * self.page
            log.warning(
                "job %r is parked, whole, but its control file cannot be written (%s): the %s of simulated "
                "device memory it still lists stay the job's until a write of it lands (at its next restore, or "
                "another job's that needs them), and "
                "a daemon started meanwhile finishes the park from them. Check that the file system of %s takes "
                "writes",
                a.name,
                exc.message,
                human_size(nbytes),
                sim.root,
            )

    def _roll_back_a(self) -> None:
        """Nothing was handed over: the device copy is whole; drop the host copy, the job runs on."""
        sim, a = self.sim, self.a
        sim._give_back(self.a_files)
        self.a_files = []
        a.remove_folder(sim.pool)
        with sim._lock:
            sim._update(a, strict=False, state=RESIDENT, epoch=a.epoch + 1)

    def _fail_a(self, exc: BaseException) -> None:
        """The park stopped: roll it back if no page was handed over, else finish it without pacing.

        A park that cannot be finished either is parked all the same, its bytes whole (``SimBackend._park_unfinished``).
        """
        sim, a = self.sim, self.a
        if not any(self.a_handed.values()):
            self._roll_back_a()
            try:
                sim._reraise("snapshot", a, exc)
            except Exception as err:
                self.a_result = err
            return
        try:  # pages were handed over: the only whole copy is the host one, so complete it (the last step commits)
            while self.a_index < len(self.a_records):
                self._step_a()
            self.a_result = MoveResult(self.a_moved, time.perf_counter() - self.start)
        except Exception as err:
            # Its bytes are whole, the rest in the pages its file still lists: parked all the same, and the park
            # half succeeds, for the scheduler must hear the job is parked (a failed park says resident, or faulted).
            listed = [v for v in a.regions.values() if v.extents]
            sim._park_unfinished(a, listed, err.with_traceback(None))  # the copy's frames hold slices of the arena
            nbytes = sum(r.nbytes for r in self.a_records)  # what its parked files take on the host
            self.a_result = MoveResult(nbytes, time.perf_counter() - self.start)

    # --- the restore --------------------------------------------------------------------------

    def _step_b_or_fail(self) -> None:
        try:
            self._step_b()
        except Exception as exc:  # the restore fails alone: the park goes on
            self._fail_b(exc)

    def _b_can_go(self) -> bool:
        if self.b_index == len(self.b_records):
            return True  # only the commit is left
        r = self.b_records[self.b_index]
        return bool(self.pool.get(r.gpu)) or self.sim._allocators[r.gpu].free_pages > 0

    def _step_b(self) -> None:
        """Copy the restore's next chunk into free or handed-over pages; the last one commits the restore."""
        sim, b = self.sim, self.b
        if self.b_index == len(self.b_records):  # a job with no regions: only the commit
            self._commit_b()
            return
        r = self.b_records[self.b_index]
        if self.b_src is None:
            self.b_src = sim._parked_buffer(b, r)
        want = min(_CHUNK, r.nbytes - self.b_pos)
        npages = -(-want // self.page)
        got: list[int] = []
        with sim._lock:  # the pages the park handed over first: they are mapped already (warm)
            pool = self.pool.get(r.gpu, [])
            take = min(npages, len(pool))
            got += pool[:take]
            del pool[:take]
            free = sim._allocators[r.gpu]
            if len(got) < npages and free.free_pages:
                fresh = free.take(min(npages - len(got), free.free_pages)) or ()
                try:
                    sim._back(r.gpu, fresh)  # pages no park handed over may not be there yet (a full tmpfs)
                except errors.TimeslicedError as exc:
                    free.give(fresh)
                    self.pool.setdefault(r.gpu, [])[:0] = got
                    _refuse_restore(b.name, exc)
                got += _pages(fresh)
        self.b_placed[r.region] += got
        src, base = self.b_src.address, sim._addresses[r.gpu]
        for page, count in _runs(got):
            n = min(count * self.page, r.nbytes - self.b_pos)
            sim._inked(r.gpu, ((page, count),), n)
            ctypes.memmove(base + page * self.page, src + self.b_pos, n)
            self.b_pos += n
            self.b_moved += n
        if self.b_pos == r.nbytes:
            self._close_b_src()
            self.b_index, self.b_pos = self.b_index + 1, 0
            if self.b_index == len(self.b_records):
                self._commit_b()

    def _commit_b(self) -> None:
        """Commit the restore, its last byte copied: the job is resident (its parked files go after the swap)."""
        sim, b = self.sim, self.b
        self.copied_at = time.perf_counter()
        placed = {
            r.region: RegionRecord(r.region, r.gpu, r.nbytes, _runs(self.b_placed[r.region])) for r in self.b_records
        }
        with sim._lock:
            for record in placed.values():
                sim._zero_tail(record)
            sim._commit_restored(b, placed)  # raises RestoreRefused: ``_fail_b`` gives the pages back
        self.b_result = MoveResult(self.b_moved, time.perf_counter() - self.start)

    def _clean_up_b(self) -> None:
        """The restore committed: its parked files become the pool's (off the swap's path); the folder stays.

        Once, whatever the park did meanwhile: a resident job keeps no parked copy.
        """
        if isinstance(self.b_result, MoveResult) and not self.b_cleaned:
            self.b_cleaned = True
            self.sim._recycle(self.b_bufs.values())
            self.b_bufs = {}

    def _close_b_src(self) -> None:
        """Done with the current region's parked file: keep it mapped for the pool, or the next try."""
        if self.b_src is not None:
            self.b_bufs[self.b_records[self.b_index].region] = self.b_src
            self.b_src = None

    def _fail_b(self, exc: BaseException) -> None:
        """The restore stopped: give back its pages; its parked copy, only read, stays (``_reraise``'s rules)."""
        sim, b = self.sim, self.b
        self._close_b_src()
        with sim._lock:
            for region, pages in self.b_placed.items():
                sim._allocators[self.b_records_gpu(region)].give(_runs(pages))
            self.b_placed = {k: [] for k in self.b_placed}
        try:
            sim._reraise("restore", b, exc)
        except Exception as err:
            self.b_result = err

    def _no_pages(self) -> errors.RestoreRefused:
        """Why the restore cannot go on once the park is done: no page is free on its region's GPU."""
        a, b = self.a, self.b
        gpu = self.b_records[self.b_index].gpu
        why = (
            f"pages that {a.name!r}'s control file still lists stay {a.name!r}'s until it can be written"
            if any(v.gpu == gpu for v in a.held)
            else "another allocation took the pages it counted on"
        )
        return errors.RestoreRefused(
            f"swap of job {b.name!r} in for {a.name!r} ran out of pages on gpu {gpu} ({why}); {b.name!r} stays "
            "parked, whole: restore it again once memory is free there"
        )

    def _stopped(self, exc: BaseException) -> BaseException:
        """The error of a restore that the park's failure stopped: its parked copy, only read, is whole."""
        if not isinstance(exc, Exception) or isinstance(exc, (_Aborted, errors.StateIntact)):
            return exc  # an abandoned swap keeps the rules of an abandoned restore (``_reraise``)
        refused = errors.RestoreRefused(
            f"swap of job {self.b.name!r} in for {self.a.name!r} stopped when the park failed ({exc}); "
            f"{self.b.name!r} stays parked, whole: restore it again"
        )
        refused.__cause__ = exc
        return refused

    def b_records_gpu(self, region: int) -> int:
        return next(r.gpu for r in self.b_records if r.region == region)
