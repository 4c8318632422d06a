"""RL phase hooks and the framework adapters against a real daemon on the simulated GPU.

Two RL runs (a, b) share both pools: the trainers' group on GPU 0, the samplers' on GPU 1.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest

import timesliced
from timesliced import errors
from timesliced.daemon.embedded import EmbeddedDaemon
from timesliced.integrations.adapters import (
    OPENRLHF_EXPERIENCE,
    OPENRLHF_TRAINER,
    SLIME_ACTOR,
    SLIME_ROLLOUT,
    VerlTimers,
    wrap_methods,
)
from timesliced.integrations.phases import AsyncPhaseHooks, Phase, PhaseHooks

from ..helpers.processes import wait_for

Run = tuple[timesliced.Client, timesliced.Client]


def group(c: timesliced.Client, name: str) -> dict[str, Any]:
    return next(g for g in c.status()["groups"] if g["group"] == name)  # type: ignore[no-any-return]


def holders(c: timesliced.Client) -> dict[str, str | None]:
    return {g["group"]: g["holder"] for g in c.status()["groups"]}


@pytest.fixture
def runs(daemon: EmbeddedDaemon) -> Iterator[dict[str, Run]]:
    sock = str(daemon.socket)
    clients = {
        name: (
            # each run as its own process would be: one party
            timesliced.Client(f"{name}-trainer", "trainers", address=sock, gpus=[0], party=f"run-{name}"),
            timesliced.Client(f"{name}-sampler", "samplers", address=sock, gpus=[1], party=f"run-{name}"),
        )
        for name in ("a", "b")
    }
    for pair in clients.values():
        for c in pair:
            c.connect()
    try:
        yield clients
    finally:
        for pair in clients.values():
            for c in pair:
                c.close()


def test_each_phase_holds_its_pools_and_gives_them_back(runs: dict[str, Run]) -> None:
    trainer, sampler = runs["a"]
    hooks = PhaseHooks(trainer, sampler, timeout=10)
    with hooks.rollout():
        assert holders(trainer) == {"trainers": None, "samplers": "a-sampler"}
    with hooks.train():
        assert holders(trainer) == {"trainers": "a-trainer", "samplers": None}
        with hooks.weight_sync():
            assert holders(trainer) == {"trainers": "a-trainer", "samplers": "a-sampler"}
            assert hooks.phases == (Phase.TRAIN, Phase.WEIGHT_SYNC)
        assert holders(trainer) == {"trainers": "a-trainer", "samplers": None}  # the train phase goes on
    with hooks.weight_sync():
        assert holders(trainer) == {"trainers": "a-trainer", "samplers": "a-sampler"}
    assert holders(trainer) == {"trainers": None, "samplers": None}
    assert hooks.switches == 4


def test_phases_against_the_lock_order_are_refused_and_change_nothing(runs: dict[str, Run]) -> None:
    trainer, sampler = runs["a"]
    hooks = PhaseHooks(trainer, sampler, timeout=10)
    hooks.begin_train()
    with pytest.raises(ValueError, match="weight_sync"):
        hooks.begin_rollout()
    assert hooks.phases == (Phase.TRAIN,) and holders(trainer) == {"trainers": "a-trainer", "samplers": None}
    with pytest.raises(ValueError, match="reverse order"):
        hooks.end_rollout()
    assert hooks.phases == (Phase.TRAIN,)
    hooks.end_train()
    hooks.begin_rollout()
    with pytest.raises(ValueError, match="cannot begin inside a rollout"):
        hooks.begin_train()
    hooks.close()
    assert hooks.phases == () and holders(trainer) == {"trainers": None, "samplers": None}


def _opposite_syncs(a: PhaseHooks, b: PhaseHooks) -> tuple[dict[str, threading.Event], list[BaseException]]:
    """a trains (holds the trainers' pool) while b rolls out (holds the samplers'); then both sync."""
    barrier = threading.Barrier(2, timeout=10)
    inside = {"a": threading.Event(), "b": threading.Event()}
    failures: list[BaseException] = []

    def run(name: str, hooks: PhaseHooks, outer: Phase) -> None:
        try:
            with hooks.phase(outer):
                barrier.wait()  # both hold their pool: the opposite orders are set up
                with hooks.weight_sync():
                    inside[name].set()
        except BaseException as exc:  # reported to the test
            failures.append(exc)

    threads = [
        threading.Thread(target=run, args=("a", a, Phase.TRAIN)),
        threading.Thread(target=run, args=("b", b, Phase.ROLLOUT)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return inside, failures


@pytest.mark.slow
def test_two_runs_syncing_weights_from_opposite_pools_never_deadlock(runs: dict[str, Run]) -> None:
    inside, failures = _opposite_syncs(PhaseHooks(*runs["a"], timeout=20), PhaseHooks(*runs["b"], timeout=20))
    assert not failures and inside["a"].is_set() and inside["b"].is_set()
    assert holders(runs["a"][0]) == {"trainers": None, "samplers": None}


class OrderedHooks(PhaseHooks):
    """A deliberately naive weight sync: keep the pool held, then ask for the other (trainer first)."""

    def begin(self, phase: Phase) -> None:
        if phase is not Phase.WEIGHT_SYNC:
            super().begin(phase)
            return
        assert self.sampler is not None
        for role, client in (("trainer", self.trainer), ("sampler", self.sampler)):
            if role not in self._held:
                client.acquire(self.timeout)
                self._held |= {role}
        self._stack = (*self._stack, phase)


@pytest.mark.slow
def test_the_same_syncs_deadlock_when_a_pool_is_held_while_asking_for_the_other(runs: dict[str, Run]) -> None:
    """The check above can fail: ordered acquisition from opposite pools waits until a timeout breaks it.

    Neither sync gets in before one of them times out; the other may then get in, once the run that
    timed out has left its phase and let its pool go.
    """
    inside, failures = _opposite_syncs(OrderedHooks(*runs["a"], timeout=1.0), OrderedHooks(*runs["b"], timeout=1.0))
    assert not (inside["a"].is_set() and inside["b"].is_set())
    assert failures and all(isinstance(f, errors.AcquireTimeout) for f in failures)
    assert len(failures) + inside["a"].is_set() + inside["b"].is_set() == 2


@pytest.mark.slow
def test_holding_the_trainer_pool_while_asking_for_the_sampler_goes_before_a_gang(runs: dict[str, Run]) -> None:
    """Ordered acquisition (trainer, then sampler) by one party does not wait behind another run's gang
    that keeps the free samplers' pool while it waits for the trainers' pool: the party goes first,
    then the gang."""
    (a_trainer, a_sampler), b = runs["a"], runs["b"]
    a_trainer.acquire(10)
    b_hooks = PhaseHooks(*b, timeout=20)
    synced = threading.Event()

    def b_sync() -> None:
        with b_hooks.weight_sync():
            synced.set()

    t = threading.Thread(target=b_sync)
    t.start()
    wait_for(lambda: "gang" in (group(a_trainer, "samplers")["waiting_for"] or ""))
    a_sampler.acquire(10.0)  # the samplers' pool is free, and its head is b's gang: a's party holds the trainers'
    assert not synced.is_set()
    a_sampler.release()
    a_trainer.release()
    t.join(20)
    assert synced.is_set()


@pytest.mark.slow
def test_a_weight_sync_that_cannot_start_leaves_the_train_phase_holding_its_pool(runs: dict[str, Run]) -> None:
    (a_trainer, a_sampler), (_, b_sampler) = runs["a"], runs["b"]
    b_sampler.acquire(10)  # the samplers' pool stays busy
    hooks = PhaseHooks(a_trainer, a_sampler, timeout=0.5)
    hooks.begin_train()
    with pytest.raises(errors.AcquireTimeout):
        hooks.begin_weight_sync()
    assert hooks.phases == (Phase.TRAIN,)
    assert holders(a_trainer) == {"trainers": "a-trainer", "samplers": "b-sampler"}  # the pool taken back
    hooks.end_train()
    assert holders(a_trainer)["trainers"] is None


def test_a_colocated_run_takes_one_lock_for_every_phase(runs: dict[str, Run]) -> None:
    trainer, _ = runs["a"]
    hooks = PhaseHooks(trainer, timeout=10)
    with hooks.train():
        with hooks.weight_sync():
            assert holders(trainer)["trainers"] == "a-trainer"
        with hooks.rollout():
            assert holders(trainer)["trainers"] == "a-trainer"
    assert holders(trainer)["trainers"] is None and hooks.switches == 1


def test_verl_timers_hold_each_named_step(runs: dict[str, Run]) -> None:
    trainer, sampler = runs["a"]
    timers = VerlTimers(PhaseHooks(trainer, sampler, timeout=10))
    seen: dict[str, dict[str, str | None]] = {}
    timing_raw: dict[str, float] = {}
    # the shape of RayPPOTrainer.fit's step: named timers around each part
    with timers.marked_timer("step", timing_raw):
        for name in ("gen", "reward", "old_log_prob", "adv", "update_actor", "update_weights"):
            with timers.marked_timer(name, timing_raw, color="red"):
                seen[name] = holders(trainer)
    assert seen["gen"] == {"trainers": None, "samplers": "a-sampler"}
    assert seen["reward"] == seen["adv"] == {"trainers": None, "samplers": None}
    assert seen["old_log_prob"] == seen["update_actor"] == {"trainers": "a-trainer", "samplers": None}
    assert seen["update_weights"] == {"trainers": "a-trainer", "samplers": "a-sampler"}
    assert set(timing_raw) == {*seen, "step"} and all(v >= 0 for v in timing_raw.values())


class FakeOpenRLHFTrainer:
    """The shape of OpenRLHF's PPO trainer: ``ppo_train`` broadcasts to the engines at its end."""

    def __init__(self, probe: timesliced.Client) -> None:
        self.probe = probe
        self.seen: list[tuple[str, dict[str, str | None]]] = []

    def ppo_train(self, step: int) -> dict[str, int]:
        self.seen.append(("ppo_train", holders(self.probe)))
        self.broadcast_to_vllm()
        self.seen.append(("ppo_train after", holders(self.probe)))
        return {"step": step}

    def broadcast_to_vllm(self) -> None:
        self.seen.append(("broadcast_to_vllm", holders(self.probe)))


