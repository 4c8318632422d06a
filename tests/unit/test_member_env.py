"""A client's job, group and registration from its arguments, else from what ``timesliced run`` set."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from timesliced.client.protocol import Address, member, process_party, register_args, resolve_address
from timesliced.wire.park import ParkSpec

NONE = {"gpus": None, "park": None, "memory": None, "priority": None, "weight": None}
RUN = {
    "TIMESLICED_JOB": "rl/trainer",
    "TIMESLICED_GROUP": "pool",
    "TIMESLICED_PARK": "offload",
    "TIMESLICED_MEMORY": "1073741824",
    "TIMESLICED_GPUS": "0,2",
    "TIMESLICED_PRIORITY": "3",
    "TIMESLICED_WEIGHT": "2.5",
}


def test_everything_left_out_comes_from_the_environment() -> None:
    got = member(None, None, **NONE, environ=RUN)
    assert (got.job, got.group, got.park, got.memory, got.gpus) == ("rl/trainer", "pool", "offload", 1 << 30, [0, 2])
    assert (got.priority, got.weight) == (3, 2.5)


def test_explicit_arguments_win_over_the_environment() -> None:
    spec = ParkSpec("sim")
    got = member("mine", "other", gpus=[1], park=spec, memory="2GiB", priority=0, weight=1.0, environ=RUN)
    assert (got.job, got.group, got.park, got.memory, got.gpus, got.priority, got.weight) == (
        "mine",
        "other",
        spec,
        "2GiB",
        [1],
        0,
        1.0,
    )


def test_a_client_of_another_job_or_group_takes_none_of_the_launched_job_s_settings() -> None:
    for job, group in (("rl/sampler", "samplers"), ("rl/trainer", "other"), ("other", "pool")):
        got = member(job, group, **NONE, environ=RUN)
        assert (got.gpus, got.park, got.memory, got.priority, got.weight) == (None, None, None, 0, 1.0)
    same = member("rl/trainer", "pool", **NONE, environ=RUN)  # the launched job, named again: they are its
    assert (same.gpus, same.memory, same.priority) == ([0, 2], 1 << 30, 3)


def test_a_malformed_address_variable_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIMESLICED_ADDRESS", "tcp://host")
    with pytest.raises(
        ValueError, match=r"^\$TIMESLICED_ADDRESS='tcp://host': .*give a socket path or tcp://HOST:PORT"
    ):
        resolve_address(None)


def test_without_either_the_defaults_stand() -> None:
    got = member("a", "g", **NONE, environ={})
    assert (got.gpus, got.park, got.memory, got.priority, got.weight) == (None, None, None, 0, 1.0)


@pytest.mark.parametrize(
    ("environ", "says"),
    [
        ({}, "no job and group given"),
        ({"TIMESLICED_JOB": "a"}, "no group given"),
        ({"TIMESLICED_GROUP": "g", "TIMESLICED_JOB": "  "}, "no job given"),
    ],
)
def test_no_job_or_group_says_how_to_give_them(environ: dict[str, str], says: str) -> None:
    with pytest.raises(ValueError, match=says) as caught:
        member(None, None, **NONE, environ=environ)
    assert "timesliced run --job J --group G" in str(caught.value)


@pytest.mark.parametrize(
    ("name", "value", "says"),
    [
        ("TIMESLICED_MEMORY", "banana", "is not a size; give one like 16GiB"),
        ("TIMESLICED_PARK", "teleport", "is no parking method"),
        ("TIMESLICED_PARK", '{"method": "vllm"}', "needs 'endpoints'"),
        ("TIMESLICED_PARK", "{not json", "no valid park map"),
        ("TIMESLICED_GPUS", "0,x", "neither the node's GPU numbers"),
        ("TIMESLICED_GPUS", "-1", "neither the node's GPU numbers"),
        ("TIMESLICED_PRIORITY", "high", "is not an integer"),
        ("TIMESLICED_WEIGHT", "lots", "is not a number"),
    ],
)
def test_a_malformed_variable_is_named(name: str, value: str, says: str) -> None:
    with pytest.raises(ValueError, match=says) as caught:
        member("a", "g", **NONE, environ={name: value})
    assert f"${name}" in str(caught.value)


def test_a_park_map_in_the_environment_is_a_park_spec() -> None:
    text = '{"method": "vllm", "endpoints": ["http://127.0.0.1:8000"], "level": 2, "reloads_weights": true}'
    got = member("a", "g", **NONE, environ={"TIMESLICED_PARK": text})
    assert got.park == ParkSpec("vllm", ("http://127.0.0.1:8000",), (), 2, True)


def test_gpus_visible_passes_through() -> None:
    assert member("a", "g", **NONE, environ={"TIMESLICED_GPUS": "visible"}).gpus == "visible"


def test_the_address_comes_from_the_environment_unless_given(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TIMESLICED_ADDRESS", "tcp://10.0.0.7:7070")
    assert resolve_address(None) == Address("tcp", host="10.0.0.7", port=7070)
    assert resolve_address(str(tmp_path / "x.sock")) == Address("unix", path=str(tmp_path / "x.sock"))
    monkeypatch.setenv("TIMESLICED_ADDRESS", str(tmp_path / "run.sock"))
    assert resolve_address(None) == Address("unix", path=str(tmp_path / "run.sock"))
    monkeypatch.delenv("TIMESLICED_ADDRESS")
    monkeypatch.setenv("TIMESLICED_SOCKET", str(tmp_path / "local.sock"))
    assert resolve_address(None) == Address("unix", path=str(tmp_path / "local.sock"))


def test_a_party_is_the_process_s_unless_named() -> None:
    """Every client of a process acts for one party, whatever its job; ``$TIMESLICED_PARTY`` or
    ``party=`` names one for several processes."""
    mine = member("a", "g", **NONE, environ={})
    assert mine.party == member("b", "other", **NONE, environ={}).party == process_party()
    assert str(os.getpid()) in mine.party
    named = {**RUN, "TIMESLICED_PARTY": "run-7"}
    assert member("rl/sampler", "samplers", **NONE, environ=named).party == "run-7"  # another job: still the process's
    assert member(None, None, **NONE, party="mine", environ=named).party == "mine"


def test_register_args_carry_a_party_and_refuse_a_bad_one() -> None:
    assert register_args("a", "g", None, None, party="run-7")["party"] == "run-7"
    assert "party" not in register_args("a", "g", None, None)
    with pytest.raises(ValueError, match="party must be a string of at most 256"):
        register_args("a", "g", None, None, party="x" * 257)


def test_a_party_too_long_in_the_environment_is_refused_naming_the_variable() -> None:
    with pytest.raises(ValueError, match=r"\$TIMESLICED_PARTY is 257 characters long; give a name of at most 256"):
        member("a", "g", **NONE, environ={**RUN, "TIMESLICED_PARTY": "x" * 257})
    assert member("a", "g", **NONE, environ={**RUN, "TIMESLICED_PARTY": "x" * 256}).party == "x" * 256
