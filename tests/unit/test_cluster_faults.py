"""A cluster core is never left half-changed: a malformed message, or a bug, leaves it as it was.

A fault is injected (a function that a handler calls is made to raise) and a structural snapshot
of the whole node (its follower state, its leader's half, the orchestrator and the scheduler)
taken before and after shows that nothing changed. The one exception is a bug that strikes after
the leader's scheduler took its step: then the leader drops that state and takes stock again.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from typing import Any

import pytest

from timesliced.cluster import messages, node, orchestrator, rebuild
from timesliced.cluster.asks import Acquire, Register
from timesliced.cluster.effects import Send
from timesliced.cluster.messages import Grant, MalformedPeerMessage, Ready, Sync
from timesliced.cluster.node import ClusterNode
from timesliced.daemon.root import Daemon

from ..helpers.harness import core_state


class Injected(Exception):
    """The fault this test injects."""


def broken(*args: Any, **kwargs: Any) -> Any:
    raise Injected("injected")


def state(n: ClusterNode, now: float) -> tuple[Any, ...]:
    """Everything the node knows, as comparable plain data."""
    lead, orch = n.lead, n.lead.orch
    return (
        repr({k: v for k, v in vars(n).items() if k not in ("election", "lead")}),
        n.election.describe(now),
        repr({k: v for k, v in vars(lead).items() if k not in ("election", "orch", "_figures")}),
        lead._figures is None,
        None if orch is None else core_state(orch.scheduler, now),
        None if orch is None else repr({k: v for k, v in vars(orch).items() if k != "scheduler"}),
    )


# --- a follower ---------------------------------------------------------------------------------


def heartbeat(term: int, leader: str) -> dict[str, Any]:
    return {"k": "elect", "m": {"type": "heartbeat", "term": term, "leader": leader, "sent_at": 0.0}}


def follower() -> ClusterNode:
    """Node b following a in term 2: job A registered on conn 1, an acquire waiting, a move under way."""
    n = ClusterNode("b", ("a", "b", "c"), {0: 100}, rng=random.Random(1))
    n.start(0.0)
    n.receive("a", heartbeat(2, "a"), 0.1)
    n.receive("a", {"k": "sync", "era": [2, 1]}, 0.1)
    n.receive("a", {"k": "ready", "era": [2, 1]}, 0.1)
    n.request(Register(1, 1, "A", "g", (0,)), 0.2)
    n.request(Register(2, 1, "B", "g", (0,)), 0.2)
    for req, job in ((1, "A"), (2, "B")):
        result = {"job": job, "group": "g", "gpus": [100], "location": "resident"}
        n.receive("a", {"k": "res", "id": req, "op": "register", "ok": True, "result": result, "era": [2, 1]}, 0.2)
    n.request(Acquire(1, 2), 0.3)
    n.receive("a", {"k": "move", "op": 7, "kind": "snapshot", "job": "B", "era": [2, 1], "streams_with": []}, 0.3)
    n.drain()
    return n


def grant(fence: int, rid: int) -> dict[str, Any]:
    info = {"group": "g", "job": "A", "fence": fence, "waited_s": 0.0, "switch_s": 0.0, "restored": False, "term": 2}
    return {"k": "grant", "tickets": [[1, rid]], "info": info, "again": False, "era": [2, 1]}


FOLLOWER_FAULTS: list[tuple[str, Callable[[ClusterNode], None], Any, str]] = [
    # (what, the input, what is broken, the attribute)
    ("a grant", lambda n: n.receive("a", grant(1, 2), 0.4), messages.GrantInfo, "to_wire"),
    ("a fail", lambda n: n.receive("a", fail(2), 0.4), messages.WireError, "exception"),
    (
        "a move",
        lambda n: n.receive(
            "a", {"k": "move", "op": 8, "kind": "restore", "job": "A", "era": [2, 1], "streams_with": []}, 0.4
        ),
        node,
        "moved",
    ),
    ("a move ending", lambda n: n.move_finished((2, 1, 7), True, 60, 0.1, "", 0.4), node, "moved"),
    ("a move ending, told", lambda n: n.move_finished((2, 1, 7), True, 60, 0.1, "", 0.4), messages.Note, "__init__"),
    (
        "a notice",
        lambda n: n.receive("a", {"k": "notify", "job": "A", "event": "lock_lost", "data": {}, "era": [2, 1]}, 0.4),
        node,
        "Push",
    ),
    ("a close", lambda n: n.closed(1, 0.4), node, "Closed"),
    ("an acquire", lambda n: n.request(Acquire(2, 3), 0.4), node, "Req"),
    ("a new leader's sync", lambda n: n.receive("c", {"k": "sync", "era": [3, 1]}, 0.5), ClusterNode, "_report"),
]


def fail(rid: int) -> dict[str, Any]:
    return {"k": "fail", "conn": 1, "rid": rid, "error": {"code": "job_faulted", "message": "no"}, "era": [2, 1]}


@pytest.mark.parametrize(("what", "step", "owner", "name"), FOLLOWER_FAULTS, ids=[f[0] for f in FOLLOWER_FAULTS])
def test_a_follower_handler_that_fails_changes_nothing(
    monkeypatch: pytest.MonkeyPatch, what: str, step: Callable[[ClusterNode], None], owner: Any, name: str
) -> None:
    n = follower()
    if what == "a new leader's sync":  # its report is sent at once: no move is under way
        n.move_finished((2, 1, 7), True, 60, 0.1, "", 0.4)
        n.receive("c", heartbeat(3, "c"), 0.4)
        n.drain()
    before = state(n, 0.4)
    monkeypatch.setattr(owner, name, broken)
    with pytest.raises(Injected):
        step(n)
    assert state(n, 0.4) == before
    monkeypatch.undo()
    step(n)  # and once the fault is gone, the same input goes through
    assert state(n, 0.4) != before


def test_the_same_inputs_without_a_fault_change_the_node() -> None:
    """The inputs above are not no-ops (a test that cannot fail is a bug)."""
    for what, step, _, _ in FOLLOWER_FAULTS:
        n = follower()
        if what == "a new leader's sync":
            n.move_finished((2, 1, 7), True, 60, 0.1, "", 0.4)
            n.receive("c", heartbeat(3, "c"), 0.4)
        before = state(n, 0.4)
        step(n)
        assert state(n, 0.4) != before


@pytest.mark.parametrize(
    "message",
    [
        {"k": "grant", "tickets": [[1, 2]], "info": {"group": "g"}, "again": False, "era": [2, 1]},
        {"k": "move", "op": 8, "kind": "teleport", "job": "A", "era": [2, 1]},
        {"k": "res", "id": 3, "op": "register", "ok": True, "result": {"gpus": "all"}, "era": [2, 1]},
        {"k": "sync", "era": [3]},
        {"k": "elect", "m": {"type": "heartbeat", "term": True, "leader": "a", "sent_at": 0.0}},
        {"k": "elect", "m": {"type": "heartbeat", "term": 2, "leader": "c", "sent_at": 0.0}},  # a second leader in 2
        {"k": "coup"},
    ],
    ids=lambda m: m.get("k"),
)
def test_a_malformed_message_is_refused_before_anything_changes(message: dict[str, Any]) -> None:
    n = follower()
    before = state(n, 0.4)
    sender = "c" if message.get("m", {}).get("leader") == "c" else "a"
    with pytest.raises(MalformedPeerMessage):
        n.receive(sender, message, 0.4)
    assert state(n, 0.4) == before and n.drain() == []


# --- the leader -----------------------------------------------------------------------------------


def elected(reporters: tuple[str, ...] = ("b",)) -> ClusterNode:
    """Node a, leader of a, b, c in term 1, its era (1, 1) taken stock of with the reports of ``reporters``."""
    n = ClusterNode("a", ("a", "b", "c"), {0: 100}, rng=random.Random(1), election_timeout=(1.0, 2.0))
    n.start(0.0)
    n.handle_timers(2.0)  # a pre-vote
    n.receive("b", {"k": "elect", "m": {"type": "pre_vote_reply", "term": 1, "granted": True}}, 2.0)
    n.receive("b", {"k": "elect", "m": {"type": "vote_reply", "term": 1, "granted": True}}, 2.0)
    assert n.election.role.value == "leader"
    for peer in reporters:
        n.receive(peer, {"k": "report", "report": report(), "era": [1, 1]}, 2.1)
    n.drain()
    return n


def report(waiting: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Node b's: job B registered on its conn 1 and resident, nobody holding."""
    job = {
        "job": "B",
        "group": "g",
        "exclusive": False,
        "location": "resident",
        "footprint": {"0": 40},
        "faulted": "",
        "span": [0, 100],
        "gone": False,
        "freezes": True,
        "memory": None,
        "memory_each": None,
        "priority": 0,
        "weight": 1.0,
    }
    return {
        "devices": {"0": 100},
        "sessions": [{"conn": 1, "job": "B", "pids": [], "party": None}],
        "jobs": [job],
        "holders": [],
        "waiting": waiting or [],
        "fences": {},
        "turns": [],
    }


