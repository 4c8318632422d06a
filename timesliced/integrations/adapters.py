"""Thin adapters from RL frameworks' hook points onto ``PhaseHooks``, without importing the frameworks.

Each framework names its phases differently; these tables say which name is which phase, as read
in the frameworks' sources (names change between releases: pass your own table where yours differ).

- veRL: ``RayPPOTrainer.fit`` wraps each step in ``marked_timer(name, timing_raw)``, named ``gen``
  (generation: the rollout), ``old_log_prob``, ``ref``, ``values``, ``update_critic``,
  ``update_actor``, ``save_checkpoint`` (the actor's and critic's workers: train), ``testing``
  (validation: a rollout), ``update_weights`` (recent releases: a weight sync), ``reward`` and
  ``adv`` (CPU, no lock; ``step`` wraps the whole step and only times).
  ``VerlTimers.marked_timer`` has the same call shape: put it in the trainer module's place
  (``verl.trainer.ppo.ray_trainer.marked_timer = timers.marked_timer``).
- OpenRLHF: the PPO trainer's ``ppo_train`` (train) and ``broadcast_to_vllm`` (weight sync, called
  inside ``ppo_train``: the hooks hand the trainer's lock through a gang, see ``phases``), and the
  experience maker's ``make_experience_list`` (rollout): ``wrap_methods(trainer, hooks,
  OPENRLHF_TRAINER)`` and ``wrap_methods(maker, hooks, OPENRLHF_EXPERIENCE)``.
- slime: ``train.py``'s loop calls ``rollout_manager.generate(rollout_id)`` (rollout),
  ``actor_model.train(rollout_id, data)`` (train) and ``actor_model.update_weights()`` (weight
  sync): ``SLIME_ROLLOUT`` and ``SLIME_ACTOR``.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from .phases import Phase, PhaseHooks

VERL_TIMERS: Mapping[str, Phase] = {
    "gen": Phase.ROLLOUT,
    "old_log_prob": Phase.TRAIN,
    "ref": Phase.TRAIN,
    "values": Phase.TRAIN,
    "update_critic": Phase.TRAIN,
    "update_actor": Phase.TRAIN,
    "save_checkpoint": Phase.TRAIN,  # reads the trainer's GPU state
    "testing": Phase.ROLLOUT,  # validation generates on the rollout engines
    "update_weights": Phase.WEIGHT_SYNC,  # checkpoint_manager.update_weights, in recent releases
}
OPENRLHF_TRAINER: Mapping[str, Phase] = {"ppo_train": Phase.TRAIN, "broadcast_to_vllm": Phase.WEIGHT_SYNC}
OPENRLHF_EXPERIENCE: Mapping[str, Phase] = {"make_experience_list": Phase.ROLLOUT}
SLIME_ROLLOUT: Mapping[str, Phase] = {"generate": Phase.ROLLOUT, "eval": Phase.ROLLOUT}
SLIME_ACTOR: Mapping[str, Phase] = {"train": Phase.TRAIN, "update_weights": Phase.WEIGHT_SYNC}


class VerlTimers:
    """veRL's ``marked_timer`` that also holds each named step's phase.

    Like veRL's, it adds the step's seconds to ``timing_raw[name]``; a name not in ``phases``
    (``reward``, ``adv``, ``step``) only times.
    """

    def __init__(self, hooks: PhaseHooks, phases: Mapping[str, Phase] = VERL_TIMERS) -> None:
        self.hooks = hooks
        self.phases = dict(phases)

    @contextmanager
    def marked_timer(self, name: str, timing_raw: dict[str, float], *args: Any, **kwargs: Any) -> Iterator[None]:
        phase = self.phases.get(name)
        started = time.perf_counter()
        try:
            if phase is None:
                yield
            else:
                with self.hooks.phase(phase):
                    yield
        finally:
            timing_raw[name] = timing_raw.get(name, 0.0) + time.perf_counter() - started


def wrap_methods(obj: Any, hooks: PhaseHooks, methods: Mapping[str, Phase]) -> Any:
    """Make each named method of ``obj`` run inside its phase (on this instance only); returns ``obj``.

    Raises ``ValueError`` naming the methods ``obj`` lacks, before wrapping any.
    """
    missing = sorted(name for name in methods if not callable(getattr(obj, name, None)))
    if missing:
        raise ValueError(
            f"{type(obj).__name__} has no method {', '.join(missing)}: pass a table of the methods "
            "your version of the framework has"
        )
    for name, phase in methods.items():
        setattr(obj, name, _in_phase(getattr(obj, name), hooks, phase))
    return obj


def _in_phase(method: Callable[..., Any], hooks: PhaseHooks, phase: Phase) -> Callable[..., Any]:
    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with hooks.phase(phase):
            return method(*args, **kwargs)

    return wrapper