class FakeExperienceMaker:
    def __init__(self, probe: timesliced.Client) -> None:
        self.probe = probe
        self.seen: list[dict[str, str | None]] = []

    def make_experience_list(self, prompts: list[str]) -> list[str]:
        self.seen.append(holders(self.probe))
        return [p + "!" for p in prompts]


def test_openrlhf_methods_run_in_their_phases(runs: dict[str, Run]) -> None:
    trainer, sampler = runs["a"]
    hooks = PhaseHooks(trainer, sampler, timeout=10)
    ppo = wrap_methods(FakeOpenRLHFTrainer(trainer), hooks, OPENRLHF_TRAINER)
    maker = wrap_methods(FakeExperienceMaker(trainer), hooks, OPENRLHF_EXPERIENCE)
    assert maker.make_experience_list(["x"]) == ["x!"]
    assert ppo.ppo_train(3) == {"step": 3}
    assert maker.seen == [{"trainers": None, "samplers": "a-sampler"}]
    assert ppo.seen == [
        ("ppo_train", {"trainers": "a-trainer", "samplers": None}),
        ("broadcast_to_vllm", {"trainers": "a-trainer", "samplers": "a-sampler"}),
        ("ppo_train after", {"trainers": "a-trainer", "samplers": None}),
    ]
    assert holders(trainer) == {"trainers": None, "samplers": None}


