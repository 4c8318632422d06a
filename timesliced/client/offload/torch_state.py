"""Parking PyTorch state: modules, optimizers and tensors, by tag.

:class:`TorchOffload` is the torch counterpart of
:class:`~.regions.Offloader` and answers the same park /
unpark directives. Parking a tensor copies its data (and its ``.grad``) to a
host tensor, page-locked on CUDA, then swaps the tensor's storage for an
empty one (``t.data = torch.empty(0, ...)``) so that the caching allocator
can hand the memory back to the driver (``torch.cuda.empty_cache()``).
Unparking allocates device memory again, copies the host tensor into it on
a dedicated stream and swaps it back in. The tensor *objects* survive, so
``nn.Parameter`` identities, the optimizer's references to them and its
state dict stay valid; the device addresses change (unlike the raw path).

While parked a tensor is empty (shape ``[0]``): code that touches it fails
on the shape, so run GPU work only inside a granted slice.

``import torch`` happens here only; the rest of the package never needs it.
"""

from __future__ import annotations

import ctypes
import threading
import time
import weakref
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from ...errors import BackendError, BackendUnavailable, UnknownRegion
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


def _nbytes(t: Any) -> int:
    return int(t.numel() * t.element_size())


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
class _Parked:
    """A parked tensor: the object itself and its host copies."""

    tensor: Any
    tag: str
    label: str
    device: Any
    host: Any
    grad_host: Any | None = None
    checksum: int | None = None
    grad_checksum: int | None = None

    @property
    def nbytes(self) -> int:
        return _nbytes(self.host) + (_nbytes(self.grad_host) if self.grad_host is not None else 0)


