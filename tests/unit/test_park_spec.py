"""The ``park`` argument of ``register``: what is refused at registration, and the round trip."""

from __future__ import annotations

from typing import Any

import pytest

from timesliced import errors
from timesliced.wire.park import ParkSpec

URL = "http://127.0.0.1:8000"


@pytest.mark.parametrize(
    "spec",
    [
        ParkSpec("sim"),
        ParkSpec("vllm", (URL,), ("weights",), 1),
        ParkSpec("vllm", (URL,), (), 2, reloads_weights=True),
        ParkSpec("sglang", (URL, "https://h:1/p"), ("kv_cache",), reloads_weights=True),
    ],
)
def test_round_trip(spec: ParkSpec) -> None:
    assert ParkSpec.from_wire(spec.to_wire(), "sim") == spec


def test_a_park_without_the_opt_in_is_read_as_not_opting_in() -> None:
    # What clients (and journals) from before reloads_weights send.
    raw = {"method": "sglang", "endpoints": [URL], "tags": [], "level": 1}
    assert ParkSpec.from_wire(raw, "sim").reloads_weights is False


def test_vllm_level_2_needs_the_job_to_reload_its_weights() -> None:
    with pytest.raises(errors.BadRequest) as info:
        ParkSpec.from_wire({"method": "vllm", "endpoints": [URL], "level": 2}, "sim")
    message = info.value.message
    assert "discards the engine's weights" in message and "use level 1" in message
    assert "'reloads_weights': true" in message and "reloads the engine's weights itself" in message
    assert "reload_weights" in message  # how the job does it on vLLM
    spec = ParkSpec.from_wire({"method": "vllm", "endpoints": [URL], "level": 2, "reloads_weights": True}, "sim")
    assert (spec.level, spec.reloads_weights) == (2, True)


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        ({"method": "vllm", "endpoints": [URL], "reloads_weights": 1}, "must be true or false"),
        ({"method": "vllm", "endpoints": [URL], "reloads_weights": "yes"}, "must be true or false"),
        ({"method": "offload", "reloads_weights": True}, "for jobs parked with vllm or sglang, not offload"),
        ({"method": "sim", "reloads_weights": True}, "leave it out"),
    ],
)
def test_refused(raw: dict[str, Any], match: str) -> None:
    with pytest.raises(errors.BadRequest, match=match):
        ParkSpec.from_wire(raw, "sim")


def test_other_methods_keep_taking_level_2() -> None:
    # Only vLLM discards weights at level 2; the others ignore the level, as before.
    assert ParkSpec.from_wire({"method": "sim", "level": 2}, "sim").level == 2
    assert ParkSpec.from_wire({"method": "sglang", "endpoints": [URL], "level": 2}, "sim").level == 2
