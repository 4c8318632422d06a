"""The client's session core (pure): handshake, reconnection, timeouts, abandoned acquires, heartbeats.

Every input goes through ``Harness``, which checks the core's invariants after each step and, for an
input that must be refused, that nothing changed at all (outputs included). The daemon is played by
hand: the harness decodes what the core sends and encodes replies and pushes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import pytest

from timesliced import errors
from timesliced.client.codec import Grant
from timesliced.client.session import (
    GRACE_S,
    TRANSITIONS,
    WARNING,
    Answered,
    ClientSession,
    Disconnect,
    Failed,
    Input,
    Logged,
    Output,
    Pushed,
    State,
    Unreachable,
)
from timesliced.wire.codec import FrameDecoder, encode
from timesliced.wire.messages import Push, Reply

E = TypeVar("E", bound=BaseException)
SOCKET = "/run/timesliced/ts.sock"
REGISTER = {"job": "j", "group": "g", "gpus": None, "pids": [1]}
GRANT = {"group": "g", "job": "j", "fence": 1, "waited_s": 0.0, "switch_s": 0.0, "restored": False}


class Harness:
    """Drives one ``ClientSession`` with an explicit clock, and plays the daemon's side of the wire."""

    def __init__(self, *, token: bool = False, **config: Any) -> None:
        def auth(hello: Any) -> dict[str, Any] | None:
            if "challenge" not in hello:
                return None
            if not token:
                raise errors.PermissionDenied("the daemon asks for the shared token")
            return {"proof": "p-" + hello["challenge"]}

        self.core = ClientSession("j", dict(REGISTER), {"version": 1}, address=SOCKET, auth=auth, **config)
        self.now = 0.0
        self.outputs: list[Output] = []
        self.conn = 0
        self._decoder = FrameDecoder()

    # --- inputs ----------------------------------------------------------------------------

    def do(self, call: Callable[[float], Any]) -> Any:
        """One input at ``now``; returns its result. Outputs pile up in ``outputs``."""
        result = call(self.now)
        self.outputs += self.core.drain()
        self.core.check_invariants()
        return result

    def fails(self, call: Callable[[float], Any], error: type[E], match: str | None = None) -> E:
        """Feed ``call``, expect ``error``, and check that the core did not change."""
        before = snapshot(self.core)
        with pytest.raises(error, match=match) as info:
            call(self.now)
        assert snapshot(self.core) == before, "a refused input changed the session"
        self.core.check_invariants()
        return info.value

    def at(self, now: float) -> None:
        """The clock moves to ``now`` and the timers run."""
        self.now = now
        self.do(self.core.handle_timers)

    # --- the daemon's side -------------------------------------------------------------------

    def made(self) -> int:
        """The attempt that is due connects."""
        self.do(self.core.start_attempt)
        self._decoder = FrameDecoder()
        self.conn = self.do(self.core.connection_made)
        return self.conn

    def sent(self) -> list[dict[str, Any]]:
        """The requests the core wrote since the last look."""
        return self._decoder.feed(self.core.data_to_send())

    def sent_ops(self) -> list[str]:
        return [r["op"] for r in self.sent()]

    def answer(self, rid: int, result: Any = None, *, error: errors.TimeslicedError | None = None) -> None:
        reply = Reply(rid, error is None, result, error)
        self.feed(encode(reply.to_wire()))

    def push(self, event: str, **data: Any) -> None:
        self.feed(encode(Push(event, data).to_wire()))

    def feed(self, data: bytes) -> None:
        self.do(lambda now: self.core.receive_data(self.conn, data, now))

    def expect(self, op: str) -> dict[str, Any]:
        """The one request the core sent since the last look, which must be ``op``."""
        (request,) = self.sent()
        assert request["op"] == op, request
        return request

    def handshake(self, *, lease: float | None = None, challenge: str | None = None, session: int = 7) -> None:
        """The attempt that is due connects and the daemon takes the job."""
        self.made()
        hello = self.expect("hello")
        result: dict[str, Any] = {"version": 1, "session": session}
        if lease is not None:
            result["lease_s"] = lease
        if challenge is not None:
            result["challenge"] = challenge
        self.answer(hello["id"], result)
        if challenge is not None:
            auth = self.expect("auth")
            assert auth["args"] == {"proof": "p-" + challenge}
            self.answer(auth["id"], {})
        register = self.expect("register")
        assert register["args"] == REGISTER
        self.answer(register["id"], {"session": session, "gpus": [0, 1]})

    def ready(self, **handshake: Any) -> int:
        """Connect from scratch; returns the id of the ``wait_ready`` that was answered."""
        rid: int = self.do(self.core.wait_ready)
        self.handshake(**handshake)
        assert self.core.state is State.READY
        assert self.take(Answered) == [Answered(rid, None)]
        return rid

    def lost(self, reason: str = "the daemon closed the connection") -> None:
        self.do(lambda now: self.core.connection_lost(self.conn, now, reason))

    def refused_attempt(self, why: Unreachable = Unreachable.STALE) -> None:
        self.do(self.core.start_attempt)
        self.do(lambda now: self.core.connection_failed(now, "[Errno 111] Connection refused", why))

    def take(self, kind: type[Any]) -> list[Any]:
        """The outputs of ``kind`` so far (taken out of ``outputs``)."""
        found = [o for o in self.outputs if isinstance(o, kind)]
        self.outputs = [o for o in self.outputs if not isinstance(o, kind)]
        return found

    def failed(self, rid: int) -> errors.TimeslicedError:
        (failure,) = [o for o in self.take(Failed) if o.rid == rid]
        return failure.error  # type: ignore[no-any-return]

    def answered(self, rid: int) -> Any:
        (answer,) = [o for o in self.take(Answered) if o.rid == rid]
        return answer.value


