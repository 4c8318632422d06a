"""Which GPU is which: this process's CUDA ordinals and the node's GPU numbers, matched by UUID.

The daemon numbers a node's GPUs as NVML does (``nvidia-smi``'s indices, the
``gpus`` of a registration, the keys of a footprint, ``timesliced status``).
A process sees CUDA *ordinals* instead: the driver renumbers the devices that
``CUDA_VISIBLE_DEVICES`` lets through (indices, ``GPU-<uuid>`` prefixes or
``MIG-<uuid>`` ids), in the order that variable lists them, or else in the
order ``CUDA_DEVICE_ORDER`` gives (``FASTEST_FIRST`` by default, not PCI bus
order). So ``cuda:0`` may be the node's GPU 3. Nothing here parses those
variables: the driver has applied them, and its answer is matched with NVML's
by the one name both share, the device's UUID. Nothing depends on
``CUDA_DEVICE_ORDER`` then.

- ``cuDeviceGetUuid`` (cuda-python, ``cuda.bindings.driver``) returns
  ``(CUresult, CUuuid)``; ``CUuuid.bytes`` is the device's 16 octets. For a MIG
  device it is the MIG instance's UUID (cuda-python 13's docstring; 12.x has
  that behaviour as ``cuDeviceGetUuid_v2``, used where the binding has it).
- NVML's ``nvmlDeviceGetUUID`` gives the same octets as text: ``GPU-`` then the
  16 bytes in order as lowercase hex in groups of 8-4-4-4-12 (how ``nvidia-smi
  -L`` prints them, and how CUDA programs format ``CUuuid`` to match NVML); a MIG
  instance reads ``MIG-`` and the same form (drivers from R470 on), and
  ``nvmlDeviceGetDeviceHandleFromMigDeviceHandle`` leads to its GPU.
- ``nvmlInit`` / ``nvmlShutdown`` are reference counted (NVML's documentation),
  so reading NVML here never closes it for someone else in the process.

Where the process cannot see NVML (the simulated GPU, a laptop, CPU torch), the
numbering is the identity: CUDA ordinals are taken as the node's numbers.
"""

from __future__ import annotations

import importlib
import logging
import sys
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import BackendUnavailable, UnknownDevice

log = logging.getLogger(__name__)

UUID_BYTES = 16
_GROUPS = (4, 2, 2, 2, 6)  # bytes per dash-separated group of the text form


def uuid_text(raw: bytes, kind: str = "GPU") -> str:
    """NVML's text form of 16 UUID bytes: ``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`` (``kind``: GPU or MIG)."""
    if len(raw) != UUID_BYTES:
        raise ValueError(f"a device UUID has {UUID_BYTES} bytes, got {len(raw)}")
    parts, at = [], 0
    for n in _GROUPS:
        parts.append(raw[at : at + n].hex())
        at += n
    return f"{kind}-" + "-".join(parts)


def uuid_bytes(text: str) -> bytes:
    """The 16 bytes of a UUID written as text (with or without a ``GPU-`` / ``MIG-`` prefix and dashes)."""
    body = text.strip()
    for prefix in ("GPU-", "MIG-"):
        if body.upper().startswith(prefix):
            body = body[len(prefix) :]
    raw = bytes.fromhex(body.replace("-", ""))
    if len(raw) != UUID_BYTES:
        raise ValueError(f"{text!r} is not a device UUID")
    return raw


@dataclass(frozen=True)
class GpuNumbering:
    """How this process's CUDA ordinals map to the node's GPU numbers (NVML indices).

    ``nodes[ordinal]`` is the node's number of CUDA device ``ordinal`` and
    ``uuids[ordinal]`` its UUID; ``nodes is None`` is the identity (no NVML
    here), unless ``problem`` says why the map could not be learned, which every
    lookup then raises. ``source`` says how it was learned.
    """

    nodes: tuple[int, ...] | None
    uuids: tuple[str, ...] = ()
    source: str = "identity"
    problem: str = ""

    @classmethod
    def identity(cls, source: str = "identity") -> GpuNumbering:
        return cls(None, (), source)

    @property
    def is_identity(self) -> bool:
        return self.nodes is None and not self.problem

    def node(self, ordinal: int) -> int:
        """The node's number of CUDA device ``ordinal``.

        Raises ``UnknownDevice`` for an ordinal this process does not see and
        ``BackendUnavailable`` when the map could not be learned (``problem``).
        """
        if isinstance(ordinal, bool) or not isinstance(ordinal, int) or ordinal < 0:
            raise ValueError(f"a CUDA device ordinal is a non-negative integer, got {ordinal!r}")
        if self.problem:
            raise BackendUnavailable(self.problem)
        if self.nodes is None:
            return ordinal
        if ordinal >= len(self.nodes):
            seen = f"CUDA devices 0..{len(self.nodes) - 1}" if self.nodes else "no CUDA device"
            raise UnknownDevice(
                f"CUDA device {ordinal} is not visible to this process (it sees {seen}; "
                "CUDA_VISIBLE_DEVICES decides which): use one of those",
                ordinal=ordinal,
                visible=len(self.nodes),
            )
        return self.nodes[ordinal]

    def nodes_of(self, ordinals: Iterable[int]) -> list[int]:
        """The node's numbers of several CUDA ordinals, in their order (see :meth:`node`)."""
        return [self.node(o) for o in ordinals]

    def local(self, node: int) -> int | None:
        """The CUDA ordinal of the node's GPU ``node`` in this process, or ``None`` where it sees no such device."""
        if self.problem:
            raise BackendUnavailable(self.problem)
        if self.nodes is None:
            return node
        return self.nodes.index(node) if node in self.nodes else None

    def per_node(self, per_ordinal: Mapping[int, int]) -> dict[int, int]:
        """Bytes per CUDA ordinal as bytes per node GPU (two ordinals of one GPU, MIG instances, add up)."""
        out: dict[int, int] = {}
        for ordinal, n in per_ordinal.items():
            gpu = self.node(ordinal)
            out[gpu] = out.get(gpu, 0) + n
        return out


