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


def test_an_exit_cut_while_it_puts_the_handlers_back_still_runs_what_came_and_its_recorders_forward(
    handlers: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A signal that lands while ``__exit__`` puts the handlers back: what was held still runs, none is swallowed."""
    from timesliced.client import signals

    held = HeldSignals()
    setsignal = signals._setsignal
    cut = [True]

    def cut_once(signum: int, handler: Any) -> Any:
        if cut[0] and handler is not held._recorder:  # putting the first one back: Ctrl-C lands here
            cut[0] = False
            raise KeyboardInterrupt
        return setsignal(signum, handler)

    monkeypatch.setattr(signals, "_setsignal", cut_once)
    with pytest.raises(KeyboardInterrupt), held:
        signal.raise_signal(signal.SIGUSR2)
    assert handlers == [signal.SIGUSR2]  # held, and run although the exit was cut
    recorders = [s for s in (signal.SIGUSR1, signal.SIGUSR2) if signal.getsignal(s) == held._recorder]
    assert recorders, "the cut left no recorder in place: the test shows nothing"
    signal.raise_signal(signal.SIGUSR2)  # outside a block, a recorder left in place forwards at once
    assert handlers == [signal.SIGUSR2, signal.SIGUSR2]
    with pytest.raises(Raised):
        signal.raise_signal(signal.SIGUSR1)
    with held:  # the next block finds its own recorders and still holds, then puts every handler back
        signal.raise_signal(signal.SIGUSR2)
        assert handlers[3:] == []
    assert handlers[3:] == [signal.SIGUSR2]
    assert all(signal.getsignal(s) != held._recorder for s in (signal.SIGUSR1, signal.SIGUSR2))


def test_every_held_handler_runs_though_one_raises_and_the_first_exception_comes_out(handlers: list[int]) -> None:
    with pytest.raises(Raised), HELD:
        signal.raise_signal(signal.SIGUSR1)  # raises when run
        signal.raise_signal(signal.SIGUSR2)
    assert handlers == [signal.SIGUSR1, signal.SIGUSR2]


def test_a_block_inside_a_block_is_part_of_it(handlers: list[int]) -> None:
    with HELD:
        with HELD:
            signal.raise_signal(signal.SIGUSR2)
        assert handlers == []  # still held: the outer block is not over
    assert handlers == [signal.SIGUSR2]


def test_a_handler_set_between_blocks_is_the_one_run(handlers: list[int]) -> None:
    with HELD:
        pass
    later: list[Any] = []
    signal.signal(signal.SIGUSR2, lambda signum, frame: later.append(signum))
    with HELD:
        signal.raise_signal(signal.SIGUSR2)
    assert later == [signal.SIGUSR2] and handlers == []
