"""Raw device regions: allocate parkable device memory by tag, and park and unpark it.

A workload allocates the device memory it wants to be parkable through an
:class:`Offloader`, one :class:`Region` per allocation, each with a *tag*
(``"weights"``, ``"optimizer"``, ``"lora"``, ...). When the daemon directs
the job to park some tags, :meth:`Offloader.park` copies those regions to
host memory and frees their device memory; :meth:`Offloader.unpark` maps
device memory again at the *same* addresses and copies the bytes back, so
``region.ptr`` stays valid for the workload's kernels throughout. The device
is a :class:`~.device_memory.DeviceMemory`.

Every region is at every moment either *resident* (the device copy is the
valid one) or *parked* (the host copy is): an operation that fails midway
puts every region it touched back into one of those two states and says
which in the error's details (``resident`` / ``parked``: region names).
A park that fails is rolled back to resident where possible; an unpark that
fails leaves its regions parked.
"""

from __future__ import annotations

import threading
import time
import zlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

from ...errors import BackendError, NotResident, TimeslicedError, UnknownRegion
from .device_memory import DEFAULT_CHUNK, DeviceMemory, HostBuffer, plan_chunks, round_up
from .parkable import MoveStats, tag_set


def checksum(view: memoryview | bytes, chunk: int = DEFAULT_CHUNK) -> int:
    """CRC-32 of a byte buffer (in chunks, so very large buffers are fine)."""
    mv = memoryview(view).cast("B")
    crc = 0
    for off, n in plan_chunks(mv.nbytes, chunk):
        crc = zlib.crc32(mv[off : off + n], crc)
    return crc


class RoomGate(Protocol):
    """The limit of a streamed unpark (``timesliced.client.directives.Room``): bytes per node GPU it may map."""

    def fits(self, gpu: int, nbytes: int) -> bool: ...

    def take(self, gpu: int, nbytes: int) -> None: ...


# --- regions --------------------------------------------------------------------------


class Region:
    """One parkable device allocation, made by :meth:`Offloader.alloc`.

    ``ptr`` is its device address, the same for the region's whole life;
    ``nbytes`` what was asked for; ``size`` the device memory it takes when
    resident (``nbytes`` rounded up to the mapping granularity). ``gpu`` is
    the device as the memory numbers it (a CUDA ordinal on a GPU),
    ``node_gpu`` the same device as the daemon numbers it.
    """

    __slots__ = (
        "_checksum",
        "_host",
        "_mapped",
        "_owner",
        "_resident",
        "gpu",
        "name",
        "nbytes",
        "node_gpu",
        "ptr",
        "size",
        "tag",
    )

    def __init__(
        self, owner: Offloader, name: str, tag: str, gpu: int, nbytes: int, ptr: int, size: int, node_gpu: int
    ) -> None:
        self._owner = owner
        self.name = name
        self.tag = tag
        self.gpu = gpu
        self.node_gpu = node_gpu
        self.nbytes = nbytes
        self.ptr = ptr
        self.size = size
        self._resident = True  # the device copy is the valid one
        self._mapped = True  # device memory is mapped (also briefly while parked, during an unpark)
        self._host: HostBuffer | None = None  # kept across cycles for reuse
        self._checksum: int | None = None  # of the host copy, taken at park when verifying

    @property
    def resident(self) -> bool:
        return self._resident

    @property
    def host(self) -> HostBuffer | None:
        """The host buffer (the valid copy while parked); ``None`` before the first park."""
        return self._host

    def read(self, offset: int = 0, nbytes: int | None = None) -> bytes:
        """Copy bytes out of the region; raises ``NotResident`` while it is parked."""
        return self._owner.read(self, offset, nbytes)

    def write(self, data: bytes | bytearray | memoryview, offset: int = 0) -> None:
        """Copy ``data`` into the region; raises ``NotResident`` while it is parked."""
        self._owner.write(self, data, offset)

    def __repr__(self) -> str:
        state = "resident" if self._resident else "parked"
        return f"Region({self.name!r}, tag={self.tag!r}, gpu={self.gpu}, nbytes={self.nbytes}, {state})"