def match_by_uuid(cuda: Sequence[bytes], node: Mapping[str, int]) -> tuple[int, ...]:
    """The node's number of each CUDA device, in ordinal order, from their UUIDs.

    ``cuda``: each ordinal's UUID bytes (``cuDeviceGetUuid``); ``node``: NVML's
    UUID text (``GPU-…``, and ``MIG-…`` for MIG instances) -> the GPU's index,
    any case. Raises ``UnknownDevice`` for a CUDA device that NVML does not list.
    """
    known = {uuid.lower(): index for uuid, index in node.items()}
    out: list[int] = []
    for ordinal, raw in enumerate(cuda):
        for kind in ("GPU", "MIG"):
            index = known.get(uuid_text(raw, kind).lower())
            if index is not None:
                out.append(index)
                break
        else:
            raise UnknownDevice(
                f"CUDA device {ordinal} ({uuid_text(raw)}) is not one of the GPUs NVML lists here "
                f"({', '.join(sorted(known)) or 'none'}): run the job where the daemon's NVML sees its GPUs",
                ordinal=ordinal,
                uuid=uuid_text(raw),
            )
    return tuple(out)


# --- what the driver and NVML say ---------------------------------------------------------------


def cuda_uuids(driver: Any) -> list[bytes]:
    """Each visible CUDA device's UUID, in ordinal order, through the driver API (``cuda.bindings.driver``).

    An empty list where the driver finds no device (``CUDA_VISIBLE_DEVICES``
    hides them all). Raises ``BackendUnavailable`` when the driver cannot be
    loaded or one of its calls fails.
    """
    try:
        result, *_ = driver.cuInit(0)
    except Exception as exc:  # cuda-python raises its own error when libcuda cannot be loaded
        raise BackendUnavailable(f"the CUDA driver cannot be loaded: {exc}") from exc
    if int(result) == _CUDA_ERROR_NO_DEVICE:
        return []  # e.g. CUDA_VISIBLE_DEVICES="" or one that names no GPU of this machine
    _check(result, "cuInit")
    result, count = driver.cuDeviceGetCount()
    _check(result, "cuDeviceGetCount")
    # cuda-python 12.x: cuDeviceGetUuid is the v1 call and _v2 returns MIG UUIDs; 13.x has only
    # cuDeviceGetUuid, with the v2 behaviour (its docstring).
    get_uuid = getattr(driver, "cuDeviceGetUuid_v2", None) or driver.cuDeviceGetUuid
    out: list[bytes] = []
    for ordinal in range(int(count)):
        result, dev = driver.cuDeviceGet(ordinal)
        _check(result, "cuDeviceGet")
        result, uuid = get_uuid(dev)
        _check(result, "cuDeviceGetUuid")
        out.append(bytes(uuid.bytes))
    return out


def torch_uuids(torch: Any) -> list[bytes]:
    """Each visible CUDA device's UUID as torch reports it (``get_device_properties(i).uuid``)."""
    out: list[bytes] = []
    for ordinal in range(int(torch.cuda.device_count())):
        uuid = torch.cuda.get_device_properties(ordinal).uuid
        raw = getattr(uuid, "bytes", None)  # torch's _CUuuid has .bytes; its text is 8-4-4-4-12 hex
        out.append(bytes(raw) if isinstance(raw, (bytes, bytearray)) else uuid_bytes(str(uuid)))
    return out


def nvml_uuids(lib: Any, extra: Iterable[str] = ()) -> dict[str, int] | None:
    """NVML's GPUs as UUID text -> index, or ``None`` where NVML cannot be used here.

    ``extra``: MIG UUIDs (``MIG-…``) to resolve to their GPU's index as well;
    one NVML does not know is left out. A GPU NVML counts but will not open
    (no permission, say) is left out too: no CUDA device of this process can be it.
    """
    try:
        lib.nvmlInit()
    except Exception as exc:  # no driver, no library, no permission: a machine without NVIDIA GPUs
        log.debug("NVML is not available here (%s): CUDA ordinals are the node's GPU numbers", exc)
        return None
    nvml_error = getattr(lib, "NVMLError", Exception)
    try:
        out: dict[str, int] = {}
        for index in range(int(lib.nvmlDeviceGetCount())):
            try:
                handle = lib.nvmlDeviceGetHandleByIndex(index)
                out[str(lib.nvmlDeviceGetUUID(handle))] = index
            except nvml_error as exc:
                log.debug("NVML GPU %d is left out of the numbering: %s", index, exc)
        for uuid in extra:
            try:
                mig = lib.nvmlDeviceGetHandleByUUID(uuid)
                parent = lib.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mig)
                out[uuid] = int(lib.nvmlDeviceGetIndex(parent))
            except nvml_error as exc:
                log.debug("NVML does not resolve %s: %s", uuid, exc)
        return out
    finally:
        try:
            lib.nvmlShutdown()
        except Exception:
            pass  # reference counted; a failing shutdown leaves nothing of ours open


