"""``HELD``: signals' Python handlers held back for a block of the main thread, then run in order."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from types import FrameType
from typing import Any

import pytest

from timesliced.client.signals import HELD, HeldSignals


class Raised(Exception):
    pass


@pytest.fixture
def handlers() -> Iterator[list[int]]:
    """SIGUSR1 and SIGUSR2 handlers that note the signal, SIGUSR1's then raising ``Raised``; put back afterwards."""
    seen: list[int] = []

    def note(signum: int, frame: FrameType | None) -> None:
        seen.append(signum)

    def note_and_raise(signum: int, frame: FrameType | None) -> None:
        seen.append(signum)
        raise Raised

    previous = signal.signal(signal.SIGUSR1, note_and_raise), signal.signal(signal.SIGUSR2, note)
    yield seen
    signal.signal(signal.SIGUSR1, previous[0])
    signal.signal(signal.SIGUSR2, previous[1])


def test_a_signal_in_the_block_runs_its_handler_after_the_block_and_raises_from_the_with_line(
    handlers: list[int],
) -> None:
    done: list[str] = []
    with pytest.raises(Raised), HELD:
        signal.raise_signal(signal.SIGUSR1)
        done.append("after the signal")  # the handler did not cut the block
        assert handlers == []
    assert done == ["after the signal"]
    assert handlers == [signal.SIGUSR1]


def test_the_handlers_are_put_back_and_signals_after_the_block_run_at_once(handlers: list[int]) -> None:
    usr1, usr2 = signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGUSR2)
    with HELD:
        assert signal.getsignal(signal.SIGUSR1) is not usr1  # held
    assert (signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGUSR2)) == (usr1, usr2)
    signal.raise_signal(signal.SIGUSR2)
    assert handlers == [signal.SIGUSR2]


def test_signals_held_together_run_in_the_order_they_came(handlers: list[int]) -> None:
    with HELD:
        signal.raise_signal(signal.SIGUSR2)
        signal.raise_signal(signal.SIGUSR2)
    assert handlers == [signal.SIGUSR2, signal.SIGUSR2]
    with pytest.raises(Raised), HELD:
        signal.raise_signal(signal.SIGUSR2)
        signal.raise_signal(signal.SIGUSR1)
    assert handlers[2:] == [signal.SIGUSR2, signal.SIGUSR1]


def test_an_exception_of_the_block_itself_still_puts_the_handlers_back(handlers: list[int]) -> None:
    usr1 = signal.getsignal(signal.SIGUSR1)
    with pytest.raises(ZeroDivisionError), HELD:
        1 / 0  # noqa: B018
    assert signal.getsignal(signal.SIGUSR1) is usr1


def test_ignored_and_default_dispositions_are_left_alone() -> None:
    previous = signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    try:
        with HELD:
            assert signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN
            signal.raise_signal(signal.SIGUSR1)  # ignored, as it would be outside
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_a_recorder_left_in_place_by_a_cut_exit_runs_the_handler_it_stands_for(handlers: list[int]) -> None:
    """An exception in the middle of ``__exit__`` may leave a recorder installed: it must not swallow signals."""
    held = HeldSignals()
    held.__enter__()
    held._held = False  # the first line of ``__exit__``, and nothing after it
    try:
        signal.raise_signal(signal.SIGUSR2)
        assert handlers == [signal.SIGUSR2]
        with pytest.raises(Raised):
            signal.raise_signal(signal.SIGUSR1)
        with held:  # the next block finds its own recorders and still holds, then puts the handlers back
            signal.raise_signal(signal.SIGUSR2)
            assert handlers == [signal.SIGUSR2, signal.SIGUSR1]
        assert handlers == [signal.SIGUSR2, signal.SIGUSR1, signal.SIGUSR2]
    finally:
        held.__exit__(None, None, None)
    assert all(signal.getsignal(s) is not held._recorder for s in (signal.SIGUSR1, signal.SIGUSR2))


def test_a_handler_set_between_blocks_is_the_one_run(handlers: list[int]) -> None:
    with HELD:
        pass
    later: list[Any] = []
    signal.signal(signal.SIGUSR2, lambda signum, frame: later.append(signum))
    with HELD:
        signal.raise_signal(signal.SIGUSR2)
    assert later == [signal.SIGUSR2] and handlers == []
