"""On-disk layout of the simulated GPU backend, shared by the daemon and its clients.

A sim root holds three kinds of files, all on a memory file system so that
they outlive any one process:

``gpu<N>.arena``
    The memory of simulated device N: ``capacity`` bytes cut into fixed-size
    pages. The daemon and every client map it shared, so a client's writes
    are real bytes that the daemon can copy out when it parks the job.

``jobs/<jobkey>.ctl``
    One control file per job, written only by the daemon and mapped
    read-only by clients. It says whether the job is on the device and where
    each of its regions lives (a run-length list of arena pages, like GPU
    virtual memory). Clients check it before and after every access.

``parked/<jobkey>/<region>.bin``
    The host copy of a parked region.

Control file format (little endian)::

    header, 96 bytes at offset 0:
        magic "TSSIMCTL" | gen u64 | version u32 | gpus u32 | capacity u64
        page_size u64 | name_len u32 | reserved u32
        slot 0: offset u64, capacity u64, length u64
        slot 1: offset u64, capacity u64, length u64
    the job name (UTF-8), then the two slot areas.

    slot: state u32 | nregions u32 | epoch u64 | next_region u64
          nregions entries (sorted by region id):
              region u64 | gpu u32 | nextents u32 | nbytes u64 | first_extent u64
          extents: first_page u32 | npages u32

``gen`` is a seqlock generation: odd while the daemon is changing the file.
The committed slot is ``(gen >> 1) & 1``; the daemon writes the other slot and
then flips ``gen`` with one aligned 8-byte store. A daemon killed mid-update
therefore leaves the previous table intact, and a reader that sees the same
even ``gen`` before and after its read saw a consistent table. ``epoch``
changes whenever the job's state changes, so a client can tell "the table
changed" (say, a sibling region was allocated) from "my region moved".
"""

from __future__ import annotations

import bisect
import hashlib
import mmap
import os
import re
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from timesliced import errors

MAGIC = b"TSSIMCTL"
VERSION = 1

# Job states as stored in a control file.
RESIDENT = 0
PARKED = 1
FAULTED = 2
PARKING = 3  # being copied to host memory; the device copy is still the valid one
RECLAIMED = 4  # forgotten by the daemon; the file is about to be unlinked

STATE_NAMES = {RESIDENT: "resident", PARKED: "parked", FAULTED: "faulted", PARKING: "parking", RECLAIMED: "reclaimed"}

HEADER = struct.Struct("<8sQIIQQII6Q")
GEN = struct.Struct("<Q")
GEN_OFFSET = 8
SLOT_DESC = struct.Struct("<QQQ")
SLOT_DESC_OFFSETS = (48, 72)
SLOT_HEAD = struct.Struct("<IIQQ")
ENTRY = struct.Struct("<QIIQQ")
REGION_ID = struct.Struct("<Q")
EXTENT = struct.Struct("<II")

Extent = tuple[int, int]  # (first page, number of pages)


# --- paths ---------------------------------------------------------------------------

_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def job_key(job: str) -> str:
    """A file-name-safe, collision-resistant key for any job name."""
    raw = job.encode("utf-8", "surrogatepass")
    readable = _UNSAFE.sub("_", job)[:48].lstrip(".") or "job"
    return f"{readable}-{hashlib.sha1(raw).hexdigest()[:12]}"


def arena_path(root: Path, gpu: int) -> Path:
    return root / f"gpu{gpu}.arena"


def ctl_path(root: Path, job: str) -> Path:
    return root / "jobs" / f"{job_key(job)}.ctl"


def parked_dir(root: Path, job: str) -> Path:
    return root / "parked" / job_key(job)


# --- what the daemon sends a client --------------------------------------------------


@dataclass(frozen=True)
class RegionInfo:
    """Everything a client needs to map one region; ``nbytes`` is the requested size."""

    region: int
    gpu: int
    nbytes: int
    ctl_path: str
    arena_path: str
    page_size: int

    def to_wire(self) -> dict[str, Any]:
        return {
            "region": self.region,
            "gpu": self.gpu,
            "nbytes": self.nbytes,
            "ctl_path": self.ctl_path,
            "arena_path": self.arena_path,
            "page_size": self.page_size,
        }

    @classmethod
    def from_wire(cls, d: Any) -> RegionInfo:
        if not isinstance(d, dict):
            raise errors.ProtocolError(f"malformed region info: {d!r}")
        ints = ("region", "gpu", "nbytes", "page_size")
        strs = ("ctl_path", "arena_path")
        for key in ints:
            if not isinstance(d.get(key), int) or isinstance(d.get(key), bool):
                raise errors.ProtocolError(f"malformed region info: {key!r} must be an integer")
        for key in strs:
            if not isinstance(d.get(key), str):
                raise errors.ProtocolError(f"malformed region info: {key!r} must be a string")
        return cls(d["region"], d["gpu"], d["nbytes"], d["ctl_path"], d["arena_path"], d["page_size"])


# --- control file records ------------------------------------------------------------


@dataclass(frozen=True)
class RegionRecord:
    """One row of the region table; ``extents`` is empty while the job is not on the device."""

    region: int
    gpu: int
    nbytes: int
    extents: tuple[Extent, ...]


@dataclass(frozen=True)
class SlotData:
    """One complete version of a job's table."""

    state: int
    epoch: int
    next_region: int
    regions: tuple[RegionRecord, ...]


@dataclass(frozen=True)
class CtlHeader:
    gen: int
    gpus: int
    capacity: int
    page_size: int
    job: str
    slots: tuple[tuple[int, int, int], tuple[int, int, int]]  # (offset, capacity, length)

    @property
    def committed(self) -> int:
        return (self.gen >> 1) & 1