class TorchOffload:
    """Parks and unparks registered torch tensors by tag (see the module docstring).

    ``verify``: checksum host copies at park and check the device copies at
    unpark (default of the calls' ``verify`` argument). ``drop_grads``:
    discard ``.grad`` at park instead of keeping it. ``keep_host_bytes``:
    host tensors kept for reuse once their tensors are back (``None``: all,
    ``0``: none). ``pin_memory``: page-lock host copies (``None``: for CUDA
    tensors). Thread-safe.

    Raises ``BackendUnavailable`` when torch is not installed.
    """

    def __init__(
        self,
        *,
        verify: bool = False,
        drop_grads: bool = False,
        keep_host_bytes: int | None = None,
        pin_memory: bool | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        _torch()
        if keep_host_bytes is not None and keep_host_bytes < 0:
            raise ValueError(f"keep_host_bytes must not be negative, got {keep_host_bytes}")
        self.verify = verify
        self.drop_grads = drop_grads
        self.keep_host_bytes = keep_host_bytes
        self.pin_memory = pin_memory
        self._clock = clock
        self._sources: dict[str, list[_Source]] = {}
        self._parked: dict[int, _Parked] = {}  # id(tensor) -> its parked state; holds the tensor alive
        self._kept: dict[tuple[int, str], tuple[weakref.ref[Any], Any]] = {}  # (id, "data"/"grad") -> host tensor
        self._streams: dict[Any, Any] = {}
        self._lock = threading.RLock()

    # -- registry

    def register(self, obj: Any, *, tag: str, name: str | None = None) -> int:
        """Register ``obj`` under ``tag``; returns how many tensors it holds now.

        ``obj``: an ``nn.Module`` (its parameters and buffers), an optimizer
        (its state tensors, found again at every park, so registering before
        the first step is fine), a tensor, or an iterable of tensors.
        Raises ``TypeError`` for anything else and ``ValueError`` for a
        tensor that is sparse, a view, registered under another tag, or for
        a tag that is parked now.
        """
        torch = _torch()
        if not isinstance(tag, str) or not tag:
            raise ValueError(f"tag must be a non-empty string, got {tag!r}")
        label = name or tag
        if isinstance(obj, torch.nn.Module):
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
            others = {id(t): other for other in self._sources if other != tag for _, _, t in self._resolve([other])}
            found = list(source.tensors())
            for what, t in found:
                self._check_tensor(what, t)
                if id(t) in others:
                    raise ValueError(f"{what} is registered under tag {others[id(t)]!r} already")
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
        with self._lock:
            return id(tensor) in self._parked

    def host_copy(self, tensor: Any) -> Any | None:
        """The host tensor that holds ``tensor``'s data while it is parked, else ``None``."""
        with self._lock:
            parked = self._parked.get(id(tensor))
            return parked.host if parked is not None else None

    def footprint(self) -> dict[int, int]:
        """Device bytes per GPU of the registered tensors (and grads) when all are resident."""
        with self._lock:
            out: dict[int, int] = {}
            for _, _, t in self._resolve(()):
                parked = self._parked.get(id(t))
                device = parked.device if parked is not None else t.device
                if device.type == "cuda":
                    n = parked.nbytes if parked is not None else self._resident_bytes(t)
                    out[device.index] = out.get(device.index, 0) + n
            return out

    def resident(self) -> dict[int, int]:
        """Device bytes per GPU held now by registered tensors (and grads)."""
        with self._lock:
            out: dict[int, int] = {}
            for _, _, t in self._resolve(()):
                if id(t) not in self._parked and t.device.type == "cuda":
                    out[t.device.index] = out.get(t.device.index, 0) + self._resident_bytes(t)
            return out

    # -- park / unpark

    def park(self, tags: Iterable[str] = (), *, verify: bool | None = None) -> MoveStats:
        """Copy the tagged tensors (all if ``tags`` is empty) to host and free their device memory.

        Tensors already parked are skipped. Raises ``UnknownRegion`` for an
        unregistered tag and ``BackendError`` when a copy fails, with every
        tensor still resident.
        """
        torch = _torch()
        verify = self.verify if verify is None else verify
        with self._lock:
            start = self._clock()
            selected = self._resolve(tags)
            todo = [x for x in selected if id(x[2]) not in self._parked]
            entries: list[_Parked] = []
            grads: list[Any] = []
            current = ("", "")
            # Phase 1: copy out; nothing is freed, so a failure leaves everything resident.
            try:
                for tag, label, t in todo:
                    current = (tag, label)
                    grad = t.grad if t.is_leaf and t.requires_grad else None
                    entry = _Parked(t, tag, label, t.device, self._host_for(t, "data", t))
                    if grad is not None and not self.drop_grads:
                        entry.grad_host = self._host_for(t, "grad", grad)
                    entries.append(entry)
                    grads.append(grad)
                copy_start = self._clock()
                streams: set[Any] = set()
                for entry, grad in zip(entries, grads, strict=True):
                    current = (entry.tag, entry.label)
                    streams.add(self._copy(entry.host, entry.tensor.detach(), entry.device))
                    if entry.grad_host is not None:
                        streams.add(self._copy(entry.grad_host, grad, entry.device))
                current = ("", "")
                self._sync(streams)
                copy_seconds = self._clock() - copy_start
                if verify:
                    for entry in entries:
                        entry.checksum = tensor_checksum(entry.host)
                        if entry.grad_host is not None:
                            entry.grad_checksum = tensor_checksum(entry.grad_host)
            except Exception as exc:
                self._drain()
                raise self._failure("park", exc, current, selected) from exc
            # Phase 2: swap in empty storage (cannot fail halfway in a way that matters).
            cuda = False
            for entry in entries:
                t = entry.tensor
                if t.is_leaf and t.requires_grad:
                    t.grad = None
                t.data = torch.empty(0, dtype=t.dtype, device=t.device)
                self._parked[id(t)] = entry
                cuda = cuda or entry.device.type == "cuda"
            if cuda:
                torch.cuda.empty_cache()  # hand the freed blocks back to the driver
            return self._stats("park", entries, selected, start, copy_seconds, verify)

    def unpark(self, tags: Iterable[str] = (), *, verify: bool | None = None) -> MoveStats:
        """Bring the tagged parked tensors (all if ``tags`` is empty) back to their devices.

        Tensors already resident are skipped. Raises ``UnknownRegion`` for an
        unregistered tag and ``BackendError`` when allocation, a copy or
        verification fails; every tensor of the call is then still parked.
        """
        torch = _torch()
        verify = self.verify if verify is None else verify
        with self._lock:
            start = self._clock()
            selected = self._resolve(tags)
            wanted = tag_set(tags) or set(self._sources)
            entries = [p for p in self._parked.values() if p.tag in wanted]
            fresh: list[tuple[Any, Any | None]] = []
            current = ("", "")
            try:
                for entry in entries:
                    current = (entry.tag, entry.label)
                    data = self._new_device_tensor(entry.host, entry.device)
                    grad = None
                    if entry.grad_host is not None:
                        grad = self._new_device_tensor(entry.grad_host, entry.device)
                    fresh.append((data, grad))
                copy_start = self._clock()
                streams: set[Any] = set()
                for entry, (data, grad) in zip(entries, fresh, strict=True):
                    current = (entry.tag, entry.label)
                    streams.add(self._copy(data, entry.host, entry.device))
                    if grad is not None:
                        streams.add(self._copy(grad, entry.grad_host, entry.device))
                current = ("", "")
                self._sync(streams)
                copy_seconds = self._clock() - copy_start
                if verify:
                    self._verify(entries, fresh)
            except Exception as exc:
                self._drain()
                fresh.clear()
                if any(e.device.type == "cuda" for e in entries):
                    torch.cuda.empty_cache()
                if isinstance(exc, BackendError) and exc.details.get("verify"):
                    exc.details["parked"] = sorted({e.label for e in entries})
                    raise
                raise self._failure("unpark", exc, current, selected) from exc
            for entry, (data, grad) in zip(entries, fresh, strict=True):
                t = entry.tensor
                t.data = data
                if grad is not None:
                    t.grad = grad
                del self._parked[id(t)]
                self._keep(entry)
            return self._stats("unpark", entries, selected, start, copy_seconds, verify)

    # -- overridable steps (tests inject failures here)

    def _new_host_tensor(self, like: Any) -> Any:
        torch = _torch()
        pin = self.pin_memory if self.pin_memory is not None else like.device.type == "cuda"
        pin = pin and like.device.type == "cuda" and torch.cuda.is_available()
        return torch.empty_like(like, device="cpu", pin_memory=pin)

    def _new_device_tensor(self, host: Any, device: Any) -> Any:
        # Allocated on the caller's current stream, so the caching allocator
        # never reuses the block under that stream's later kernels.
        return _torch().empty_like(host, device=device)

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

    @staticmethod
    def _check_tensor(what: str, t: Any) -> None:
        torch = _torch()
        if t.layout != torch.strided:
            raise ValueError(f"{what} is not a dense (strided) tensor")
        if t.is_meta:
            raise ValueError(f"{what} is a meta tensor: it has no memory to park")
        if t._base is not None:
            raise ValueError(f"{what} is a view: parking it would not free its base; register the base")

    def _resident_bytes(self, t: Any) -> int:
        n = _nbytes(t)
        if t.is_leaf and t.requires_grad and t.grad is not None:
            n += _nbytes(t.grad)
        return n

    def _host_for(self, owner: Any, which: str, like: Any) -> Any:
        """A host tensor shaped like ``like``: the one kept from the last cycle if it fits."""
        kept = self._kept.pop((id(owner), which), None)
        if kept is not None:
            ref, host = kept
            if ref() is owner and host.shape == like.shape and host.dtype == like.dtype:
                return host
        return self._new_host_tensor(like)

    def _keep(self, entry: _Parked) -> None:
        for key in [k for k, (ref, _) in self._kept.items() if ref() is None]:
            del self._kept[key]
        kept = sum(_nbytes(host) for _, host in self._kept.values())
        ref = weakref.ref(entry.tensor)
        for which, host in (("data", entry.host), ("grad", entry.grad_host)):
            if host is None:
                continue
            if self.keep_host_bytes is None or kept + _nbytes(host) <= self.keep_host_bytes:
                self._kept[(id(entry.tensor), which)] = (ref, host)
                kept += _nbytes(host)

    def _stream(self, device: Any) -> Any:
        torch = _torch()
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)
        return stream

    def _copy(self, dst: Any, src: Any, device: Any) -> Any:
        """Queue ``dst.copy_(src)``: on CUDA on the copy stream, after the work queued so far."""
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

    def _verify(self, entries: list[_Parked], fresh: list[tuple[Any, Any | None]]) -> None:
        bad: list[_Parked] = []
        for entry, (data, grad) in zip(entries, fresh, strict=True):
            expected = entry.checksum if entry.checksum is not None else tensor_checksum(entry.host)
            ok = tensor_checksum(data.cpu()) == expected
            if grad is not None and entry.grad_host is not None:
                g_expected = entry.grad_checksum
                if g_expected is None:
                    g_expected = tensor_checksum(entry.grad_host)
                ok = ok and tensor_checksum(grad.cpu()) == g_expected
            if not ok:
                bad.append(entry)
        if bad:
            first = bad[0]
            raise BackendError(
                f"tensor {first.label!r} (tag {first.tag!r}) does not match its parked copy after unpark",
                verify=True,
                region=first.label,
                tag=first.tag,
                mismatched=[e.label for e in bad],
            )

    def _failure(self, op: str, exc: Exception, current: tuple[str, str], selected: list[Any]) -> BackendError:
        tag, label = current
        where = f" at {label!r} ({tag})" if label else ""
        state = "every tensor is still resident" if op == "park" else "every tensor of the call is still parked"
        cause = getattr(exc, "message", None) or f"{exc.__class__.__name__}: {exc}"
        parked = sorted(p.label for p in self._parked.values())
        details: dict[str, Any] = {"op": op, "cause": cause, "parked": parked}
        if label:
            details.update(region=label, tag=tag)
        return BackendError(f"{op} failed{where}: {cause}; {state}", **details)

    def _stats(
        self, op: str, moved: list[_Parked], selected: list[Any], start: float, copy_seconds: float, verify: bool
    ) -> MoveStats:
        per_gpu: dict[int, int] = {}
        for entry in moved:
            if entry.device.type == "cuda":
                per_gpu[entry.device.index] = per_gpu.get(entry.device.index, 0) + entry.nbytes
        return MoveStats(
            op=op,
            nbytes=sum(e.nbytes for e in moved),
            seconds=self._clock() - start,
            copy_seconds=copy_seconds if moved else 0.0,
            regions=len(moved),
            skipped=len(selected) - len(moved),
            verified=verify,
            per_gpu=per_gpu,
            resident=self.resident(),
            footprint=self.footprint(),
        )
