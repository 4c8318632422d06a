"""The election core, one transition at a time.

Node ``a`` with peers ``b`` and ``c`` (majority 2), election timeout ``(1, 2)``,
heartbeat ``0.25``. Its random source always answers the midpoint, so every
election deadline is exact (``now + 1.5``). Each state is reached through real
inputs (never by setting fields):

========== ===================================================== ================
state      how                                                   then
========== ===================================================== ================
fresh      ``start(0)``                                          follower, term 0, deadline 1.5
follower   fresh + ``Heartbeat(1, b)`` at 0.2                    follows b in term 1; lease to 1.2, deadline 1.7
follower2  fresh + ``Heartbeat(2, b)`` at 0.2                    as above in term 2
pre        fresh + timers at 1.5                                 pre-candidate, term 0, deadline 3.0
candidate  pre + ``PreVoteReply(1, granted)`` from b at 1.5      term 1, voted a, deadline 3.0
leader     candidate + ``VoteReply(1, granted)`` from b at 1.5   leads term 1 since 1.5; heartbeat due 1.75,
                                                                 steps down at 2.5 unless a peer acknowledges
========== ===================================================== ================
"""

from __future__ import annotations

import copy
import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from timesliced.core.election import (
    HIGHER_TERM,
    LOST_QUORUM,
    MESSAGES,
    BecameLeader,
    Effect,
    Election,
    Heartbeat,
    HeartbeatReply,
    LeaderChanged,
    Message,
    Persist,
    Persisted,
    PreVote,
    PreVoteReply,
    RequestVote,
    Role,
    Send,
    SteppedDown,
    VoteReply,
    message_from_wire,
)

F, P, C, L = Role.FOLLOWER, Role.PRE_CANDIDATE, Role.CANDIDATE, Role.LEADER


class Midpoint(random.Random):
    """A random source whose ``uniform(a, b)`` is always the midpoint."""

    def uniform(self, a: float, b: float) -> float:
        return (a + b) / 2


def core(node: str = "a", peers: tuple[str, ...] = ("b", "c"), **kwargs: Any) -> Election:
    kwargs.setdefault("rng", Midpoint(0))
    return Election(node, peers, **kwargs)


def snapshot(e: Election) -> tuple[Any, ...]:
    """Everything the core holds, as comparable data."""
    fields_ = {k: v for k, v in vars(e).items() if k != "_rng"}
    return copy.deepcopy(fields_), e._rng.getstate()


# --- states, reached through inputs --------------------------------------------------


def fresh(pre_vote: bool = True) -> Election:
    e = core(pre_vote=pre_vote)
    e.start(0.0)
    return e


def follower(term: int = 1) -> Election:
    e = fresh()
    e.receive("b", Heartbeat(term, "b", 7.0), 0.2)
    return e


def pre() -> Election:
    e = fresh()
    e.handle_timers(1.5)
    return e


def candidate(pre_vote: bool = True) -> Election:
    if not pre_vote:
        e = fresh(pre_vote=False)
        e.handle_timers(1.5)
        return e
    e = pre()
    e.receive("b", PreVoteReply(1, True), 1.5)
    return e


def leader() -> Election:
    e = candidate()
    e.receive("b", VoteReply(1, True), 1.5)
    return e


STATES: dict[str, Callable[[], Election]] = {
    "fresh": fresh,
    "follower": follower,
    "follower2": lambda: follower(2),
    "pre": pre,
    "candidate": candidate,
    "leader": leader,
    "fresh-nopv": lambda: fresh(pre_vote=False),
    "candidate-nopv": lambda: candidate(pre_vote=False),
}


@dataclass(frozen=True)
class Tick:
    """``handle_timers(now)``"""


@dataclass(frozen=True)
class Recv:
    sender: str
    message: Message


Input = Tick | Recv


def feed(e: Election, inp: Input, now: float) -> None:
    if isinstance(inp, Tick):
        e.handle_timers(now)
    else:
        e.receive(inp.sender, inp.message, now)


def hb(term: int, sent_at: float, to: tuple[str, ...] = ("b", "c")) -> list[Effect]:
    return [Send(p, Heartbeat(term, "a", sent_at)) for p in to]


