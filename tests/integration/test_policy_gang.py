"""Queue policies and gang acquire against real daemons: one daemon, and a two-daemon cluster."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

import timesliced
from timesliced import errors
from timesliced.bench.cluster import LocalCluster
from timesliced.client.gang import acquire_gang, acquire_gang_async
from timesliced.config import DaemonConfig
from timesliced.core.policy import QueuePolicy
from timesliced.daemon.embedded import EmbeddedDaemon

from ..helpers.daemon import serving
from ..helpers.processes import wait_for

MiB = 1 << 20


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[EmbeddedDaemon]:
    """Two simulated GPUs; groups under ``priority`` (``--policy priority``)."""
    config = DaemonConfig(
        state_dir=tmp_path / "state",
        backend="sim",
        gpus=2,
        gpu_memory=64 * MiB,
        bandwidth=0,
        queue_policies={"*": QueuePolicy("priority")},
    )
    with serving(config) as embedded:
        yield embedded


def group(c: Any, name: str) -> dict[str, Any]:
    return next(g for g in c.status()["groups"] if g["group"] == name)  # type: ignore[no-any-return]


def test_priority_goes_first_and_status_shows_it(daemon: EmbeddedDaemon) -> None:
    sock = str(daemon.socket)
    with (
        timesliced.Client("h", "g", address=sock) as h,
        timesliced.Client("low", "g", address=sock) as low,
        timesliced.Client("high", "g", address=sock, priority=3, weight=2.0) as high,
    ):
        h.acquire()
        waits = [threading.Thread(target=c.acquire, args=(10.0,)) for c in (low, high)]
        waits[0].start()
        wait_for(lambda: len(group(h, "g")["queue"]) == 1)
        waits[1].start()
        wait_for(lambda: len(group(h, "g")["queue"]) == 2)
        g = group(h, "g")
        assert g["policy"] == "priority"
        places = {p["job"]: p for p in g["queue"]}
        assert places["high"]["priority"] == 3 and places["high"]["weight"] == 2.0
        assert places["high"]["effective_priority"] >= 3.0 and places["low"]["effective_priority"] >= 0.0
        h.release()
        waits[1].join(10)
        assert high.lock.holding and not low.lock.holding
        assert daemon.daemon is not None
        logged = [e for e in daemon.daemon.history.events if e.kind == "policy"]
        assert [(e.group, e.job) for e in logged] == [("g", "high")] and "before 'low'" in logged[0].detail
        high.release()
        waits[0].join(10)
        assert low.lock.holding


def test_a_bad_weight_is_refused_at_the_boundary(daemon: EmbeddedDaemon) -> None:
    with pytest.raises(ValueError, match="weight"):
        timesliced.Client("w", "g", address=str(daemon.socket), weight=0)
    from timesliced.client.sync import Client

    c = Client("w", "g", address=str(daemon.socket))
    try:
        with pytest.raises(errors.BadRequest, match="weight"):
            c._call("register", {"job": "w2", "group": "g", "weight": -1})
        with pytest.raises(errors.BadRequest, match="members"):
            c._call("acquire", {"gang": "x", "members": 0})
    finally:
        c.close()


def test_gang_holds_both_pools_or_neither(daemon: EmbeddedDaemon) -> None:
    sock = str(daemon.socket)
    with (
        timesliced.Client("trainer", "trainers", address=sock, gpus=[0]) as trainer,
        timesliced.Client("sampler", "samplers", address=sock, gpus=[1]) as sampler,
        timesliced.Client("rival", "samplers", address=sock, gpus=[1]) as rival,
    ):
        rival.acquire()
        inside = threading.Event()
        done = threading.Event()

        def sync_weights() -> None:
            with timesliced.gang(trainer, sampler, timeout=20.0) as grants:
                assert {g.group for g in grants} == {"trainers", "samplers"}
                inside.set()
                done.wait(10)

        t = threading.Thread(target=sync_weights)
        t.start()
        wait_for(lambda: group(rival, "trainers")["waiting_for"] is not None)
        assert group(rival, "trainers")["holder"] is None  # its pool is free, yet the gang waits whole
        assert "gang" in group(rival, "trainers")["waiting_for"]
        rival.release()
        assert inside.wait(10)
        assert group(rival, "trainers")["holder"] == "trainer" and group(rival, "samplers")["holder"] == "sampler"
        done.set()
        t.join(10)
        assert group(rival, "trainers")["holder"] is None and group(rival, "samplers")["holder"] is None


@contextmanager
def trainer_with_a_gang_waiting(
    daemon: EmbeddedDaemon,
) -> Iterator[tuple[timesliced.Client, timesliced.Client, list[str], threading.Thread]]:
    """This process holds the trainers' pool (``trainer``; ``sampler`` is its samplers' client) while a
    gang of another party waits for the trainers' pool and keeps the free samplers' pool; the list gets
    the gang's groups once it is granted, in the thread."""
    sock = str(daemon.socket)
    with (
        timesliced.Client("trainer", "trainers", address=sock, gpus=[0]) as trainer,
        timesliced.Client("sampler", "samplers", address=sock, gpus=[1]) as sampler,
        timesliced.Client("gt", "trainers", address=sock, gpus=[0], party="other-run") as gt,
        timesliced.Client("gs", "samplers", address=sock, gpus=[1], party="other-run") as gs,
    ):
        trainer.acquire()
        got: list[str] = []

        def other_run() -> None:
            with timesliced.gang(gt, gs, timeout=20.0) as grants:
                got.extend(g.group for g in grants)

        t = threading.Thread(target=other_run)
        t.start()
        wait_for(lambda: "gang" in (group(trainer, "samplers")["waiting_for"] or ""))
        yield trainer, sampler, got, t


