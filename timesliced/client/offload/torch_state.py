"""Parking PyTorch state: modules, optimizers and tensors, by tag, one storage at a time.

:class:`TorchOffload` is the torch counterpart of :class:`~.regions.Offloader`
and answers the same park / unpark directives. It parks *storages*, not
tensors: the distinct ``untyped_storage()`` of every registered tensor (and of
its ``.grad``) is copied once to a host buffer (page-locked for CUDA), then
resized to zero bytes, which gives its memory back to the caching allocator
(``torch.cuda.empty_cache()`` then returns it to the driver). Unparking resizes
each storage to its size again and copies the bytes back. The tensors are never
touched: every view of a storage, every parameter cut from one flat buffer,
every ``expand``-ed buffer and every ``.grad`` keeps its Python object, shape,
strides and storage offset, and keeps sharing memory with the others (their
``data_ptr()`` move together: the differences between them stay the same).
So ``nn.Parameter`` identities, the optimizer's references and state, and
gradients that are views of one bucket all survive. That is how FSDP frees and
re-allocates its flat parameters (``torch.distributed.utils._free_storage`` /
``_alloc_storage``: ``resize_`` of the storage).

What torch does, as this module relies on it (torch 2.13):

- ``UntypedStorage.resize_(0)`` frees the memory and leaves the storage with a
  null pointer; ``resize_(n)`` allocates ``n`` bytes on the storage's own device
  (``resize_bytes_cuda`` takes a device guard of the storage's device) on that
  device's current stream. A storage that torch did not allocate (``from_numpy``,
  DLPack, ``from_blob``) is not resizable and is refused at registration.
- Tensors that share a storage share one ``StorageImpl``; ``untyped_storage()``
  returns the same object for all of them, and ``_cdata`` is its address.
- ``torch.cuda.synchronize(device)`` waits for all kernels in all streams on the
  device (its docstring; it calls ``cudaDeviceSynchronize`` under the device's
  guard): a park waits for every stream of the job, not only the caller's
  current one, before its first copy.
- A copy through a byte view of the storage (``torch.empty(0).set_(storage)``)
  bumps no version counter of the registered tensors, so tensors saved for
  backward stay valid: their bytes come back unchanged.

While parked, a tensor keeps its shape but its storage holds no memory:
touching it reads freed memory (a crash on CPU, an illegal-address fault that
ends the CUDA context on a GPU). Touch device state only inside a granted slice.

Refused at registration, with the tensor named: DTensors and other wrapper
subclasses (FSDP2's ``fully_shard``, tensor parallelism: their memory is their
local shards, which torch.distributed manages), modules under FSDP, storages
that are not resizable, tensors of devices other than CPU and CUDA, and storages
inside a private memory pool of the caching allocator (a CUDA graph's pool, a
``torch.cuda.MemPool``): a CUDA graph replays at the addresses it captured, and
an unpark moves every storage. Tensors that a graph only *reads* (parameters
that ``make_graphed_callables`` or ``torch.compile(mode="reduce-overhead")``
captured as static inputs) live in the ordinary pool and cannot be told apart:
do not register those; park such a job with ``cuda-checkpoint`` (or keep the
memory in :class:`~.regions.Offloader` regions, whose addresses survive a park).

Per-GPU figures are keyed by the node's GPU numbers (the daemon's), mapped from
torch's CUDA device indices by :mod:`timesliced.client.gpus`.

``import torch`` happens here only; the rest of the package never needs it.
"""

from __future__ import annotations

import ctypes
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from ...errors import BackendError, BackendUnavailable, UnknownRegion
from ..gpus import GpuNumbering, process_numbering
from .device_memory import DEFAULT_CHUNK, plan_chunks
from .parkable import MoveStats, tag_set


def _torch() -> Any:
    try:
        import torch  # type: ignore[import-not-found, unused-ignore]
    except ImportError as exc:
        raise BackendUnavailable("parking torch state needs PyTorch (pip install 'timesliced[torch]')") from exc
    return torch


def tensor_checksum(t: Any) -> int:
    """CRC-32 of a CPU tensor's bytes in row-major order."""
    torch = _torch()
    flat = t.detach().reshape(-1).contiguous()
    if flat.numel() == 0:
        return 0
    raw = flat.view(torch.uint8)
    crc = 0
    for off, n in plan_chunks(raw.numel(), DEFAULT_CHUNK):
        crc = zlib.crc32(ctypes.string_at(raw.data_ptr() + off, n), crc)
    return crc