def to_all(message: Message) -> list[Effect]:
    return [Send("b", message), Send("c", message)]


@dataclass(frozen=True)
class Row:
    state: str
    now: float
    input: Input
    role: Role
    term: int
    leader: str | None
    voted_for: str | None
    deadline: float
    effects: list[Effect] = field(default_factory=list)


# fmt: off
TABLE: dict[str, Row] = {
    # --- a follower that knows no leader (term 0)
    "fresh: election timeout -> pre-candidate, asks without bumping its term":
        Row("fresh", 1.5, Tick(), P, 0, None, None, 3.0, to_all(PreVote(1, "a"))),
    "fresh: timers before the deadline do nothing":
        Row("fresh", 1.4, Tick(), F, 0, None, None, 1.5),
    "fresh: grants a pre-vote, changes nothing":
        Row("fresh", 0.5, Recv("b", PreVote(1, "b")), F, 0, None, None, 1.5, [Send("b", PreVoteReply(1, True))]),
    "fresh: vote for a higher term -> term and vote persisted in one Persist, then the reply":
        Row("fresh", 0.5, Recv("b", RequestVote(1, "b")), F, 1, None, "b", 2.0,
            [Persist(1, "b"), Send("b", VoteReply(1, True))]),
    "fresh: heartbeat of a higher term -> follows it":
        Row("fresh", 0.5, Recv("b", Heartbeat(2, "b", 9.0)), F, 2, "b", None, 2.0,
            [Persist(2, None), LeaderChanged("b", 2), Send("b", HeartbeatReply(2, 9.0))]),
    "fresh: a vote refusal of a higher term -> adopts it":
        Row("fresh", 0.5, Recv("b", VoteReply(3, False)), F, 3, None, None, 2.0, [Persist(3, None)]),
    "fresh: a pre-vote refusal of a higher term -> adopts it":
        Row("fresh", 0.5, Recv("b", PreVoteReply(3, False)), F, 3, None, None, 2.0, [Persist(3, None)]),
    "fresh: a heartbeat reply of a higher term -> adopts it":
        Row("fresh", 0.5, Recv("b", HeartbeatReply(3, 0.1)), F, 3, None, None, 2.0, [Persist(3, None)]),
    "fresh: a granted pre-vote it did not ask for is ignored":
        Row("fresh", 0.5, Recv("b", PreVoteReply(1, True)), F, 0, None, None, 1.5),
    # --- a follower of b in term 1 (heard at 0.2: lease to 1.2, deadline 1.7)
    "follower: within the lease a pre-vote is ignored (stickiness)":
        Row("follower", 1.0, Recv("c", PreVote(2, "c")), F, 1, "b", None, 1.7),
    "follower: within the lease a higher-term vote request is ignored (stickiness)":
        Row("follower", 1.0, Recv("c", RequestVote(2, "c")), F, 1, "b", None, 1.7),
    "follower: within the lease a same-term vote request is ignored":
        Row("follower", 1.0, Recv("c", RequestVote(1, "c")), F, 1, "b", None, 1.7),
    "follower: after the lease a pre-vote is granted, and nothing else changes":
        Row("follower", 1.3, Recv("c", PreVote(2, "c")), F, 1, "b", None, 1.7, [Send("c", PreVoteReply(2, True))]),
    "follower: after the lease a vote is granted":
        Row("follower", 1.3, Recv("c", RequestVote(2, "c")), F, 2, None, "c", 2.8,
            [LeaderChanged(None, 2), Persist(2, "c"), Send("c", VoteReply(2, True))]),
    "follower: a pre-vote for a term it already has is refused with its term":
        Row("follower", 1.0, Recv("c", PreVote(1, "c")), F, 1, "b", None, 1.7, [Send("c", PreVoteReply(1, False))]),
    "follower: the leader's heartbeat is acknowledged and pushes the deadline":
        Row("follower", 1.0, Recv("b", Heartbeat(1, "b", 8.0)), F, 1, "b", None, 2.5,
            [Send("b", HeartbeatReply(1, 8.0))]),
    "follower: election timeout -> pre-candidate, forgets the leader":
        Row("follower", 1.7, Tick(), P, 1, None, None, 3.2, [LeaderChanged(None, 1), *to_all(PreVote(2, "a"))]),
    "follower2: a stale leader's heartbeat is answered with the newer term":
        Row("follower2", 1.0, Recv("c", Heartbeat(1, "c", 3.0)), F, 2, "b", None, 1.7,
            [Send("c", HeartbeatReply(2, 3.0))]),
    "follower2: a stale vote request is refused with the newer term":
        Row("follower2", 1.0, Recv("c", RequestVote(1, "c")), F, 2, "b", None, 1.7, [Send("c", VoteReply(2, False))]),
    # --- a pre-candidate in term 0 (deadline 3.0)
    "pre: a majority of pre-votes -> candidate: term bumped, self-vote persisted before asking":
        Row("pre", 1.5, Recv("b", PreVoteReply(1, True)), C, 1, None, "a", 3.0,
            [Persist(1, "a"), *to_all(RequestVote(1, "a"))]),
    "pre: a refusal at its own term changes nothing":
        Row("pre", 1.5, Recv("b", PreVoteReply(0, False)), P, 0, None, None, 3.0),
    "pre: a refusal with a higher term -> follower in that term":
        Row("pre", 1.5, Recv("b", PreVoteReply(2, False)), F, 2, None, None, 3.0, [Persist(2, None)]),
    "pre: a leader's heartbeat -> follows it":
        Row("pre", 1.5, Recv("b", Heartbeat(1, "b", 4.0)), F, 1, "b", None, 3.0,
            [Persist(1, None), LeaderChanged("b", 1), Send("b", HeartbeatReply(1, 4.0))]),
    "pre: timeout -> a new pre-vote round, still term 0":
        Row("pre", 3.0, Tick(), P, 0, None, None, 4.5, to_all(PreVote(1, "a"))),
    "pre: grants another node's pre-vote":
        Row("pre", 1.5, Recv("b", PreVote(1, "b")), P, 0, None, None, 3.0, [Send("b", PreVoteReply(1, True))]),
    "pre: grants a vote request of a higher term -> follower":
        Row("pre", 1.5, Recv("b", RequestVote(1, "b")), F, 1, None, "b", 3.0,
            [Persist(1, "b"), Send("b", VoteReply(1, True))]),
    # --- a candidate in term 1 (voted a, deadline 3.0)
    "candidate: a majority of votes -> leader, heartbeats at once":
        Row("candidate", 1.5, Recv("b", VoteReply(1, True)), L, 1, "a", "a", 1.75,
            [BecameLeader(1), LeaderChanged("a", 1), *hb(1, 1.5)]),
    "candidate: a refusal changes nothing":
        Row("candidate", 1.5, Recv("b", VoteReply(1, False)), C, 1, None, "a", 3.0),
    "candidate: a refusal with a higher term -> follower":
        Row("candidate", 1.5, Recv("b", VoteReply(2, False)), F, 2, None, None, 3.0, [Persist(2, None)]),
    "candidate: a rival of the same term is refused (it voted for itself)":
        Row("candidate", 1.5, Recv("b", RequestVote(1, "b")), C, 1, None, "a", 3.0, [Send("b", VoteReply(1, False))]),
    "candidate: a rival of a higher term gets the vote":
        Row("candidate", 1.5, Recv("b", RequestVote(2, "b")), F, 2, None, "b", 3.0,
            [Persist(2, "b"), Send("b", VoteReply(2, True))]),
    "candidate: the same term's leader -> follower, keeps its vote":
        Row("candidate", 1.5, Recv("b", Heartbeat(1, "b", 4.0)), F, 1, "b", "a", 3.0,
            [LeaderChanged("b", 1), Send("b", HeartbeatReply(1, 4.0))]),
    "candidate: timeout -> pre-vote again for the next term":
        Row("candidate", 3.0, Tick(), P, 1, None, "a", 4.5, to_all(PreVote(2, "a"))),
    "candidate: grants a pre-vote for a higher term":
        Row("candidate", 1.5, Recv("b", PreVote(2, "b")), C, 1, None, "a", 3.0, [Send("b", PreVoteReply(2, True))]),
    "candidate: refuses a pre-vote for its own term":
        Row("candidate", 1.5, Recv("b", PreVote(1, "b")), C, 1, None, "a", 3.0, [Send("b", PreVoteReply(1, False))]),
    "candidate: a late pre-vote is ignored":
        Row("candidate", 1.5, Recv("b", PreVoteReply(1, True)), C, 1, None, "a", 3.0),
    # --- the leader of term 1 (since 1.5; heartbeat due 1.75; check-quorum at 2.5)
    "leader: heartbeat interval -> a heartbeat to every peer":
        Row("leader", 1.75, Tick(), L, 1, "a", "a", 2.0, hb(1, 1.75)),
    "leader: no acknowledgement within the window -> steps down, lost quorum":
        Row("leader", 2.5, Tick(), F, 1, None, "a", 4.0, [SteppedDown(1, LOST_QUORUM), LeaderChanged(None, 1)]),
    "leader: an acknowledgement is recorded silently":
        Row("leader", 1.6, Recv("b", HeartbeatReply(1, 1.5)), L, 1, "a", "a", 1.75),
    "leader: a reply with a higher term -> steps down":
        Row("leader", 1.6, Recv("b", HeartbeatReply(2, 1.5)), F, 2, None, None, 3.1,
            [SteppedDown(1, HIGHER_TERM), Persist(2, None), LeaderChanged(None, 2)]),
    "leader: within its window a vote request is ignored (stickiness)":
        Row("leader", 1.6, Recv("b", RequestVote(2, "b")), L, 1, "a", "a", 1.75),
    "leader: within its window a pre-vote is ignored (stickiness)":
        Row("leader", 1.6, Recv("b", PreVote(2, "b")), L, 1, "a", "a", 1.75),
    "leader: past its window (timers late) a vote request deposes it":
        Row("leader", 2.6, Recv("b", RequestVote(2, "b")), F, 2, None, "b", 4.1,
            [SteppedDown(1, HIGHER_TERM), LeaderChanged(None, 2), Persist(2, "b"), Send("b", VoteReply(2, True))]),
    "leader: a newer leader's heartbeat -> steps down and follows":
        Row("leader", 1.6, Recv("b", Heartbeat(2, "b", 1.0)), F, 2, "b", None, 3.1,
            [SteppedDown(1, HIGHER_TERM), Persist(2, None), LeaderChanged("b", 2), Send("b", HeartbeatReply(2, 1.0))]),
    "leader: a late vote changes nothing":
        Row("leader", 1.6, Recv("c", VoteReply(1, True)), L, 1, "a", "a", 1.75),
    "leader: a pre-vote for its own term is refused":
        Row("leader", 1.6, Recv("b", PreVote(1, "b")), L, 1, "a", "a", 1.75, [Send("b", PreVoteReply(1, False))]),
    "leader: a same-term vote request is ignored":
        Row("leader", 1.6, Recv("b", RequestVote(1, "b")), L, 1, "a", "a", 1.75),
    "leader: an echo from before it led (an older leader's heartbeat) is no acknowledgement":
        Row("leader", 1.6, Recv("b", HeartbeatReply(1, 0.5)), L, 1, "a", "a", 1.75),
    # --- without pre-vote
    "no pre-vote: election timeout -> candidate at once":
        Row("fresh-nopv", 1.5, Tick(), C, 1, None, "a", 3.0, [Persist(1, "a"), *to_all(RequestVote(1, "a"))]),
    "no pre-vote: candidate timeout -> next term":
        Row("candidate-nopv", 3.0, Tick(), C, 2, None, "a", 4.5, [Persist(2, "a"), *to_all(RequestVote(2, "a"))]),
}
# fmt: on


