"""The Ray integration on a real local Ray runtime (started once for the module) and a real daemon.

CI sets ``TIMESLICED_REQUIRE_RAY=1``, so a missing Ray fails there instead of skipping.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import timesliced
from timesliced.config import DaemonConfig
from timesliced.daemon.embedded import EmbeddedDaemon
from timesliced.integrations.ray import TimeslicedActor, gang, gpu_phase

from ..helpers.daemon import serving
from ..helpers.processes import REPO

if os.environ.get("TIMESLICED_REQUIRE_RAY") == "1":
    import ray
else:
    ray = pytest.importorskip("ray")

pytestmark = pytest.mark.slow

MiB = 1 << 20
FOOTPRINT = 3 * MiB  # two jobs' regions do not fit one 4 MiB GPU together


@pytest.fixture(scope="module")
def runtime() -> Iterator[None]:
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}},  # the workers import this checkout
    )
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[EmbeddedDaemon]:
    config = DaemonConfig(
        state_dir=tmp_path / "state", backend="sim", gpus=2, gpu_memory=4 * MiB, bandwidth=0, pid_poll_interval=0.1
    )
    with serving(config) as embedded:
        yield embedded


def actor(job: str, group: str, gpu: int, daemon: EmbeddedDaemon) -> Any:
    from ..helpers.ray_actors import Worker

    return ray.remote(num_cpus=0)(Worker).remote(job, group, gpu, str(daemon.socket))


def test_two_jobs_samplers_take_turns_on_one_gpu(runtime: None, daemon: EmbeddedDaemon) -> None:
    a, b = actor("a", "samplers", 1, daemon), actor("b", "samplers", 1, daemon)
    infos = ray.get([a.info.remote(), b.info.remote()])
    assert all(i["pid"] == i["actor_pid"] != os.getpid() for i in infos)  # each actor registered itself
    sums = {"a": ray.get(a.load.remote(FOOTPRINT, 1)), "b": ray.get(b.load.remote(FOOTPRINT, 2))}
    restores = 0
    for _ in range(3):
        out = dict(zip("ab", ray.get([a.generate.remote(), b.generate.remote()]), strict=True))
        for job, seen in out.items():
            assert seen["holders"]["samplers"] == job  # the daemon says this job holds the GPU now
            assert seen["checksum"] == sums[job]  # its bytes came back whole after the other's turn
        restores += sum(seen["restored"] for seen in out.values())
    assert restores >= 3  # the two never fit together: each round restores one at least
    for h in (a, b):
        ray.kill(h)


def test_a_weight_sync_across_two_actors_holds_both_groups_as_one_gang(runtime: None, daemon: EmbeddedDaemon) -> None:
    trainer, sampler = actor("t", "trainers", 0, daemon), actor("s", "samplers", 1, daemon)
    weights = ray.get(trainer.load.remote(FOOTPRINT, 5))
    ray.get(sampler.load.remote(FOOTPRINT, 9))
    members = gang(2)
    sent = trainer.send_weights.remote(**members)
    got = sampler.receive_weights.remote([sent], **members)  # in a list: Ray passes the ref unresolved
    sent_out, got_out = ray.get([sent, got], timeout=60)
    # the sampler holds until the trainer's weights reach it, so the trainer sees both held at once
    assert sent_out["holders"] == {"trainers": "t", "samplers": "s"}
    assert got_out["holders"]["samplers"] == "s"
    assert got_out["checksum"] == weights
    with timesliced.Client("probe", "other", address=str(daemon.socket), gpus=[0]) as probe:
        assert {g["group"]: g["holder"] for g in probe.status()["groups"]}["trainers"] is None
    for h in (trainer, sampler):
        ray.kill(h)


def test_a_killed_actor_gives_its_lock_back(runtime: None, daemon: EmbeddedDaemon) -> None:
    holder = actor("dead", "samplers", 1, daemon)
    assert ray.get(holder.hold.remote())
    ray.kill(holder)
    with timesliced.Client("next", "samplers", address=str(daemon.socket), gpus=[1]) as nxt:
        grant = nxt.acquire(30)  # granted once the daemon sees the actor's connection and process gone
        assert grant.job == "next"


class Plain(TimeslicedActor):
    @gpu_phase
    def step(self) -> int:
        return 1


def test_a_phase_before_connecting_says_what_to_do() -> None:
    with pytest.raises(RuntimeError, match="timeslice_connect"):
        Plain().step()
    with pytest.raises(ValueError, match="at least one"):
        gang(0)
