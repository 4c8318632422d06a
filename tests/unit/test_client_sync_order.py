"""The sync client's shell around its core, driven by hand (``tests/helpers/sync_core.py``): no daemon, no socket.

- Pushes are carried out in the stream's order whichever thread read them and however late it
  dispatches: a streamed unpark's room is opened, relayed to and ended under the client's lock, as the
  core puts the pushes out, so a room never outlives its connection and a ``rest`` never comes before
  its unpark.
- A directive's answers go on the connection it came on, or nowhere.
- A signal's exception in the main thread (simulated where it lands: right after a call returns)
  strands no other thread's answer, leaves no request that nobody waits for, and loses no frame silently.
- A client used in a process forked from its own raises at once and writes nothing.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

import timesliced
from timesliced import errors
from timesliced.client import shell, sync
from timesliced.client.session import Answered, Failed, Logged, Pushed

from ..helpers.sync_core import OfflineClient

DIRECTIVE = 4242
UNPARK = {"directive": DIRECTIVE, "action": "unpark", "tags": [], "room": {"0": 0}}
REST = {"directive": DIRECTIVE, "rest": True}


class StreamingExecutor:
    """An executor that streams: its unpark maps one byte of GPU 0 through the room; its park waits for ``go``."""

    streams = True

    def __init__(self) -> None:
        self.ended = threading.Event()
        self.go = threading.Event()
        self.go.set()
        self.outcome: list[str] = []

    def park(self, tags: Any = (), *, verify: Any = None, freed: Any = None) -> dict[str, Any]:
        self.go.wait(10)
        self.ended.set()
        return {"nbytes": 0, "seconds": 0.0}

    def unpark(self, tags: Any = (), *, verify: Any = None, room: Any = None) -> dict[str, Any]:
        try:
            room.take(0, 1)
            self.outcome.append("mapped")
        except errors.BackendError as exc:
            self.outcome.append(exc.message)
            raise
        finally:
            self.ended.set()
        return {"nbytes": 1, "seconds": 0.0}


@pytest.fixture
def executor() -> StreamingExecutor:
    return StreamingExecutor()


@pytest.fixture
def off(executor: StreamingExecutor) -> Iterator[OfflineClient]:
    off = OfflineClient(offloader=executor)
    off.connect()
    yield off
    executor.go.set()
    off.close()


# --- finding: pushes in the stream's order ------------------------------------------------------------


def test_a_room_read_before_its_connection_ended_is_ended_with_it(off: OfflineClient, executor: Any) -> None:
    later = off.push("offload", UNPARK)  # read by one thread, which is preempted before it dispatches
    off.end()  # another thread reads the connection's end
    off.client._dispatch(later)
    assert executor.ended.wait(5), "the unpark waits for room from a connection that is gone, for ever"
    assert executor.outcome == ["the streamed unpark was called off: the daemon closed the connection"]


def test_a_rest_dispatched_before_its_unpark_still_lifts_the_limit(off: OfflineClient, executor: Any) -> None:
    first = off.push("offload", UNPARK)  # the reader thread read it, then was preempted
    second = off.push("offload_room", REST)  # a caller took the socket, read the next bytes ...
    off.client._dispatch(second)  # ... and dispatched them first
    off.client._dispatch(first)
    assert executor.ended.wait(5), "the unpark waits for room although the limit was lifted"
    assert executor.outcome == ["mapped"]


def test_on_push_still_sees_every_push_in_order(executor: Any) -> None:
    seen: list[str] = []
    off = OfflineClient(offloader=executor, on_push=lambda event, data: seen.append(event))
    try:
        off.connect()
        off.client._dispatch(off.push("offload", UNPARK) + off.push("offload_room", REST))
        assert executor.ended.wait(5) and seen == ["offload", "offload_room"]
    finally:
        off.close()


# --- finding: a directive's answers go with its connection -----------------------------------------


def test_an_old_connections_directive_is_answered_on_no_newer_connection(off: OfflineClient, executor: Any) -> None:
    executor.go.clear()
    off.client._dispatch(off.push("offload", {"directive": 1, "action": "park", "tags": []}))  # daemon A's park 1
    off.end()  # A dies while the worker parks
    off.connect()  # the restarted daemon B, whose own directive 1 may come next
    off.wire.requests()
    executor.go.set()
    assert executor.ended.wait(5)
    off.client._directives.submit(lambda: None).result(5)  # type: ignore[union-attr]  # the worker is done
    assert [r["op"] for r in off.wire.requests()] == [], "A's answer went out on B's connection"
    off.client._dispatch(off.push("offload", {"directive": 1, "action": "park", "tags": []}))  # B's own park 1
    off.client._directives.submit(lambda: None).result(5)  # type: ignore[union-attr]
    (done,) = off.wire.requests()
    assert done["op"] == "offload_done" and done["args"]["directive"] == 1 and done["args"]["ok"]


# --- finding: a signal's exception in the main thread ----------------------------------------------


def test_an_interrupted_dispatch_answers_every_waiter_and_runs_every_callback_then_raises(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[str] = []
    off = OfflineClient(on_push=lambda event, data: seen.append(event))
    original = sync._Answer.set_exception
    fired: list[bool] = []

    def then_a_signal(self: sync._Answer, error: BaseException) -> None:
        original(self, error)
        if not fired:
            fired.append(True)
            raise KeyboardInterrupt  # the handler's exception, right after the first answer is set

    monkeypatch.setattr(sync._Answer, "set_exception", then_a_signal)
    answers = [sync._Answer() for _ in range(3)]
    lost = errors.ConnectionLost("the client is closed")
    later: list[Any] = [(a, Failed(rid, lost)) for rid, a in enumerate(answers, 1)]
    later += [(None, Pushed("granted", {}, 1)), (None, Logged(20, "x")), (None, Pushed("lock_lost", {}, 1))]
    with pytest.raises(KeyboardInterrupt):
        off.client._dispatch(later)
    assert all(a.settled for a in answers), "a thread waits for ever"
    assert seen == ["granted", "lock_lost"] and later == []
    off.close()


def test_a_callback_that_raises_runs_once_and_the_rest_still_run() -> None:
    seen: list[str] = []

    def on_push(event: str, data: Any) -> None:
        seen.append(event)
        if event == "a":
            raise KeyboardInterrupt

    off = OfflineClient(on_push=on_push)
    answer = sync._Answer()
    with pytest.raises(KeyboardInterrupt):
        off.client._dispatch([(None, Pushed("a", {}, 1)), (answer, Answered(1, 5)), (None, Pushed("b", {}, 1))])
    assert seen == ["a", "b"] and answer.result(0) == 5
    off.close()


def interrupted_after(start: Any) -> Any:
    """``start``, with a signal's exception landing right after it returned."""

    def call(now: float) -> int:
        start(now)
        raise KeyboardInterrupt

    return call