@pytest.mark.parametrize("row", TABLE.values(), ids=TABLE.keys())
def test_transition(row: Row) -> None:
    e = STATES[row.state]()
    e.drain()
    feed(e, row.input, row.now)
    assert e.drain() == row.effects
    assert (e.role, e.term, e.leader, e.voted_for) == (row.role, row.term, row.leader, row.voted_for)
    assert e.next_deadline() == row.deadline


def test_table_covers_every_role_and_message() -> None:
    roles = {STATES[r.state]().role for r in TABLE.values()}
    assert roles == set(Role)
    kinds = {type(r.input.message) for r in TABLE.values() if isinstance(r.input, Recv)}
    assert kinds == set(MESSAGES)
    for state in STATES:
        assert any(r.state == state for r in TABLE.values()), state


def test_every_state_as_documented() -> None:
    got = {name: (make().role, make().term, make().leader, make().voted_for) for name, make in STATES.items()}
    assert got == {
        "fresh": (F, 0, None, None),
        "follower": (F, 1, "b", None),
        "follower2": (F, 2, "b", None),
        "pre": (P, 0, None, None),
        "candidate": (C, 1, None, "a"),
        "leader": (L, 1, "a", "a"),
        "fresh-nopv": (F, 0, None, None),
        "candidate-nopv": (C, 1, None, "a"),
    }