def test_a_process_that_holds_the_trainers_gets_the_samplers_before_a_gang(daemon: EmbeddedDaemon) -> None:
    """This process holds the trainers' pool and asks for the samplers' by a single acquire, while a
    gang of another party waits for the trainers' pool and keeps the free samplers' pool: kept behind
    the gang, the acquire would wait for ever (the trainers' pool is let go only after it)."""
    with trainer_with_a_gang_waiting(daemon) as (trainer, sampler, got, t):
        assert group(trainer, "samplers")["holder"] is None
        sampler.acquire(timeout=10.0)  # the weight sync: both pools, the trainers' first
        assert daemon.daemon is not None
        (logged,) = [e for e in daemon.daemon.history.events if e.kind == "policy"]
        assert logged.job == "sampler" and "holds group 'trainers'" in logged.detail
        sampler.release()
        trainer.release()
        t.join(20)
        assert sorted(got) == ["samplers", "trainers"]


def test_a_process_that_hands_its_pools_over_is_refused_a_second_pass(daemon: EmbeddedDaemon) -> None:
    """The hand-off of one process: it holds the samplers' pool (got before the gang) and asks for the
    trainers' again. Passing the gang a second time while it holds one of its pools would starve the
    gang, so the acquire fails at once with ``GangWaiting``; once the process lets go, the gang goes."""
    with trainer_with_a_gang_waiting(daemon) as (trainer, sampler, got, t):
        sampler.acquire(timeout=10.0)  # the first pass
        trainer.release()
        wait_for(lambda: "gang" in (group(trainer, "trainers")["waiting_for"] or ""))
        with pytest.raises(timesliced.GangWaiting, match="Release group 'samplers'") as refused:
            trainer.acquire(timeout=10.0)
        assert refused.value.code == "gang_waiting" and refused.value.details["gang_groups"] == ["samplers", "trainers"]
        assert not trainer.lock.holding and sampler.lock.holding
        assert daemon.daemon is not None
        logged = [e for e in daemon.daemon.history.events if e.kind == "policy" and e.job == "trainer"]
        assert len(logged) == 1 and "went before this gang once already" in logged[0].detail
        sampler.release()
        t.join(20)
        assert sorted(got) == ["samplers", "trainers"]


def test_a_party_is_refused_at_the_boundary(daemon: EmbeddedDaemon) -> None:
    with pytest.raises(ValueError, match="party"):
        timesliced.Client("p", "g", address=str(daemon.socket), party="x" * 300)


