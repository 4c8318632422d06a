"""``Client``: a waiting call reads the socket in its own thread; the reader thread reads the rest of the time.

These look at the shell's state (``_caller_reading``; ``_wakes.watching``: the socket is in the reader
thread's epoll set, unmasked) to show which thread waits on the socket; the behaviour they guard
(answers, pushes, close, timeouts) is checked from the outside as well.
"""

from __future__ import annotations

import shutil
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import timesliced
from timesliced import errors
from timesliced.config import DaemonConfig
from timesliced.core.slices import SlicePolicy
from timesliced.daemon.embedded import EmbeddedDaemon
from timesliced.env import default_sim_dir

from ..helpers.processes import wait_for

MiB = 1 << 20


@pytest.fixture
def warned(tmp_path: Path) -> Iterator[EmbeddedDaemon]:
    """A daemon that warns a holder (``slice_overdue``) 0.2 s into a slice that others wait for."""
    config = DaemonConfig(
        state_dir=tmp_path / "state",
        backend="sim",
        gpus=1,
        gpu_memory=8 * MiB,
        bandwidth=0,
        slice_policies={"*": SlicePolicy(0.2, "warn")},
    )
    d = EmbeddedDaemon(config).start()
    yield d
    d.stop()
    shutil.rmtree(default_sim_dir(tmp_path / "state"), ignore_errors=True)


def reader_watches(client: timesliced.Client) -> bool:
    """The client's socket wakes its reader thread (in its epoll set, unmasked)."""
    wakes = client._wakes
    return wakes is not None and wakes.watching


def acquire_in_thread(client: timesliced.Client, **kw: Any) -> tuple[threading.Thread, list[Any]]:
    """``client.acquire(**kw)`` on a thread of its own; the list gets the grant or the exception."""
    got: list[Any] = []

    def run() -> None:
        try:
            got.append(client.acquire(**kw))
        except BaseException as exc:  # the test looks at it
            got.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, got


def test_a_waiting_acquire_reads_the_socket_and_gives_it_back_for_the_pushes(warned: EmbeddedDaemon) -> None:
    pushes: list[str] = []
    with (
        timesliced.Client(job="a", group="g", address=warned.socket) as a,
        timesliced.Client(job="b", group="g", address=warned.socket, on_push=lambda e, _: pushes.append(e)) as b,
        timesliced.Client(job="c", group="g", address=warned.socket) as c,
    ):
        wait_for(lambda: reader_watches(b))  # connected and idle: the reader thread waits on the socket
        a.acquire()
        t, got = acquire_in_thread(b)
        wait_for(lambda: b._caller_reading and not reader_watches(b))  # b's caller took the socket
        a.release()
        t.join(5)
        assert got and isinstance(got[0], timesliced.Grant) and got[0].job == "b"
        wait_for(lambda: reader_watches(b))  # given back: the reader thread waits on the socket again
        assert not b._caller_reading
        waiter, later = acquire_in_thread(c)  # b now holds a slice that c waits for: warned 0.2 s in
        wait_for(lambda: "slice_overdue" in pushes, timeout=5)  # read by b's reader thread: nobody waits
        b.release()
        waiter.join(5)
        assert later and isinstance(later[0], timesliced.Grant) and later[0].job == "c"
        c.release()


def test_an_answer_set_by_another_thread_wakes_the_caller_reading_the_socket(warned: EmbeddedDaemon) -> None:
    """The caller waits on the socket, not on its answer: whoever else settles the answer must wake it."""
    with (
        timesliced.Client(job="a", group="g", address=warned.socket) as a,
        timesliced.Client(job="b", group="g", address=warned.socket) as b,
    ):
        a.acquire()
        t, got = acquire_in_thread(b)
        wait_for(lambda: b._caller_reading)
        with b._lock:
            ((rid, answer),) = b._waiters.items()  # the acquire's
            del b._waiters[rid]
        answer.set_exception(errors.AcquireCancelled("settled by the test from another thread"))
        t.join(2)
        assert not t.is_alive(), "the caller reading the socket did not wake for its answer"
        assert isinstance(got[0], errors.AcquireCancelled)
        wait_for(lambda: reader_watches(b) and not b._caller_reading)
        a.release()