# --- illegal inputs ------------------------------------------------------------------

# fmt: off
ILLEGAL: dict[str, tuple[str, float, Any, Any]] = {
    # state, now, sender, message
    "unknown sender": ("follower", 1.0, "z", PreVote(2, "z")),
    "sender is the node itself": ("follower", 1.0, "a", PreVote(2, "a")),
    "not a message": ("follower", 1.0, "b", {"type": "pre_vote", "term": 2, "candidate": "b"}),
    "an effect, not a message": ("follower", 1.0, "b", Send("a", PreVote(2, "b"))),
    "pre-vote for someone else": ("follower", 1.3, "b", PreVote(2, "c")),
    "vote request for someone else": ("fresh", 0.5, "b", RequestVote(1, "c")),
    "heartbeat in another's name": ("follower", 1.0, "c", Heartbeat(1, "b", 1.0)),
    "a second leader in the follower's term": ("follower", 1.0, "c", Heartbeat(1, "c", 1.0)),
    "a second leader in the leader's own term": ("leader", 1.6, "b", Heartbeat(1, "b", 1.0)),
    "a vote for a term never campaigned in (pre-candidate)": ("pre", 1.5, "b", VoteReply(1, True)),
    "a vote for a term never campaigned in (candidate)": ("candidate", 1.5, "b", VoteReply(2, True)),
    "a pre-vote for a term never proposed": ("pre", 1.5, "b", PreVoteReply(2, True)),
    "time going backwards": ("leader", 1.4, "b", HeartbeatReply(1, 1.5)),
}
# fmt: on