def req(op: str, args: dict[str, Any], rid: int = 1) -> dict[str, Any]:
    return {"k": "req", "id": rid, "op": op, "args": args, "era": [1, 1]}


REGISTER_C = req(
    "register",
    {
        "conn": 2,
        "rid": 1,
        "job": "C",
        "group": "g",
        "gpus": [0],
        "pids": [],
        "exclusive": False,
        "extra": {},
        "freezes": True,
        "memory": None,
        "memory_each": None,
        "priority": 0,
        "weight": 1.0,
        "party": None,
    },
)


def test_a_rebuild_that_fails_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    n = elected(reporters=())
    assert n.lead._collect == {"a": n.lead._collect["a"]}  # its own report is in; b's completes a majority
    before = state(n, 2.1)
    monkeypatch.setattr(rebuild, "adopt_sessions", broken)
    with pytest.raises(Injected):
        n.receive("b", {"k": "report", "report": report(), "era": [1, 1]}, 2.1)
    assert state(n, 2.1) == before and not n.leading
    monkeypatch.undo()
    n.receive("b", {"k": "report", "report": report(), "era": [1, 1]}, 2.1)
    assert n.leading and n.scheduler is not None and "B" in n.scheduler.jobs


@pytest.mark.parametrize(
    ("request_", "name"),
    [
        (REGISTER_C, "global_session"),
        (REGISTER_C, "_gpu"),
        (req("acquire", {"conn": 1, "rid": 2, "timeout": None, "gang": None, "members": 0}), "global_session"),
        ({"k": "note", "op": "freed", "args": {"job": "B", "gpu": 0, "nbytes": 40}, "era": [1, 1]}, "_gpu"),
    ],
    ids=["register/session", "register/gpus", "acquire", "freed"],
)
def test_a_leader_input_that_fails_before_its_scheduler_steps_changes_nothing(
    monkeypatch: pytest.MonkeyPatch, request_: dict[str, Any], name: str
) -> None:
    n = elected()
    before = state(n, 2.2)
    monkeypatch.setattr(orchestrator, name, broken)
    with pytest.raises(Injected):
        n.receive("b", request_, 2.2)
    assert state(n, 2.2) == before
    assert n.scheduler is not None
    n.scheduler.check_invariants()