def snapshot(core: ClientSession) -> str:
    """Everything the core knows, as comparable text."""
    fields = {k: v for k, v in vars(core).items() if k not in ("auth", "_proto")}
    proto = core._proto
    decoder = proto._decoder
    return repr((sorted((k, repr(v)) for k, v in fields.items()), proto._next_id, bytes(decoder._buf), decoder._broken))


@pytest.fixture
def h() -> Harness:
    return Harness()


# --- the core is pure, and its table is whole -----------------------------------------------------


def test_every_state_has_a_row_and_every_row_closes() -> None:
    assert set(TRANSITIONS) == set(State)
    for state, row in TRANSITIONS.items():
        assert row[Input.CLOSE] == {State.CLOSED}
        assert (Input.REQUEST in row) == (state is not State.LOST)
        assert all(targets <= set(State) for targets in row.values())
    starts = [s for s, row in TRANSITIONS.items() if Input.START_ATTEMPT in row]
    assert starts == [State.WAITING]


def test_the_harness_sees_a_refused_input_that_changes_something(h: Harness) -> None:
    def broken(now: float) -> None:
        h.core.lock.holding = True
        raise ValueError("refused, but too late")

    with pytest.raises(AssertionError, match="changed the session"):
        h.fails(broken, ValueError)


# --- the first connection ------------------------------------------------------------------------


def test_a_request_connects_first_and_goes_out_once_the_job_is_registered(h: Harness) -> None:
    rid = h.do(lambda now: h.core.request("status", None, now))
    assert h.core.state is State.WAITING and h.core.attempt_at == 0.0 and h.core.wants_connection
    assert h.do(h.core.start_attempt) == 10.0  # connect_timeout, within the window of 60 s
    assert h.core.state is State.CONNECTING
    h.conn = h.do(h.core.connection_made)
    assert h.core.state is State.HELLO and h.core.connection == h.conn == 1
    assert h.core.deadline_of(rid) is None  # waiting for the connection: the window decides
    hello = h.expect("hello")
    h.answer(hello["id"], {"version": 1})
    assert h.core.state is State.REGISTER
    register = h.expect("register")
    h.answer(register["id"], {"session": 7, "gpus": [0, 1]})
    assert h.core.state is State.READY and (h.core.session, h.core.gpus) == (7, [0, 1])
    (status,) = h.sent()
    assert (status["id"], status["op"]) == (rid, "status")
    assert h.core.deadline_of(rid) == 60.0  # request_timeout, once it went out
    h.answer(rid, {"groups": []})
    assert h.answered(rid) == {"groups": []}
    assert h.core.reconnects == 0 and h.core.pending() == []


