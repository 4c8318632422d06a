"""On-disk layout of the simulated GPU, shared by the daemon (which writes it) and its clients (which map it).

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

import errno
import hashlib
import mmap
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import errors

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


LOCK_NAME = "daemon.lock"  # the daemon's flock on its root: one daemon per root, released when its process dies
POOL_NAME = "pool"  # the folder of warm parked-file buffers no job holds (``backends/sim_buffers.py``)


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
        regions.append(RegionRecord(region, gpu, nbytes, read_extents(buf, ext_base, first, nextents, end)))
    return SlotData(state, epoch, next_region, tuple(regions))


def read_extents(buf: Any, ext_base: int, first: int, count: int, end: int) -> tuple[Extent, ...]:
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
    n = os.pwrite(fd, data, offset)  # the whole of it, as a rule: the loop is for a write cut short
    if n == len(data):
        return
    view = memoryview(data)[n:]
    offset += n
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


class CtlWriter:
    """The daemon's handle on one control file: it alone writes it, one whole table at a time.

    It keeps the file open from its creation (or adoption) to ``close``: a commit is then three or
    four ``pwrite`` calls and no ``open`` or ``close``, which a 1 MiB move, some 170 us at 6 GB/s,
    takes two or three of. Raises ``OSError`` from ``create``, ``adopt`` and ``commit``.
    """

    def __init__(self, path: Path, fd: int, gen: int, slots: list[tuple[int, int, int]], size: int) -> None:
        self.path = path
        self._fd = fd
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
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, start + cap)
            _pwrite_all(fd, header + name, 0)
            _pwrite_all(fd, body, start)
            os.rename(tmp, path)  # the descriptor follows the file to its name
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, 0, slots, start + cap)

    @classmethod
    def adopt(cls, path: Path, header: CtlHeader, size: int) -> CtlWriter:
        return cls(path, os.open(path, os.O_RDWR), header.gen, list(header.slots), size)

    def commit(self, slot: SlotData) -> None:
        """Publish a new table: write the idle slot, then flip ``gen`` to make it the committed one."""
        body = encode_slot(slot)
        gen = self._gen
        target = 1 - ((gen >> 1) & 1)
        fd = self._fd
        if fd < 0:
            raise OSError(errno.EBADF, f"the writer of {self.path} is closed")
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

    def close(self) -> None:
        """Close the file (it stays on disk); a later ``commit`` raises ``OSError``."""
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)
