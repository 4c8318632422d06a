"""``memory=`` at registration: the client's encoding, the daemon's checks, and the serve flags (pure)."""

from __future__ import annotations

import pytest

from timesliced import errors
from timesliced.cli import build_parser, config_from_args
from timesliced.client.protocol import memory_args, register_args
from timesliced.config import DaemonConfig
from timesliced.wire.messages import arg_memory

GiB = 1 << 30


@pytest.mark.parametrize(
    ("memory", "wire"),
    [
        (20 * GiB, {"*": 20 * GiB}),
        ("20GiB", {"*": 20 * GiB}),
        ({0: "1GiB", 3: 512}, {"0": GiB, "3": 512}),
    ],
)
def test_the_client_sends_a_declaration_per_gpu_or_for_each(memory: object, wire: dict[str, int]) -> None:
    assert memory_args(memory) == wire  # type: ignore[arg-type]
    assert register_args("j", "g", None, None, memory=memory)["memory"] == wire  # type: ignore[arg-type]
    assert arg_memory({"memory": wire}) == (
        {int(k): v for k, v in wire.items() if k != "*"} or None,
        wire.get("*"),
    )


def test_no_declaration_sends_nothing() -> None:
    assert "memory" not in register_args("j", "g", None, None)
    assert arg_memory({}) == (None, None)


@pytest.mark.parametrize("memory", ["lots", 0, -5, {}, {-1: 5}, {"0": 5}, {0: 0}, True])
def test_the_client_refuses_a_declaration_that_is_none(memory: object) -> None:
    with pytest.raises(ValueError, match=r"memory|size"):
        memory_args(memory)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "wire",
    [[1], {}, {"*": 0}, {"0": -1}, {"0": True}, {"x": 5}, {"-1": 5}, {"0": "5GiB"}, {"0": 1 << 60}],
)
def test_the_daemon_refuses_a_malformed_declaration_by_name(wire: object) -> None:
    with pytest.raises(errors.BadRequest, match="'memory'"):
        arg_memory({"memory": wire})


def serve(*argv: str) -> DaemonConfig:
    return config_from_args(build_parser().parse_args(["serve", *argv]))


def test_serve_flags_for_residency() -> None:
    default = serve()
    assert (default.memory_headroom, default.prefetch, default.park_every_handoff) == (GiB, True, False)
    assert default.stream_switches is True
    given = serve("--memory-headroom", "512MiB", "--no-prefetch", "--park-every-handoff", "--no-stream-switches")
    assert (given.memory_headroom, given.prefetch, given.park_every_handoff) == (512 << 20, False, True)
    assert given.stream_switches is False
