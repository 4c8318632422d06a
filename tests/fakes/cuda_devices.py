"""A machine's GPUs as the CUDA driver enumerates them for one process, and as NVML lists them.

``Machine`` holds physical GPUs (UUID, PCI bus id, a speed, MIG instances).
``Machine.driver(env)`` is the part of ``cuda.bindings.driver`` that device
numbering uses (``cuInit``, ``cuDeviceGetCount``, ``cuDeviceGet``,
``cuDeviceGetUuid``), enumerating the GPUs as the CUDA documentation says the
driver does for a process with that environment:

- ``CUDA_DEVICE_ORDER``: ``FASTEST_FIRST`` (the default) puts the fastest first
  (the driver's heuristic; ``speed`` stands in for it, ties by PCI bus id),
  ``PCI_BUS_ID`` orders by PCI bus id;
- ``CUDA_VISIBLE_DEVICES``: unset, every GPU; empty, none (``cuInit`` returns
  ``CUDA_ERROR_NO_DEVICE``); else a comma-separated list enumerated in its own
  order, of indices (into the order above: the long-standing behaviour; the
  CUDA 13 guide words them as nvidia-smi's indices, and the code under test
  never reads the variable either way), ``GPU-`` UUID prefixes that name
  one GPU, or ``MIG-`` UUIDs of MIG instances. The first entry that names no
  device ends the list; a device named twice hides every device.

Results are the real ``CUresult`` values and UUIDs real ``CUuuid`` structs where
cuda-python is installed (stand-ins with the same numbers, names and ``bytes``
otherwise). ``Machine.nvml()`` is a ``FakeNvml`` (tests/fakes/nvml.py) over the
same GPUs, in PCI bus order as NVML lists them, that also resolves MIG UUIDs
(``nvmlDeviceGetHandleByUUID``, ``nvmlDeviceGetDeviceHandleFromMigDeviceHandle``,
``nvmlDeviceGetIndex``).
"""

from __future__ import annotations

import ctypes
import enum
import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest

from .nvml import FakeGpu, FakeNvml, nvml_error, pynvml

try:
    _real: Any = importlib.import_module("cuda.bindings.driver")
except ImportError:  # pragma: no cover - exercised where cuda-python is missing
    _real = None


class StandInCUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_NOT_INITIALIZED = 3
    CUDA_ERROR_NO_DEVICE = 100
    CUDA_ERROR_INVALID_DEVICE = 101


class _StandInUuid:
    def __init__(self, raw: bytes) -> None:
        self.bytes = raw


def _result(name: str) -> Any:
    return getattr(_real.CUresult, name) if _real is not None else StandInCUresult[name]


@dataclass
class Gpu:
    """One physical GPU: its UUID bytes, PCI bus id, relative speed and MIG instances' UUID bytes."""

    uuid: bytes
    bus: int
    speed: int = 1
    migs: list[bytes] = field(default_factory=list)

    def text(self, kind: str = "GPU", raw: bytes | None = None) -> str:
        h = (raw or self.uuid).hex()
        return f"{kind}-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


class Machine:
    """Physical GPUs; see the module docstring."""

    def __init__(self, gpus: list[Gpu]) -> None:
        self.gpus = gpus

    def by_bus(self) -> list[Gpu]:
        return sorted(self.gpus, key=lambda g: g.bus)

    def visible(self, env: Mapping[str, str]) -> list[bytes] | None:
        """The UUIDs of the devices a process with ``env`` sees, in ordinal order (``None``: none at all)."""
        order = env.get("CUDA_DEVICE_ORDER", "FASTEST_FIRST")
        ranked = self.by_bus() if order == "PCI_BUS_ID" else sorted(self.gpus, key=lambda g: (-g.speed, g.bus))
        spec = env.get("CUDA_VISIBLE_DEVICES")
        if spec is None:
            return [g.uuid for g in ranked]
        out: list[bytes] = []
        for entry in (e.strip() for e in spec.split(",")) if spec.strip() else ():
            found = self._entry(entry, ranked)
            if found is None:
                break
            if found in out:
                return []
            out.append(found)
        return out or None

    def _entry(self, entry: str, ranked: list[Gpu]) -> bytes | None:
        if entry.isdigit():
            return ranked[int(entry)].uuid if int(entry) < len(ranked) else None
        if entry.startswith("MIG-"):
            for g in ranked:
                for mig in g.migs:
                    if g.text("MIG", mig).lower() == entry.lower():
                        return mig
            return None
        if entry.startswith("GPU-"):
            hits = [g.uuid for g in ranked if g.text().lower().startswith(entry.lower())]
            return hits[0] if len(hits) == 1 else None
        return None

    def driver(self, env: Mapping[str, str]) -> FakeDriver:
        return FakeDriver(self, env)

    def nvml(self) -> MigNvml:
        return MigNvml(self)


