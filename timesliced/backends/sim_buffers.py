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

Every pool file lives in ``<root>/pool``; a park renames one into the job's parked folder (``rename(2)``
within one file system is atomic), so a file is the pool's or a job's, never both. The pool holds no
state: a daemon that starts deletes what an earlier one left there.
"""

from __future__ import annotations

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

    def __init__(self, path: Path, m: mmap.mmap) -> None:
        self.path = path
        self._map = m
        self._anchor: ctypes.c_char | None = ctypes.c_char.from_buffer(m)  # pins the mapping while in use
        self.address = ctypes.addressof(self._anchor)

    @classmethod
    def open(cls, path: Path) -> Buffer:
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

    def rename(self, path: Path) -> None:
        os.rename(self.path, path)
        self.path = path

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

    def take(self, size: int, path: Path) -> Buffer | None:
        """The smallest buffer of at least ``size`` bytes, cut to ``size`` and renamed to ``path``; None if none.

        None also gives back at least ``size`` bytes of buffers (oldest first; all, if fewer): the
        caller then writes a new file of ``size`` bytes in the room they leave.

        The buffer leaves the pool before the rename, so a crash in between leaves at most a stray
        file in the job's parked folder, which start-up removes as nobody's.
        """
        evicted: list[Buffer] = []
        with self._lock:
            fits = [b for b in self._free if b.size >= size]
            if not fits:
                # The park takes new pages: give back as much first, so that the pool and the parked
                # state together never hold more than admission counted (the pool is room to it).
                self.missed += 1
                freed = 0
                while self._free and freed < size:
                    old = self._free.pop(0)
                    self.bytes -= old.size
                    freed += old.size
                    evicted.append(old)
            else:
                buf = min(fits, key=lambda b: b.size)
                self._free.remove(buf)
                self.bytes -= buf.size
                self.taken += 1
        if not fits:
            for old in evicted:
                self._delete(old)
            return None
        try:
            buf.rename(path)
            buf.cut(size)
        except BaseException:
            self._delete(buf)
            raise
        return buf

    def give(self, buf: Buffer) -> None:
        """Keep ``buf`` (a restored region's file) for a later park, or delete it when it does not fit the limit.

        The oldest buffers go first to make room: they are the least likely to match the next park.
        """
        if buf.size > self.limit:
            self._delete(buf)
            return
        try:
            buf.rename(self.folder / f"{uuid.uuid4().hex}.bin")
        except OSError:
            self._delete(buf)
            return
        with self._lock:
            self._free.append(buf)
            self.bytes += buf.size
            evicted = []
            while self.bytes > self.limit:
                old = self._free.pop(0)
                self.bytes -= old.size
                evicted.append(old)
        for old in evicted:
            self._delete(old)

    def drop(self) -> int:
        """Delete every buffer (their pages go back to the kernel); returns the bytes freed."""
        with self._lock:
            gone, self._free, freed, self.bytes = self._free, [], self.bytes, 0
        for buf in gone:
            self._delete(buf)
        return freed

    def describe(self) -> schema.SimPool:
        with self._lock:
            return {"held": self.bytes, "limit": self.limit, "taken": self.taken, "missed": self.missed}

    def close(self) -> None:
        self.drop()

    @staticmethod
    def _delete(buf: Buffer) -> None:
        buf.close()
        buf.path.unlink(missing_ok=True)