def encode_slot(slot: SlotData) -> bytes:
    parts = [SLOT_HEAD.pack(slot.state, len(slot.regions), slot.epoch, slot.next_region)]
    first = 0
    for r in slot.regions:
        parts.append(ENTRY.pack(r.region, r.gpu, len(r.extents), r.nbytes, first))
        first += len(r.extents)
    for r in slot.regions:
        parts.extend(EXTENT.pack(p, n) for p, n in r.extents)
    return b"".join(parts)


def decode_slot(buf: bytes, off: int, length: int) -> SlotData:
    """Parse a whole slot; raises ValueError or struct.error on malformed bytes."""
    end = off + length
    if length < SLOT_HEAD.size or end > len(buf):
        raise ValueError("slot outside the file")
    state, nregions, epoch, next_region = SLOT_HEAD.unpack_from(buf, off)
    ext_base = off + SLOT_HEAD.size + nregions * ENTRY.size
    if ext_base > end:
        raise ValueError("region table outside its slot")
    regions = []
    for i in range(nregions):
        region, gpu, nextents, nbytes, first = ENTRY.unpack_from(buf, off + SLOT_HEAD.size + i * ENTRY.size)
        regions.append(RegionRecord(region, gpu, nbytes, _extents(buf, ext_base, first, nextents, end)))
    return SlotData(state, epoch, next_region, tuple(regions))


def _extents(buf: Any, ext_base: int, first: int, count: int, end: int) -> tuple[Extent, ...]:
    lo = ext_base + first * EXTENT.size
    hi = lo + count * EXTENT.size
    if hi > end:
        raise ValueError("extent list outside its slot")
    return tuple(EXTENT.iter_unpack(buf[lo:hi]))


def decode_header(buf: bytes | mmap.mmap) -> CtlHeader:
    if len(buf) < HEADER.size:
        raise ValueError("file too short for a control header")
    magic, gen, version, gpus, capacity, page_size, name_len, _, *desc = HEADER.unpack_from(buf, 0)
    if magic != MAGIC:
        raise ValueError("not a timesliced sim control file")
    if version != VERSION:
        raise ValueError(f"control file version {version}, this code reads version {VERSION}")
    name = bytes(buf[HEADER.size : HEADER.size + name_len]).decode("utf-8", "surrogatepass")
    slots = ((desc[0], desc[1], desc[2]), (desc[3], desc[4], desc[5]))
    return CtlHeader(gen, gpus, capacity, page_size, name, slots)


def read_ctl(path: Path) -> tuple[CtlHeader, SlotData, int]:
    """The header, committed table and size of a control file (daemon start-up)."""
    data = path.read_bytes()
    header = decode_header(data)
    off, _, length = header.slots[header.committed]
    return header, decode_slot(data, off, length), len(data)


def _slot_capacity(nbytes: int) -> int:
    return max(4096, 1 << (2 * nbytes - 1).bit_length())


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


class CtlWriter:
    """The daemon's handle on one control file: it alone writes it, one whole table at a time."""

    def __init__(self, path: Path, gen: int, slots: list[tuple[int, int, int]], size: int) -> None:
        self.path = path
        self._gen = gen
        self._slots = slots
        self._size = size

    @classmethod
    def create(cls, path: Path, job: str, *, gpus: int, capacity: int, page_size: int, slot: SlotData) -> CtlWriter:
        """Write a new control file atomically (temp file, then rename) so no reader sees half of it."""
        name = job.encode("utf-8", "surrogatepass")
        body = encode_slot(slot)
        start = -(-(HEADER.size + len(name)) // 64) * 64
        cap = _slot_capacity(len(body))
        slots = [(start, cap, len(body)), (0, 0, 0)]
        header = HEADER.pack(MAGIC, 0, VERSION, gpus, capacity, page_size, len(name), 0, *slots[0], *slots[1])
        tmp = path.with_name(path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, start + cap)
            _pwrite_all(fd, header + name, 0)
            _pwrite_all(fd, body, start)
        finally:
            os.close(fd)
        os.rename(tmp, path)
        return cls(path, 0, slots, start + cap)

    @classmethod
    def adopt(cls, path: Path, header: CtlHeader, size: int) -> CtlWriter:
        return cls(path, header.gen, list(header.slots), size)

    def commit(self, slot: SlotData) -> None:
        """Publish a new table: write the idle slot, then flip ``gen`` to make it the committed one."""
        body = encode_slot(slot)
        gen = self._gen
        target = 1 - ((gen >> 1) & 1)
        fd = os.open(self.path, os.O_RDWR)
        try:
            if gen % 2 == 0:
                gen += 1
                _pwrite_all(fd, GEN.pack(gen), GEN_OFFSET)
                self._gen = gen
            off, cap, _ = self._slots[target]
            if len(body) > cap:
                off, cap = self._size, _slot_capacity(len(body))
                os.ftruncate(fd, off + cap)  # grow only: clients may have the tail mapped
                self._size = off + cap
            _pwrite_all(fd, body, off)
            _pwrite_all(fd, SLOT_DESC.pack(off, cap, len(body)), SLOT_DESC_OFFSETS[target])
            self._slots[target] = (off, cap, len(body))
            _pwrite_all(fd, GEN.pack(gen + 1), GEN_OFFSET)
            self._gen = gen + 1
        finally:
            os.close(fd)


# --- client side ---------------------------------------------------------------------

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
        extents = _extents(mm, ext_base, first, nextents, off + length)
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
