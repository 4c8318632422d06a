"""Parked-file buffers of the simulated GPU, and the pool that keeps them warm between parks.

A park copies device pages into a host file on the tmpfs. Into a file whose pages the kernel must
allocate as it goes, that runs at a fraction of the machine's copy ceiling (``timesliced bench copy``:
about 3.5 GB/s through ``write(2)`` on a 2-core machine against a warm copy's 11); into pages that are
allocated *and* mapped in this process already it runs at the ceiling. So the backend keeps the files
of restored jobs, mapped, as a pool (``BufferPool``) and the next park writes into one of them: the
host memory that held one job's parked state is reused, warm, for the next job's, instead of being
given back to the kernel and allocated again.

Facts this relies on:

- ``madvise(2)`` ``MADV_POPULATE_WRITE`` (Linux 5.14): "Populate (prefault) page tables writable,
  faulting-in all pages in the range just as if manually writing to each page"; it fails with
  ``EINVAL`` on older kernels, and then the copy itself faults the pages in.
- tmpfs's ``fallocate`` allocates pages without zeroing them; the first touch zeroes them. A pool
  buffer's pages were written by the park that made the file, so populating them only maps them.
- ``ctypes.memmove`` is a ``CFUNCTYPE`` function: a foreign call that releases the GIL (the ctypes
  documentation of ``CFUNCTYPE``), so the two directions of a swap copy on two cores at once.
- ``mmap.resize`` on Linux truncates the file and ``mremap``s the mapping (CPython's ``mmap``
  module), so a buffer bigger than a region is cut to the region's exact size and the tail pages go
  back to the kernel.

A pool file lives in ``<root>/pool``, or where a restore left it: at its place in the restored job's
parked folder (``keep``), so that the job's next park, which writes the same regions as a rule, takes
it there without a rename (a ``rename(2)`` between folders cost a 1 MiB swap some 10-20 us of its
170 at 6 GB/s). A park renames any other one into its job's parked folder (``rename(2)`` within one
file system is atomic). A file is the pool's or a job's, never both: a resident job's parked folder
holds only the pool's files, which a daemon that starts deletes with the folder (start-up removes the
parked folders of resident jobs), as it deletes what an earlier one left in ``<root>/pool``. The pool
holds no state.

Whatever names a file (a rename, an unlink) happens under the pool's lock: a park that finds no
buffer for a path creates a new file there, which must never be a file the pool is still moving or
deleting.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import threading
import uuid
from pathlib import Path

from timesliced.wire import status as schema

MADV_POPULATE_WRITE = 23  # <asm-generic/mman-common.h>; Python 3.11's mmap module has no name for it
_can_populate = True


def populate(m: mmap.mmap, start: int = 0, length: int | None = None) -> None:
    """Map ``m``'s pages in ``[start, start + length)`` writable now, so a copy into them takes no fault."""
    global _can_populate
    if not _can_populate:
        return
    try:
        m.madvise(MADV_POPULATE_WRITE, start, len(m) - start if length is None else length)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        _can_populate = False  # a kernel before 5.14: the copy faults the pages in as it goes


class Buffer:
    """One parked file on the tmpfs, mapped shared and writable in this process, its pages populated.

    ``address`` is where its bytes start in memory, for ``ctypes.memmove``; it stays valid until
    ``close``. Raises ``OSError`` from ``open`` when the file cannot be mapped.
    """

    def __init__(self, path: str | Path, m: mmap.mmap) -> None:
        # A string: a move compares and renames paths, and ``pathlib`` costs it microseconds per path.
        self.name = os.fspath(path)
        self._map = m
        self._anchor: ctypes.c_char | None = ctypes.c_char.from_buffer(m)  # pins the mapping while in use
        self.address = ctypes.addressof(self._anchor)

    @property
    def path(self) -> Path:
        return Path(self.name)

    @classmethod
    def open(cls, path: str | Path) -> Buffer:
        """Map a complete parked file (its size is the region's) and populate its page tables."""
        fd = os.open(path, os.O_RDWR)
        try:
            m = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        try:
            populate(m)
        except OSError:
            m.close()
            raise
        return cls(path, m)

    @property
    def size(self) -> int:
        return len(self._map)

    def rename(self, path: str | Path) -> None:
        os.rename(self.name, path)
        self.name = os.fspath(path)

    def cut(self, size: int) -> None:
        """Make the file (and the mapping) exactly ``size`` bytes, ``size`` at most its size."""
        if size == self.size:
            return
        self._anchor = None
        self._map.resize(size)
        self._anchor = ctypes.c_char.from_buffer(self._map)
        self.address = ctypes.addressof(self._anchor)

    def close(self) -> None:
        """Unmap; the file stays (its pages are the file's until it is deleted)."""
        self._anchor = None
        self.address = 0
        if not self._map.closed:
            self._map.close()


