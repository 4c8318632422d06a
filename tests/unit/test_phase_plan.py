"""The phase hooks' rules (``integrations.phase_plan``), table-driven: what each begin and end gives
back and takes, and every refused nesting."""

from __future__ import annotations

import pytest

from timesliced.integrations.phase_plan import SAMPLER, TRAINER, Phase, Step, begin, end, needs, retake

R, T, W = Phase.ROLLOUT, Phase.TRAIN, Phase.WEIGHT_SYNC
NONE: frozenset[str] = frozenset()
TR, SA, BOTH = frozenset({TRAINER}), frozenset({SAMPLER}), frozenset({TRAINER, SAMPLER})

# (open phases, held, phase begun) -> (release, take, held after)
BEGINS = [
    ((), NONE, R, (NONE, SA, SA)),
    ((), NONE, T, (NONE, TR, TR)),
    ((), NONE, W, (NONE, BOTH, BOTH)),
    ((T,), TR, T, (NONE, NONE, TR)),  # nested alike: nothing to take
    ((R,), SA, R, (NONE, NONE, SA)),
    ((T,), TR, W, (TR, BOTH, BOTH)),  # give back the trainer's lock, take both as a gang
    ((R,), SA, W, (SA, BOTH, BOTH)),
    ((W,), BOTH, R, (NONE, NONE, BOTH)),  # inside a weight sync everything is held
    ((W,), BOTH, T, (NONE, NONE, BOTH)),
    ((T, W), BOTH, W, (NONE, NONE, BOTH)),
]


@pytest.mark.parametrize(("stack", "held", "phase", "want"), BEGINS)
def test_begin(stack: tuple[Phase, ...], held: frozenset[str], phase: Phase, want: tuple[frozenset[str], ...]) -> None:
    step = begin(stack, held, phase, colocated=False)
    assert (step.release, step.take, step.held) == want
    assert step.gang == (len(want[1]) == 2)


@pytest.mark.parametrize(("stack", "held", "phase"), [((T,), TR, R), ((R,), SA, T), ((T, T), TR, R)])
def test_a_pool_is_never_asked_for_while_the_other_is_held(
    stack: tuple[Phase, ...], held: frozenset[str], phase: Phase
) -> None:
    with pytest.raises(ValueError, match="cannot begin inside"):
        begin(stack, held, phase, colocated=False)


# (open phases, held, phase ended) -> (release, held after)
ENDS = [
    ((R,), SA, R, (SA, NONE)),
    ((T,), TR, T, (TR, NONE)),
    ((W,), BOTH, W, (BOTH, NONE)),
    ((T, W), BOTH, W, (SA, TR)),  # the train phase goes on with its pool
    ((R, W), BOTH, W, (TR, SA)),
    ((W, R), BOTH, R, (NONE, BOTH)),
    ((T, T), TR, T, (NONE, TR)),
]


@pytest.mark.parametrize(("stack", "held", "phase", "want"), ENDS)
def test_end(stack: tuple[Phase, ...], held: frozenset[str], phase: Phase, want: tuple[frozenset[str], ...]) -> None:
    step = end(stack, held, phase, colocated=False)
    assert (step.release, step.take, step.held) == (want[0], NONE, want[1])


@pytest.mark.parametrize(("stack", "phase"), [((), T), ((T,), R), ((T, W), T)])
def test_only_the_innermost_phase_ends(stack: tuple[Phase, ...], phase: Phase) -> None:
    with pytest.raises(ValueError, match="reverse order"):
        end(stack, needs(stack, False), phase, colocated=False)


def test_a_colocated_run_takes_its_one_lock_once() -> None:
    assert begin((), NONE, W, colocated=True) == Step(NONE, TR, TR)
    for phase in (R, T, W):
        assert begin((T,), TR, phase, colocated=True) == Step(NONE, NONE, TR)
    assert end((T, R), TR, R, colocated=True) == Step(NONE, NONE, TR)
    assert end((T,), TR, T, colocated=True) == Step(TR, NONE, NONE)


def test_what_a_failed_gang_takes_back() -> None:
    assert retake((T,), False) == TR and retake((R,), False) == SA and retake((), False) == NONE


def test_every_reachable_state_takes_both_pools_only_as_a_gang() -> None:
    """Walk every sequence of up to four begins and ends: no step asks for a pool while holding the other."""
    seen = 0
    frontier: list[tuple[tuple[Phase, ...], frozenset[str]]] = [((), NONE)]
    for _ in range(4):
        nxt = []
        for stack, held in frontier:
            assert held == needs(stack, False)
            for phase in Phase:
                try:
                    step = begin(stack, held, phase, colocated=False)
                except ValueError:
                    continue
                after = held - step.release
                assert not step.take or not after, "asks for a lock while holding one"
                assert not step.take or step.take == BOTH or not (step.take & held)
                nxt.append(((*stack, phase), step.held))
            if stack:
                step = end(stack, held, stack[-1], colocated=False)
                nxt.append((stack[:-1], step.held))
            seen += 1
        frontier = nxt
    assert seen > 20