def test_close_from_another_thread_ends_an_acquire_that_reads_the_socket(warned: EmbeddedDaemon) -> None:
    a = timesliced.Client(job="a", group="g", address=warned.socket)
    b = timesliced.Client(job="b", group="g", address=warned.socket)
    try:
        b.connect()  # an acquire reads the socket itself when it finds the connection open
        a.acquire()
        t, got = acquire_in_thread(b)
        wait_for(lambda: b._caller_reading)
        b.close()
        t.join(5)
        assert got and isinstance(got[0], errors.ConnectionLost)
        assert b._reader is not None and not b._reader.is_alive()  # the reader thread ended once the caller left
        a.release()
    finally:
        a.close()
        b.close()


def test_a_timed_out_acquire_that_reads_the_socket_leaves_the_queue(warned: EmbeddedDaemon) -> None:
    with (
        timesliced.Client(job="a", group="g", address=warned.socket) as a,
        timesliced.Client(job="b", group="g", address=warned.socket) as b,
    ):
        a.acquire()
        started = time.monotonic()
        with pytest.raises(errors.AcquireTimeout):
            b.acquire(timeout=0.2)
        assert time.monotonic() - started < 5
        wait_for(lambda: reader_watches(b) and not b._caller_reading)
        a.release()
        assert b.acquire(timeout=5).fence == 2  # b's expired acquire was never granted behind its back
        b.release()


def test_a_call_while_another_caller_reads_is_answered_through_that_caller(warned: EmbeddedDaemon) -> None:
    """One caller reads the socket at a time; the others' answers reach them through it."""
    with (
        timesliced.Client(job="a", group="g", address=warned.socket) as a,
        timesliced.Client(job="b", group="g", address=warned.socket) as b,
    ):
        a.acquire()
        t, got = acquire_in_thread(b)
        wait_for(lambda: b._caller_reading)
        assert [j["job"] for j in b.status()["jobs"]] == ["a", "b"]  # read by the acquiring thread
        assert b._caller_reading and t.is_alive()  # which still waits on the socket for its grant
        a.release()
        t.join(5)
        assert got and isinstance(got[0], timesliced.Grant)
        b.ping()  # the socket is free again (the main thread leaves it to the reader thread)
        b.release()


def test_the_main_thread_reads_the_socket_itself_while_it_waits(warned: EmbeddedDaemon) -> None:
    """The grant wakes the waiting main thread directly, not the reader thread first."""
    with (
        timesliced.Client(job="a", group="g", address=warned.socket) as a,
        timesliced.Client(job="b", group="g", address=warned.socket) as b,
    ):
        a.acquire()
        seen: list[bool] = []

        def look_then_release() -> None:  # while the main thread waits in b.acquire()
            wait_for(lambda: len(b._waiters) == 1)
            wait_for(lambda: b._caller_reading)
            seen.append(reader_watches(b))
            a.release()

        t = threading.Thread(target=look_then_release, daemon=True)
        t.start()
        assert b.acquire(timeout=10).job == "b"
        t.join(5)
        assert seen == [False], "the reader thread kept the socket while the main thread waited"
        b.release()


class Interrupted(Exception):
    """What the test's SIGUSR1 handler raises, as a Ctrl-C's handler raises ``KeyboardInterrupt``."""


class SignalAfterRecv:
    """A client's socket whose next ``recv`` in the main thread that reads bytes is hit by SIGUSR1 before it returns.

    The handler runs at the first step after ``raise_signal``, inside this ``recv``: the bytes are out
    of the kernel and not yet with the client, the worst moment for a signal's exception.
    """

    def __init__(self, sock: Any) -> None:
        self.sock, self.armed, self.hit = sock, True, 0

    def recv(self, *args: Any) -> bytes:
        data: bytes = self.sock.recv(*args)
        if data and self.armed and threading.current_thread() is threading.main_thread():
            self.armed = False
            self.hit += 1
            signal.raise_signal(signal.SIGUSR1)
        return data

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sock, name)