def test_the_token_proof_answers_the_challenge() -> None:
    h = Harness(token=True)
    h.ready(challenge="abcd")
    assert h.core.state is State.READY


def test_without_a_token_the_first_connection_fails_before_anything_more_is_sent(h: Harness) -> None:
    rid = h.do(h.core.wait_ready)
    h.made()
    hello = h.expect("hello")
    h.answer(hello["id"], {"version": 1, "challenge": "abcd"})
    assert h.sent() == []  # no guess at the proof
    assert isinstance(h.failed(rid), errors.PermissionDenied)
    assert h.take(Disconnect) and h.core.state is State.IDLE and not h.core.wants_connection


@pytest.mark.parametrize(
    ("step", "error"),
    [
        ("hello", errors.VersionMismatch("daemon speaks protocol 2")),
        ("register", errors.GroupMismatch("group g is GPU 0 only")),
        ("register", errors.BadRequest("unknown parking method")),
    ],
)
def test_a_refused_first_connection_fails_its_waiters_and_the_next_call_starts_afresh(
    h: Harness, step: str, error: errors.TimeslicedError
) -> None:
    rid = h.do(lambda now: h.core.acquire(None, now))
    h.made()
    hello = h.expect("hello")
    if step == "register":
        h.answer(hello["id"], {"version": 1})
        hello = h.expect("register")
    h.answer(hello["id"], error=error)
    assert type(h.failed(rid)) is type(error)
    assert h.core.state is State.IDLE and h.take(Disconnect)
    h.do(h.core.wait_ready)
    assert h.core.state is State.WAITING and h.core.attempt_at == h.now


def test_nothing_there_fails_a_first_connection_at_once(h: Harness) -> None:
    rid = h.do(h.core.wait_ready)
    h.refused_attempt(Unreachable.ABSENT)
    error = h.failed(rid)
    assert isinstance(error, errors.ConnectionLost)
    assert error.message == f"cannot reach the timesliced daemon at {SOCKET}: [Errno 111] Connection refused"
    assert h.core.state is State.IDLE


def test_a_window_that_reached_a_daemon_does_not_make_the_next_one_wait_for_nothing(h: Harness) -> None:
    """What an earlier connection reached (it got through, then was given up) counts only in its own window."""
    rid = h.do(h.core.wait_ready)
    h.made()  # connected, the hello unanswered
    h.do(lambda now: h.core.abandon(rid, now))
    assert h.core.state is State.IDLE
    rid = h.do(h.core.wait_ready)
    h.refused_attempt(Unreachable.ABSENT)  # now nothing is there at all
    assert isinstance(h.failed(rid), errors.ConnectionLost) and h.core.state is State.IDLE


def test_a_stale_socket_is_tried_with_backoff_until_the_window_ends_and_then_named() -> None:
    h = Harness(reconnect=3.0)
    rid = h.do(h.core.wait_ready)
    attempts = []
    while h.core.state is not State.IDLE:
        attempt_at = h.core.attempt_at
        assert attempt_at is not None and h.core.next_deadline() == attempt_at
        attempts.append(attempt_at)
        h.at(attempt_at)
        h.refused_attempt()
    assert attempts == pytest.approx([0.0, 0.05, 0.15, 0.35, 0.75, 1.55, 2.55, 3.0])
    error = h.failed(rid)
    assert isinstance(error, errors.ConnectionLost)
    assert f"cannot reach the timesliced daemon at {SOCKET} within 3s" in error.message
    assert f"the socket {SOCKET} exists but nothing listens on it (a daemon that died?)" in error.message
    assert f"start the daemon, or remove the stale socket file {SOCKET}" in error.message


def test_an_acquire_with_a_timeout_gives_up_on_a_stale_socket_and_the_connecting_stops(h: Harness) -> None:
    rid = h.do(lambda now: h.core.acquire(2.0, now))
    h.refused_attempt()
    assert h.core.deadline_of(rid) == 2.0 + GRACE_S
    while h.core.state is State.WAITING and (h.core.attempt_at or 0) < 2.0 + GRACE_S:
        h.at(h.core.attempt_at or 0)
        h.refused_attempt()
    h.at(2.0 + GRACE_S)
    error = h.failed(rid)
    assert isinstance(error, errors.ConnectionLost) and "exists but nothing listens" in error.message
    assert h.core.state is State.IDLE  # nobody waits for the connection any more