def discover(*, driver: Any = None, nvml: Any = None, torch: Any = None) -> GpuNumbering:
    """Learn this process's numbering: CUDA's UUIDs (``driver``, else ``torch``) matched with NVML's.

    ``driver`` / ``nvml`` / ``torch`` replace ``cuda.bindings.driver``, ``pynvml``
    and an imported torch (tests); by default cuda-python is tried first, then
    torch if the process has imported it. Never raises: a map that cannot be
    learned is a numbering whose ``problem`` says why.
    """
    lib = nvml if nvml is not None else _import("pynvml")
    node = nvml_uuids(lib) if lib is not None else None
    if not node:
        return GpuNumbering.identity("no NVML GPUs here: CUDA ordinals are the node's numbers")
    raw: list[bytes] | None = None
    problems: list[str] = []
    sources: list[tuple[str, Any, Callable[[Any], list[bytes]]]] = [
        ("cuda-python", driver if driver is not None else _import("cuda.bindings.driver"), cuda_uuids)
    ]
    if torch is not None or "torch" in sys.modules:
        sources.append(("torch", torch if torch is not None else sys.modules["torch"], torch_uuids))
    source = ""
    for source, module, read in sources:
        if module is None:
            problems.append(f"{source} is not installed")
            continue
        try:
            raw = read(module)
            break
        except Exception as exc:
            problems.append(f"{source}: {exc}")
    if raw is None:
        return GpuNumbering(
            None,
            source="unknown",
            problem="this process's CUDA devices cannot be matched with the node's GPUs ("
            + "; ".join(problems or ["no way to ask CUDA"])
            + "): install cuda-python (pip install 'timesliced[cuda]')",
        )
    gpus = {u.lower() for u in node}
    unmatched = [uuid_text(r, "MIG") for r in raw if uuid_text(r).lower() not in gpus]
    if unmatched:  # MIG instances: NVML names them only through their GPU, so ask for these by UUID
        node = nvml_uuids(lib, unmatched) or node
    try:
        nodes = match_by_uuid(raw, node)
    except UnknownDevice as exc:
        return GpuNumbering(None, source=source, problem=exc.message)
    return GpuNumbering(nodes, tuple(uuid_text(r) for r in raw), f"{source} UUIDs matched with NVML's")


_process: GpuNumbering | None = None
_process_lock = threading.Lock()


def process_numbering() -> GpuNumbering:
    """This process's numbering, learned once (the driver reads ``CUDA_VISIBLE_DEVICES`` once, at ``cuInit``)."""
    global _process
    with _process_lock:
        if _process is None:
            _process = discover()
            log.debug("GPU numbering: %s (%s)", _process.nodes, _process.source)
        return _process


def node_gpus(ordinals: Iterable[int] | None = None) -> list[int]:
    """The node's GPU numbers of this process's CUDA devices ``ordinals`` (all it sees if ``None``).

    What to register when a job names its GPUs as it sees them: ``Client(...,
    gpus=node_gpus([0, 1]))``, or ``gpus="visible"``. Where NVML is not there
    the ordinals are returned as they are. Raises ``UnknownDevice`` for an
    ordinal this process does not see and ``BackendUnavailable`` when CUDA
    cannot be asked (or, with ``ordinals=None``, without NVML: the visible
    devices cannot be counted).
    """
    numbering = process_numbering()
    if ordinals is not None:
        return numbering.nodes_of(ordinals)
    if numbering.problem:
        raise BackendUnavailable(numbering.problem)
    if numbering.nodes is None:
        raise BackendUnavailable(
            "gpus='visible' needs NVML and CUDA to see which GPUs this process uses, and neither is "
            "here: name the node's GPUs as numbers (gpus=[0, 1])"
        )
    if not numbering.nodes:
        raise BackendUnavailable(
            "this process sees no CUDA device (CUDA_VISIBLE_DEVICES hides them all): set it to the job's "
            "GPUs, or name the node's GPUs as numbers (gpus=[0, 1])"
        )
    return list(numbering.nodes)


# --- helpers ------------------------------------------------------------------------------------

_CUDA_ERROR_NO_DEVICE = 100  # cuda.h


def _check(result: Any, call: str) -> None:
    if int(result) != 0:
        name = getattr(result, "name", None) or f"CUresult {int(result)}"
        raise BackendUnavailable(f"{call} failed: {name}", call=call, result=name)


def _import(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None