@pytest.mark.parametrize(("state", "now", "sender", "message"), ILLEGAL.values(), ids=ILLEGAL.keys())
def test_illegal_message_raises_and_changes_nothing(state: str, now: float, sender: Any, message: Any) -> None:
    e = STATES[state]()
    before = snapshot(e)
    with pytest.raises(ValueError):
        e.receive(sender, message, now)
    assert snapshot(e) == before


@pytest.mark.parametrize("now", [math.nan, math.inf, -math.inf, True, "1.0", None])
def test_bad_time_raises_and_changes_nothing(now: Any) -> None:
    for e in (follower(), leader()):
        before = snapshot(e)
        with pytest.raises(ValueError):
            e.handle_timers(now)
        with pytest.raises(ValueError):
            e.receive("b", PreVote(5, "b"), now)
        assert snapshot(e) == before


def test_calls_out_of_order() -> None:
    e = core()
    with pytest.raises(RuntimeError):
        e.receive("b", PreVote(1, "b"), 0.0)
    with pytest.raises(RuntimeError):
        e.handle_timers(0.0)
    assert e.next_deadline() is None
    e.start(0.0)
    before = snapshot(e)
    with pytest.raises(RuntimeError):
        e.start(1.0)
    assert snapshot(e) == before


@pytest.mark.parametrize(
    "kwargs",
    [
        {"node_id": ""},
        {"node_id": 3},
        {"peers": ("b", "a")},
        {"peers": "bc"},
        {"peers": ("b", "b")},
        {"peers": ("b", "")},
        {"election_timeout": (2.0, 1.0)},
        {"election_timeout": (1.0, 1.0)},
        {"election_timeout": (0.0, 1.0)},
        {"election_timeout": (1.0, math.inf)},
        {"heartbeat_interval": 1.0},
        {"heartbeat_interval": 0.0},
        {"rng": random},
        {"pre_vote": 1},
        {"persisted": {"term": 1, "voted_for": None}},
    ],
)
def test_bad_construction(kwargs: dict[str, Any]) -> None:
    args: dict[str, Any] = {"node_id": "a", "peers": ("b", "c"), "rng": random.Random(0)}
    args.update(kwargs)
    with pytest.raises(ValueError):
        Election(args.pop("node_id"), args.pop("peers"), **args)