def test_a_daemon_that_comes_back_within_the_window_is_waited_for(h: Harness) -> None:
    rid = h.do(h.core.wait_ready)
    for _ in range(3):
        h.at(h.core.attempt_at or 0)
        h.refused_attempt()
    h.at(h.core.attempt_at or 0)
    h.handshake()
    assert h.answered(rid) is None and h.core.state is State.READY


def test_a_first_connection_nobody_waits_for_any_more_stops(h: Harness) -> None:
    rid = h.do(h.core.wait_ready)
    h.made()
    h.do(lambda now: h.core.abandon(rid, now))
    assert h.core.state is State.IDLE and h.take(Disconnect)


def test_a_daemon_lost_during_the_first_handshake_is_tried_again(h: Harness) -> None:
    rid = h.do(h.core.wait_ready)
    h.made()
    h.lost()
    assert h.core.state is State.WAITING and h.core.attempt_at == pytest.approx(0.05)  # backing off
    h.at(0.05)
    h.refused_attempt(Unreachable.ABSENT)  # the restarted daemon has not bound its socket yet: still waited for
    assert h.core.state is State.WAITING
    h.at(h.core.attempt_at or 0)
    h.handshake()
    assert h.answered(rid) is None


def test_a_handshake_that_stalls_is_cut_and_tried_again(h: Harness) -> None:
    h.do(h.core.wait_ready)
    h.made()
    assert h.core.next_deadline() == 10.0  # connect_timeout for the hello
    h.at(10.0)
    assert h.take(Disconnect) and h.core.state is State.WAITING and h.core.connection == 0


def test_a_silent_daemon_makes_an_acquire_with_a_timeout_name_the_step_it_waits_for(h: Harness) -> None:
    rid = h.do(lambda now: h.core.acquire(1.0, now))
    h.made()
    h.at(1.0 + GRACE_S)
    error = h.failed(rid)
    assert isinstance(error, errors.ConnectionLost) and "took the connection but has not answered 'hello'" in str(error)


# --- requests on a ready connection -------------------------------------------------------------


def test_an_acquire_asks_with_what_is_left_of_its_timeout(h: Harness) -> None:
    rid = h.do(lambda now: h.core.acquire(2.0, now))
    h.now = 0.5
    h.handshake()
    (acquire,) = h.sent()
    assert acquire["args"] == {"timeout": 1.5} and acquire["id"] == rid
    h.answer(rid, GRANT)
    assert h.answered(rid) == Grant.from_wire(GRANT) and h.core.lock.holding


def test_an_acquire_the_daemon_does_not_answer_in_time_is_withdrawn_and_a_late_grant_released(h: Harness) -> None:
    h.ready()
    rid = h.do(lambda now: h.core.acquire(2.0, now))
    assert h.expect("acquire")["args"] == {"timeout": 2.0}
    h.at(2.0 + GRACE_S - 0.01)
    assert h.take(Failed) == []
    h.at(2.0 + GRACE_S)
    assert isinstance(h.failed(rid), errors.AcquireTimeout)
    assert h.expect("cancel")["args"] == {"request": rid}
    h.answer(rid, GRANT)  # the grant won the race with the cancel
    assert h.expect("release")["args"] == {} and not h.core.lock.holding
    assert h.take(Answered) == []


def test_a_late_grant_is_kept_while_another_acquire_of_the_client_waits(h: Harness) -> None:
    h.ready()
    first = h.do(lambda now: h.core.acquire(1.0, now))
    second = h.do(lambda now: h.core.acquire(None, now))
    h.sent()
    h.at(1.0 + GRACE_S)
    assert isinstance(h.failed(first), errors.AcquireTimeout) and h.sent_ops() == ["cancel"]
    h.answer(first, GRANT)  # one grant serves every ticket of the session
    assert h.sent() == []
    h.answer(second, GRANT)
    assert h.answered(second).fence == 1 and h.core.lock.holding


