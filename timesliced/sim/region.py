"""A client's simulated device memory: regions mapped from the arena, checked against the control file.

Each access reads the job's control file (``layout``) under its seqlock to find where the region's
pages are, copies, and checks that nothing moved meanwhile; while the job is parked it raises
``NotResident`` (or waits, for a preempted job, see ``SimRegion.hold``).
"""

from __future__ import annotations

import bisect
import hashlib
import mmap
import os
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

from .. import errors
from .layout import (
    ENTRY,
    FAULTED,
    GEN,
    GEN_OFFSET,
    PARKING,
    RECLAIMED,
    REGION_ID,
    RESIDENT,
    SLOT_DESC,
    SLOT_DESC_OFFSETS,
    SLOT_HEAD,
    RegionInfo,
    decode_header,
    read_extents,
)

_SEQLOCK_PATIENCE = 5.0  # seconds a client waits for a half-written table before giving up
_FILL_CHUNK = 1 << 20


class _Mapping:
    """One shared mapping of a file, reused by every region of this process that needs it."""

    def __init__(self, path: str, key: tuple[str, int, int, bool], writable: bool) -> None:
        self.key = key
        self.refs = 0
        self._fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
        self._prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        self.mm = mmap.mmap(self._fd, 0, mmap.MAP_SHARED, self._prot)
        self.view = memoryview(self.mm)
        self._retired: list[tuple[mmap.mmap, memoryview]] = []

    def cover(self, end: int) -> None:
        """Remap if the file grew past the current mapping (control files only grow)."""
        if end <= len(self.mm):
            return
        size = os.fstat(self._fd).st_size
        if end > size:
            raise ValueError("control table points past the end of its file")
        # Another thread may still be reading the old mapping: retire it rather than unmap it under them.
        self._retired.append((self.mm, self.view))
        self.mm = mmap.mmap(self._fd, size, mmap.MAP_SHARED, self._prot)
        self.view = memoryview(self.mm)

    def close(self) -> None:
        for mm, view in [*self._retired, (self.mm, self.view)]:
            _release(mm, view)
        os.close(self._fd)


def _release(mm: mmap.mmap, view: memoryview) -> None:
    try:
        view.release()
        mm.close()
    except BufferError:
        pass  # a slice still points in (another thread mid-copy); it unmaps when the last one goes


_maps: dict[tuple[str, int, int, bool], _Mapping] = {}
_maps_lock = threading.Lock()


def _acquire(path: str, writable: bool) -> _Mapping:
    st = os.stat(path)
    key = (path, st.st_dev, st.st_ino, writable)  # a re-created file is a new mapping
    with _maps_lock:
        m = _maps.get(key)
        if m is None:
            m = _maps[key] = _Mapping(path, key, writable)
        m.refs += 1
        return m


def _drop(m: _Mapping) -> None:
    with _maps_lock:
        m.refs -= 1
        if m.refs == 0:
            del _maps[m.key]
            m.close()


def _gen(mm: mmap.mmap) -> int:
    return int(GEN.unpack_from(mm, GEN_OFFSET)[0])


class _Torn(Exception):
    """The table changed under a reader."""


@dataclass(frozen=True)
class _Placement:
    """Where a region's bytes are in the arena, valid for one ``gen`` of the control file."""

    gen: int
    epoch: int
    starts: list[int]  # region offset where each extent begins
    arena_offsets: list[int]
    lengths: list[int]