def test_slime_tables_and_a_missing_method(runs: dict[str, Run]) -> None:
    trainer, sampler = runs["a"]
    hooks = PhaseHooks(trainer, sampler, timeout=10)
    seen: list[tuple[str, dict[str, str | None]]] = []

    class Rollouts:
        def generate(self, rollout_id: int) -> int:
            seen.append(("generate", holders(trainer)))
            return rollout_id

        def eval(self, rollout_id: int) -> None:
            seen.append(("eval", holders(trainer)))

    class Actor:
        def train(self, rollout_id: int, data: int) -> None:
            seen.append(("train", holders(trainer)))

        def update_weights(self) -> None:
            seen.append(("update_weights", holders(trainer)))

    rollouts, actor = wrap_methods(Rollouts(), hooks, SLIME_ROLLOUT), wrap_methods(Actor(), hooks, SLIME_ACTOR)
    actor.update_weights()  # slime syncs before its first rollout
    actor.train(0, rollouts.generate(0))
    assert [s for s, _ in seen] == ["update_weights", "generate", "train"]
    assert seen[0][1] == {"trainers": "a-trainer", "samplers": "a-sampler"}
    assert seen[1][1] == {"trainers": None, "samplers": "a-sampler"}
    assert seen[2][1] == {"trainers": "a-trainer", "samplers": None}
    with pytest.raises(ValueError, match="has no method train, update_weights"):
        wrap_methods(Rollouts(), hooks, {**SLIME_ACTOR, "generate": Phase.ROLLOUT})


@pytest.mark.slow
def test_async_hooks_sync_from_opposite_pools_too(daemon: EmbeddedDaemon) -> None:
    sock = str(daemon.socket)

    async def scenario() -> list[str]:
        clients = {
            name: (
                timesliced.AsyncClient(f"{name}-trainer", "trainers", address=sock, gpus=[0]),
                timesliced.AsyncClient(f"{name}-sampler", "samplers", address=sock, gpus=[1]),
            )
            for name in ("a", "b")
        }
        a, b = (AsyncPhaseHooks(*clients[n], timeout=20) for n in ("a", "b"))
        holding = {"a": asyncio.Event(), "b": asyncio.Event()}
        done: list[str] = []

        async def run(name: str, hooks: AsyncPhaseHooks, outer: Phase) -> None:
            async with hooks.phase(outer):
                holding[name].set()
                for event in holding.values():
                    await event.wait()  # a holds the trainers' pool, b the samplers'
                async with hooks.weight_sync():
                    assert hooks.held == {"trainer", "sampler"}
                    done.append(name)
                assert hooks.phases == (outer,)

        try:
            await asyncio.wait_for(asyncio.gather(run("a", a, Phase.TRAIN), run("b", b, Phase.ROLLOUT)), 30)
            probe = clients["a"][0]
            assert {g["group"]: g["holder"] for g in (await probe.status())["groups"]} == {
                "trainers": None,
                "samplers": None,
            }
        finally:
            for pair in clients.values():
                for c in pair:
                    await c.close()
        return sorted(done)

    assert asyncio.run(scenario()) == ["a", "b"]
