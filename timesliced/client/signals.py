"""``HELD``: the signals' Python handlers held back for a few lines of the main thread that must not be cut.

Python runs a signal's handler in the main thread, between two of its steps, so the handler's
exception (a Ctrl-C's ``KeyboardInterrupt``, a SIGTERM handler's ``SystemExit``) can land anywhere
there: between a ``recv`` and the code that keeps what it read, say, which then loses it. Inside
``with HELD:`` each signal that has a Python handler is recorded instead; on the way out the handlers
are put back and called for what came, in order (all of them; the first exception is raised), so
what they raise comes out of the ``with`` line, once the block has done its work. Only the main
thread may use it (only it can set handlers).

A handler that is swapped and never put back (an exception landing in the middle of the way out)
stays harmless: outside a block, the recorder calls the handler it stands for at once. A handler
set while no block runs is found by the next block: every block looks at every signal again.

Swapping goes through ``signal.signal``, which sets the signal's C-level action again: a
``signal.siginterrupt`` setting of a signal with a Python handler is not kept, nor a C-level handler
installed over one (``faulthandler.register(..., chain=True)`` after ``signal.signal``).

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
    """The context manager behind ``HELD``; a block inside a block is part of the outer one."""

    def __init__(self) -> None:
        self._depth = 0  # blocks entered and not left
        self._held = False  # signals are recorded now (set last on the way in, first on the way out)
        self._handlers: dict[int, Handler] = {}  # signal -> the handler its recorder stands for
        self._caught: list[tuple[int, FrameType | None]] = []  # kept here until run: a cut exit loses none
        self._recorder = self._record  # one object, so a handler found is known for one of ours
        self._seen: list[Any] = []  # every signal's handler as the last block found it
        self._python: list[tuple[int, Handler]] = []  # those of them that are Python's (not ours)

    def __enter__(self) -> HeldSignals:
        self._depth += 1
        if self._depth > 1:
            return self
        try:
            if self._caught:
                self._run_caught()  # what a cut exit left, before anything is read
            seen = list(map(_getsignal, _SIGNALS))  # the look at every signal, in one C loop
            if seen != self._seen:  # a handler set since the last block (most blocks find the same)
                self._seen = seen
                pairs = zip(_SIGNALS, seen, strict=True)
                self._python = [(s, h) for s, h in pairs if callable(h) and h is not self._recorder]
            # Swapped while not yet held: a signal meanwhile runs its own handler, before anything was read.
            for signum, handler in self._python:
                self._handlers[signum] = handler
                _setsignal(signum, self._recorder)
        except BaseException:
            self._depth -= 1  # the ``with`` never began: nothing to leave
            raise
        self._held = True
        return self

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        if self._depth:
            return
        self._held = False  # from here a signal runs its handler at once, through the recorder if need be
        try:
            for signum, handler in list(self._handlers.items()):
                if _getsignal(signum) is self._recorder:
                    _setsignal(signum, handler)
                del self._handlers[signum]
        finally:
            self._run_caught()

    def _record(self, signum: int, frame: FrameType | None) -> None:
        if self._held:
            self._caught.append((signum, frame))
        else:
            self._run(signum, frame)

    def _run_caught(self) -> None:
        """Run every handler for what came while held, in order, then raise the first one's exception.

        As Python does for signals that come together: one handler's exception does not keep the
        others from running. Each is taken off the list before it runs, so it runs once.
        """
        error: BaseException | None = None
        while self._caught:
            signum, frame = self._caught.pop(0)
            try:
                self._run(signum, frame)
            except BaseException as exc:
                error = error or exc
        if error is not None:
            raise error

    def _run(self, signum: int, frame: FrameType | None) -> None:
        handler = self._handlers.get(signum) or _getsignal(signum)
        if callable(handler) and handler is not self._recorder:
            handler(signum, frame)


HELD = HeldSignals()