def test_an_abandoned_acquire_is_cancelled_only_if_it_went_out(h: Harness) -> None:
    unsent = h.do(lambda now: h.core.acquire(None, now))
    h.do(lambda now: h.core.abandon(unsent, now))  # before the connection: nothing to cancel
    assert h.core.state is State.IDLE and h.core.data_to_send() == b""
    h.ready()
    rid = h.do(lambda now: h.core.acquire(None, now))
    h.sent()
    h.do(lambda now: h.core.abandon(rid, now))
    assert h.expect("cancel")["args"] == {"request": rid} and h.core.pending() == []


def test_a_grant_delivered_to_a_waiter_that_was_cancelled_meanwhile_goes_back(h: Harness) -> None:
    h.ready()
    rid = h.do(lambda now: h.core.acquire(None, now))
    h.sent()
    h.answer(rid, GRANT)
    assert h.answered(rid).job == "j"
    h.do(lambda now: h.core.abandon(rid, now))  # the caller's task was cancelled before it resumed
    assert h.sent_ops() == ["release"] and not h.core.lock.holding


def test_a_grant_that_did_not_take_the_lock_stays_when_its_waiter_is_cancelled(h: Harness) -> None:
    h.ready()
    first = h.do(lambda now: h.core.acquire(None, now))
    h.answer(first, GRANT)
    again = h.do(lambda now: h.core.acquire(None, now))  # another thread, while the lock is held
    h.answer(again, GRANT)
    h.sent()
    h.do(lambda now: h.core.abandon(again, now))
    assert h.sent() == [] and h.core.lock.holding


def test_release_frees_the_lock_and_an_unanswered_request_times_out(h: Harness) -> None:
    h.ready()
    rid = h.do(lambda now: h.core.acquire(None, now))
    h.answer(rid, GRANT)
    release = h.do(lambda now: h.core.request("release", None, now))
    h.answer(release, {"group": "g"})
    assert h.answered(release) == {"group": "g"} and not h.core.lock.holding
    status = h.do(lambda now: h.core.request("status", None, now))
    h.at(60.0)
    error = h.failed(status)
    assert isinstance(error, errors.ConnectionLost) and "did not answer 'status' within 60s" in str(error)
    h.answer(status, {})  # too late: dropped
    assert h.take(Answered) == [] and h.core.state is State.READY


def test_a_refused_request_fails_its_caller_only(h: Harness) -> None:
    h.ready()
    rid = h.do(lambda now: h.core.request("release", None, now))
    h.answer(rid, error=errors.NotHolder("job 'j' does not hold group 'g'"))
    assert isinstance(h.failed(rid), errors.NotHolder) and h.core.state is State.READY


def test_pushes_move_the_lock_state_and_reach_the_shell(h: Harness) -> None:
    h.ready()
    rid = h.do(lambda now: h.core.acquire(None, now))
    h.answer(rid, GRANT)
    h.push("slice_overdue", reason="past its maximum slice of 0.3 s")
    h.push("preempted", reason="preempted after its maximum slice")
    assert h.core.lock.preempted == "preempted after its maximum slice"
    h.push("granted", group="g")
    assert h.core.lock.preempted is None
    h.push("faulted", reason="restore failed")
    assert h.core.lock.faulted == "restore failed"
    h.push("resumed", was="restore failed")
    assert h.core.lock.faulted is None
    h.push("move_failed", kind="snapshot", reason="snapshot failed: the tmpfs is full", intact=True)
    assert h.core.lock.faulted is None  # its state is whole: nothing to resume
    h.push("lock_lost", reason="force-released")
    assert not h.core.lock.holding
    pushed = [o.event for o in h.take(Pushed)]
    assert pushed == ["slice_overdue", "preempted", "granted", "faulted", "resumed", "move_failed", "lock_lost"]
    logged = h.take(Logged)
    assert [o.level for o in logged] == [WARNING, WARNING, WARNING] and "tmpfs is full" in logged[-1].message


