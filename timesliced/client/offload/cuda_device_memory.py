"""Device memory through the CUDA driver API (cuda-python): the real :class:`~.device_memory.DeviceMemory`.

``cuda.bindings.driver`` is imported when a :class:`CudaDeviceMemory` is built,
never at import: this module imports without cuda-python.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from ...errors import BackendError, BackendUnavailable, UnknownDevice
from ...util.parse import exact_size
from ..gpus import GpuNumbering, discover
from .address_space import AddressSpace
from .device_memory import DEFAULT_CHUNK, HostBuffer, plan_chunks


def _import_driver() -> Any:
    try:
        return importlib.import_module("cuda.bindings.driver")
    except ImportError as exc:
        raise BackendUnavailable(
            "the offload backend needs cuda-python (pip install 'timesliced[cuda]')", cause=str(exc)
        ) from exc


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


class CudaDeviceMemory:
    """Device memory through the CUDA driver API (cuda-python).

    Regions live in the devices' primary contexts (the ones the CUDA runtime
    and PyTorch use), so their pointers work in any kernel of the process.
    Copies run in ``chunk_bytes`` pieces on one non-blocking stream per GPU;
    host buffers are page-locked (``cuMemHostAlloc``, portable) unless
    ``pinned=False``. ``driver`` replaces ``cuda.bindings.driver`` (tests).
    GPUs are CUDA ordinals of this process; ``node_gpu`` names them as the
    daemon does, through ``numbering`` (by default learned from this driver's
    UUIDs and NVML's on first use, see :mod:`timesliced.client.gpus`).

    Raises ``BackendUnavailable`` when cuda-python or the driver is missing,
    and ``BackendError`` with the failing call and CUresult name otherwise.
    """

    def __init__(
        self,
        *,
        chunk_bytes: int = DEFAULT_CHUNK,
        pinned: bool = True,
        driver: Any = None,
        numbering: GpuNumbering | None = None,
    ) -> None:
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
        self._numbering = numbering
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

    def node_gpu(self, gpu: int) -> int:
        with self._lock:
            if self._numbering is None:
                self._numbering = discover(driver=self._d)
            try:
                return self._numbering.node(gpu)
            except UnknownDevice as exc:  # a device the driver does not have is a BackendError here, as ever
                raise BackendError(exc.message, **exc.details) from exc

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

    # What a streamed swap relies on (CUDA programming guide, "Asynchronous Concurrent Execution", and
    # the cuMemcpy*Async reference): an async copy returns before it completes and runs in its
    # stream's order; it is asynchronous only with page-locked host memory (hence cuMemHostAlloc);
    # on a non-zero stream a host<->device copy may overlap operations in other streams; a device
    # with asyncEngineCount == 2 can run a host-to-device and a device-to-host copy at once, both
    # with page-locked memory. In a swap the two directions are two processes (two contexts), each
    # copying on its own stream; the guide says kernels of different contexts do not run at once
    # and says nothing of copies, so whether the two directions overlap across processes is
    # measured (tests/gpu, ``timesliced bench offload --device cuda``), not assumed.
    def _copy(self, call: str, host: HostBuffer, va: int, nbytes: int) -> None:
        if nbytes < 0 or nbytes > host.nbytes:
            raise BackendError(
                f"a copy of {exact_size(nbytes)} does not fit a host buffer of {exact_size(host.nbytes)}"
            )
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