# --- the wire ------------------------------------------------------------------------

SAMPLES: list[Message] = [
    PreVote(3, "n1"),
    PreVoteReply(3, True),
    RequestVote(3, "n1"),
    VoteReply(2, False),
    Heartbeat(3, "n1", 12.5),
    HeartbeatReply(3, 12.5),
]


@pytest.mark.parametrize("message", SAMPLES, ids=lambda m: type(m).__name__)
def test_wire_round_trip(message: Message) -> None:
    wire = message.to_wire()
    assert wire["type"] == type(message).TYPE
    assert json.loads(json.dumps(wire)) == wire  # plain data only
    assert message_from_wire(wire) == message
    assert type(message).from_wire(wire) == message
    assert message_from_wire({**wire, "future_field": [1, 2]}) == message  # newer peers may add fields


@pytest.mark.parametrize(
    "wire",
    [
        None,
        [],
        "pre_vote",
        {},
        {"type": "nominate", "term": 1, "candidate": "b"},
        {"type": 1},
        {"type": "pre_vote", "term": 1},
        {"type": "pre_vote", "term": "1", "candidate": "b"},
        {"type": "pre_vote", "term": True, "candidate": "b"},
        {"type": "pre_vote", "term": 1.0, "candidate": "b"},
        {"type": "pre_vote", "term": 0, "candidate": "b"},
        {"type": "pre_vote", "term": 1, "candidate": ""},
        {"type": "pre_vote", "term": 1, "candidate": "x" * 256},
        {"type": "pre_vote", "term": 1, "candidate": b"b"},
        {"type": "request_vote", "term": 0, "candidate": "b"},
        {"type": "request_vote", "term": 2**63, "candidate": "b"},
        {"type": "vote_reply", "term": -1, "granted": True},
        {"type": "vote_reply", "term": 1, "granted": 1},
        {"type": "pre_vote_reply", "term": 1, "granted": None},
        {"type": "heartbeat", "term": 0, "leader": "b", "sent_at": 1.0},
        {"type": "heartbeat", "term": 1, "leader": "b", "sent_at": math.nan},
        {"type": "heartbeat", "term": 1, "leader": "b", "sent_at": "now"},
        {"type": "heartbeat_reply", "term": 1, "sent_at": True},
        {"type": "heartbeat_reply", "term": 1, "sent_at": math.inf},
    ],
)
def test_malformed_wire_raises_value_error(wire: Any) -> None:
    with pytest.raises(ValueError):
        message_from_wire(wire)


def test_from_wire_of_one_class_refuses_another() -> None:
    with pytest.raises(ValueError):
        PreVote.from_wire(RequestVote(1, "b").to_wire())


wire_values = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=4) | st.binary(max_size=2)


@given(
    st.fixed_dictionaries(
        {"type": st.sampled_from([cls.TYPE for cls in MESSAGES]) | st.text(max_size=3)},
        optional={
            "term": wire_values,
            "candidate": wire_values,
            "leader": wire_values,
            "granted": wire_values,
            "sent_at": wire_values,
        },
    )
)
def test_any_map_decodes_or_raises_value_error(wire: dict[str, Any]) -> None:
    try:
        message = message_from_wire(wire)
    except ValueError:
        return
    assert message_from_wire(message.to_wire()) == message


def test_persisted_round_trip_and_validation() -> None:
    state = Persisted(4, "b")
    assert Persisted.from_wire(json.loads(json.dumps(state.to_wire()))) == state
    assert Persist(4, "b").state == state
    for bad in [{"term": 4}, {"term": -1, "voted_for": None}, {"term": 0, "voted_for": "b"}, [4, "b"]]:
        with pytest.raises(ValueError):
            Persisted.from_wire(bad)


# --- persistence ---------------------------------------------------------------------