def storage_key(t: Any) -> int:
    """What identifies ``t``'s storage: the address of its ``StorageImpl``, shared by every view of it."""
    return int(t.untyped_storage()._cdata)


def _bytes_of(storage: Any) -> Any:
    """A ``uint8`` tensor over the whole of ``storage`` (no copy: it aliases the storage)."""
    torch = _torch()
    n = storage.nbytes()
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (n,), (1,))


class _Source:
    """Something registered under a tag; lists its tensors afresh each time (optimizer state grows lazily)."""

    def __init__(self, kind: str, obj: Any, label: str) -> None:
        self.kind = kind
        self.obj = obj
        self.label = label

    def tensors(self) -> Iterator[tuple[str, Any]]:
        torch = _torch()
        if self.kind == "module":
            for name, t in self.obj.named_parameters():
                yield f"{self.label}.{name}", t
            for name, t in self.obj.named_buffers():
                yield f"{self.label}.{name}", t
        elif self.kind == "optimizer":
            for i, group in enumerate(self.obj.param_groups):
                for j, p in enumerate(group["params"]):
                    for key, value in self.obj.state.get(p, {}).items():
                        if isinstance(value, torch.Tensor):
                            yield f"{self.label}.state[{i}.{j}].{key}", value
        else:
            for i, t in enumerate(self.obj):
                yield f"{self.label}[{i}]", t


@dataclass
class _Storage:
    """One storage of registered tensors (or of their grads), moved as a whole."""

    key: int
    storage: Any  # the UntypedStorage; held while parked, so the StorageImpl (and every view of it) lives on
    owner: Any  # the first tensor found on it
    tag: str
    label: str
    device: Any
    nbytes: int
    shared: int = 1  # registered tensors (and grads) on it
    host: Any = None  # uint8 host tensor with the bytes while parked
    checksum: int | None = None

    @property
    def where(self) -> str:
        others = f" and {self.shared - 1} more tensor(s) on its storage" if self.shared > 1 else ""
        return f"{self.label!r}{others}"


