"""The device-memory seam of the offload executor: what it asks of the device, and pure helpers.

The executor (:mod:`.regions`) parks a region by copying it to host memory and
then *unmapping* its physical device memory while keeping its virtual address
range reserved; unparking maps new physical memory at the same address and
copies the bytes back. A pointer that user code holds thus stays valid across a
park / unpark cycle. That is CUDA's virtual memory management
(``cuMemAddressReserve`` / ``cuMemCreate`` + ``cuMemMap`` / ``cuMemUnmap``),
and :class:`DeviceMemory` is the seam that exposes exactly those steps.

Two implementations, each in its own module:

- :class:`~.cuda_device_memory.CudaDeviceMemory`: the real thing, on the CUDA
  driver API through cuda-python;
- :class:`~.host_device_memory.HostDeviceMemory`: device memory held in host
  buffers, the CPU stand-in (demo, CI, laptops).

Both keep their reservations and mappings in an
:class:`~.address_space.AddressSpace`, and both raise
:class:`~timesliced.errors.NotResident` for an access to memory that is
reserved but not mapped (a parked region) and
:class:`~timesliced.errors.BackendError` for every other failure.
"""

from __future__ import annotations

from typing import Protocol

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

    Addresses are plain ints. ``gpu`` is the device as this memory numbers it
    (a CUDA ordinal of the process for :class:`~.cuda_device_memory.CudaDeviceMemory`);
    ``node_gpu`` names it as the daemon does. ``reserve`` / ``map`` sizes and
    addresses must be multiples of ``granularity(gpu)``. Copies are
    asynchronous: they are complete only after ``synchronize()``. Every method
    raises ``BackendError`` on failure; ``read`` / ``write`` raise
    ``NotResident`` for reserved but unmapped memory.
    """

    def node_gpu(self, gpu: int) -> int:
        """The node's number (NVML index; the daemon's) of this memory's device ``gpu``.

        Raises ``BackendError`` for a device that is not there (or that cannot
        be matched with the node's GPUs, saying why).
        """
        ...

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