def test_untracked_requests_go_out_only_on_a_registered_connection(h: Harness) -> None:
    h.do(lambda now: h.core.send("offload_done", {"directive": 1, "ok": True}, now))
    assert h.core.data_to_send() == b"" and h.core.state is State.IDLE
    h.ready()
    h.do(lambda now: h.core.send("offload_done", {"directive": 1, "ok": True}, now))
    (done,) = h.sent()
    h.answer(done["id"], error=errors.BadRequest("no offload directive 1"))  # nobody waits: dropped
    assert h.take(Failed) == []


def test_a_directives_answer_goes_on_the_connection_it_came_on_or_nowhere(h: Harness) -> None:
    h.ready()
    first = h.conn
    h.push("offload", directive=1, action="park")
    (pushed,) = h.take(Pushed)
    assert pushed.connection == first  # the shell ties the directive to its connection
    h.lost()
    h.handshake()  # a restarted daemon, which numbers its own directives from wherever it starts
    h.do(lambda now: h.core.send("offload_done", {"directive": 1, "ok": True}, now, connection=first))
    assert h.sent() == [], "the old daemon's directive 1 was answered on the new connection"
    h.do(lambda now: h.core.send("offload_done", {"directive": 1, "ok": True}, now, connection=h.conn))
    assert [r["op"] for r in h.sent()] == ["offload_done"]


def test_a_connection_the_core_leaves_is_named_in_its_disconnect(h: Harness) -> None:
    h.ready()
    conn = h.conn
    h.do(h.core.close)
    assert h.take(Disconnect) == [Disconnect("the client is closed", conn)]


def test_the_next_request_id_is_known_before_the_request_is_made(h: Harness) -> None:
    expected = h.core.next_request
    assert h.do(lambda now: h.core.request("status", None, now)) == expected
    assert h.core.next_request > expected


# --- heartbeats follow the latest daemon's lease ----------------------------------------------------


def test_heartbeats_every_third_of_the_lease_and_after_a_reconnection_the_new_lease(h: Harness) -> None:
    h.ready(lease=30.0)
    assert h.core.lease == 30.0 and h.core.next_deadline() == pytest.approx(10.0)
    h.at(5.0)
    rid = h.do(lambda now: h.core.request("ping", None, now))  # any bytes count: the next heartbeat moves on
    assert h.core.next_deadline() == pytest.approx(15.0)
    h.answer(rid)
    h.at(15.0)
    assert h.sent_ops() == ["ping", "ping"]
    h.now = 20.0
    h.lost()
    h.at(20.0)
    h.handshake(lease=0.9)
    assert h.core.lease == 0.9 and h.core.reconnects == 1
    assert h.core.next_deadline() == pytest.approx(20.3)
    h.at(20.3)
    assert h.sent_ops() == ["ping"]
    h.lost()
    h.at(20.3)
    h.handshake(lease=None)  # a daemon without leases: no heartbeats at all
    assert h.core.lease is None and h.core.next_deadline() is None


# --- reconnection ---------------------------------------------------------------------------------


def test_a_holder_reconnects_asks_for_its_lock_first_then_resends_with_the_same_ids(h: Harness) -> None:
    h.ready()
    rid = h.do(lambda now: h.core.acquire(None, now))
    h.answer(rid, GRANT)
    status = h.do(lambda now: h.core.request("status", None, now))
    waiter = h.do(lambda now: h.core.acquire(30.0, now))
    assert h.sent_ops() == ["acquire", "status", "acquire"]
    h.now = 10.0
    h.lost()
    assert h.core.state is State.WAITING and h.core.attempt_at == 10.0
    (warning,) = h.take(Logged)
    assert "lost its daemon" in warning.message and "reconnecting for up to 60s" in warning.message
    h.now = 12.0
    h.made()
    hello = h.expect("hello")
    h.answer(hello["id"], {"version": 1})
    register = h.expect("register")
    h.answer(register["id"], {"session": 9, "gpus": [0]})
    assert h.core.state is State.REACQUIRE
    again = h.expect("acquire")
    assert again["args"] == {"timeout": None} and again["id"] not in (rid, status, waiter)
    h.answer(again["id"], {**GRANT, "fence": 2})
    assert h.core.state is State.READY and h.core.reconnects == 1 and h.core.session == 9
    resent = h.sent()
    assert [(r["id"], r["op"]) for r in resent] == [(status, "status"), (waiter, "acquire")]
    assert resent[1]["args"] == {"timeout": 18.0}  # what is left of its 30 s
    h.answer(status, {"groups": []})
    assert h.answered(status) == {"groups": []}