class FakeDriver:
    """The device-numbering calls of ``cuda.bindings.driver`` for one process (see the module docstring)."""

    def __init__(self, machine: Machine, env: Mapping[str, str]) -> None:
        self.machine = machine
        self.env = dict(env)
        self.devices: list[bytes] | None = None  # set by cuInit, as the driver reads the environment once
        self.calls: list[str] = []
        self._keep: list[Any] = []  # the buffers behind real CUuuid structs

    def _enter(self, name: str, *args: Any) -> None:
        if _real is not None:  # a wrong name or argument count fails here as it would against the bindings
            import inspect

            inspect.signature(getattr(_real, name)).bind(*args)
        self.calls.append(name)

    def cuInit(self, flags: int) -> tuple[Any]:
        self._enter("cuInit", flags)
        self.devices = self.machine.visible(self.env)
        return (_result("CUDA_ERROR_NO_DEVICE" if self.devices is None else "CUDA_SUCCESS"),)

    def cuDeviceGetCount(self) -> tuple[Any, int]:
        self._enter("cuDeviceGetCount")
        if self.devices is None:
            return (_result("CUDA_ERROR_NOT_INITIALIZED"), 0)
        return (_result("CUDA_SUCCESS"), len(self.devices))

    def cuDeviceGet(self, ordinal: int) -> tuple[Any, Any]:
        self._enter("cuDeviceGet", ordinal)
        if self.devices is None or not 0 <= ordinal < len(self.devices):
            return (_result("CUDA_ERROR_INVALID_DEVICE"), None)
        return (_result("CUDA_SUCCESS"), _real.CUdevice(ordinal) if _real is not None else ordinal)

    def cuDeviceGetUuid(self, dev: Any) -> tuple[Any, Any]:
        self._enter("cuDeviceGetUuid", dev)
        assert self.devices is not None
        raw = self.devices[int(dev)]
        if _real is None:
            return (_result("CUDA_SUCCESS"), _StandInUuid(raw))
        buf = ctypes.create_string_buffer(raw, 16)
        self._keep.append(buf)
        return (_result("CUDA_SUCCESS"), _real.CUuuid(ctypes.addressof(buf)))


class MigNvml(FakeNvml):
    """``FakeNvml`` over a machine's GPUs (PCI bus order), resolving MIG instances by UUID."""

    def __init__(self, machine: Machine) -> None:
        self.machine = machine
        self.ordered = machine.by_bus()
        super().__init__([FakeGpu(uuid=g.text()) for g in self.ordered])
        self._migs = {
            g.text("MIG", m).lower(): (i, k) for i, g in enumerate(self.ordered) for k, m in enumerate(g.migs)
        }

    def install(self, monkeypatch: pytest.MonkeyPatch) -> MigNvml:
        super().install(monkeypatch)
        for name in ("nvmlDeviceGetHandleByUUID", "nvmlDeviceGetDeviceHandleFromMigDeviceHandle", "nvmlDeviceGetIndex"):
            monkeypatch.setattr(pynvml, name, getattr(self, name))
        return self

    # MIG handles are addresses above 0x1000 (GPU handles are 1..n), never dereferenced.
    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> Any:
        self._initialized("nvmlDeviceGetHandleByUUID")
        for i, g in enumerate(self.ordered):
            if g.text().lower() == uuid.lower():
                return ctypes.cast(ctypes.c_void_p(i + 1), pynvml.c_nvmlDevice_t)
        if uuid.lower() in self._migs:
            i, k = self._migs[uuid.lower()]
            return ctypes.cast(ctypes.c_void_p(0x1000 * (i + 1) + k), pynvml.c_nvmlDevice_t)
        raise nvml_error(pynvml.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, mig: Any) -> Any:
        self._initialized("nvmlDeviceGetDeviceHandleFromMigDeviceHandle")
        address = ctypes.cast(mig, ctypes.c_void_p).value or 0
        if address < 0x1000:
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)  # not a MIG handle
        return ctypes.cast(ctypes.c_void_p(address // 0x1000), pynvml.c_nvmlDevice_t)

    def nvmlDeviceGetIndex(self, handle: Any) -> int:
        self._initialized("nvmlDeviceGetIndex")
        return self._index(handle)
