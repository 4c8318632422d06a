"""The serve options of leases, slices and fault injection, parsed into the daemon's config."""

from __future__ import annotations

import pytest

from timesliced.cli import build_parser, config_from_args
from timesliced.config import DaemonConfig, parse_crash_points
from timesliced.core.policy import QueuePolicy
from timesliced.core.slices import SlicePolicy


def config(*argv: str) -> DaemonConfig:
    return config_from_args(build_parser().parse_args(["serve", *argv]))


def test_defaults_keep_every_group_unbounded_with_a_30_s_lease() -> None:
    c = config()
    assert c.slice_policies == {} and c.lease == 30.0 and c.recovery_grace == 30.0


def test_max_slice_for_every_group_and_for_one() -> None:
    c = config("--max-slice", "300", "--max-slice", "trainers=60:preempt", "--preempt-grace", "5")
    assert c.slice_policies == {"*": SlicePolicy(300, "warn", 5), "trainers": SlicePolicy(60, "preempt", 5)}
    c = config("--max-slice", "120", "--slice-action", "preempt")
    assert c.slice_policies == {"*": SlicePolicy(120, "preempt", 10)}


@pytest.mark.parametrize("bad", ["soon", "0", "g=-5", "g=10:kill", "=:"])
def test_a_bad_max_slice_is_refused_with_its_text(bad: str) -> None:
    with pytest.raises(SystemExit, match=r"--max-slice: not a maximum slice"):
        config("--max-slice", bad)


def test_queue_policies_for_every_group_and_for_one() -> None:
    assert config().queue_policies == {}  # every group fifo
    c = config("--policy", "fair", "--policy", "trainers=priority", "--aging", "30")
    assert c.queue_policies == {"*": QueuePolicy("fair", 30.0), "trainers": QueuePolicy("priority", 30.0)}


@pytest.mark.parametrize("argv", [("--policy", "lottery"), ("--policy", "g="), ("--policy", "fair", "--aging", "0")])
def test_a_bad_policy_is_refused_with_its_text(argv: tuple[str, ...]) -> None:
    with pytest.raises(SystemExit, match=r"--policy: not a queue policy"):
        config(*argv)


def test_lease_and_grace_must_not_be_negative() -> None:
    with pytest.raises(SystemExit, match="must be >= 0"):
        config("--lease", "-1")
    assert config("--lease", "0").lease == 0  # no lease: quiet connections stay


def test_crash_points_name_a_step_and_optionally_the_nth_time() -> None:
    assert parse_crash_points("") == {}
    assert parse_crash_points("before-snapshot, at-grant@4") == {"before-snapshot": 1, "at-grant": 4}
    for bad in ("after-lunch", "at-grant@0", "at-grant@x"):
        with pytest.raises(ValueError, match="not a crash point"):
            parse_crash_points(bad)