class SimRegion:
    """A client's handle on one device region (mapped from the RegionInfo the daemon sent)."""

    def __init__(self, info: RegionInfo, job: str, arena: _Mapping, ctl: _Mapping) -> None:
        self.region = info.region
        self.gpu = info.gpu
        self.nbytes = info.nbytes
        self._page_size = info.page_size
        self._arena: _Mapping | None = arena
        self._ctl: _Mapping | None = ctl
        self._placement: _Placement | None = None
        self._job = job
        # While this returns True (its job was preempted and waits to be granted again), an
        # access to the parked region waits for the region to be back instead of raising.
        self.hold: Callable[[], bool] | None = None

    @classmethod
    def open(cls, info: RegionInfo) -> SimRegion:
        """Map the region's arena read-write and its job's control file read-only."""
        try:
            ctl = _acquire(info.ctl_path, writable=False)
        except FileNotFoundError:
            raise errors.UnknownRegion(f"region {info.region} is gone: its job was reclaimed") from None
        try:
            header = decode_header(ctl.mm)
            if header.page_size != info.page_size or not 0 <= info.gpu < header.gpus:
                raise ValueError(f"region info {info} does not match control file {info.ctl_path}")
            arena = _acquire(info.arena_path, writable=True)
        except BaseException:
            _drop(ctl)
            raise
        return cls(info, header.job, arena, ctl)

    def __enter__(self) -> SimRegion:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for m in (self._arena, self._ctl):
            if m is not None:
                _drop(m)
        self._arena = self._ctl = None

    # --- data access -----------------------------------------------------------------

    def write(self, data: bytes | bytearray | memoryview, offset: int = 0) -> None:
        src = memoryview(data).cast("B")
        self._check_range(offset, len(src))
        arena, place = self._begin()
        for a, x, n in self._pieces(place, offset, len(src)):
            arena.view[a : a + n] = src[x : x + n]
        self._end(place)

    def read(self, nbytes: int | None = None, offset: int = 0) -> bytes:
        n = self.nbytes - offset if nbytes is None else nbytes
        self._check_range(offset, n)
        arena, place = self._begin()
        out = b"".join([arena.view[a : a + k] for a, _, k in self._pieces(place, offset, n)])
        self._end(place)
        return out

    def readinto(self, buf: bytearray | memoryview, offset: int = 0) -> int:
        """Fill ``buf`` from the region starting at ``offset`` without an intermediate copy."""
        dst = memoryview(buf).cast("B")
        self._check_range(offset, len(dst))
        arena, place = self._begin()
        for a, x, n in self._pieces(place, offset, len(dst)):
            dst[x : x + n] = arena.view[a : a + n]
        self._end(place)
        return len(dst)

    def fill(self, pattern: bytes) -> None:
        """Repeat ``pattern`` over the whole region, so byte i is ``pattern[i % len(pattern)]``."""
        p = bytes(pattern)
        if not p:
            raise ValueError("fill pattern must not be empty")
        reps = max(1, _FILL_CHUNK // len(p))
        span = reps * len(p)
        tile = memoryview(p * (reps + 1))  # any phase of the pattern followed by `span` bytes
        arena, place = self._begin()
        for a, x, n in self._pieces(place, 0, self.nbytes):
            done = 0
            while done < n:
                phase = (x + done) % len(p)
                k = min(n - done, span)
                arena.view[a + done : a + done + k] = tile[phase : phase + k]
                done += k
        self._end(place)

    def checksum(self) -> str:
        """blake2b (16-byte digest) of the region's bytes, in hex."""
        h = hashlib.blake2b(digest_size=16)
        arena, place = self._begin()
        for a, _, n in self._pieces(place, 0, self.nbytes):
            h.update(arena.view[a : a + n])
        self._end(place)
        return h.hexdigest()

    # --- residency checks ------------------------------------------------------------

    def _check_range(self, offset: int, n: int) -> None:
        if offset < 0 or n < 0 or offset + n > self.nbytes:
            raise ValueError(f"range [{offset}, {offset + n}) is outside region {self.region} of {self.nbytes} bytes")

    def _mappings(self) -> tuple[_Mapping, _Mapping]:
        if self._arena is None or self._ctl is None:
            raise ValueError(f"region {self.region} is closed")
        return self._arena, self._ctl

    def _begin(self) -> tuple[_Mapping, _Placement]:
        """Where the region is now; raises unless the job is resident (or held: see ``hold``)."""
        delay = 0.0005
        while True:
            try:
                return self._begin_once()
            except errors.NotResident:
                if self.hold is None or not self.hold():
                    raise
            time.sleep(delay)
            delay = min(2 * delay, 0.02)

    def _begin_once(self) -> tuple[_Mapping, _Placement]:
        arena, ctl = self._mappings()
        gen = _gen(ctl.mm)
        place = self._placement
        if place is not None and place.gen == gen:
            return arena, place
        deadline = time.monotonic() + _SEQLOCK_PATIENCE
        while True:
            if gen % 2 == 0:
                try:
                    place = self._lookup(ctl, gen)
                except (_Torn, ValueError, struct.error):
                    place = None
                if _gen(ctl.mm) == gen:
                    if place is None:
                        raise errors.BackendError(f"control file {ctl.key[0]} is corrupt")
                    self._placement = place
                    return arena, place
            if time.monotonic() > deadline:
                raise errors.BackendError(f"control file of job {self._job!r} stayed mid-update; is the daemon alive?")
            time.sleep(0.0001)
            gen = _gen(ctl.mm)

    def _end(self, before: _Placement) -> None:
        """After an access: fail it if the job left the device (or moved) while it ran."""
        _, ctl = self._mappings()
        if _gen(ctl.mm) == before.gen:
            return
        _, now = self._begin_once()
        if now.epoch != before.epoch:
            raise errors.NotResident(
                f"region {self.region} of job {self._job!r} was moved while being accessed; "
                "acquire the lock before touching device memory",
                job=self._job,
                region=self.region,
            )

    def _lookup(self, ctl: _Mapping, gen: int) -> _Placement:
        off, _, length = SLOT_DESC.unpack_from(ctl.mm, SLOT_DESC_OFFSETS[(gen >> 1) & 1])
        ctl.cover(off + length)
        mm = ctl.mm
        if length < SLOT_HEAD.size:
            raise _Torn
        state, nregions, epoch, _ = SLOT_HEAD.unpack_from(mm, off)
        entries = off + SLOT_HEAD.size
        ext_base = entries + nregions * ENTRY.size
        if ext_base > off + length:
            raise _Torn
        lo, hi = 0, nregions
        while lo < hi:  # entries are sorted by region id
            mid = (lo + hi) // 2
            if REGION_ID.unpack_from(mm, entries + mid * ENTRY.size)[0] < self.region:
                lo = mid + 1
            else:
                hi = mid
        entry = ENTRY.unpack_from(mm, entries + lo * ENTRY.size) if lo < nregions else None
        if entry is None or entry[0] != self.region:
            self._raise_missing(state, gen)
        self._raise_unless_resident(state, gen)
        _, gpu, nextents, nbytes, first = entry
        extents = read_extents(mm, ext_base, first, nextents, off + length)
        if gpu != self.gpu or nbytes != self.nbytes or sum(n for _, n in extents) * self._page_size < nbytes:
            raise _Torn
        starts, offsets, lengths, pos = [], [], [], 0
        for page, count in extents:
            starts.append(pos)
            offsets.append(page * self._page_size)
            lengths.append(count * self._page_size)
            pos += count * self._page_size
        return _Placement(gen, epoch, starts, offsets, lengths)

    def _confirmed(self, gen: int) -> bool:
        assert self._ctl is not None
        return _gen(self._ctl.mm) == gen

    def _raise_missing(self, state: int, gen: int) -> NoReturn:
        if not self._confirmed(gen):
            raise _Torn
        why = "the job was reclaimed" if state == RECLAIMED else "it was freed"
        raise errors.UnknownRegion(
            f"job {self._job!r} has no region {self.region} ({why})", job=self._job, region=self.region
        )

    def _raise_unless_resident(self, state: int, gen: int) -> None:
        if state == RESIDENT:
            return
        if not self._confirmed(gen):
            raise _Torn
        where = f"region {self.region} of job {self._job!r}"
        if state == FAULTED:
            raise errors.JobFaulted(f"{where} is lost: the job is faulted", job=self._job, region=self.region)
        doing = "is being parked to" if state == PARKING else "is parked in"
        raise errors.NotResident(
            f"{where} {doing} host memory; acquire the lock before touching device memory",
            job=self._job,
            region=self.region,
        )

    @staticmethod
    def _pieces(place: _Placement, offset: int, n: int) -> list[tuple[int, int, int]]:
        """(arena offset, offset into the caller's buffer, length) for region bytes [offset, offset+n)."""
        out = []
        i = bisect.bisect_right(place.starts, offset) - 1
        pos, end = offset, offset + n
        while pos < end:
            start = place.starts[i]
            take = min(end, start + place.lengths[i]) - pos
            out.append((place.arena_offsets[i] + pos - start, pos - offset, take))
            pos += take
            i += 1
        return out