def test_a_gang_that_times_out_leaves_nothing_held(daemon: EmbeddedDaemon) -> None:
    sock = str(daemon.socket)
    with (
        timesliced.Client("trainer", "trainers", address=sock, gpus=[0]) as trainer,
        timesliced.Client("sampler", "samplers", address=sock, gpus=[1]) as sampler,
        timesliced.Client("rival", "samplers", address=sock, gpus=[1]) as rival,
    ):
        rival.acquire()
        with (
            pytest.raises((errors.AcquireTimeout, errors.AcquireCancelled)),
            timesliced.gang(trainer, sampler, timeout=0.3),
        ):
            pass
        assert not trainer.lock.holding and not sampler.lock.holding
        wait_for(lambda: group(rival, "trainers")["queue"] == [] and group(rival, "samplers")["queue"] == [])


def nothing_queued_or_held(c: Any) -> bool:
    groups = [group(c, "trainers"), group(c, "samplers")]
    return all(g["queue"] == [] and g["holder"] is None for g in groups)


def test_a_gang_interrupted_while_it_submits_leaves_no_member_queued(
    daemon: EmbeddedDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A KeyboardInterrupt as the second member is submitted: the first, submitted already, is withdrawn.

    Left queued, it would wait at the head of the free trainers group for a gang that never completes,
    holding that group from every other job until its timeout: a ghost granted to nobody.
    """
    sock = str(daemon.socket)
    with (
        timesliced.Client("trainer", "trainers", address=sock, gpus=[0]) as trainer,
        timesliced.Client("sampler", "samplers", address=sock, gpus=[1]) as sampler,
        timesliced.Client("rival", "trainers", address=sock, gpus=[0]) as rival,
    ):

        def interrupted(*args: object, **kwargs: object) -> object:
            raise KeyboardInterrupt

        monkeypatch.setattr(sampler, "_submit", interrupted)
        with pytest.raises(KeyboardInterrupt):
            acquire_gang(trainer, sampler, timeout=30.0)
        monkeypatch.undo()
        wait_for(lambda: nothing_queued_or_held(rival), timeout=5.0)
        assert rival.acquire(timeout=5.0).group == "trainers"  # at once: no member waits ahead of it
        assert not trainer.lock.holding and not sampler.lock.holding


def test_a_gang_whose_clean_up_is_interrupted_still_gives_back_every_member(
    daemon: EmbeddedDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Ctrl-C as the sampler's grant comes back, and a second one while that grant is given back.

    The trainer's grant, taken already, must be released all the same: its caller was told none holds.
    """
    sock = str(daemon.socket)
    with (
        timesliced.Client("trainer", "trainers", address=sock, gpus=[0]) as trainer,
        timesliced.Client("sampler", "samplers", address=sock, gpus=[1]) as sampler,
        timesliced.Client("rival", "trainers", address=sock, gpus=[0]) as rival,
    ):
        wait, withdraw = sampler._wait, sampler._withdraw

        def wait_then_interrupt(waiter: Any) -> Any:
            wait(waiter)
            raise KeyboardInterrupt

        def withdraw_then_interrupt(rid: int) -> None:
            withdraw(rid)
            raise KeyboardInterrupt

        monkeypatch.setattr(sampler, "_wait", wait_then_interrupt)
        monkeypatch.setattr(sampler, "_withdraw", withdraw_then_interrupt)
        with pytest.raises(KeyboardInterrupt):
            acquire_gang(trainer, sampler, timeout=30.0)
        monkeypatch.undo()
        assert not trainer.lock.holding and not sampler.lock.holding
        wait_for(lambda: nothing_queued_or_held(rival), timeout=5.0)


def test_an_async_gang_cancelled_while_it_submits_leaves_no_member_queued(
    daemon: EmbeddedDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def main() -> None:
        sock = str(daemon.socket)
        async with (
            timesliced.AsyncClient("trainer", "trainers", address=sock, gpus=[0]) as trainer,
            timesliced.AsyncClient("sampler", "samplers", address=sock, gpus=[1]) as sampler,
            timesliced.AsyncClient("rival", "trainers", address=sock, gpus=[0]) as rival,
        ):

            def cancelled(*args: object, **kwargs: object) -> object:
                raise asyncio.CancelledError

            monkeypatch.setattr(sampler, "_submit", cancelled)
            with pytest.raises(asyncio.CancelledError):
                await acquire_gang_async(trainer, sampler, timeout=30.0)
            monkeypatch.undo()
            for _ in range(250):
                groups = [g for g in (await rival.status())["groups"] if g["group"] in ("trainers", "samplers")]
                if all(g["queue"] == [] and g["holder"] is None for g in groups):
                    break
                await asyncio.sleep(0.02)
            else:
                raise AssertionError(f"a member is still queued or held: {groups}")
            assert (await rival.acquire(timeout=5.0)).group == "trainers"
            assert not trainer.lock.holding and not sampler.lock.holding

    asyncio.run(main())


def test_async_gang(daemon: EmbeddedDaemon) -> None:
    async def main() -> None:
        sock = str(daemon.socket)
        async with (
            timesliced.AsyncClient("trainer", "trainers", address=sock, gpus=[0]) as trainer,
            timesliced.AsyncClient("sampler", "samplers", address=sock, gpus=[1]) as sampler,
        ):
            async with timesliced.gang_async(trainer, sampler, timeout=10.0) as grants:
                assert sorted(g.job for g in grants) == ["sampler", "trainer"]
                assert trainer.lock.holding and sampler.lock.holding
            assert not trainer.lock.holding and not sampler.lock.holding

    asyncio.run(main())


@pytest.mark.slow
def test_a_gang_across_two_daemons(tmp_path: Path) -> None:
    """Trainer pool on one node, sampler pool on the other: the leader grants the gang whole."""
    with LocalCluster(tmp_path, 2) as cluster:
        cluster.start_all()
        a, b = cluster.names
        with (
            timesliced.Client("trainer", "trainers", address=str(cluster.socket(a))) as trainer,
            timesliced.Client("sampler", "samplers", address=str(cluster.socket(b))) as sampler,
            timesliced.Client("rival", "samplers", address=str(cluster.socket(b))) as rival,
        ):
            rival.acquire()
            got: list[Any] = []

            def sync_weights() -> None:
                with timesliced.gang(trainer, sampler, timeout=30.0) as grants:
                    got.extend(grants)
                    got.append((trainer.lock.holding, sampler.lock.holding))

            t = threading.Thread(target=sync_weights)
            t.start()
            leader = cluster.leader()
            wait_for(lambda: "gang" in (group_of(cluster, leader, "trainers").get("waiting_for") or ""), timeout=10)
            assert group_of(cluster, leader, "trainers")["holder"] is None
            rival.release()
            t.join(30)
            assert sorted(g.group for g in got[:2]) == ["samplers", "trainers"] and got[2] == (True, True)


@pytest.mark.slow
def test_a_process_holding_one_nodes_pool_passes_a_gang_on_the_other(tmp_path: Path) -> None:
    """The party rule at the leader: trainers on one node, samplers on the other."""
    with LocalCluster(tmp_path, 2) as cluster:
        cluster.start_all()
        a, b = cluster.names
        with (
            timesliced.Client("trainer", "trainers", address=str(cluster.socket(a))) as trainer,
            timesliced.Client("sampler", "samplers", address=str(cluster.socket(b))) as sampler,
            timesliced.Client("gt", "trainers", address=str(cluster.socket(a)), party="other-run") as gt,
            timesliced.Client("gs", "samplers", address=str(cluster.socket(b)), party="other-run") as gs,
        ):
            trainer.acquire(timeout=20.0)
            got: list[Any] = []

            def other_run() -> None:
                with timesliced.gang(gt, gs, timeout=30.0) as grants:
                    got.extend(g.group for g in grants)

            t = threading.Thread(target=other_run)
            t.start()
            leader = cluster.leader()
            wait_for(lambda: "gang" in (group_of(cluster, leader, "samplers").get("waiting_for") or ""), timeout=10)
            sampler.acquire(timeout=20.0)
            sampler.release()
            trainer.release()
            t.join(30)
            assert sorted(got) == ["samplers", "trainers"]


def group_of(cluster: LocalCluster, node: str, name: str) -> dict[str, Any]:
    return next((g for g in cluster.status(node)["groups"] if g["group"] == name), {})