def test_a_signal_just_after_the_main_thread_read_the_grant_loses_nothing(warned: EmbeddedDaemon) -> None:
    """The handler's exception comes once the grant is in the client: the acquire raises it and gives the grant back."""

    def handler(signum: int, frame: Any) -> None:
        raise Interrupted

    previous = signal.signal(signal.SIGUSR1, handler)
    try:
        with (
            timesliced.Client(job="a", group="g", address=warned.socket) as a,
            timesliced.Client(job="b", group="g", address=warned.socket) as b,
        ):
            a.acquire()
            b.ping()
            with b._lock:
                assert b._sock is not None
                b._sock = sock = SignalAfterRecv(b._sock)  # type: ignore[assignment]

            def release_once_b_waits() -> None:
                wait_for(lambda: len(b._waiters) == 1 and b._caller_reading)
                a.release()

            t = threading.Thread(target=release_once_b_waits, daemon=True)
            t.start()
            with pytest.raises(Interrupted):
                b.acquire(timeout=10)
            t.join(5)
            assert sock.hit == 1, "the signal did not land in the main thread's read"
            # The grant was read whole and given back as the acquire was given up: the lock is free again.
            assert a.acquire(timeout=5).job == "a"
            a.release()
            assert b.acquire(timeout=5).job == "b"
            assert signal.getsignal(signal.SIGUSR1) is handler
            b.release()
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_a_signal_as_the_main_thread_gives_the_socket_back_leaves_it_with_the_reader_thread(
    warned: EmbeddedDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A signal's exception in the hand-back comes after it: a socket left taken would never be read again."""
    from timesliced.client import sync

    def handler(signum: int, frame: Any) -> None:
        raise Interrupted

    watch = sync._Answer.watch
    armed = [False]

    def signalled_watch(self: Any, wakes: Any) -> None:
        if wakes is None and armed[0] and threading.current_thread() is threading.main_thread():
            armed[0] = False
            signal.raise_signal(signal.SIGUSR1)  # the first step of the hand-back
        watch(self, wakes)

    previous = signal.signal(signal.SIGUSR1, handler)
    monkeypatch.setattr(sync._Answer, "watch", signalled_watch)
    try:
        with (
            timesliced.Client(job="a", group="g", address=warned.socket) as a,
            timesliced.Client(job="b", group="g", address=warned.socket, request_timeout=30) as b,
        ):
            a.acquire()

            def release_once_b_reads() -> None:
                wait_for(lambda: len(b._waiters) == 1 and b._caller_reading)
                a.release()

            t = threading.Thread(target=release_once_b_reads, daemon=True)
            t.start()
            armed[0] = True
            with pytest.raises(Interrupted):
                b.acquire(timeout=10)
            t.join(5)
            assert not armed[0], "the signal did not land in the hand-back"
            assert not b._caller_reading and reader_watches(b)
            assert len(b.status()["jobs"]) == 2  # read at once, not after request_timeout
            assert a.acquire(timeout=5).job == "a"  # b's grant, given up on, went back
            a.release()
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_a_signal_handler_that_calls_the_client_while_the_main_thread_waits_is_answered(
    warned: EmbeddedDaemon,
) -> None:
    """A SIGTERM-style handler that asks the daemon something while the main thread waits for the lock.

    The main thread holds the socket for its wait; the handler's call, below it on the same thread,
    reads the socket itself. Left to nobody, it would wait out ``request_timeout`` and fail.
    """
    asked: list[Any] = []
    with (
        timesliced.Client(job="a", group="g", address=warned.socket) as a,
        timesliced.Client(job="b", group="g", address=warned.socket, request_timeout=30) as b,
    ):
        a.acquire()

        def handler(signum: int, frame: Any) -> None:
            asked.append(len(b.status()["jobs"]))

        previous = signal.signal(signal.SIGUSR1, handler)
        try:

            def signal_then_release() -> None:
                wait_for(lambda: len(b._waiters) == 1 and b._caller_reading)
                signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGUSR1)
                wait_for(lambda: bool(asked), timeout=10)  # answered while b's acquire still waits
                a.release()

            t = threading.Thread(target=signal_then_release, daemon=True)
            t.start()
            assert b.acquire(timeout=20).job == "b"
            t.join(5)
        finally:
            signal.signal(signal.SIGUSR1, previous)
        assert asked == [2]
        b.release()