def test_an_acquire_interrupted_right_after_it_was_made_is_withdrawn(off: OfflineClient) -> None:
    core = off.client._core
    with pytest.raises(KeyboardInterrupt):
        off.client._submit(interrupted_after(lambda now: core.acquire(None, now)))
    (acquire, cancel) = off.wire.requests()
    assert acquire["op"] == "acquire"
    assert cancel["op"] == "cancel" and cancel["args"] == {"request": acquire["id"]}
    assert off.client._waiters == {} and not core._pending, "an acquire nobody waits for stays queued"


def test_a_request_interrupted_before_it_was_made_withdraws_nothing(off: OfflineClient) -> None:
    def refused(now: float) -> int:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        off.client._submit(refused)
    assert off.wire.requests() == [] and off.client._waiters == {}


def test_an_acquire_interrupted_before_its_wait_began_is_withdrawn(
    off: OfflineClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupted(*args: Any) -> Any:
        raise KeyboardInterrupt  # at the wait's first step

    monkeypatch.setattr(off.client, "_follow", interrupted)
    with pytest.raises(KeyboardInterrupt):
        off.client.acquire()
    assert [r["op"] for r in off.wire.requests()] == ["acquire", "cancel"]
    assert not off.client._core._pending


def test_frames_cut_short_by_an_interrupt_end_the_connection_and_go_out_on_the_next(off: OfflineClient) -> None:
    client, core = off.client, off.client._core
    with client._lock:  # another thread's request, queued in the core, not flushed yet
        rid = core.request("status", None, time.monotonic())
        client._waiters[rid] = theirs = sync._Answer()
    off.wire.fail = KeyboardInterrupt()  # lands in the main thread's sendall: frames taken, not all sent
    with pytest.raises(KeyboardInterrupt):
        client._step(core.handle_timers)
    assert off.wire.shut, "the frames are dropped and the connection goes on without them"
    assert client._sock is None
    off.end()  # the reader thread reads the end it caused
    off.wire.shut = False
    off.connect()
    (status,) = off.wire.requests()
    assert status["op"] == "status" and status["id"] == rid  # re-sent with its id on the new connection
    client._dispatch(off.feed({"id": rid, "ok": True, "result": {"daemon": "ok"}}))
    assert theirs.result(0) == {"daemon": "ok"}


# --- finding: a client used in a forked child ---------------------------------------------------------


def test_a_client_in_another_process_raises_at_once_and_sends_nothing(
    off: OfflineClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shell._Process, "pid", -1)  # what the fork hook sets in a child
    with pytest.raises(errors.ConnectionLost, match="make a new client in this process"):
        off.client.release()
    off.client.close()
    assert off.wire.requests() == [] and not off.wire.shut
    assert off.client._core.connection == off.conn  # the parent's connection is still open in the core


def test_an_async_client_in_another_process_raises_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    client = timesliced.AsyncClient("a", "g", address="/nonexistent/timesliced.sock")
    monkeypatch.setattr(shell._Process, "pid", -1)

    async def body() -> None:
        with pytest.raises(errors.ConnectionLost, match="is a fork of it"):
            await client.acquire()
        await client.close()

    asyncio.run(body())
    assert client._core.state.value == "idle"  # it never asked for a connection