class TorchOffload:
    """Parks and unparks registered torch tensors by tag, one storage at a time (see the module docstring).

    ``verify``: checksum host copies at park and check the device copies at
    unpark (default of the calls' ``verify`` argument). ``drop_grads``:
    discard ``.grad`` at park (set to ``None``) instead of keeping it.
    ``keep_host_bytes``: host buffers kept for reuse once their storages are
    back (``None``: all, ``0``: none). ``pin_memory``: page-lock host copies
    (``None``: for CUDA storages). ``numbering``: how torch's CUDA device
    indices map to the node's GPU numbers (default: this process's, learned
    when the first CUDA tensor is registered). Thread-safe.

    Raises ``BackendUnavailable`` when torch is not installed.
    """

    def __init__(
        self,
        *,
        verify: bool = False,
        drop_grads: bool = False,
        keep_host_bytes: int | None = None,
        pin_memory: bool | None = None,
        numbering: GpuNumbering | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        _torch()
        if keep_host_bytes is not None and keep_host_bytes < 0:
            raise ValueError(f"keep_host_bytes must not be negative, got {keep_host_bytes}")
        self.verify = verify
        self.drop_grads = drop_grads
        self.keep_host_bytes = keep_host_bytes
        self.pin_memory = pin_memory
        self._numbering = numbering
        self._clock = clock
        self._sources: dict[str, list[_Source]] = {}
        self._parked: dict[int, _Storage] = {}  # storage key -> its parked state (holds the storage)
        self._kept: dict[int, tuple[Any, Any]] = {}  # storage key -> (StorageWeakRef, host buffer) for reuse
        self._checked: set[int] = set()  # storage keys already checked against private memory pools
        self._streams: dict[Any, Any] = {}
        self._lock = threading.RLock()

    # -- registry

    def register(self, obj: Any, *, tag: str, name: str | None = None) -> int:
        """Register ``obj`` under ``tag``; returns how many tensors it holds now.

        ``obj``: an ``nn.Module`` (its parameters and buffers), an optimizer
        (its state tensors, found again at every park, so registering before
        the first step is fine), a tensor (a view too: its whole storage is
        parked), or an iterable of tensors. Raises ``TypeError`` for anything
        else, ``ValueError`` for a tensor that cannot be parked (the message
        names it and says why: sparse, meta, a DTensor or a module under FSDP,
        a storage that is not resizable or lives in a CUDA graph's memory pool,
        a device other than CPU and CUDA), for a storage that tensors of
        another tag use, and for a tag that is parked now; ``UnknownDevice`` /
        ``BackendUnavailable`` for a CUDA device that cannot be named as the
        node names it.
        """
        torch = _torch()
        if not isinstance(tag, str) or not tag:
            raise ValueError(f"tag must be a non-empty string, got {tag!r}")
        label = name or tag
        if isinstance(obj, torch.nn.Module):
            self._check_module(obj, name or type(obj).__name__)
            source = _Source("module", obj, name or type(obj).__name__)
        elif isinstance(obj, torch.optim.Optimizer):
            source = _Source("optimizer", obj, name or type(obj).__name__)
        elif isinstance(obj, torch.Tensor):
            source = _Source("tensors", [obj], label)
        elif isinstance(obj, Iterable) and not isinstance(obj, (str, bytes, dict)):
            items = list(obj)
            for item in items:
                if not isinstance(item, torch.Tensor):
                    raise TypeError(f"expected tensors, got a {type(item).__name__} in the iterable")
            source = _Source("tensors", items, label)
        else:
            raise TypeError(f"cannot register a {type(obj).__name__}: pass a module, an optimizer or tensors")
        with self._lock:
            if any(p.tag == tag for p in self._parked.values()):
                raise ValueError(f"tag {tag!r} is parked; register after unparking it")
            found = list(source.tensors())
            for what, t in found:
                self._check_tensor(what, t)
            others = self._owners({tag})
            for what, t in found:
                other = others.get(storage_key(t))
                if other is not None:
                    raise ValueError(
                        f"{what!r} is on the storage of {other[1]!r}, registered under tag {other[0]!r} already: "
                        "a storage is parked whole, so it belongs to one tag; register them under one tag"
                    )
            self._check_pools([t for _, t in found])
            for _, t in found:
                if t.device.type == "cuda":
                    self._node(t.device)  # a CUDA device it cannot name fails here, not in a park
            self._sources.setdefault(tag, []).append(source)
            return len({id(t) for _, t in found})

    def unregister(self, tag: str) -> None:
        """Forget everything registered under ``tag``; raises ``ValueError`` while it is parked."""
        with self._lock:
            if tag not in self._sources:
                raise UnknownRegion(f"nothing is registered under tag {tag!r}", tags=[tag])
            if any(p.tag == tag for p in self._parked.values()):
                raise ValueError(f"tag {tag!r} is parked; unpark it first")
            del self._sources[tag]

    def tags(self) -> set[str]:
        with self._lock:
            return set(self._sources)

    def tensors(self, tags: Iterable[str] = ()) -> list[Any]:
        """The registered tensors with one of ``tags`` (all if empty), found now."""
        with self._lock:
            return [t for _, _, t in self._resolve(tags)]

    def is_parked(self, tensor: Any) -> bool:
        """Whether ``tensor``'s storage is parked (by this executor)."""
        with self._lock:
            return storage_key(tensor) in self._parked

    def host_copy(self, tensor: Any) -> Any | None:
        """A host tensor over the bytes that hold ``tensor``'s data while its storage is parked, else ``None``.

        It has ``tensor``'s dtype, shape, strides and storage offset, over the
        parked storage's host buffer: writing it changes what unpark brings back.
        """
        torch = _torch()
        with self._lock:
            parked = self._parked.get(storage_key(tensor))
            if parked is None:
                return None
            host = parked.host.untyped_storage()
            view = torch.empty(0, dtype=tensor.dtype, device="cpu")
            return view.set_(host, tensor.storage_offset(), tensor.size(), tensor.stride())

    def footprint(self) -> dict[int, int]:
        """Device bytes per GPU (the node's numbers) of the registered storages and grads when all are resident."""
        with self._lock:
            found = self._collect((), strict=False)
            entries = list(found.values()) + [p for k, p in self._parked.items() if k not in found]
            return self._per_gpu(entries)

    def resident(self) -> dict[int, int]:
        """Device bytes per GPU (the node's numbers) held now by registered storages and grads."""
        with self._lock:
            return self._per_gpu([s for s in self._collect((), strict=False).values() if s.key not in self._parked])

    # -- park / unpark

    def park(self, tags: Iterable[str] = (), *, verify: bool | None = None) -> MoveStats:
        """Copy the tagged storages (all if ``tags`` is empty) to host and free their device memory.

        Storages already parked are skipped. Every CUDA device involved is
        synchronised (all its streams) before the first copy. Raises
        ``UnknownRegion`` for an unregistered tag and ``BackendError`` when a
        copy fails (or a storage cannot be parked), with every storage still
        resident.
        """
        torch = _torch()
        verify = self.verify if verify is None else verify
        with self._lock:
            start = self._clock()
            current: _Storage | None = None
            try:
                found = self._collect(tags)
                self._check_pools([s.owner for s in found.values() if s.key not in self._checked])
            except ValueError as exc:
                raise BackendError(f"park refused: {exc}; every tensor is still resident", op="park") from exc
            todo = [s for s in found.values() if s.key not in self._parked and s.nbytes > 0]
            skipped = sum(1 for s in found.values() if s.key in self._parked)
            # Phase 1: copy out; nothing is freed, so a failure leaves everything resident.
            try:
                for s in todo:
                    current = s
                    s.host = self._host_for(s)
                current = None
                for device in sorted({s.device for s in todo if s.device.type == "cuda"}, key=str):
                    self._synchronize(device)  # every stream of the device: the job's own work lands first
                copy_start = self._clock()
                streams: set[Any] = set()
                for s in todo:
                    current = s
                    streams.add(self._copy(s.host, _bytes_of(s.storage), s.device))
                current = None
                self._sync(streams)
                copy_seconds = self._clock() - copy_start
                if verify:
                    for s in todo:
                        s.checksum = tensor_checksum(s.host)
            except Exception as exc:
                self._drain()
                for s in todo:
                    s.host = None
                raise self._failure("park", exc, current) from exc
            # Phase 2: free the device memory (resizing to zero frees; it does not fail halfway in a way that matters).
            for s in todo:
                s.storage.resize_(0)
                self._parked[s.key] = s
            if not tag_set(tags):  # every registered storage is in found: forget the ones that are gone
                self._checked &= set(found) | set(self._parked)
            if self.drop_grads:
                for _, _, t in self._resolve(tags):
                    if t.is_leaf and t.grad is not None:
                        t.grad = None
            if any(s.device.type == "cuda" for s in todo):
                torch.cuda.empty_cache()  # hand the freed blocks back to the driver
            return self._stats("park", todo, skipped, start, copy_seconds, verify)

    def unpark(self, tags: Iterable[str] = (), *, verify: bool | None = None) -> MoveStats:
        """Bring the tagged parked storages (all if ``tags`` is empty) back to their devices.

        Storages already resident are skipped. Raises ``UnknownRegion`` for an
        unregistered tag and ``BackendError`` when allocation, a copy or
        verification fails; every storage of the call is then still parked.
        """
        torch = _torch()
        verify = self.verify if verify is None else verify
        with self._lock:
            start = self._clock()
            found = self._collect(tags, strict=False)  # what is parked always comes back
            wanted = tag_set(tags) or set(self._sources)
            entries = [p for p in self._parked.values() if p.tag in wanted]
            skipped = sum(1 for s in found.values() if s.key not in self._parked and s.nbytes > 0)
            allocated: list[_Storage] = []
            current: _Storage | None = None
            try:
                for entry in entries:
                    current = entry
                    self._allocate(entry.storage, entry.nbytes)
                    allocated.append(entry)
                current = None
                copy_start = self._clock()
                streams: set[Any] = set()
                for entry in entries:
                    current = entry
                    streams.add(self._copy(_bytes_of(entry.storage), entry.host, entry.device))
                current = None
                self._sync(streams)
                copy_seconds = self._clock() - copy_start
                if verify:
                    self._verify(entries)
            except Exception as exc:
                self._drain()
                for entry in allocated:  # back to parked: the host copies are untouched
                    entry.storage.resize_(0)
                if any(e.device.type == "cuda" for e in allocated):
                    torch.cuda.empty_cache()
                if isinstance(exc, BackendError) and exc.details.get("verify"):
                    exc.details["parked"] = sorted(e.label for e in self._parked.values())
                    raise
                raise self._failure("unpark", exc, current) from exc
            for entry in entries:
                del self._parked[entry.key]
                self._keep(entry)
            return self._stats("unpark", entries, skipped, start, copy_seconds, verify)

    # -- overridable steps (tests inject failures here)

    def _new_host_tensor(self, nbytes: int, device: Any) -> Any:
        torch = _torch()
        pin = self.pin_memory if self.pin_memory is not None else device.type == "cuda"
        pin = pin and device.type == "cuda" and torch.cuda.is_available()
        return torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=pin)

    def _allocate(self, storage: Any, nbytes: int) -> None:
        # On the storage's device (resize_bytes_cuda takes its device guard), from that device's
        # current stream, so the caching allocator never reuses the block under that stream's later work.
        storage.resize_(nbytes)

    def _synchronize(self, device: Any) -> None:
        _torch().cuda.synchronize(device)

    def _private_pool_ranges(self, devices: set[Any]) -> list[tuple[int, int]]:
        """Address ranges ``[start, end)`` the caching allocator holds in private pools (CUDA graphs, MemPools)."""
        if not any(d.type == "cuda" for d in devices):
            return []
        # Every segment of every device; the default pool is (0, 0). Inductor's CUDA-graph trees find
        # their graphs' memory the same way (get_cudagraph_segments).
        snapshot = _torch().cuda.memory_snapshot
        try:
            segments = snapshot(include_traces=False)  # no allocation stacks to gather: cheaper
        except TypeError:  # an older torch: memory_snapshot(mempool_id=None), no include_traces
            segments = snapshot()
        return [
            (int(seg["address"]), int(seg["address"]) + int(seg["total_size"]))
            for seg in segments
            if tuple(seg.get("segment_pool_id", (0, 0))) != (0, 0)
        ]

    # -- helpers

    def _resolve(self, tags: Iterable[str]) -> list[tuple[str, str, Any]]:
        """(tag, label, tensor) for every tensor registered under ``tags`` (all if empty), each once."""
        wanted = sorted(tag_set(tags))
        unknown = sorted(set(wanted) - set(self._sources))
        if unknown:
            raise UnknownRegion(f"nothing is registered under tags {unknown}", tags=unknown)
        out: list[tuple[str, str, Any]] = []
        seen: set[int] = set()
        for tag in wanted or list(self._sources):
            for source in self._sources[tag]:
                for label, t in source.tensors():
                    if id(t) not in seen:
                        seen.add(id(t))
                        out.append((tag, label, t))
        return out

    def _collect(self, tags: Iterable[str], *, strict: bool = True) -> dict[int, _Storage]:
        """The storages of the tensors registered under ``tags`` (all if empty) and of their grads, each once.

        A parked storage is its parked entry. With ``strict``, raises
        ``ValueError`` when tensors of two tags share one storage (optimizer
        state found after registration); otherwise the first tag keeps it.
        """
        found: dict[int, _Storage] = {}
        for tag, label, t in self._resolve(tags):
            self._add(found, tag, label, t, strict)
            grad = t.grad if t.is_leaf else None  # .grad of a non-leaf warns, and autograd fills only leaves
            if grad is not None and not self.drop_grads:
                self._add(found, tag, f"{label}.grad", grad, strict)
        wanted = tag_set(tags)
        if strict and wanted:  # the storages of the tags asked for must not be the other tags' too
            for key, (tag, what) in self._owners(wanted).items():
                entry = found.get(key)
                if entry is not None:
                    raise ValueError(
                        f"{entry.where} (tag {entry.tag!r}) shares its storage with {what!r} (tag {tag!r})"
                    )
        return found

    def _add(self, found: dict[int, _Storage], tag: str, label: str, t: Any, strict: bool) -> None:
        if strict and not self._known(t):
            self._check_tensor(label, t)  # optimizer state and grads appear after registration
        key = storage_key(t)
        entry = found.get(key)
        if entry is not None:
            if entry.tag != tag and strict:
                raise ValueError(f"{label!r} (tag {tag!r}) shares its storage with {entry.label!r} (tag {entry.tag!r})")
            entry.shared += 1
            return
        parked = self._parked.get(key)
        if parked is not None:
            found[key] = parked
            return
        storage = t.untyped_storage()
        found[key] = _Storage(key, storage, t, tag, label, storage.device, int(storage.nbytes()))

    def _known(self, t: Any) -> bool:
        """Whether ``t``'s storage was checked already (at registration or at an earlier park)."""
        try:
            return storage_key(t) in self._checked
        except Exception:  # a tensor without a storage of its own: the check says what it is
            return False

    def _owners(self, skip: set[str]) -> dict[int, tuple[str, str]]:
        """Storage key -> (tag, label) of every registered tensor (and grad) outside the tags ``skip``."""
        out: dict[int, tuple[str, str]] = {}
        for tag in self._sources:
            if tag in skip:
                continue
            for _, label, t in self._resolve([tag]):
                out.setdefault(storage_key(t), (tag, label))
                grad = t.grad if t.is_leaf else None
                if grad is not None:
                    out.setdefault(storage_key(grad), (tag, f"{label}.grad"))
        return out

    @staticmethod
    def _check_module(module: Any, label: str) -> None:
        fsdp = sys.modules.get("torch.distributed.fsdp")  # nothing can be under FSDP unless it was imported
        if fsdp is None:
            return
        kinds = tuple(
            k for k in (getattr(fsdp, "FSDPModule", None), getattr(fsdp, "FullyShardedDataParallel", None)) if k
        )
        for name, sub in module.named_modules():
            if kinds and isinstance(sub, kinds):
                where = f"{label}.{name}" if name else label
                raise ValueError(
                    f"{where!r} is sharded by FSDP ({type(sub).__name__}): FSDP allocates and frees its parameters' "
                    "memory itself, and parking it underneath is not supported; park this job with the "
                    "cuda-checkpoint method instead"
                )

    @staticmethod
    def _check_tensor(what: str, t: Any) -> None:
        torch = _torch()
        dtensor = sys.modules.get("torch.distributed.tensor")
        if dtensor is not None and isinstance(t, getattr(dtensor, "DTensor", ())):
            raise ValueError(
                f"{what!r} is a DTensor (FSDP2's fully_shard or tensor parallelism): its memory is its local shard, "
                "which torch.distributed manages; parking DTensors is not supported: park this job with the "
                "cuda-checkpoint method instead"
            )
        from torch.utils._python_dispatch import is_traceable_wrapper_subclass  # type: ignore[import-not-found, unused-ignore]

        if is_traceable_wrapper_subclass(t):
            raise ValueError(
                f"{what!r} is a {type(t).__name__}, a tensor subclass that wraps other tensors: its own storage is not "
                "its memory; register the plain tensors it holds instead"
            )
        if t.layout != torch.strided:
            raise ValueError(f"{what!r} is not a dense (strided) tensor")
        if t.is_meta:
            raise ValueError(f"{what!r} is a meta tensor: it has no memory to park")
        if t.device.type not in ("cpu", "cuda"):
            raise ValueError(f"{what!r} is on {t.device}: only CPU and CUDA tensors can be parked")
        if not t.untyped_storage().resizable():
            raise ValueError(
                f"{what!r} uses memory torch did not allocate (from_numpy, DLPack, from_blob): its storage cannot be "
                "resized, so it cannot be parked; register a copy that torch owns (t.clone())"
            )

    def _check_pools(self, tensors: list[Any]) -> None:
        """Refuse storages in a private memory pool (a CUDA graph's): an unpark would move them under the graph."""
        if not tensors:
            return
        ranges = self._private_pool_ranges({t.device for t in tensors})
        for t in tensors:
            ptr = t.untyped_storage().data_ptr()
            if ptr and any(lo <= ptr < hi for lo, hi in ranges):
                raise ValueError(
                    f"tensor on {t.device} at {ptr:#x} lives in a private memory pool of the caching allocator (a CUDA "
                    "graph's, or a torch.cuda.MemPool): a graph replays at the addresses it captured, and an unpark "
                    "moves every storage; do not register it, or park this job with the cuda-checkpoint method"
                )
        self._checked.update(storage_key(t) for t in tensors)

    def _numbering_now(self) -> GpuNumbering:
        if self._numbering is None:
            self._numbering = process_numbering()
        return self._numbering

    def _node(self, device: Any) -> int:
        """The node's number of a CUDA device of this process."""
        return self._numbering_now().node(device.index if device.index is not None else 0)

    def _per_gpu(self, entries: Iterable[_Storage]) -> dict[int, int]:
        out: dict[int, int] = {}
        for s in entries:
            if s.device.type == "cuda" and s.nbytes:
                gpu = self._node(s.device)
                out[gpu] = out.get(gpu, 0) + s.nbytes
        return out

    def _host_for(self, s: _Storage) -> Any:
        """A host buffer for ``s``: the one kept from its last cycle if it still fits."""
        kept = self._kept.pop(s.key, None)
        if kept is not None:
            ref, host = kept
            if not ref.expired() and host.numel() == s.nbytes and host.is_pinned() == self._pinned(s.device):
                return host
        return self._new_host_tensor(s.nbytes, s.device)

    def _pinned(self, device: Any) -> bool:
        torch = _torch()
        pin = self.pin_memory if self.pin_memory is not None else device.type == "cuda"
        return bool(pin and device.type == "cuda" and torch.cuda.is_available())

    def _keep(self, entry: _Storage) -> None:
        from torch.multiprocessing.reductions import StorageWeakRef  # type: ignore[import-not-found, unused-ignore]

        for key in [k for k, (ref, _) in self._kept.items() if ref.expired()]:
            del self._kept[key]
        host, entry.host, entry.checksum = entry.host, None, None
        kept = sum(int(h.numel()) for _, h in self._kept.values())
        if self.keep_host_bytes is None or kept + entry.nbytes <= self.keep_host_bytes:
            self._kept[entry.key] = (StorageWeakRef(entry.storage), host)  # type: ignore[no-untyped-call, unused-ignore]

    def _stream(self, device: Any) -> Any:
        torch = _torch()
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)
        return stream

    def _copy(self, dst: Any, src: Any, device: Any) -> Any:
        """Queue ``dst.copy_(src)``: on CUDA on the copy stream, after the work queued so far on the current one."""
        torch = _torch()
        if device.type != "cuda":
            dst.copy_(src)
            return None
        stream = self._stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        return stream

    @staticmethod
    def _sync(streams: set[Any]) -> None:
        for stream in streams:
            if stream is not None:
                stream.synchronize()

    def _drain(self) -> None:
        try:
            self._sync(set(self._streams.values()))
        except Exception:
            pass  # the failure being handled is the one to report

    def _verify(self, entries: list[_Storage]) -> None:
        bad: list[_Storage] = []
        for entry in entries:
            expected = entry.checksum if entry.checksum is not None else tensor_checksum(entry.host)
            if tensor_checksum(_bytes_of(entry.storage).cpu()) != expected:
                bad.append(entry)
        if bad:
            first = bad[0]
            raise BackendError(
                f"tensor {first.where} (tag {first.tag!r}) does not match its parked copy after unpark",
                verify=True,
                region=first.label,
                tag=first.tag,
                mismatched=[e.label for e in bad],
            )

    def _failure(self, op: str, exc: Exception, current: _Storage | None) -> BackendError:
        where = f" at {current.where} ({current.tag})" if current is not None else ""
        state = "every tensor is still resident" if op == "park" else "every tensor of the call is still parked"
        cause = getattr(exc, "message", None) or f"{exc.__class__.__name__}: {exc}"
        parked = sorted(p.label for p in self._parked.values())
        details: dict[str, Any] = {"op": op, "cause": cause, "parked": parked}
        if current is not None:
            details.update(region=current.label, tag=current.tag)
        return BackendError(f"{op} failed{where}: {cause}; {state}", **details)

    def _stats(
        self, op: str, moved: list[_Storage], skipped: int, start: float, copy_seconds: float, verify: bool
    ) -> MoveStats:
        return MoveStats(
            op=op,
            nbytes=sum(s.nbytes for s in moved),
            seconds=self._clock() - start,
            copy_seconds=copy_seconds if moved else 0.0,
            regions=len(moved),
            skipped=skipped,
            verified=verify,
            per_gpu=self._per_gpu(moved),
            resident=self.resident(),
            footprint=self.footprint(),
        )
