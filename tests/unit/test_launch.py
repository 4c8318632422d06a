"""``timesliced run``'s checks before anything starts, and which signals it forwards."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from timesliced.client.launch import SI_KERNEL, Launch, LaunchRefused, _had_it, prepare

SI_USER = 0  # include/uapi/asm-generic/siginfo.h


def info(signo: int, code: int) -> signal.struct_siginfo:
    return signal.struct_siginfo((signo, code, 0, 0, 0, 0, 0))


@pytest.mark.parametrize(
    ("signo", "code", "same_group", "had_it"),
    [
        (signal.SIGINT, SI_KERNEL, True, True),  # the terminal's Ctrl-C: the command got it too
        (signal.SIGQUIT, SI_KERNEL, True, True),
        (signal.SIGINT, SI_USER, True, False),  # kill -INT <launcher>: for the launcher alone
        (signal.SIGINT, SI_KERNEL, False, False),  # the command left our group: the terminal missed it
        (signal.SIGTERM, SI_KERNEL, True, False),
        (signal.SIGHUP, SI_KERNEL, True, True),  # the terminal hung up: its group got it
        (signal.SIGHUP, SI_USER, True, False),
    ],
)
def test_only_the_terminals_own_signals_to_our_group_are_not_forwarded(
    signo: int, code: int, same_group: bool, had_it: bool
) -> None:
    ours = os.getpgrp() if same_group else os.getpgrp() + 1
    assert _had_it(info(signo, code), os.getpid(), ours) is had_it


def test_the_command_gets_the_job_and_the_daemon_in_its_environment(tmp_path: Path) -> None:
    launch = Launch("rl/trainer", "pool", ("true",), address="rel.sock", park="offload", memory="1.5GB", gpus="0,1")
    got = prepare(launch, {"PATH": os.environ["PATH"], "KEEP": "me"})
    assert got.argv[0].endswith("/true") and os.path.isabs(got.argv[0])
    assert got.env["KEEP"] == "me"
    assert got.env["TIMESLICED_JOB"] == "rl/trainer" and got.env["TIMESLICED_GROUP"] == "pool"
    assert got.env["TIMESLICED_ADDRESS"] == os.path.abspath("rel.sock")  # the command may change directory
    assert got.env["TIMESLICED_PARK"] == "offload"
    assert got.env["TIMESLICED_MEMORY"] == str(int(1.5 * (1 << 30)))
    assert got.env["TIMESLICED_GPUS"] == "0,1"
    assert "TIMESLICED_PRIORITY" not in got.env and "TIMESLICED_WEIGHT" not in got.env
    tcp = prepare(Launch("a", "g", ("true",), address="tcp://10.1.2.3:7070"), {"PATH": os.environ["PATH"]})
    assert tcp.env["TIMESLICED_ADDRESS"] == "tcp://10.1.2.3:7070"


@pytest.mark.parametrize(
    ("launch", "status", "says"),
    [
        (Launch("a", "g", ()), 2, "needs a command"),
        (Launch("", "g", ("true",)), 2, "needs --job J and --group G"),
        (Launch("a", "g", ("true",), park="teleport"), 2, "choose one of sim, cuda-checkpoint"),
        (Launch("a", "g", ("true",), memory="banana"), 2, "like 16GiB, 512MiB or 1.5GB"),
        (Launch("a", "g", ("true",), memory="0"), 2, "is not a size"),
        (Launch("a", "g", ("true",), gpus="one"), 2, "the node's GPU numbers"),
        (Launch("a", "g", ("true",), weight=0.0), 2, "--weight must be a positive number"),
        (Launch("a", "g", ("true",), address="tcp://nowhere"), 2, "give a socket path or tcp://HOST:PORT"),
        (Launch("a", "g", ("surely-no-such-program",)), 127, "command not found"),
    ],
)
def test_bad_use_is_refused_before_anything_starts(launch: Launch, status: int, says: str) -> None:
    with pytest.raises(LaunchRefused) as refused:
        prepare(launch, {"PATH": os.environ["PATH"]})
    assert refused.value.status == status and says in refused.value.message
    assert "\n" not in refused.value.message