def test_a_leader_that_fails_after_its_scheduler_stepped_takes_stock_again(monkeypatch: pytest.MonkeyPatch) -> None:
    n = elected()
    assert n.lead.orch is not None
    era = n.lead.orch.era
    monkeypatch.setattr(orchestrator, "Queued", broken)  # after the acquire was queued
    with pytest.raises(Injected):
        n.receive("b", req("acquire", {"conn": 1, "rid": 2, "timeout": None, "gang": None, "members": 0}), 2.2)
    assert not n.leading and n.lead._collect_era == (era[0], era[1] + 1)  # that state is dropped
    syncs = [e for e in n.drain() if isinstance(e, Send) and isinstance(e.message, Sync)]
    assert sorted(s.to for s in syncs) == ["b", "c"] and any("broke on a bug" in p for p in n.problems)
    monkeypatch.undo()
    # b answers the new era's sync with its report, the acquire in it: it is granted from there
    waiting = [{"conn": 1, "rid": 2, "seq": None, "order": 1, "deadline_in": None, "gang": None, "members": 0}]
    n.receive("b", {"k": "report", "report": report(waiting), "era": [era[0], era[1] + 1]}, 2.3)
    assert n.leading and n.scheduler is not None
    n.scheduler.check_invariants()
    out = [e.message for e in n.drain() if isinstance(e, Send) and e.to == "b"]
    assert any(isinstance(m, Ready) for m in out)
    assert [m.info.job for m in out if isinstance(m, Grant)] == ["B"]


# --- the daemon: a peer's malformed message is the peer's, anything else is a bug ------------------


class _Shell:
    """The part of ``Daemon`` that ``_on_peer_message`` uses."""

    def __init__(self, error: Exception) -> None:
        self.error = error
        self.cluster = self

    def receive(self, sender: str, message: dict[str, Any], now: float) -> None:
        raise self.error

    def _now(self) -> float:
        return 0.0

    def _step(self, call: Callable[..., Any], *args: Any) -> Any:
        return call(*args)


@pytest.mark.parametrize(
    ("error", "logged"),
    [(MalformedPeerMessage("grant.info.fence must be ..."), "dropped a malformed message"), (KeyError("x"), "bug:")],
)
def test_the_daemon_logs_a_malformed_message_as_the_peers_and_anything_else_as_a_bug(
    caplog: pytest.LogCaptureFixture, error: Exception, logged: str
) -> None:
    with caplog.at_level(logging.WARNING, logger="timesliced.daemon.root"):
        Daemon._on_peer_message(_Shell(error), "b", {})  # type: ignore[arg-type]
    (record,) = caplog.records
    assert logged in record.getMessage()
    assert (record.exc_info is not None) == (logged == "bug:")