def test_an_acquire_gives_up_while_the_client_reconnects(h: Harness) -> None:
    h.ready()
    rid = h.do(lambda now: h.core.acquire(2.0, now))
    h.sent()
    h.lost()
    for _ in range(4):
        h.at(h.core.attempt_at or 0)
        h.refused_attempt()
    h.at(2.0 + GRACE_S)
    error = h.failed(rid)
    assert isinstance(error, errors.AcquireTimeout)
    assert "not granted within 2s: the client is reconnecting" in error.message and "nothing listens" in error.message
    assert h.core.state is State.WAITING  # a reconnection goes on for its own sake


def test_a_daemon_that_does_not_come_back_loses_the_session_until_it_is_closed() -> None:
    h = Harness(reconnect=2.0)
    h.ready()
    rid = h.do(lambda now: h.core.request("release", None, now))
    h.lost()
    while h.core.state is State.WAITING:
        h.at(h.core.attempt_at or 0)
        h.refused_attempt(Unreachable.ABSENT)
    assert h.core.state is State.LOST and h.now == 2.0
    error = h.failed(rid)
    assert isinstance(error, errors.ConnectionLost) and error.message.startswith(
        "the daemon did not come back within 2s"
    )
    assert h.fails(lambda now: h.core.request("status", None, now), errors.ConnectionLost) is error
    h.fails(h.core.wait_ready, errors.ConnectionLost)
    h.do(h.core.close)
    assert h.core.state is State.CLOSED
    h.do(h.core.wait_ready)
    assert h.core.state is State.WAITING


def test_without_reconnect_a_lost_daemon_is_lost_at_once() -> None:
    h = Harness(reconnect=0.0)
    h.ready()
    rid = h.do(lambda now: h.core.acquire(None, now))
    h.lost()
    assert h.core.state is State.LOST and h.failed(rid).message == "the daemon closed the connection"


def test_a_restarted_daemon_that_refuses_the_job_loses_the_session(h: Harness) -> None:
    h.ready()
    h.lost()
    h.made()
    hello = h.expect("hello")
    h.answer(hello["id"], {"version": 1})
    register = h.expect("register")
    h.answer(register["id"], error=errors.GroupMismatch("group g is GPU 0 only"))
    assert h.core.state is State.LOST and isinstance(h.core.error, errors.GroupMismatch)
    assert any("cannot resume" in o.message for o in h.take(Logged))


@pytest.mark.parametrize(
    ("closing", "state"),
    [
        (errors.ConnectionLost("no heartbeat within the lease of 1s"), State.WAITING),  # connect again
        (errors.ProtocolError("frame too large"), State.LOST),
    ],
)
def test_a_closing_error_from_the_daemon(h: Harness, closing: errors.TimeslicedError, state: State) -> None:
    h.ready()
    rid = h.do(lambda now: h.core.request("status", None, now))
    h.push("granted")  # what came before the closing error is handled first
    h.feed(encode({"id": None, "ok": False, "error": errors.to_wire(closing)}))
    assert h.take(Disconnect) and h.core.state is state and [o.event for o in h.take(Pushed)] == ["granted"]
    if state is State.LOST:
        assert isinstance(h.failed(rid), type(closing))
    else:
        assert h.core.pending() == [rid]


def test_broken_bytes_lose_the_session(h: Harness) -> None:
    h.ready()
    h.feed(b"\xff\xff\xff\xff")
    assert h.core.state is State.LOST and isinstance(h.core.error, errors.FrameTooLarge)


def test_reports_about_a_connection_that_is_gone_change_nothing(h: Harness) -> None:
    h.ready()
    old = h.conn
    h.lost()
    h.made()
    before = snapshot(h.core)
    h.do(lambda now: h.core.receive_data(old, encode({"push": "lock_lost", "data": {}}), now))
    h.do(lambda now: h.core.connection_lost(old, now, "late"))
    assert snapshot(h.core) == before and not h.take(Pushed)


