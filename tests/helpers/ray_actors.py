"""Ray actor classes for the Ray integration's tests (workers import them from this checkout)."""

from __future__ import annotations

import os
from typing import Any

from timesliced.integrations.ray import TimeslicedActor, gpu_phase


def holders(actor: TimeslicedActor) -> dict[str, str | None]:
    return {g["group"]: g["holder"] for g in actor.timeslice.status()["groups"]}


class Worker(TimeslicedActor):
    """A trainer or a sampler: its weights in a simulated device region, filled from a seed."""

    def __init__(self, job: str, group: str, gpu: int, address: str) -> None:
        self.connected = self.timeslice_connect(job, group, address=address, gpus=[gpu])
        self.region: Any = None

    def info(self) -> dict[str, Any]:
        return {**self.connected, "actor_pid": os.getpid()}

    @gpu_phase(timeout=30)
    def load(self, nbytes: int, seed: int) -> str:
        self.region = self.timeslice.sim_alloc(nbytes, self.timeslice.gpus[0])
        self.region.fill(bytes([seed % 251 + 1, 7, seed % 13]))
        return str(self.region.checksum())

    @gpu_phase(timeout=30)
    def generate(self) -> dict[str, Any]:
        grant = self.timeslice_grant
        assert grant is not None
        return {"holders": holders(self), "checksum": self.region.checksum(), "restored": grant.restored}

    @gpu_phase(timeout=30)
    def send_weights(self) -> dict[str, Any]:
        return {"holders": holders(self), "weights": self.region.read()}

    @gpu_phase(timeout=30)
    def receive_weights(self, sent: list[Any]) -> dict[str, Any]:
        import ray

        seen = holders(self)
        self.region.write(ray.get(sent[0])["weights"])  # the trainer sends while both are held
        return {"holders": seen, "checksum": self.region.checksum()}

    def hold(self) -> bool:
        """Take the lock and keep it: the test kills the actor while it holds."""
        self.timeslice.acquire(30)
        return True