def test_a_signal_while_the_main_thread_holds_the_clients_lock_runs_its_handler_once_the_lock_is_free(
    warned: EmbeddedDaemon,
) -> None:
    """A handler run inside a section under the lock would deadlock on it if it called the client."""
    seen: list[bool] = []

    class SignalOnSend:
        """The client's socket, whose next ``sendall`` from the main thread is hit by SIGUSR1 (under the lock)."""

        def __init__(self, sock: Any) -> None:
            self.sock, self.armed = sock, True

        def sendall(self, data: bytes) -> None:
            self.sock.sendall(data)
            if self.armed and threading.current_thread() is threading.main_thread():
                self.armed = False
                signal.raise_signal(signal.SIGUSR1)

        def __getattr__(self, name: str) -> Any:
            return getattr(self.sock, name)

    with timesliced.Client(job="a", group="g", address=warned.socket, request_timeout=30) as a:
        a.ping()

        def handler(signum: int, frame: Any) -> None:
            seen.append(a._lock.locked())
            if not seen[-1]:  # (taking a held lock here would hang the test instead of failing it)
                a.ping()

        previous = signal.signal(signal.SIGUSR1, handler)
        try:
            with a._lock:
                assert a._sock is not None
                a._sock = sock = SignalOnSend(a._sock)  # type: ignore[assignment]
            assert len(a.status()["jobs"]) == 1
        finally:
            signal.signal(signal.SIGUSR1, previous)
        assert not sock.armed, "the signal did not land in the main thread's send"
        assert seen == [False], "the handler ran while the main thread held the client's lock"


def test_an_on_push_that_calls_the_client_from_the_main_threads_read_is_answered(warned: EmbeddedDaemon) -> None:
    """``on_push`` runs on the thread that read the push, here the main thread waiting in its own call."""
    released: list[str] = []
    clients: list[timesliced.Client] = []

    def on_push(event: str, data: dict[str, Any]) -> None:
        if event == "slice_overdue" and not released:
            clients[0].release()
            released.append(threading.current_thread().name)

    with (
        timesliced.Client(job="a", group="g", address=warned.socket, on_push=on_push, request_timeout=30) as a,
        timesliced.Client(job="b", group="g", address=warned.socket) as b,
    ):
        clients.append(a)
        a.acquire()
        waiter, got = acquire_in_thread(b, timeout=20)  # b waits: a's slice is overdue after 0.2 s
        deadline = time.monotonic() + 20
        while not released and time.monotonic() < deadline:
            a.ping()  # the main thread reads the socket while it waits for each answer
        waiter.join(20)
        assert released, "on_push never saw slice_overdue, or its release failed"
        assert got and isinstance(got[0], timesliced.Grant) and got[0].job == "b"
        b.release()


def test_a_caller_interrupted_as_it_takes_the_socket_gives_it_back(
    warned: EmbeddedDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An exception raised in a reading caller at any point leaves the socket to the reader thread again."""
    from timesliced.client import sync

    with timesliced.Client(job="a", group="g", address=warned.socket) as a:
        a.ping()
        watch = sync._Wakes.watch
        armed = [True]
        with a._lock:  # the reader thread reads no answer now: the ping's caller must take the socket to get its own
            assert a._wakes is not None and a._sock is not None
            watch(a._wakes, a._sock, False)

        def interrupted_watch(self: Any, sock: Any, on: bool) -> None:
            watch(self, sock, on)
            if armed[0] and not on:
                armed[0] = False
                raise KeyboardInterrupt  # as an asynchronous exception would, just after the socket was masked

        monkeypatch.setattr(sync._Wakes, "watch", interrupted_watch)
        first: list[BaseException] = []

        def ping() -> None:
            try:
                a.ping()
            except BaseException as exc:  # the test looks at it
                first.append(exc)

        t = threading.Thread(target=ping, daemon=True)
        t.start()
        t.join(5)
        assert first and isinstance(first[0], KeyboardInterrupt)
        wait_for(lambda: reader_watches(a) and not a._caller_reading)
        later, got = acquire_in_thread(a, timeout=5)  # and a reading caller gets its answer again
        later.join(5)
        assert got and isinstance(got[0], timesliced.Grant)
        a.release()
