"""Which parking methods this node offers, and the devices they schedule.

``--backend`` names the default method, the one a job gets when it does not
name its own at registration:

- ``sim``: simulated GPUs (no driver needed); jobs may also use ``offload``,
  ``vllm`` and ``sglang`` against them (their memory lives elsewhere).
- ``cuda-checkpoint``: real GPUs from NVML; needs a driver with the checkpoint
  API and fitting cuda-bindings, checked at start with a clear error. The probe
  initialises the daemon's CUDA driver without an inherited ``CUDA_VISIBLE_DEVICES``
  and decides how footprints are measured (``status``: ``parking.checkpoint``).
- ``offload`` / ``vllm`` / ``sglang``: real GPUs from NVML where there is a
  driver, else simulated GPUs stand in for scheduling (a laptop, CI).
- ``auto``: ``cuda-checkpoint`` where the driver supports it, else ``sim``;
  the reason is logged and shown by ``status``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .. import errors
from ..backends.base import Backend, DeviceInfo, GpuMemory
from ..backends.offload import Direct, OffloadBackend, free_room
from ..config import DaemonConfig
from ..wire import status
from ..wire.park import METHODS

if TYPE_CHECKING:
    from ..backends.cuda_checkpoint import CudaCheckpointBackend
    from ..backends.sim import SimBackend
    from ..nvml import Nvml

log = logging.getLogger(__name__)

CHOICES = ("auto", *METHODS)


@dataclass
class Parking:
    default: str  # the method of jobs that name none
    why: str  # how the default was chosen
    devices: list[DeviceInfo]
    device_source: str  # "sim" | "nvml"
    backends: dict[str, Backend]
    unavailable: dict[str, str] = field(default_factory=dict)  # method -> why not on this node
    nvml: Nvml | None = None  # the open NVML handle, when there is a driver
    sim: SimBackend | None = None  # the simulated GPUs' backend, when the devices are simulated

    def backend(self, method: str) -> Backend:
        found = self.backends.get(method)
        if found is None:
            why = self.unavailable.get(method, f"unknown parking method {method!r} (known: {', '.join(METHODS)})")
            raise errors.BackendUnavailable(f"parking method {method!r} is not available on this node: {why}")
        return found

    def describe(self) -> status.Parking:
        checkpoint = getattr(self.backends.get("cuda-checkpoint"), "describe", None)
        return {
            "default": self.default,
            "why": self.why,
            "device_source": self.device_source,
            "methods": {m: "available" if m in self.backends else self.unavailable.get(m, "") for m in METHODS},
            "checkpoint": checkpoint() if callable(checkpoint) else None,
            "sim_held": self.sim.held() if self.sim is not None else {},
        }

    def sim_or_raise(self) -> SimBackend:
        """The simulated GPUs' backend; raises ``BackendUnavailable`` on a node with real GPUs."""
        if self.sim is None:
            raise errors.BackendUnavailable("simulated device memory needs simulated GPUs (--backend sim)")
        return self.sim

    async def aclose(self) -> None:
        for backend in self.backends.values():
            try:
                await backend.aclose()
            except Exception:
                log.exception("closing backend %s failed", backend.name)
        if self.nvml is not None:
            self.nvml.close()


def open_parking(config: DaemonConfig, direct: Direct) -> Parking:
    """Probe the node and build every backend it can run; raises ``BackendUnavailable``."""
    if config.backend not in CHOICES:
        raise errors.BackendUnavailable(f"unknown backend {config.backend!r} (choose from {', '.join(CHOICES)})")
    nvml = None
    checkpoint_verdict = "the daemon simulates its GPUs (--backend sim)"
    checkpoint = None
    if config.backend != "sim":
        from ..nvml import Nvml

        nvml = Nvml.open()
        checkpoint, checkpoint_verdict = _open_cuda_checkpoint(config, nvml)
    if config.backend == "cuda-checkpoint" and checkpoint is None:
        if nvml is not None:
            nvml.close()
        raise errors.BackendUnavailable(f"cuda-checkpoint cannot run here: {checkpoint_verdict}")
    if config.backend == "auto":
        default = "cuda-checkpoint" if checkpoint is not None else "sim"
        why = "auto: " + ("the driver supports checkpoints" if checkpoint is not None else checkpoint_verdict)
    else:
        default, why = config.backend, "--backend"
    real = nvml is not None and nvml.available and default != "sim"
    backends: dict[str, Backend] = {}
    unavailable: dict[str, str] = {}
    sim = None
    if real:
        assert nvml is not None
        devices, source = nvml.devices(), "nvml"
        unavailable["sim"] = "the node has real GPUs (start with --backend sim to simulate)"
    else:
        if nvml is not None and default != "sim":
            log.warning("no NVML (%s): simulating %d GPUs to schedule %s jobs", nvml.reason, config.gpus, default)
        if nvml is not None:
            nvml.close()
        sim = _open_sim(config)
        devices, source = sim.devices(), "sim"
        backends["sim"] = sim
    if checkpoint is not None and real:
        backends["cuda-checkpoint"] = checkpoint
    else:
        unavailable["cuda-checkpoint"] = checkpoint_verdict if checkpoint is None else "the GPUs are simulated"
        if checkpoint is not None:
            checkpoint.close()
    memory: GpuMemory | None = nvml if real else None
    # A swap's restore may start in the free room less the headroom, read from NVML on real GPUs.
    backends["offload"] = OffloadBackend(
        direct, verify=config.offload_verify, room=free_room(memory, config.memory_headroom)
    )
    from ..backends.engines import make_engine_backend

    for method in ("vllm", "sglang"):
        backends[method] = make_engine_backend(method, timeout=config.engine_timeout, memory=memory)
    return Parking(default, why, devices, source, backends, unavailable, nvml if real else None, sim)


def _open_sim(config: DaemonConfig) -> Any:
    from ..backends.sim import SimBackend

    return SimBackend(
        config.resolved_sim_dir(),
        gpus=config.gpus,
        capacity=config.gpu_memory,
        page_size=config.page_size,
        bandwidth=config.bandwidth,
        pool=config.sim_pool,
    )


def _open_cuda_checkpoint(config: DaemonConfig, nvml: Any) -> tuple[CudaCheckpointBackend | None, str]:
    """The backend and "ok", or None and why not."""
    from ..backends import cuda_checkpoint

    try:
        backend = cuda_checkpoint.open_backend(nvml, lock_timeout=config.lock_timeout)
    except errors.BackendUnavailable as exc:
        return None, exc.message
    return backend, "ok"
