"""``HELD``: the signals' Python handlers held back for a few lines of the main thread that must not be cut.

Python runs a signal's handler in the main thread, between two of its steps, so the handler's
exception (a Ctrl-C's ``KeyboardInterrupt``, a SIGTERM handler's ``SystemExit``) can land anywhere
there: between a ``recv`` and the code that keeps what it read, say, which then loses it. Inside
``with HELD:`` each signal that has a Python handler is recorded instead; on the way out the handlers
are put back and called for what came, in order, so what they raise comes out of the ``with`` line,
once the block has done its work. Only the main thread may use it (only it can set handlers).

A handler that is swapped and never put back (an exception landing in the middle of the way out)
stays harmless: outside a block, the recorder calls the handler it stands for at once. A handler
set while no block runs is found by the next block: every block looks at every signal again.

It uses ``_signal``, the C module that ``signal`` wraps: ``signal.getsignal`` and ``signal.signal``
turn numbers into enums both ways, about 1.7 µs a call on a small VM, where a block looks at some 60
signals; the C functions take about 1.5 µs for all of them.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from types import FrameType
from typing import Any

try:
    import _signal  # type: ignore[import-not-found]  # the C module has no stub of its own

    _getsignal: Callable[[int], Any] = _signal.getsignal
    _setsignal: Callable[[int, Any], Any] = _signal.signal
except ImportError:  # an interpreter without CPython's module: the slower wrappers do the same
    _getsignal, _setsignal = signal.getsignal, signal.signal

# SIGKILL and SIGSTOP cannot have a handler; the rest are looked at in every block.
_SIGNALS = tuple(int(s) for s in sorted(signal.valid_signals()) if s not in (signal.SIGKILL, signal.SIGSTOP))

Handler = Callable[[int, FrameType | None], Any]


class HeldSignals:
    """The context manager behind ``HELD`` (not re-entrant: one block at a time)."""

    def __init__(self) -> None:
        self._held = False
        self._handlers: dict[int, Handler] = {}  # signal -> the handler its recorder stands for
        self._caught: list[tuple[int, FrameType | None]] = []
        self._recorder = self._record  # one object, so a handler found is known for one of ours

    def __enter__(self) -> HeldSignals:
        # Swapped while not yet held: a signal meanwhile runs its own handler, before anything was read.
        for signum in _SIGNALS:
            handler = _getsignal(signum)
            if handler is not self._recorder and callable(handler):
                self._handlers[signum] = handler
                _setsignal(signum, self._recorder)
        self._caught.clear()
        self._held = True
        return self

    def __exit__(self, *exc: object) -> None:
        self._held = False  # from here a signal runs its handler at once, through the recorder if need be
        caught, self._caught = self._caught, []
        for signum, handler in list(self._handlers.items()):
            if _getsignal(signum) is self._recorder:
                _setsignal(signum, handler)
            del self._handlers[signum]
        for signum, frame in caught:  # what came while held, in order; the first exception ends the rest
            self._run(signum, frame)

    def _record(self, signum: int, frame: FrameType | None) -> None:
        if self._held:
            self._caught.append((signum, frame))
        else:
            self._run(signum, frame)

    def _run(self, signum: int, frame: FrameType | None) -> None:
        handler = self._handlers.get(signum) or _getsignal(signum)
        if callable(handler) and handler is not self._recorder:
            handler(signum, frame)


HELD = HeldSignals()