def test_close_fails_every_waiter_and_forgets_the_hold(h: Harness) -> None:
    h.ready()
    rid = h.do(lambda now: h.core.acquire(None, now))
    h.answer(rid, GRANT)
    waiting = h.do(lambda now: h.core.request("status", None, now))
    h.do(h.core.close)
    assert h.take(Disconnect) and h.failed(waiting).message == "the client is closed"
    assert h.core.state is State.CLOSED and not h.core.lock.holding
    before = snapshot(h.core)
    h.do(h.core.close)
    assert snapshot(h.core) == before


# --- refused inputs change nothing ----------------------------------------------------------------


def in_state(state: State) -> Harness:
    """A harness whose session is in ``state``."""
    h = Harness(token=True)
    if state is State.IDLE:
        return h
    h.do(h.core.wait_ready)
    if state is State.WAITING:
        return h
    if state is State.CONNECTING:
        h.do(h.core.start_attempt)
        return h
    if state in (State.HELLO, State.AUTH, State.REGISTER):
        h.made()
        if state is State.HELLO:
            return h
        hello = h.expect("hello")
        h.answer(hello["id"], {"version": 1, **({"challenge": "c"} if state is State.AUTH else {})})
        return h
    h.handshake()
    if state is State.READY:
        return h
    if state is State.CLOSED:
        h.do(h.core.close)
        return h
    rid = h.do(lambda now: h.core.acquire(None, now))
    h.answer(rid, GRANT)
    if state is State.LOST:
        h.core.reconnect = 0.0
        h.lost()
        return h
    h.lost()
    assert state is State.REACQUIRE
    h.made()
    hello = h.expect("hello")
    h.answer(hello["id"], {"version": 1})
    h.answer(h.expect("register")["id"], {"session": 8, "gpus": [0]})
    return h


CALLS: dict[Input, Callable[[ClientSession], Callable[[float], Any]]] = {
    Input.REQUEST: lambda core: lambda now: core.request("status", None, now),
    Input.START_ATTEMPT: lambda core: core.start_attempt,
    Input.CONNECTION_MADE: lambda core: core.connection_made,
    Input.CONNECTION_FAILED: lambda core: lambda now: core.connection_failed(now, "refused"),
    # a report about the open connection; with none open it is a stale report, ignored rather than refused
    Input.RECEIVE_DATA: lambda core: lambda now: core.receive_data(core.connection or -1, b"", now),
    Input.CONNECTION_LOST: lambda core: lambda now: core.connection_lost(core.connection or -1, now, "gone"),
}


@pytest.mark.parametrize("state", list(State))
def test_inputs_missing_from_the_table_are_refused_and_change_nothing(state: State) -> None:
    h = in_state(state)
    assert h.core.state is state
    for event, call in CALLS.items():
        if event in TRANSITIONS[state]:
            continue
        if event in (Input.RECEIVE_DATA, Input.CONNECTION_LOST) and not h.core.connection:
            before = snapshot(h.core)
            call(h.core)(h.now)
            assert snapshot(h.core) == before
            continue
        error = errors.ConnectionLost if state is State.LOST and event is Input.REQUEST else ValueError
        h.fails(call(h.core), error)


@pytest.mark.parametrize("state", list(State))
def test_malformed_calls_are_refused_in_every_state(state: State) -> None:
    h = in_state(state)
    h.fails(lambda now: h.core.acquire(-1.0, now), ValueError, "timeout must be >= 0")
    h.fails(lambda now: h.core.request("", None, now), ValueError, "non-empty")
    h.fails(lambda now: h.core.send("", None, now), ValueError, "non-empty")
    too_large = {"blob": b"x" * (2 << 20)}
    h.fails(lambda now: h.core.request("status", too_large, now), errors.FrameTooLarge)
    h.fails(lambda now: h.core.send("offload_done", too_large, now), errors.FrameTooLarge)


def test_an_attempt_is_refused_before_it_is_due(h: Harness) -> None:
    h.do(h.core.wait_ready)
    h.refused_attempt()
    assert h.core.attempt_at == pytest.approx(0.05)
    h.fails(h.core.start_attempt, ValueError, "no connection attempt is due")