def test_persist_precedes_every_send_of_its_term() -> None:
    """Whatever the path, a message carrying a new term or a vote leaves after the state is written."""
    for row in TABLE.values():
        e = STATES[row.state]()
        durable = Persisted(e.term, e.voted_for)
        e.drain()
        feed(e, row.input, row.now)
        for effect in e.drain():
            if isinstance(effect, Persist):
                durable = effect.state
            elif isinstance(effect, Send):
                m = effect.message
                own = m.term - 1 if isinstance(m, PreVote) or (isinstance(m, PreVoteReply) and m.granted) else m.term
                assert own <= durable.term, row
                if isinstance(m, VoteReply) and m.granted:
                    assert durable == Persisted(m.term, effect.to), row
        assert durable == Persisted(e.term, e.voted_for), row


def test_restart_with_a_persisted_vote_refuses_a_second_vote_in_that_term() -> None:
    e = core(persisted=Persisted(3, "b"))
    e.start(10.0)
    assert (e.role, e.term, e.voted_for, e.drain()) == (F, 3, "b", [])
    e.receive("c", RequestVote(3, "c"), 10.1)
    assert e.drain() == [Send("c", VoteReply(3, False))]
    e.receive("b", RequestVote(3, "b"), 10.2)  # the same candidate asking again: the same answer, no write
    assert e.drain() == [Send("b", VoteReply(3, True))]
    e.receive("c", RequestVote(4, "c"), 10.3)
    assert e.drain() == [Persist(4, "c"), Send("c", VoteReply(4, True))]


def test_restart_never_campaigns_in_a_persisted_term() -> None:
    e = core(persisted=Persisted(3, "a"), pre_vote=False)
    e.start(0.0)
    e.handle_timers(1.5)
    assert e.drain() == [Persist(4, "a"), *to_all(RequestVote(4, "a"))]


# --- single node ---------------------------------------------------------------------


def test_single_node_leads_at_once() -> None:
    e = core(peers=())
    e.start(5.0)
    assert e.drain() == [Persist(1, "a"), BecameLeader(1), LeaderChanged("a", 1)]
    assert (e.role, e.term, e.leader, e.voted_for) == (L, 1, "a", "a")
    assert e.next_deadline() is None
    e.handle_timers(1e9)
    assert e.drain() == [] and e.is_leader_with_quorum(1e9)


def test_single_node_restart_takes_the_next_term() -> None:
    e = core(peers=(), persisted=Persisted(7, "a"))
    e.start(0.0)
    assert e.drain() == [Persist(8, "a"), BecameLeader(8), LeaderChanged("a", 8)]


# --- check-quorum --------------------------------------------------------------------


def test_check_quorum_tracks_acknowledgements() -> None:
    e = leader()
    assert not e.is_leader_with_quorum(1.5)  # nobody acknowledged it yet
    e.receive("b", HeartbeatReply(1, 1.5), 1.52)
    assert e.is_leader_with_quorum(1.52) and e.is_leader_with_quorum(2.49)
    assert not e.is_leader_with_quorum(2.5)
    e.handle_timers(1.75)
    e.receive("c", HeartbeatReply(1, 1.75), 1.8)
    assert e.is_leader_with_quorum(2.74) and not e.is_leader_with_quorum(2.75)
    assert e.describe(1.8)["acked_s_ago"] == {"b": pytest.approx(0.3), "c": pytest.approx(0.05)}
    # the window follows the newest acknowledgements; without more, it steps down exactly at its end
    fired = []
    while e.role is L:
        fired.append(e.next_deadline() or math.inf)
        e.handle_timers(fired[-1])
    assert fired == [2.0, 2.25, 2.5, 2.75]
    assert e.drain()[-2:] == [SteppedDown(1, LOST_QUORUM), LeaderChanged(None, 1)]


def test_leader_kept_acknowledged_stays_leader() -> None:
    e = leader()
    e.drain()
    now = 1.5
    for _ in range(100):
        now = e.next_deadline() or math.inf
        e.handle_timers(now)
        for effect in e.drain():
            if isinstance(effect, Send) and effect.to == "b":
                assert isinstance(effect.message, Heartbeat)
                e.receive("b", HeartbeatReply(1, effect.message.sent_at), now + 0.01)
    assert now > 20 and e.role is L and e.is_leader_with_quorum(now)


