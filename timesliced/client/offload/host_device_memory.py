"""Device memory held in host buffers: the CPU stand-in of :class:`~.device_memory.DeviceMemory`.

It is the stand-in of the product (demo, CI, laptops), so it behaves like the
driver where that matters: unmapped memory is really freed, an access to an
unmapped address raises, mapping twice raises, async copies land only at
``synchronize()``, an optional capacity makes mapping fail when full, and an
optional bandwidth model makes copies take time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ...errors import BackendError, UnknownDevice
from ...util.parse import exact_size, human_size
from ..gpus import GpuNumbering
from .address_space import AddressSpace
from .device_memory import DEFAULT_GRANULARITY, HostBuffer


@dataclass
class _Copy:
    to_host: bool
    host: HostBuffer
    va: int
    nbytes: int


class HostDeviceMemory:
    """Simulated device memory in host buffers (see the module docstring).

    ``gpus``: how many devices; ``numbering``: how their numbers map to the
    node's (default: the identity, as on the simulated GPU; tests give one to
    stand in for a narrowed ``CUDA_VISIBLE_DEVICES``); ``capacity``: bytes per device (``None``:
    unlimited; mapping past it raises ``BackendError`` like the driver's out
    of memory); ``granularity``: the mapping unit; ``bandwidth``: bytes per
    second that copies are held to (``None``: unlimited), paid at
    ``synchronize()`` for async copies and at once for ``read`` / ``write``.
    ``trace(event, gpu, nbytes)`` is told every ``map`` and ``unmap`` once it took effect
    (``"map"`` / ``"unmap"``, the memory's GPU number): the order and room of a streamed
    switch, for tests and benchmarks. Thread-safe.

    Each object stands for one process's view of its devices: the bandwidth model charges each
    process's copies on their own, so two processes copying at once (a streamed switch: one
    parks, the other unparks) run at once, like a device with one copy engine per direction.
    """

    BASE_VA = 0x7F00_0000_0000  # fake addresses: far from 0 so an int offset is never mistaken for one

    def __init__(
        self,
        gpus: int = 1,
        *,
        numbering: GpuNumbering | None = None,
        capacity: int | None = None,
        granularity: int = DEFAULT_GRANULARITY,
        bandwidth: float | None = None,
        sleep: Callable[[float], None] = time.sleep,
        trace: Callable[[str, int, int], None] | None = None,
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
        self.numbering = numbering if numbering is not None else GpuNumbering.identity()
        self.capacity = capacity
        self.bandwidth = bandwidth or None
        self._granularity = granularity
        self._sleep = sleep
        self._trace = trace
        self._space = AddressSpace()
        self._memory: dict[int, bytearray] = {}  # mapping start -> its bytes
        self._queue: list[_Copy] = []
        self._next_va = self.BASE_VA
        self._lock = threading.Lock()

    # -- address space

    def node_gpu(self, gpu: int) -> int:
        self._check_gpu(gpu)
        try:
            return self.numbering.node(gpu)
        except UnknownDevice as exc:
            raise BackendError(exc.message, **exc.details) from exc

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
                    f"out of memory on GPU {gpu}: {exact_size(nbytes)} requested, "
                    f"{human_size(self.capacity - self._space.mapped_bytes(gpu))} free",
                    call="map",
                    gpu=gpu,
                )
            span = self._space.map(va, nbytes)
            self._memory[span.va] = bytearray(nbytes)  # like cuMemCreate, new memory; zeroed here
        if self._trace is not None:
            self._trace("map", gpu, nbytes)

    def unmap(self, va: int, nbytes: int) -> None:
        with self._lock:
            if any(va <= c.va < va + nbytes for c in self._queue):
                raise BackendError(f"unmapping [{va:#x}, +{nbytes}) while copies to or from it are queued", va=va)
            span = self._space.unmap(va, nbytes)
            del self._memory[span.va]  # really freed
        if self._trace is not None:
            self._trace("unmap", span.gpu, nbytes)

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
            raise BackendError(
                f"a copy of {exact_size(copy.nbytes)} does not fit a host buffer of {exact_size(copy.host.nbytes)}"
            )
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