class BufferPool:
    """Warm parked-file buffers of restored jobs, kept for the next parks: at most ``limit`` bytes.

    Thread-safe: moves run in worker threads. ``limit`` 0 keeps nothing (every buffer given back is
    deleted). The bytes held count as room for parked state (``HostMemory``'s ``pooled``): a park
    takes them instead of new pages, and ``drop`` gives them all back to the kernel when a tmpfs
    that is full needs them for something else.
    """

    def __init__(self, folder: Path, limit: int) -> None:
        if limit < 0:
            raise ValueError(f"the pool limit must be >= 0 bytes (0: no pool), not {limit}")
        self.folder = folder
        self.limit = limit
        self._lock = threading.Lock()
        self._free: list[Buffer] = []  # oldest first
        self.bytes = 0
        self.taken = 0  # parks that wrote into a pool buffer (counters for status and bench)
        self.missed = 0  # parks that found none big enough
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)

    def clear_strays(self) -> None:
        """Delete what an earlier daemon left in the folder (nobody's state); only the root's owner calls it."""
        for stray in self.folder.iterdir():
            stray.unlink(missing_ok=True)

    def take(self, size: int, path: str | Path) -> Buffer | None:
        """A buffer of at least ``size`` bytes, cut to ``size`` and at ``path``; None if none.

        The one kept at ``path`` (``keep``) if it is big enough, else the smallest that is, renamed
        to ``path``. A buffer kept at ``path`` that is too small is deleted: the file there is the
        park's now. None also gives back at least ``size`` bytes of buffers (oldest first; all, if
        fewer): the caller then writes a new file of ``size`` bytes at ``path``, in the room they leave.

        The buffer leaves the pool before the rename, so a crash in between leaves at most a stray
        file in the job's parked folder, which start-up removes as nobody's.
        """
        evicted: list[Buffer] = []
        path = os.fspath(path)
        try:
            with self._lock:
                buf = self._choose(size, path, evicted)
                if buf is None:
                    return None
                self.taken += 1
                if buf.name != path:
                    try:
                        buf.rename(path)
                    except BaseException:
                        self._unlink(buf)
                        evicted.append(buf)
                        raise
        finally:
            for old in evicted:
                old.close()
        try:
            buf.cut(size)
        except BaseException:
            self._delete(buf)
            raise
        return buf

    def _choose(self, size: int, path: str, evicted: list[Buffer]) -> Buffer | None:
        """``take``'s buffer, out of the pool, or None (under the lock); what it deletes goes to ``evicted``."""
        here = next((b for b in self._free if b.name == path), None)
        if here is not None:
            self._free.remove(here)
            self.bytes -= here.size
            if here.size >= size:
                return here
            self._unlink(here)  # the file at ``path`` is the park's now
            evicted.append(here)
        fits = [b for b in self._free if b.size >= size]
        if fits:
            buf = min(fits, key=lambda b: b.size)
            self._free.remove(buf)
            self.bytes -= buf.size
            return buf
        # The park takes new pages: give back as much first, so that the pool and the parked state
        # together never hold more than admission counted (the pool is room to it).
        self.missed += 1
        freed = 0
        while self._free and freed < size:
            old = self._free.pop(0)
            self.bytes -= old.size
            freed += old.size
            self._unlink(old)
            evicted.append(old)
        return None

    def give(self, buf: Buffer) -> None:
        """Keep ``buf`` (a file nobody needs) for a later park in the pool's folder, or delete it past the limit.

        The oldest buffers go first to make room: they are the least likely to match the next park.
        """
        self._add(buf, rename=True)

    def keep(self, buf: Buffer) -> None:
        """Keep ``buf``, a restored region's parked file, where it is (the job's next park takes it there).

        Past the limit it is deleted, or the oldest buffers are, as ``give`` does.
        """
        self._add(buf, rename=False)

    def forget(self, folder: Path, path: Path | None = None) -> None:
        """Delete the buffers kept in ``folder`` (only the one at ``path``, if given): a job or region is gone."""
        with self._lock:
            gone = [b for b in self._free if b.path.parent == folder and path in (None, b.path)]  # rare: ``Path``
            for buf in gone:
                self._free.remove(buf)
                self.bytes -= buf.size
                self._unlink(buf)
        for buf in gone:
            buf.close()

    def _add(self, buf: Buffer, *, rename: bool) -> None:
        evicted: list[Buffer] = []
        with self._lock:
            try:
                if buf.size > self.limit:
                    raise OSError(errno.EFBIG, "bigger than the pool")
                if rename:
                    buf.rename(self.folder / f"{uuid.uuid4().hex}.bin")
            except OSError:
                self._unlink(buf)
                evicted.append(buf)
            else:
                self._free.append(buf)
                self.bytes += buf.size
                while self.bytes > self.limit:
                    old = self._free.pop(0)
                    self.bytes -= old.size
                    self._unlink(old)
                    evicted.append(old)
        for old in evicted:
            old.close()

    def drop(self) -> int:
        """Delete every buffer (their pages go back to the kernel); returns the bytes freed."""
        with self._lock:
            gone, self._free, freed, self.bytes = self._free, [], self.bytes, 0
            for buf in gone:
                self._unlink(buf)
        for buf in gone:
            buf.close()
        return freed

    def describe(self) -> schema.SimPool:
        with self._lock:
            return {"held": self.bytes, "limit": self.limit, "taken": self.taken, "missed": self.missed}

    def close(self) -> None:
        self.drop()

    def _delete(self, buf: Buffer) -> None:
        with self._lock:
            self._unlink(buf)
        buf.close()

    @staticmethod
    def _unlink(buf: Buffer) -> None:
        """Remove the buffer's file (under the lock: nothing else names a file there meanwhile); unmap it after."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(buf.name)