def test_check_quorum_of_five_needs_two_peers() -> None:
    e = core(peers=("b", "c", "d", "e"))
    e.start(0.0)
    e.handle_timers(1.5)
    e.receive("b", PreVoteReply(1, True), 1.5)
    e.receive("c", PreVoteReply(1, True), 1.5)
    e.receive("b", VoteReply(1, True), 1.5)
    assert e.role is C
    e.receive("c", VoteReply(1, True), 1.5)
    assert e.role is L
    e.receive("b", HeartbeatReply(1, 1.5), 1.6)
    e.receive("b", HeartbeatReply(1, 1.5), 1.6)  # a duplicate counts once
    assert not e.is_leader_with_quorum(1.6)
    e.receive("d", HeartbeatReply(1, 1.5), 1.6)
    assert e.is_leader_with_quorum(1.6)


def test_stepped_down_leader_grants_votes_again() -> None:
    e = leader()
    e.handle_timers(2.5)
    assert e.role is F
    e.receive("b", RequestVote(2, "b"), 2.6)
    assert e.drain()[-2:] == [Persist(2, "b"), Send("b", VoteReply(2, True))]


# --- stickiness and pre-vote ---------------------------------------------------------


def test_follower_of_a_live_leader_never_helps_a_flapping_node() -> None:
    e = follower()
    e.drain()
    now = 0.2
    for i in range(200):
        now += 0.25
        e.receive("b", Heartbeat(1, "b", now), now)
        e.receive("c", PreVote(2 + i, "c"), now + 0.1)
        e.receive("c", RequestVote(2 + i, "c"), now + 0.1)
        e.handle_timers(now + 0.1)
        assert [x for x in e.drain() if not isinstance(x, Send) or x.to != "b"] == []
    assert (e.role, e.term, e.leader) == (F, 1, "b")


@pytest.mark.parametrize("pre_vote", [True, False])
def test_partitioned_node_rejoins_without_disrupting_only_with_pre_vote(pre_vote: bool) -> None:
    """A follower cut off for 20 timeouts, then reached by its leader's heartbeat again."""
    e = core(pre_vote=pre_vote)
    e.start(0.0)
    e.receive("b", Heartbeat(1, "b", 0.0), 0.0)
    now = 0.0
    while now < 30.0:
        now = e.next_deadline() or math.inf
        e.handle_timers(now)  # every message it sends is lost
    e.drain()
    assert (e.term == 1) is pre_vote
    e.receive("b", Heartbeat(1, "b", now), now)
    reply = e.drain()[-1]
    assert isinstance(reply, Send) and isinstance(reply.message, HeartbeatReply)
    # with pre-vote the reply acknowledges the leader; without, its higher term deposes it
    assert (reply.message.term == 1) is pre_vote
    assert (e.leader == "b") is pre_vote


# --- timers, randomness, status ------------------------------------------------------


def test_election_timeouts_are_random_within_bounds() -> None:
    deadlines = set()
    for seed in range(50):
        e = Election("a", ("b", "c"), rng=random.Random(seed), election_timeout=(1.0, 2.0))
        e.start(10.0)
        d = e.next_deadline()
        assert d is not None and 11.0 <= d < 12.0
        deadlines.add(d)
    assert len(deadlines) == 50


def test_same_seed_same_run() -> None:
    def deadlines(seed: int) -> list[float | None]:
        e = Election("a", ("b", "c"), rng=random.Random(seed))
        e.start(0.0)
        out = [e.next_deadline()]
        for _ in range(5):
            e.handle_timers(out[-1] or 0.0)
            out.append(e.next_deadline())
        return out

    assert deadlines(1) == deadlines(1) != deadlines(2)


def test_describe_is_plain_data() -> None:
    e = leader()
    e.receive("b", HeartbeatReply(1, 1.5), 1.6)
    d = e.describe(1.7)
    assert json.loads(json.dumps(d)) == d
    assert d["role"] == "leader" and d["term"] == 1 and d["quorum"] is True and d["leader_since"] == 1.5
    f = follower().describe(1.0)
    assert f["role"] == "follower" and f["leader"] == "b" and f["leader_heard_s_ago"] == pytest.approx(0.8)
    assert f["quorum"] is False and f["next_deadline"] == 1.7
