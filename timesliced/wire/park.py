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

# What opting in to weights that a park discards means, for every message that asks for it.
RELOAD_PROMISE = (
    "the job reloads the engine's weights itself after every restore, before it generates "
    '(vLLM: POST /collective_rpc with {"method": "reload_weights"}, or a weight update from its trainer; '
    "SGLang: POST /update_weights_from_disk, /update_weights_from_tensor or /update_weights_from_distributed)"
)


@dataclass(frozen=True)
class ParkSpec:
    """How a job asked to be parked (the ``park`` argument of ``register``).

    ``reloads_weights``: the job's engines may discard their weights when parked (vLLM sleep
    level 2; SGLang without ``--enable-weights-cpu-backup``) because the job reloads them itself
    after every restore. Without it such a park is refused, since the engine would wake up
    serving whatever the memory then holds.
    """

    method: str
    endpoints: tuple[str, ...] = ()  # vllm / sglang: base URLs of the engine replicas
    tags: tuple[str, ...] = ()  # offload / vllm / sglang: which parts to park; () = all
    level: int = 1  # vllm sleep level (1: weights to host, 2: discard weights)
    reloads_weights: bool = False  # vllm / sglang: the job reloads discarded weights itself

    def to_wire(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "endpoints": list(self.endpoints),
            "tags": list(self.tags),
            "level": self.level,
            "reloads_weights": self.reloads_weights,
        }

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
        reloads = raw.get("reloads_weights", False)
        if not isinstance(reloads, bool):
            raise errors.BadRequest("'reloads_weights' must be true or false")
        if reloads and method not in ENGINES:
            raise errors.BadRequest(
                f"'reloads_weights' is for jobs parked with vllm or sglang, not {method}: leave it out"
            )
        if method == "vllm" and level == 2 and not reloads:
            raise errors.BadRequest(
                "vLLM sleep level 2 discards the engine's weights, so the engine would wake up with "
                "uninitialised weights; use level 1 (weights kept in host memory), or opt in with "
                f"'reloads_weights': true if {RELOAD_PROMISE}"
            )
        return cls(method, tuple(endpoints), tuple(arg_str_list(raw, "tags", max_chars=128)), level, reloads)
