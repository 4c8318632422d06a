"""Device memory as the in-process offload executor sees it.

The executor (:mod:`timesliced.client.offload`) parks a region by copying it
to host memory and then *unmapping* its physical device memory while keeping
its virtual address range reserved; unparking maps new physical memory at the
same address and copies the bytes back. A pointer that user code holds thus
stays valid across a park / unpark cycle. That is CUDA's virtual memory
management (``cuMemAddressReserve`` / ``cuMemCreate`` + ``cuMemMap`` /
``cuMemUnmap``), and :class:`DeviceMemory` is the seam that exposes exactly
those steps.

Two implementations:

:class:`HostDeviceMemory`
    Device memory held in host buffers, with fake virtual addresses. It is
    the CPU stand-in of the product (demo, CI, laptops), so it behaves like
    the driver where that matters: unmapped memory is really freed, an access
    to an unmapped address raises, mapping twice raises, async copies land
    only at ``synchronize()``, an optional capacity makes mapping fail when
    full, and an optional bandwidth model makes copies take time.

:class:`CudaDeviceMemory`
    The real thing, on the CUDA driver API through cuda-python, imported only
    when one is constructed.

Both raise :class:`~timesliced.errors.NotResident` for an access to memory
that is reserved but not mapped (a parked region) and
:class:`~timesliced.errors.BackendError` for every other failure.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import functools
import importlib
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

from ..errors import BackendError, BackendUnavailable, NotResident

KiB = 1 << 10
MiB = 1 << 20
DEFAULT_CHUNK = 64 * MiB  # one async copy per chunk: large enough to reach full PCIe / C2C bandwidth
DEFAULT_GRANULARITY = 2 * MiB  # what current NVIDIA GPUs report as the minimum mapping granularity


# --- host buffers ---------------------------------------------------------------------


class HostBuffer:
    """A host buffer that device copies read from or write into.

    ``view`` is a writable byte ``memoryview`` of exactly ``nbytes``; ``ptr``
    is its address where the implementation needs one (0 otherwise);
    ``pinned`` says whether it is page-locked.
    """

    __slots__ = ("_owner", "nbytes", "pinned", "ptr", "view")

    def __init__(self, view: memoryview, *, ptr: int = 0, pinned: bool = False, owner: object = None) -> None:
        self.view = view
        self.nbytes = view.nbytes
        self.ptr = ptr
        self.pinned = pinned
        self._owner = owner  # keeps the memory behind ``view`` alive

    def __repr__(self) -> str:
        return f"HostBuffer(nbytes={self.nbytes}, pinned={self.pinned})"


# --- the seam -------------------------------------------------------------------------


class DeviceMemory(Protocol):
    """What the offload executor needs from the device (all sizes in bytes).

    Addresses are plain ints. ``reserve`` / ``map`` sizes and addresses must
    be multiples of ``granularity(gpu)``. Copies are asynchronous: they are
    complete only after ``synchronize()``. Every method raises
    ``BackendError`` on failure; ``read`` / ``write`` raise ``NotResident``
    for reserved but unmapped memory.
    """

    def granularity(self, gpu: int) -> int:
        """The size and alignment unit of ``reserve`` and ``map`` on ``gpu``."""
        ...

    def reserve(self, nbytes: int, gpu: int) -> int:
        """Reserve a virtual address range for ``gpu``; returns its start."""
        ...

    def release_reservation(self, va: int, nbytes: int) -> None:
        """Give back a whole reservation; nothing in it may be mapped."""
        ...

    def map(self, va: int, nbytes: int) -> None:
        """Back ``[va, va + nbytes)`` of a reservation with new physical memory (contents undefined)."""
        ...

    def unmap(self, va: int, nbytes: int) -> None:
        """Unmap exactly one earlier ``map`` and free its physical memory; the range stays reserved."""
        ...

    def host_alloc(self, nbytes: int) -> HostBuffer:
        """A host buffer for device copies (page-locked where the implementation can)."""
        ...

    def host_free(self, buf: HostBuffer) -> None:
        """Free a buffer from ``host_alloc``."""
        ...

    def copy_to_host_async(self, dst: HostBuffer, va: int, nbytes: int) -> None:
        """Queue a copy of ``nbytes`` at device address ``va`` into ``dst``.

        The copy sees every write the process queued on the device before it
        (the first copy after a ``synchronize()`` waits for the device's work).
        """
        ...

    def copy_to_device_async(self, va: int, src: HostBuffer, nbytes: int) -> None:
        """Queue a copy of the first ``nbytes`` of ``src`` to device address ``va``."""
        ...

    def synchronize(self) -> None:
        """Wait for every queued copy; raises if one of them failed."""
        ...

    def read(self, va: int, nbytes: int) -> bytes:
        """Copy device memory to a new ``bytes`` (synchronous)."""
        ...

    def write(self, va: int, data: bytes | bytearray | memoryview) -> None:
        """Copy ``data`` to device memory (synchronous)."""
        ...

    def used_bytes(self, gpu: int | None = None) -> int:
        """Physical device memory mapped now, on ``gpu`` or on all GPUs."""
        ...

    def close(self) -> None:
        """Free everything this object still holds."""
        ...


# --- pure helpers ---------------------------------------------------------------------


def round_up(nbytes: int, granularity: int) -> int:
    """``nbytes`` rounded up to a whole number of ``granularity`` units (at least one)."""
    if granularity <= 0:
        raise ValueError(f"granularity must be positive, got {granularity}")
    if nbytes < 0:
        raise ValueError(f"nbytes must not be negative, got {nbytes}")
    return max(1, -(-nbytes // granularity)) * granularity


def plan_chunks(nbytes: int, chunk: int = DEFAULT_CHUNK) -> list[tuple[int, int]]:
    """``(offset, size)`` pieces that cover ``nbytes`` in order, each at most ``chunk``."""
    if chunk <= 0:
        raise ValueError(f"chunk must be positive, got {chunk}")
    if nbytes < 0:
        raise ValueError(f"nbytes must not be negative, got {nbytes}")
    return [(off, min(chunk, nbytes - off)) for off in range(0, nbytes, chunk)]


def check_result(out: Any, call: str) -> tuple[Any, ...]:
    """Unpack what a cuda-python driver call returned: ``(CUresult, *values)``.

    Returns the values; raises ``BackendError`` naming the call and the
    CUresult (``details``: ``call``, ``result``) unless it is CUDA_SUCCESS.
    """
    if not isinstance(out, tuple) or not out:
        raise BackendError(f"{call} returned {out!r}, expected (CUresult, ...)", call=call)
    result, values = out[0], out[1:]
    if int(result) != 0:
        name = getattr(result, "name", None) or f"CUresult {int(result)}"
        raise BackendError(f"{call} failed: {name}", call=call, result=name)
    return values


@dataclass(frozen=True)
class Span:
    """A virtual address range on one GPU."""

    va: int
    nbytes: int
    gpu: int

    @property
    def end(self) -> int:
        return self.va + self.nbytes


class _Spans:
    """Non-overlapping spans, sorted by address."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._spans: dict[int, Span] = {}

    def __iter__(self) -> Iterator[Span]:
        return (self._spans[va] for va in self._starts)

    def __len__(self) -> int:
        return len(self._starts)

    def at(self, va: int) -> Span | None:
        """The span that contains ``va``."""
        i = bisect.bisect_right(self._starts, va) - 1
        if i >= 0:
            span = self._spans[self._starts[i]]
            if va < span.end:
                return span
        return None

    def overlaps(self, va: int, nbytes: int) -> bool:
        i = bisect.bisect_left(self._starts, va + nbytes)
        return i > 0 and self._spans[self._starts[i - 1]].end > va

    def inside(self, outer: Span) -> list[Span]:
        lo = bisect.bisect_left(self._starts, outer.va)
        hi = bisect.bisect_left(self._starts, outer.end)
        return [self._spans[va] for va in self._starts[lo:hi]]

    def add(self, span: Span) -> None:
        bisect.insort(self._starts, span.va)
        self._spans[span.va] = span

    def remove(self, span: Span) -> None:
        self._starts.remove(span.va)
        del self._spans[span.va]


class AddressSpace:
    """Bookkeeping of reservations and the mappings inside them (no memory of its own).

    It enforces the rules of CUDA virtual memory management that both
    implementations share: a mapping lies inside one reservation and
    overlaps no other mapping; an unmap names exactly one earlier mapping;
    a reservation is released whole and only when nothing in it is mapped.
    Violations raise ``BackendError`` and change nothing.
    """

    def __init__(self) -> None:
        self.reservations = _Spans()
        self.mappings = _Spans()

    def reserve(self, va: int, nbytes: int, gpu: int) -> Span:
        if nbytes <= 0 or self.reservations.overlaps(va, nbytes):
            raise BackendError(f"cannot reserve {nbytes} bytes at {va:#x}", call="reserve", va=va)
        span = Span(va, nbytes, gpu)
        self.reservations.add(span)
        return span

    def unreserve(self, va: int, nbytes: int) -> Span:
        span = self.reservations.at(va)
        if span is None or span.va != va or span.nbytes != nbytes:
            raise BackendError(f"no reservation of {nbytes} bytes at {va:#x}", call="release_reservation", va=va)
        if self.mappings.inside(span):
            raise BackendError(f"reservation at {va:#x} still has mapped memory", call="release_reservation", va=va)
        self.reservations.remove(span)
        return span

    def map(self, va: int, nbytes: int) -> Span:
        res = self.reservations.at(va)
        if res is None or nbytes <= 0 or va + nbytes > res.end:
            raise BackendError(f"[{va:#x}, +{nbytes}) is not inside one reservation", call="map", va=va)
        if self.mappings.overlaps(va, nbytes):
            raise BackendError(f"[{va:#x}, +{nbytes}) is already mapped", call="map", va=va)
        span = Span(va, nbytes, res.gpu)
        self.mappings.add(span)
        return span

    def unmap(self, va: int, nbytes: int) -> Span:
        span = self.mappings.at(va)
        if span is None or span.va != va or span.nbytes != nbytes:
            raise BackendError(f"[{va:#x}, +{nbytes}) is not a mapping", call="unmap", va=va)
        self.mappings.remove(span)
        return span

    def resolve(self, va: int, nbytes: int) -> Span:
        """The mapping that holds all of ``[va, va + nbytes)``.

        Raises ``NotResident`` when the address is reserved but not mapped
        (parked memory) and ``BackendError`` for any other address.
        """
        if nbytes < 0:
            raise ValueError(f"nbytes must not be negative, got {nbytes}")
        span = self.mappings.at(va)
        if span is not None and va + nbytes <= span.end:
            return span
        if span is None and self.reservations.at(va) is not None:
            raise NotResident(f"device memory at {va:#x} is not mapped (parked)", va=va)
        raise BackendError(f"illegal address: [{va:#x}, +{nbytes}) is not mapped device memory", va=va)

    def mapped_bytes(self, gpu: int | None = None) -> int:
        return sum(s.nbytes for s in self.mappings if gpu is None or s.gpu == gpu)


# --- the CPU stand-in -----------------------------------------------------------------


@dataclass
class _Copy:
    to_host: bool
    host: HostBuffer
    va: int
    nbytes: int


class HostDeviceMemory:
    """Simulated device memory in host buffers (see the module docstring).

    ``gpus``: how many devices; ``capacity``: bytes per device (``None``:
    unlimited; mapping past it raises ``BackendError`` like the driver's out
    of memory); ``granularity``: the mapping unit; ``bandwidth``: bytes per
    second that copies are held to (``None``: unlimited), paid at
    ``synchronize()`` for async copies and at once for ``read`` / ``write``.
    Thread-safe.
    """

    BASE_VA = 0x7F00_0000_0000  # fake addresses: far from 0 so an int offset is never mistaken for one

    def __init__(
        self,
        gpus: int = 1,
        *,
        capacity: int | None = None,
        granularity: int = DEFAULT_GRANULARITY,
        bandwidth: float | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if gpus < 1:
            raise ValueError(f"gpus must be at least 1, got {gpus}")
        if granularity <= 0 or granularity & (granularity - 1):
            raise ValueError(f"granularity must be a power of two, got {granularity}")
        if capacity is not None and capacity < 0:
            raise ValueError(f"capacity must not be negative, got {capacity}")
        if bandwidth is not None and bandwidth < 0:
            raise ValueError(f"bandwidth must not be negative, got {bandwidth}")
        self.gpus = gpus
        self.capacity = capacity
        self.bandwidth = bandwidth or None
        self._granularity = granularity
        self._sleep = sleep
        self._space = AddressSpace()
        self._memory: dict[int, bytearray] = {}  # mapping start -> its bytes
        self._queue: list[_Copy] = []
        self._next_va = self.BASE_VA
        self._lock = threading.Lock()

    # -- address space

    def granularity(self, gpu: int) -> int:
        self._check_gpu(gpu)
        return self._granularity

    def reserve(self, nbytes: int, gpu: int) -> int:
        self._check_gpu(gpu)
        self._check_aligned("reserve", 0, nbytes)
        with self._lock:
            va = self._next_va
            self._space.reserve(va, nbytes, gpu)
            self._next_va = va + nbytes + self._granularity  # a guard gap: overruns never land in a neighbour
        return va

    def release_reservation(self, va: int, nbytes: int) -> None:
        with self._lock:
            self._space.unreserve(va, nbytes)

    def map(self, va: int, nbytes: int) -> None:
        self._check_aligned("map", va, nbytes)
        with self._lock:
            res = self._space.reservations.at(va)
            gpu = res.gpu if res is not None else -1
            if self.capacity is not None and self._space.mapped_bytes(gpu) + nbytes > self.capacity:
                raise BackendError(
                    f"out of memory on GPU {gpu}: {nbytes} bytes requested, "
                    f"{self.capacity - self._space.mapped_bytes(gpu)} free",
                    call="map",
                    gpu=gpu,
                )
            span = self._space.map(va, nbytes)
            self._memory[span.va] = bytearray(nbytes)  # like cuMemCreate, new memory; zeroed here

    def unmap(self, va: int, nbytes: int) -> None:
        with self._lock:
            if any(va <= c.va < va + nbytes for c in self._queue):
                raise BackendError(f"unmapping [{va:#x}, +{nbytes}) while copies to or from it are queued", va=va)
            span = self._space.unmap(va, nbytes)
            del self._memory[span.va]  # really freed

    # -- host buffers

    def host_alloc(self, nbytes: int) -> HostBuffer:
        if nbytes < 0:
            raise ValueError(f"nbytes must not be negative, got {nbytes}")
        data = bytearray(nbytes)
        return HostBuffer(memoryview(data), owner=data)

    def host_free(self, buf: HostBuffer) -> None:
        buf.view.release()

    # -- copies

    def copy_to_host_async(self, dst: HostBuffer, va: int, nbytes: int) -> None:
        self._queue_copy(_Copy(True, dst, va, nbytes))

    def copy_to_device_async(self, va: int, src: HostBuffer, nbytes: int) -> None:
        self._queue_copy(_Copy(False, src, va, nbytes))

    def synchronize(self) -> None:
        with self._lock:
            queue, self._queue = self._queue, []
            for c in queue:
                span = self._space.resolve(c.va, c.nbytes)
                mem, off = self._memory[span.va], c.va - span.va
                if c.to_host:
                    c.host.view[: c.nbytes] = mem[off : off + c.nbytes]
                else:
                    mem[off : off + c.nbytes] = c.host.view[: c.nbytes]
        self._pay(sum(c.nbytes for c in queue))

    def read(self, va: int, nbytes: int) -> bytes:
        with self._lock:
            span = self._space.resolve(va, nbytes)
            off = va - span.va
            data = bytes(self._memory[span.va][off : off + nbytes])
        self._pay(nbytes)
        return data

    def write(self, va: int, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        with self._lock:
            span = self._space.resolve(va, view.nbytes)
            off = va - span.va
            self._memory[span.va][off : off + view.nbytes] = view
        self._pay(view.nbytes)

    # -- figures

    def used_bytes(self, gpu: int | None = None) -> int:
        with self._lock:
            return self._space.mapped_bytes(gpu)

    def reserved_bytes(self) -> int:
        with self._lock:
            return sum(s.nbytes for s in self._space.reservations)

    def close(self) -> None:
        with self._lock:
            self._queue.clear()
            self._memory.clear()
            self._space = AddressSpace()

    # -- plumbing

    def _queue_copy(self, copy: _Copy) -> None:
        if copy.nbytes < 0 or copy.nbytes > copy.host.nbytes:
            raise BackendError(f"a copy of {copy.nbytes} bytes does not fit a host buffer of {copy.host.nbytes}")
        with self._lock:
            self._space.resolve(copy.va, copy.nbytes)  # like the driver, reject a bad address when queued
            self._queue.append(copy)

    def _pay(self, nbytes: int) -> None:
        if self.bandwidth and nbytes:
            self._sleep(nbytes / self.bandwidth)

    def _check_gpu(self, gpu: int) -> None:
        if not 0 <= gpu < self.gpus:
            raise BackendError(f"no GPU {gpu} (this device memory has {self.gpus})", gpu=gpu)

    def _check_aligned(self, call: str, va: int, nbytes: int) -> None:
        if nbytes <= 0 or nbytes % self._granularity or va % self._granularity:
            raise BackendError(
                f"{call}: address {va:#x} and size {nbytes} must be positive multiples of {self._granularity}",
                call=call,
            )


# --- the real thing -------------------------------------------------------------------


def _import_driver() -> Any:
    try:
        return importlib.import_module("cuda.bindings.driver")
    except ImportError as exc:
        raise BackendUnavailable(
            "the offload backend needs cuda-python (pip install 'timesliced[cuda]')", cause=str(exc)
        ) from exc


class CudaDeviceMemory:
    """Device memory through the CUDA driver API (cuda-python).

    Regions live in the devices' primary contexts (the ones the CUDA runtime
    and PyTorch use), so their pointers work in any kernel of the process.
    Copies run in ``chunk_bytes`` pieces on one non-blocking stream per GPU;
    host buffers are page-locked (``cuMemHostAlloc``, portable) unless
    ``pinned=False``. ``driver`` replaces ``cuda.bindings.driver`` (tests).

    Raises ``BackendUnavailable`` when cuda-python or the driver is missing,
    and ``BackendError`` with the failing call and CUresult name otherwise.
    """

    def __init__(self, *, chunk_bytes: int = DEFAULT_CHUNK, pinned: bool = True, driver: Any = None) -> None:
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        self._d = driver if driver is not None else _import_driver()
        self.chunk_bytes = chunk_bytes
        self.pinned = pinned
        try:
            check_result(self._d.cuInit(0), "cuInit")
        except BackendError as exc:
            raise BackendUnavailable(f"the CUDA driver cannot be used: {exc.message}", **exc.details) from exc
        except Exception as exc:  # cuda-python raises its own error when libcuda cannot be loaded
            raise BackendUnavailable(f"the CUDA driver cannot be loaded: {exc}") from exc
        self._space = AddressSpace()
        self._contexts: dict[int, Any] = {}  # gpu -> retained primary context
        self._streams: dict[int, Any] = {}  # gpu -> copy stream
        self._granularity: dict[int, int] = {}
        self._host: dict[int, HostBuffer] = {}  # id -> every live host buffer, freed on close
        self._busy: set[int] = set()  # GPUs with copies queued since the last synchronize
        self._lock = threading.RLock()

    # -- plumbing

    def _call(self, name: str, *args: Any) -> tuple[Any, ...]:
        try:
            out = getattr(self._d, name)(*args)
        except Exception as exc:
            raise BackendError(f"{name} raised {exc.__class__.__name__}: {exc}", call=name) from exc
        return check_result(out, name)

    def _context_of(self, gpu: int) -> Any:
        ctx = self._contexts.get(gpu)
        if ctx is None:
            (dev,) = self._call("cuDeviceGet", gpu)
            (ctx,) = self._call("cuDevicePrimaryCtxRetain", dev)
            self._contexts[gpu] = ctx
        return ctx

    @contextmanager
    def _on(self, gpu: int) -> Iterator[None]:
        """Make ``gpu``'s primary context current on this thread for the block."""
        with self._lock:
            self._call("cuCtxPushCurrent", self._context_of(gpu))
            try:
                yield
            except BaseException:
                try:
                    self._call("cuCtxPopCurrent")
                except BackendError:
                    pass  # the error already on its way out is the one to report
                raise
            self._call("cuCtxPopCurrent")

    def _stream(self, gpu: int) -> Any:
        stream = self._streams.get(gpu)
        if stream is None:
            flags = int(self._d.CUstream_flags.CU_STREAM_NON_BLOCKING)
            (stream,) = self._call("cuStreamCreate", flags)
            self._streams[gpu] = stream
        return stream

    def _prop(self, gpu: int) -> Any:
        d = self._d
        prop = d.CUmemAllocationProp()
        prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = gpu
        return prop

    def _ptr(self, va: int) -> Any:
        return self._d.CUdeviceptr(va)

    def _any_gpu(self) -> int:
        return next(iter(self._contexts), 0)

    # -- address space

    def granularity(self, gpu: int) -> int:
        with self._lock:
            g = self._granularity.get(gpu)
            if g is None:
                flag = self._d.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
                with self._on(gpu):
                    (g,) = self._call("cuMemGetAllocationGranularity", self._prop(gpu), flag)
                g = int(g)
                self._granularity[gpu] = g
            return g

    def reserve(self, nbytes: int, gpu: int) -> int:
        g = self.granularity(gpu)
        if nbytes <= 0 or nbytes % g:
            raise BackendError(f"reserve: {nbytes} is not a positive multiple of the granularity {g}", call="reserve")
        with self._on(gpu):
            (ptr,) = self._call("cuMemAddressReserve", nbytes, g, self._ptr(0), 0)
            va = int(ptr)
            try:
                self._space.reserve(va, nbytes, gpu)
            except BackendError:
                self._call("cuMemAddressFree", ptr, nbytes)
                raise
        return va

    def release_reservation(self, va: int, nbytes: int) -> None:
        with self._lock:
            res = self._space.reservations.at(va)
            gpu = res.gpu if res is not None else self._any_gpu()
            self._space.unreserve(va, nbytes)
            with self._on(gpu):
                self._call("cuMemAddressFree", self._ptr(va), nbytes)

    def map(self, va: int, nbytes: int) -> None:
        d = self._d
        with self._lock:
            span = self._space.map(va, nbytes)  # validates before the driver sees it
            try:
                with self._on(span.gpu):
                    (handle,) = self._call("cuMemCreate", nbytes, self._prop(span.gpu), 0)
                    # The mapping keeps the physical memory alive; with the handle
                    # released, cuMemUnmap alone frees it, so nothing can leak.
                    try:
                        self._call("cuMemMap", self._ptr(va), nbytes, 0, handle, 0)
                    except BaseException:
                        with contextlib.suppress(BackendError):  # keep the map's own error
                            self._call("cuMemRelease", handle)
                        raise
                    self._call("cuMemRelease", handle)
                    access = d.CUmemAccessDesc()
                    access.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
                    access.location.id = span.gpu
                    access.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
                    try:
                        self._call("cuMemSetAccess", self._ptr(va), nbytes, [access], 1)
                    except BackendError:
                        self._call("cuMemUnmap", self._ptr(va), nbytes)
                        raise
            except BaseException:
                self._space.unmap(va, nbytes)
                raise

    def unmap(self, va: int, nbytes: int) -> None:
        with self._lock:
            span = self._space.mappings.at(va)
            if span is not None and span.gpu in self._busy:
                self.synchronize()  # never pull memory out from under a copy in flight
            span = self._space.unmap(va, nbytes)
            try:
                with self._on(span.gpu):
                    self._call("cuMemUnmap", self._ptr(va), nbytes)
            except BaseException:
                self._space.mappings.add(span)
                raise

    # -- host buffers

    def host_alloc(self, nbytes: int) -> HostBuffer:
        if nbytes <= 0:
            raise ValueError(f"nbytes must be positive, got {nbytes}")
        if not self.pinned:
            data = bytearray(nbytes)
            arr = (ctypes.c_char * nbytes).from_buffer(data)
            return HostBuffer(memoryview(data), ptr=ctypes.addressof(arr), owner=(data, arr))
        with self._on(self._any_gpu()):
            (ptr,) = self._call("cuMemHostAlloc", nbytes, self._d.CU_MEMHOSTALLOC_PORTABLE)
        ptr = int(ptr)
        arr = (ctypes.c_char * nbytes).from_address(ptr)
        buf = HostBuffer(memoryview(arr).cast("B"), ptr=ptr, pinned=True, owner=arr)
        with self._lock:
            self._host[id(buf)] = buf
        return buf

    def host_free(self, buf: HostBuffer) -> None:
        buf.view.release()
        if not buf.pinned:
            return
        with self._lock:
            if self._host.pop(id(buf), None) is None:
                return  # already freed
            with self._on(self._any_gpu()):
                self._call("cuMemFreeHost", buf.ptr)

    # -- copies

    def copy_to_host_async(self, dst: HostBuffer, va: int, nbytes: int) -> None:
        self._copy("cuMemcpyDtoHAsync", dst, va, nbytes)

    def copy_to_device_async(self, va: int, src: HostBuffer, nbytes: int) -> None:
        self._copy("cuMemcpyHtoDAsync", src, va, nbytes)

    def _copy(self, call: str, host: HostBuffer, va: int, nbytes: int) -> None:
        if nbytes < 0 or nbytes > host.nbytes:
            raise BackendError(f"a copy of {nbytes} bytes does not fit a host buffer of {host.nbytes}")
        with self._lock:
            span = self._space.resolve(va, nbytes)
            with self._on(span.gpu):
                stream = self._stream(span.gpu)
                if span.gpu not in self._busy and call == "cuMemcpyDtoHAsync":
                    # The copy stream does not wait for work the process queued on its own
                    # streams: let every write the job made before yielding land first.
                    self._call("cuCtxSynchronize")
                self._busy.add(span.gpu)
                for off, n in plan_chunks(nbytes, self.chunk_bytes):
                    if call == "cuMemcpyDtoHAsync":
                        self._call(call, host.ptr + off, self._ptr(va + off), n, stream)
                    else:
                        self._call(call, self._ptr(va + off), host.ptr + off, n, stream)

    def synchronize(self) -> None:
        with self._lock:
            busy, self._busy = sorted(self._busy), set()
            for gpu in busy:
                with self._on(gpu):
                    self._call("cuStreamSynchronize", self._streams[gpu])

    def read(self, va: int, nbytes: int) -> bytes:
        out = bytearray(nbytes)
        with self._lock:
            span = self._space.resolve(va, nbytes)
            if nbytes:
                with self._on(span.gpu):
                    self._call("cuMemcpyDtoH", out, self._ptr(va), nbytes)
        return bytes(out)

    def write(self, va: int, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        with self._lock:
            span = self._space.resolve(va, view.nbytes)
            if view.nbytes:
                with self._on(span.gpu):
                    self._call("cuMemcpyHtoD", self._ptr(va), view, view.nbytes)

    # -- figures

    def used_bytes(self, gpu: int | None = None) -> int:
        with self._lock:
            return self._space.mapped_bytes(gpu)

    def close(self) -> None:
        """Unmap and free everything (best effort); raises the first failure at the end."""
        errors: list[BaseException] = []

        def attempt(fn: Callable[[], object]) -> None:
            try:
                fn()
            except BackendError as exc:
                errors.append(exc)

        with self._lock:
            attempt(self.synchronize)
            for span in list(self._space.mappings):
                attempt(functools.partial(self.unmap, span.va, span.nbytes))
            for span in list(self._space.reservations):
                attempt(functools.partial(self.release_reservation, span.va, span.nbytes))
            for buf in list(self._host.values()):
                attempt(functools.partial(self.host_free, buf))
            for gpu, stream in list(self._streams.items()):
                attempt(functools.partial(self._destroy_stream, gpu, stream))
            for gpu in list(self._contexts):
                attempt(functools.partial(self._release_context, gpu))
        if errors:
            raise errors[0]

    def _destroy_stream(self, gpu: int, stream: Any) -> None:
        with self._on(gpu):
            self._call("cuStreamDestroy", stream)
        del self._streams[gpu]

    def _release_context(self, gpu: int) -> None:
        (dev,) = self._call("cuDeviceGet", gpu)
        self._call("cuDevicePrimaryCtxRelease", dev)
        del self._contexts[gpu]