class Offloader:
    """The registry of a workload's parkable device regions and the park / unpark executor.

    ``memory`` is the device: :class:`~.cuda_device_memory.CudaDeviceMemory`
    on a GPU, :class:`~.host_device_memory.HostDeviceMemory` elsewhere.
    ``verify``: checksum host copies at park and check the device copy after
    every unpark (the default of the ``verify`` argument of ``park`` /
    ``unpark``). ``keep_host_bytes``: how many bytes of host buffers to keep
    for reuse while their regions are resident (``None``: all, ``0``: free
    each one after its unpark). Thread-safe: park / unpark and region
    access are serialised.

    Figures per GPU (``footprint``, ``resident``, :class:`~.parkable.MoveStats`)
    are keyed by the node's GPU numbers, the daemon's (``Region.node_gpu``);
    ``alloc(gpu=...)`` takes the memory's own (a CUDA ordinal on a GPU).

    It *streams*: in a streamed switch its park frees region by region and says so (``freed``),
    and its unpark maps each region only once the daemon granted room for it (``room``).
    """

    streams = True  # park(freed=...) and unpark(room=...): see timesliced.client.directives

    def __init__(
        self,
        memory: DeviceMemory,
        *,
        verify: bool = False,
        keep_host_bytes: int | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if keep_host_bytes is not None and keep_host_bytes < 0:
            raise ValueError(f"keep_host_bytes must not be negative, got {keep_host_bytes}")
        self.memory = memory
        self.verify = verify
        self.keep_host_bytes = keep_host_bytes
        self._clock = clock
        self._regions: dict[str, Region] = {}
        self._counts: dict[str, int] = {}
        self._lock = threading.RLock()

    # -- registry

    def alloc(self, nbytes: int, *, tag: str, gpu: int = 0, name: str | None = None) -> Region:
        """Allocate ``nbytes`` of parkable device memory on ``gpu`` under ``tag``.

        ``gpu`` is the memory's device number: a CUDA ordinal of this process
        on a GPU (``CUDA_VISIBLE_DEVICES`` applied). The memory's contents are
        undefined until written. Raises ``ValueError`` for a bad size, tag or a
        name in use, ``BackendError`` when the device refuses (out of memory
        included) or is not there (or cannot be named as the node does).
        """
        if not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"nbytes must be a positive integer, got {nbytes!r}")
        if not isinstance(tag, str) or not tag:
            raise ValueError(f"tag must be a non-empty string, got {tag!r}")
        with self._lock:
            node_gpu = self.memory.node_gpu(gpu)  # first: a device it cannot name fails before anything changes
            if name is None:
                n = self._counts.get(tag, 0)
                while f"{tag}/{n}" in self._regions:
                    n += 1
                name = f"{tag}/{n}"
                self._counts[tag] = n + 1
            elif name in self._regions:
                raise ValueError(f"a region named {name!r} exists already")
            size = round_up(nbytes, self.memory.granularity(gpu))
            va = self.memory.reserve(size, gpu)
            try:
                self.memory.map(va, size)
            except BaseException:
                self.memory.release_reservation(va, size)
                raise
            region = Region(self, name, tag, gpu, nbytes, va, size, node_gpu)
            self._regions[name] = region
            return region

    def free(self, region: Region) -> None:
        """Free a region's device memory, address range and host buffer (parked or not)."""
        with self._lock:
            if self._regions.get(region.name) is not region:
                raise UnknownRegion(f"region {region.name!r} is not registered here", region=region.name)
            if region._mapped:
                self.memory.unmap(region.ptr, region.size)
                region._mapped = False
            region._resident = False
            self.memory.release_reservation(region.ptr, region.size)
            del self._regions[region.name]
            self._drop_host(region)

    def regions(self, tags: Iterable[str] = ()) -> list[Region]:
        """The registered regions with one of ``tags`` (all if empty), in allocation order."""
        with self._lock:
            return self._select(tags)

    def tags(self) -> set[str]:
        with self._lock:
            return {r.tag for r in self._regions.values()}

    def footprint(self) -> dict[int, int]:
        """Device bytes per GPU when every region is resident."""
        with self._lock:
            return self._per_gpu(self._regions.values(), lambda r: r.size)

    def resident(self) -> dict[int, int]:
        """Device bytes per GPU held now."""
        with self._lock:
            return self._per_gpu((r for r in self._regions.values() if r._mapped), lambda r: r.size)

    def host_bytes(self) -> int:
        """Bytes of host buffers held now (parked copies and kept buffers)."""
        with self._lock:
            return sum(r._host.nbytes for r in self._regions.values() if r._host is not None)

    # -- region access

    def read(self, region: Region, offset: int = 0, nbytes: int | None = None) -> bytes:
        with self._lock:
            n = self._check_access(region, offset, region.nbytes - offset if nbytes is None else nbytes)
            return self.memory.read(region.ptr + offset, n) if n else b""

    def write(self, region: Region, data: bytes | bytearray | memoryview, offset: int = 0) -> None:
        view = memoryview(data).cast("B")
        with self._lock:
            if self._check_access(region, offset, view.nbytes):
                self.memory.write(region.ptr + offset, view)

    def _check_access(self, region: Region, offset: int, nbytes: int) -> int:
        if self._regions.get(region.name) is not region:
            raise UnknownRegion(f"region {region.name!r} is not registered here", region=region.name)
        if offset < 0 or nbytes < 0 or offset + nbytes > region.nbytes:
            raise ValueError(f"[{offset}, +{nbytes}) is outside region {region.name!r} of {region.nbytes} bytes")
        if not region._resident:
            raise NotResident(f"region {region.name!r} ({region.tag}) is parked", region=region.name, tag=region.tag)
        return nbytes

    # -- park / unpark

    def park(
        self,
        tags: Iterable[str] = (),
        *,
        verify: bool | None = None,
        freed: Callable[[dict[int, int]], None] | None = None,
    ) -> MoveStats:
        """Copy the tagged regions (all if ``tags`` is empty) to host memory and free their device memory.

        Regions already parked are skipped. Raises ``UnknownRegion`` for a tag
        with no regions, and ``BackendError`` when a copy or an unmap fails;
        the regions are then rolled back to resident where that works, and
        ``details["resident"]`` / ``details["parked"]`` name where each ended up.

        ``freed`` (a streamed switch): park region by region, each copied, then unmapped, then
        told to ``freed`` (node GPU -> bytes given back), so another job may map into its room at
        once. A failure then rolls nothing back (room already told may be taken): the regions parked
        so far stay parked, the rest resident, as ``details`` say; the daemon decides what follows.
        """
        verify = self.verify if verify is None else verify
        with self._lock:
            start = self._clock()
            selected = self._select(tags)
            todo = [r for r in selected if r._resident]
            if freed is not None:
                return self._park_streamed(todo, selected, start, verify, freed)
            # Phase 1: copy everything out. Nothing is freed yet, so a failure
            # here leaves every region resident.
            failed: Region | None = None
            try:
                for r in todo:
                    failed = r
                    if r._host is None:
                        r._host = self.memory.host_alloc(r.nbytes)
                copy_start = self._clock()
                for r in todo:
                    failed = r
                    assert r._host is not None
                    self.memory.copy_to_host_async(r._host, r.ptr, r.nbytes)
                failed = None
                self.memory.synchronize()
                copy_seconds = self._clock() - copy_start
            except Exception as exc:
                self._drain()
                self._trim_host_buffers()
                raise self._failure("park", exc, failed, selected) from exc
            for r in todo:
                assert r._host is not None
                r._checksum = checksum(r._host.view) if verify else None
            # Phase 2: free the device memory, one region at a time.
            done: list[Region] = []
            for r in todo:
                try:
                    self.memory.unmap(r.ptr, r.size)
                except Exception as exc:
                    rollback = self._restore(done)
                    raise self._failure("park", exc, r, selected, rollback=rollback) from exc
                r._mapped = False
                r._resident = False
                done.append(r)
            return self._stats("park", todo, selected, start, copy_seconds, verify)

    def unpark(
        self, tags: Iterable[str] = (), *, verify: bool | None = None, room: RoomGate | None = None
    ) -> MoveStats:
        """Map the tagged parked regions (all if ``tags`` is empty) at their addresses and copy them back.

        Regions already resident are skipped. Raises ``UnknownRegion`` for a
        tag with no regions, and ``BackendError`` when mapping (out of
        device memory, say), a copy or verification fails; every region of
        the call is then still parked (``details["parked"]``). A verification
        failure names the region and tag (``details["region"]``, ``["tag"]``).

        ``room`` (a streamed switch): each region is mapped only once ``room`` lets its size be
        taken on its GPU, and its copy is queued at once; while it waits for room, the copies
        queued so far are let finish (the link would idle otherwise). A wait that is called off
        fails the unpark like any other failure: every region stays parked.
        """
        verify = self.verify if verify is None else verify
        with self._lock:
            start = self._clock()
            selected = self._select(tags)
            todo = [r for r in selected if not r._resident]
            failed: Region | None = None
            try:
                copy_start = self._clock()
                if room is None:
                    for r in todo:
                        failed = r
                        if not r._mapped:
                            self.memory.map(r.ptr, r.size)
                            r._mapped = True
                    copy_start = self._clock()
                for r in todo:
                    failed = r
                    if not r._mapped:  # streamed: map each region once its room is there
                        if room is not None and not room.fits(r.node_gpu, r.size):
                            self.memory.synchronize()  # the copies queued so far run while we wait
                        if room is not None:
                            room.take(r.node_gpu, r.size)
                        self.memory.map(r.ptr, r.size)
                        r._mapped = True
                    assert r._host is not None  # a parked region always has its host copy
                    self.memory.copy_to_device_async(r.ptr, r._host, r.nbytes)
                failed = None
                self.memory.synchronize()
                copy_seconds = self._clock() - copy_start
                if verify:
                    self._verify(todo)
            except Exception as exc:
                self._drain()
                for r in todo:  # back to parked: the host copies are untouched
                    if r._mapped:
                        try:
                            self.memory.unmap(r.ptr, r.size)
                            r._mapped = False
                        except Exception:
                            pass  # still parked (host copy valid), with device memory held: footprint shows it
                if isinstance(exc, BackendError) and exc.details.get("verify"):
                    exc.details["parked"] = [r.name for r in selected if not r._resident]
                    exc.details["resident"] = [r.name for r in selected if r._resident]
                    raise
                raise self._failure("unpark", exc, failed, selected) from exc
            for r in todo:
                r._resident = True
            self._trim_host_buffers()
            return self._stats("unpark", todo, selected, start, copy_seconds, verify)

    def _park_streamed(
        self,
        todo: Sequence[Region],
        selected: Sequence[Region],
        start: float,
        verify: bool,
        freed: Callable[[dict[int, int]], None],
    ) -> MoveStats:
        """``park(freed=...)``: region by region, copy, wait for it, unmap, tell (the lock is held)."""
        copy_start = self._clock()
        for r in todo:
            try:
                if r._host is None:
                    r._host = self.memory.host_alloc(r.nbytes)
                self.memory.copy_to_host_async(r._host, r.ptr, r.nbytes)
                self.memory.synchronize()  # the bytes are on the host before the memory goes
                r._checksum = checksum(r._host.view) if verify else None
                self.memory.unmap(r.ptr, r.size)
            except Exception as exc:
                self._drain()
                raise self._failure("park", exc, r, selected) from exc
            r._mapped = False
            r._resident = False
            try:
                freed({r.node_gpu: r.size})
            except Exception:  # telling is the shell's business: the park goes on whatever
                pass
        copy_seconds = self._clock() - copy_start
        return self._stats("park", todo, selected, start, copy_seconds, verify)

    def close(self) -> None:
        """Free every region and host buffer (the device memory object stays open)."""
        with self._lock:
            for region in list(self._regions.values()):
                self.free(region)

    # -- helpers

    def _select(self, tags: Iterable[str]) -> list[Region]:
        wanted = tag_set(tags)
        if not wanted:
            return list(self._regions.values())
        unknown = wanted - {r.tag for r in self._regions.values()}
        if unknown:
            raise UnknownRegion(f"no regions tagged {sorted(unknown)}", tags=sorted(unknown))
        return [r for r in self._regions.values() if r.tag in wanted]

    def _verify(self, regions: Sequence[Region]) -> None:
        """Compare each region's device copy with the checksum of its host copy."""
        bad: list[Region] = []
        for r in regions:
            assert r._host is not None
            expected = r._checksum if r._checksum is not None else checksum(r._host.view)
            actual = 0
            for off, n in plan_chunks(r.nbytes):
                actual = zlib.crc32(self.memory.read(r.ptr + off, n), actual)
            if actual != expected:
                bad.append(r)
        if bad:
            first = bad[0]
            raise BackendError(
                f"region {first.name!r} (tag {first.tag!r}) does not match its parked copy after unpark",
                verify=True,
                region=first.name,
                tag=first.tag,
                mismatched=[r.name for r in bad],
            )

    def _restore(self, regions: Sequence[Region]) -> str:
        """Roll parked ``regions`` back to resident after a failed park; says how that went."""
        if not regions:
            return "none needed"
        mapped: list[Region] = []
        try:
            for r in regions:
                self.memory.map(r.ptr, r.size)
                r._mapped = True
                mapped.append(r)
                assert r._host is not None
                self.memory.copy_to_device_async(r.ptr, r._host, r.nbytes)
            self.memory.synchronize()
        except Exception as exc:
            self._drain()
            for r in mapped:
                try:
                    self.memory.unmap(r.ptr, r.size)
                    r._mapped = False
                except Exception:
                    pass
            return f"failed: {exc}"
        for r in regions:
            r._resident = True
        return "ok"

    def _drain(self) -> None:
        """Let copies still in flight finish before touching their memory again."""
        try:
            self.memory.synchronize()
        except Exception:
            pass  # the failure being handled is the one to report

    def _failure(
        self, op: str, exc: Exception, region: Region | None, selected: Sequence[Region], rollback: str | None = None
    ) -> BackendError:
        resident = [r.name for r in selected if r._resident]
        parked = [r.name for r in selected if not r._resident]
        where = f" at region {region.name!r} ({region.tag})" if region is not None else ""
        cause = exc.message if isinstance(exc, TimeslicedError) else f"{exc.__class__.__name__}: {exc}"
        details: dict[str, Any] = {"op": op, "resident": resident, "parked": parked, "cause": cause}
        if region is not None:
            details.update(region=region.name, tag=region.tag)
        if rollback is not None:
            details["rollback"] = rollback
        state = "every region is still resident" if not parked else f"parked now: {parked}; resident: {resident}"
        if op == "unpark":
            state = f"parked: {parked}" if parked else "nothing is parked"
        return BackendError(f"{op} failed{where}: {cause}; {state}", **details)

    def _trim_host_buffers(self) -> None:
        """Free host buffers of resident regions beyond ``keep_host_bytes``."""
        if self.keep_host_bytes is None:
            return
        budget = self.keep_host_bytes
        for r in self._regions.values():
            if r._host is None or not r._resident:
                continue
            if r._host.nbytes <= budget:
                budget -= r._host.nbytes
            else:
                self._drop_host(r)

    def _drop_host(self, region: Region) -> None:
        if region._host is not None:
            self.memory.host_free(region._host)
            region._host = None
            region._checksum = None

    def _stats(
        self,
        op: str,
        moved: Sequence[Region],
        selected: Sequence[Region],
        start: float,
        copy_seconds: float,
        verify: bool,
    ) -> MoveStats:
        return MoveStats(
            op=op,
            nbytes=sum(r.nbytes for r in moved),
            seconds=self._clock() - start,
            copy_seconds=copy_seconds if moved else 0.0,
            regions=len(moved),
            skipped=len(selected) - len(moved),
            verified=verify,
            per_gpu=self._per_gpu(moved, lambda r: r.nbytes),
            resident=self._per_gpu((r for r in self._regions.values() if r._mapped), lambda r: r.size),
            footprint=self._per_gpu(self._regions.values(), lambda r: r.size),
        )

    @staticmethod
    def _per_gpu(regions: Iterable[Region], size: Callable[[Region], int]) -> dict[int, int]:
        out: dict[int, int] = {}
        for r in regions:
            out[r.node_gpu] = out.get(r.node_gpu, 0) + size(r)
        return out
