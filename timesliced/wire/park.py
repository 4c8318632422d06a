"""How a job asks to be parked: the ``park`` argument of ``register`` (pure).

It crosses the wire, so both the client (which builds it) and the daemon (which parses it and
picks the backend) use this module; neither imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .. import errors
from .messages import arg_int, arg_str, arg_str_list

METHODS = ("sim", "cuda-checkpoint", "offload", "vllm", "sglang")
ENGINES = ("vllm", "sglang")
# The methods that stop a job's GPU work before they park it (cuda-checkpoint locks the process, the
# simulated GPU guards its pages), so a holder that did not yield may be preempted. Offload and the
# engines would unmap memory under running kernels: their jobs join no group that preempts.
FREEZING = ("sim", "cuda-checkpoint")


@dataclass(frozen=True)
class ParkSpec:
    """How a job asked to be parked (the ``park`` argument of ``register``)."""

    method: str
    endpoints: tuple[str, ...] = ()  # vllm / sglang: base URLs of the engine replicas
    tags: tuple[str, ...] = ()  # offload / vllm / sglang: which parts to park; () = all
    level: int = 1  # vllm sleep level (1: weights to host, 2: discard weights)

    def to_wire(self) -> dict[str, Any]:
        return {"method": self.method, "endpoints": list(self.endpoints), "tags": list(self.tags), "level": self.level}

    @classmethod
    def from_wire(cls, raw: Any, default: str) -> ParkSpec:
        """The ``park`` argument of ``register`` (None: ``default``'s method); raises ``BadRequest``."""
        if raw is None:
            return cls(default)
        if not isinstance(raw, dict):
            raise errors.BadRequest("'park' must be a map with a 'method'")
        method = arg_str(raw, "method")
        if method not in METHODS:
            raise errors.BadRequest(f"unknown parking method {method!r} (known: {', '.join(METHODS)})")
        endpoints = arg_str_list(raw, "endpoints", max_chars=2048)
        if method in ENGINES and not endpoints:
            raise errors.BadRequest(f"a job parked with {method} needs 'endpoints' (the engines' base URLs)")
        for url in endpoints:
            if not url.startswith(("http://", "https://")):
                raise errors.BadRequest(f"endpoint {url!r} is not an http(s) URL")
        level = arg_int(raw, "level", default=1)
        if level not in (1, 2):
            raise errors.BadRequest("'level' must be 1 (keep weights in host memory) or 2 (discard them)")
        return cls(method, tuple(endpoints), tuple(arg_str_list(raw, "tags", max_chars=128)), level)
