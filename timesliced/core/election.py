"""The election core: which daemon leads the cluster, Raft-style, without a log (pure).

No I/O, no asyncio, no clock, no global random: every input carries ``now``
(a monotonic time of this node, in seconds), randomness comes from the
``random.Random`` given at construction, and every output is an effect that
the shell drains. ``next_deadline()`` tells the shell when to call
``handle_timers(now)``.

The algorithm is Raft's election (Ongaro, section 3.4; pre-vote and
check-quorum from section 9.6) with no log to replicate:

- followers wait a randomized election timeout in ``[lo, hi)``; with
  ``pre_vote`` they first ask ``PreVote`` for ``term + 1`` without bumping
  their own term, and only with a majority of pre-votes become a candidate;
- a candidate bumps its term, votes for itself and asks ``RequestVote``; one
  vote per term, majority (counting itself) wins;
- the leader sends ``Heartbeat`` every ``heartbeat_interval``; each carries
  ``sent_at`` (the leader's own clock) which followers echo, so the leader knows
  how recently each peer acknowledged it without comparing clocks;
- check-quorum: a leader that has not heard from a majority (counting itself)
  within ``lo`` steps down (``SteppedDown(term, "lost quorum")``); it grants
  nothing as a follower of no one;
- leader stickiness: a follower that heard its leader less than ``lo`` ago,
  and a leader within its check-quorum window, ignore ``PreVote`` and
  ``RequestVote`` (no reply, no term change), so a node that flaps in and out
  of a partition cannot depose a healthy leader;
- any message with a higher term makes a node a follower in that term (a
  leader steps down with reason ``"higher term"``), except the two that carry
  a *proposed* term: ``PreVote`` and a granted ``PreVoteReply``;
- a single-node cluster (``peers=()``) is its own leader at ``start(now)``.

Ordering contract of ``drain()`` -- the safety of "one vote per term" rests on it:
the effects of all drains form one ordered stream. The shell carries them out
front to back, and a ``Persist`` must be durable (written and fsynced) before
any ``Send`` that follows it is handed to the transport. If the write fails the
shell must not send anything further from this core: stop the node, because the
core already acts on the new state. Only ``Persist`` gates ``Send``; the other
effects are notifications, and the shell may act on them at once (but a shell
acting as leader on ``BecameLeader`` has, by processing in order, already made
the candidate's self-vote durable). The core emits a ``Persist`` on every change
of ``term`` or ``voted_for``, before any ``Send`` that depends on it, and never
two ``Persist`` effects without a ``Send`` between them (the later replaces the
earlier: one fsync per input).

Invariants (checked by the simulation in ``tests/unit/test_election_sim.py``):

- at most one leader per term, ever;
- a node's term never decreases, and every message it sends carries its
  durable term (``PreVote``: the durable term + 1);
- a node grants at most one vote per term, across restarts, given that the
  shell rebuilds it from its last durable ``Persist``;
- a leader that has led for longer than ``lo`` has heard from a majority
  within the last ``lo``.

``is_leader_with_quorum(now)`` is advisory: it does not stop a newer leader
from being elected after a restart wiped a follower's in-memory lease, or under
clock drift. Whatever the leader directs must carry its term (and the
scheduler's fence) so that receivers can refuse an older leader.
"""

from __future__ import annotations

import enum
import math
import random
from dataclasses import dataclass, fields
from typing import Any, ClassVar, TypeVar

from ..wire import status

MAX_TERM = (1 << 63) - 1  # terms travel as msgpack int64
MAX_NODE_ID = 255  # characters

LOST_QUORUM = "lost quorum"
HIGHER_TERM = "higher term"


class Role(enum.Enum):
    FOLLOWER = "follower"
    PRE_CANDIDATE = "pre-candidate"
    CANDIDATE = "candidate"
    LEADER = "leader"


# --- validation ----------------------------------------------------------------------


def _check_term(value: Any, name: str, minimum: int = 0) -> None:
    # bool is an int subclass: ``True`` must not pass for term 1
    if type(value) is not int or not minimum <= value <= MAX_TERM:
        raise ValueError(f"{name!r} must be an integer in [{minimum}, {MAX_TERM}], not {value!r}")


def _check_node(value: Any, name: str) -> None:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_NODE_ID:
        raise ValueError(f"{name!r} must be a node id (a string of 1 to {MAX_NODE_ID} characters), not {value!r}")


def _check_flag(value: Any, name: str) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name!r} must be a boolean, not {value!r}")


def _check_time(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name!r} must be a finite number, not {value!r}")
    return float(value)


# --- messages ------------------------------------------------------------------------

M = TypeVar("M", bound="_Wire")


class _Wire:
    """``to_wire()`` / ``from_wire()`` for a frozen dataclass message with a ``TYPE``."""

    TYPE: ClassVar[str]
    __dataclass_fields__: ClassVar[dict[str, Any]]

    def to_wire(self) -> dict[str, Any]:
        """A map of msgpack-friendly values with a ``type`` key."""
        out: dict[str, Any] = {"type": self.TYPE}
        for f in fields(self):
            out[f.name] = getattr(self, f.name)
        return out

    @classmethod
    def from_wire(cls: type[M], data: Any) -> M:
        """Validate a received map; raises ``ValueError``. Unknown keys are ignored (newer peers)."""
        if not isinstance(data, dict):
            raise ValueError(f"a {cls.TYPE} message must be a map, not {type(data).__name__}")
        if data.get("type") != cls.TYPE:
            raise ValueError(f"expected a {cls.TYPE} message, not {data.get('type')!r}")
        names = [f.name for f in fields(cls)]
        missing = [n for n in names if n not in data]
        if missing:
            raise ValueError(f"{cls.TYPE} message lacks {missing}")
        return cls(**{n: data[n] for n in names})


@dataclass(frozen=True)
class PreVote(_Wire):
    """Would you vote for ``candidate`` in ``term``? ``term`` is proposed: the asker's term + 1."""

    TYPE = "pre_vote"
    term: int
    candidate: str

    def __post_init__(self) -> None:
        _check_term(self.term, "term", 1)
        _check_node(self.candidate, "candidate")


@dataclass(frozen=True)
class PreVoteReply(_Wire):
    """Granted: ``term`` is the proposed term echoed. Refused: the voter's own term."""

    TYPE = "pre_vote_reply"
    term: int
    granted: bool

    def __post_init__(self) -> None:
        _check_term(self.term, "term")
        _check_flag(self.granted, "granted")


@dataclass(frozen=True)
class RequestVote(_Wire):
    TYPE = "request_vote"
    term: int
    candidate: str

    def __post_init__(self) -> None:
        _check_term(self.term, "term", 1)
        _check_node(self.candidate, "candidate")


@dataclass(frozen=True)
class VoteReply(_Wire):
    """``term`` is the voter's term (the candidate's, if it was granted)."""

    TYPE = "vote_reply"
    term: int
    granted: bool

    def __post_init__(self) -> None:
        _check_term(self.term, "term")
        _check_flag(self.granted, "granted")


@dataclass(frozen=True)
class Heartbeat(_Wire):
    """The leader of ``term`` is alive. ``sent_at`` is the leader's clock, opaque to followers."""

    TYPE = "heartbeat"
    term: int
    leader: str
    sent_at: float

    def __post_init__(self) -> None:
        _check_term(self.term, "term", 1)
        _check_node(self.leader, "leader")
        object.__setattr__(self, "sent_at", _check_time(self.sent_at, "sent_at"))


@dataclass(frozen=True)
class HeartbeatReply(_Wire):
    """``term`` is the follower's term: the leader's own acknowledges it, a higher one deposes it.

    ``sent_at`` echoes the heartbeat's, so the leader knows the follower followed it at or after then.
    """

    TYPE = "heartbeat_reply"
    term: int
    sent_at: float

    def __post_init__(self) -> None:
        _check_term(self.term, "term")
        object.__setattr__(self, "sent_at", _check_time(self.sent_at, "sent_at"))


Message = PreVote | PreVoteReply | RequestVote | VoteReply | Heartbeat | HeartbeatReply
MESSAGES: tuple[type[Message], ...] = (PreVote, PreVoteReply, RequestVote, VoteReply, Heartbeat, HeartbeatReply)
_BY_TYPE: dict[str, type[Message]] = {cls.TYPE: cls for cls in MESSAGES}


def message_from_wire(data: Any) -> Message:
    """Decode any election message from its map; raises ``ValueError`` if it is malformed."""
    kind = data.get("type") if isinstance(data, dict) else None
    cls = _BY_TYPE.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ValueError(f"not an election message: type {kind!r}")
    return cls.from_wire(data)


# --- persisted state and effects -----------------------------------------------------


@dataclass(frozen=True)
class Persisted:
    """What a node must find in its state dir after a restart: its term and its vote in it."""

    term: int = 0
    voted_for: str | None = None

    def __post_init__(self) -> None:
        _check_term(self.term, "term")
        if self.voted_for is not None:
            _check_node(self.voted_for, "voted_for")
            if self.term == 0:
                raise ValueError("nobody is elected in term 0, so there is no vote in it")

    def to_wire(self) -> dict[str, Any]:
        return {"term": self.term, "voted_for": self.voted_for}

    @classmethod
    def from_wire(cls, data: Any) -> Persisted:
        """Validate a stored map; raises ``ValueError``."""
        if not isinstance(data, dict) or "term" not in data or "voted_for" not in data:
            raise ValueError(f"not a persisted election state: {data!r}")
        return cls(data["term"], data["voted_for"])


@dataclass(frozen=True)
class Send:
    """Hand ``message`` to the transport for peer ``to`` (best effort: it may be lost)."""

    to: str
    message: Message


@dataclass(frozen=True)
class Persist:
    """Make ``(term, voted_for)`` durable before carrying out any later ``Send``."""

    term: int
    voted_for: str | None

    @property
    def state(self) -> Persisted:
        return Persisted(self.term, self.voted_for)


@dataclass(frozen=True)
class BecameLeader:
    term: int


@dataclass(frozen=True)
class SteppedDown:
    """This node no longer leads ``term`` (the term it led); ``reason``: LOST_QUORUM or HIGHER_TERM."""

    term: int
    reason: str


@dataclass(frozen=True)
class LeaderChanged:
    """The leader this node knows of is now ``leader`` (``None``: unknown) in ``term``."""

    leader: str | None
    term: int


Effect = Send | Persist | BecameLeader | SteppedDown | LeaderChanged


# --- the core ------------------------------------------------------------------------


class Election:
    """One node's view of the election. Feed it ``start``, ``receive`` and ``handle_timers``.

    Misuse raises ``ValueError`` (bad arguments, malformed or impossible messages, time going
    backwards) or ``RuntimeError`` (calls out of order); either way nothing changes.
    """

    def __init__(
        self,
        node_id: str,
        peers: tuple[str, ...],
        *,
        rng: random.Random,
        election_timeout: tuple[float, float] = (1.0, 2.0),
        heartbeat_interval: float = 0.25,
        pre_vote: bool = True,
        persisted: Persisted | None = None,
    ) -> None:
        _check_node(node_id, "node_id")
        if not isinstance(peers, (tuple, list)):  # a lone string would split into one-letter peers
            raise ValueError(f"peers must be a tuple of node ids, not {peers!r}")
        peers = tuple(peers)
        for p in peers:
            _check_node(p, "peer")
        if node_id in peers or len(set(peers)) != len(peers):
            raise ValueError(f"peers must be distinct and exclude the node itself: {peers!r}")
        if not isinstance(rng, random.Random):
            raise ValueError("rng must be a random.Random")
        lo, hi = (_check_time(t, "election_timeout") for t in election_timeout)
        if not 0 < lo < hi:
            raise ValueError(f"election_timeout must be (lo, hi) with 0 < lo < hi, not {election_timeout!r}")
        heartbeat_interval = _check_time(heartbeat_interval, "heartbeat_interval")
        if not 0 < heartbeat_interval < lo:
            raise ValueError("heartbeat_interval must be positive and below the minimum election timeout")
        if persisted is not None and not isinstance(persisted, Persisted):
            raise ValueError("persisted must be a Persisted")
        _check_flag(pre_vote, "pre_vote")

        self.node_id = node_id
        self.peers = peers
        self.election_timeout = (lo, hi)
        self.heartbeat_interval = heartbeat_interval
        self.pre_vote = pre_vote
        self.majority = (len(peers) + 1) // 2 + 1
        self._rng = rng
        state = persisted or Persisted()
        self._term = state.term
        self._voted_for = state.voted_for
        self._role = Role.FOLLOWER
        self._leader: str | None = None
        self._announced: tuple[str | None, int] = (None, -1)  # the last LeaderChanged, as (leader, term)
        self._started = False
        self._now = -math.inf  # the latest ``now`` seen: time must not go backwards
        self._effects: list[Effect] = []
        self._granted: set[str] = set()  # pre-votes or votes of the current campaign, its own included
        self._election_deadline = math.inf  # follower, pre-candidate, candidate
        self._leader_heard_at = -math.inf  # follower: when the current leader was last heard
        self._leader_since = -math.inf  # leader: when it won
        self._heartbeat_deadline = math.inf  # leader
        self._acked: dict[str, float] = {}  # leader: peer -> newest ``sent_at`` it echoed in this term

    # --- queries ---------------------------------------------------------------------

    @property
    def role(self) -> Role:
        return self._role

    @property
    def term(self) -> int:
        return self._term

    @property
    def leader(self) -> str | None:
        """The leader of the current term as far as this node knows (itself, when leading)."""
        return self._leader

    @property
    def voted_for(self) -> str | None:
        return self._voted_for

    def next_deadline(self) -> float | None:
        """When ``handle_timers`` must next be called; ``None``: not before some input."""
        if not self._started:
            return None
        if self._role is Role.LEADER:
            if not self.peers:
                return None
            return min(self._heartbeat_deadline, self._quorum_deadline())
        return self._election_deadline

    def is_leader_with_quorum(self, now: float) -> bool:
        """Leading, and a majority (counting itself) acknowledged it within the last ``lo``.

        False right after winning, until the first heartbeats are acknowledged.
        """
        if self._role is not Role.LEADER:
            return False
        return not self.peers or now < self._quorum_heard_at() + self.election_timeout[0]

    def describe(self, now: float) -> status.Election:
        """A plain-data picture for ``status``."""
        leading = self._role is Role.LEADER
        return {
            "node": self.node_id,
            "peers": list(self.peers),
            "role": self._role.value,
            "term": self._term,
            "leader": self._leader,
            "voted_for": self._voted_for,
            "pre_vote": self.pre_vote,
            "quorum": self.is_leader_with_quorum(now),
            "leader_since": self._leader_since if leading else None,
            "leader_heard_s_ago": now - self._leader_heard_at
            if self._role is Role.FOLLOWER and self._leader is not None
            else None,
            "acked_s_ago": {p: now - t for p, t in sorted(self._acked.items())} if leading else {},
            "next_deadline": self.next_deadline(),
        }

    # --- inputs ----------------------------------------------------------------------

    def start(self, now: float) -> None:
        """Begin as a follower (or, alone, as leader at once). Raises ``RuntimeError`` if started."""
        if self._started:
            raise RuntimeError("the election core is already started")
        now = self._check_now(now)
        self._started = True
        self._now = now
        if self.peers:
            self._reset_election_timer(now)
        else:
            self._become_candidate(now)  # a majority of one: leads at once

    def receive(self, sender: str, message: Message, now: float) -> None:
        """Handle a message from peer ``sender`` (as the transport authenticated it).

        Raises ``ValueError`` for an unknown sender, a message that is not an election message,
        one whose fields contradict its sender, or one no correct peer could send (a second
        leader in this node's term, a vote or pre-vote for a campaign this node never ran);
        ``RuntimeError`` before ``start``. A message that raises changes nothing.
        """
        self._check_started()
        now = self._check_now(now)
        self._validate(sender, message)
        self._now = now
        if isinstance(message, PreVote):
            self._on_pre_vote(sender, message, now)
        elif isinstance(message, PreVoteReply):
            self._on_pre_vote_reply(sender, message, now)
        elif isinstance(message, RequestVote):
            self._on_request_vote(sender, message, now)
        elif isinstance(message, VoteReply):
            self._on_vote_reply(sender, message, now)
        elif isinstance(message, Heartbeat):
            self._on_heartbeat(sender, message, now)
        else:
            self._on_heartbeat_reply(sender, message, now)

    def handle_timers(self, now: float) -> None:
        """Fire whatever is due at ``now``: a campaign, a heartbeat round, a check-quorum step-down."""
        self._check_started()
        now = self._check_now(now)
        self._now = now
        if self._role is Role.LEADER:
            if not self.peers:
                return
            if now >= self._quorum_deadline():
                self._become_follower(now, self._term, None, LOST_QUORUM)
            elif now >= self._heartbeat_deadline:
                self._send_heartbeats(now)
        elif now >= self._election_deadline:
            if self.pre_vote:
                self._become_pre_candidate(now)
            else:
                self._become_candidate(now)

    def drain(self) -> list[Effect]:
        """The effects since the last drain, in the order they must be carried out (see above)."""
        out, self._effects = self._effects, []
        return out

    # --- validation ------------------------------------------------------------------

    def _check_started(self) -> None:
        if not self._started:
            raise RuntimeError("call start(now) first")

    def _check_now(self, now: float) -> float:
        now = _check_time(now, "now")
        if now < self._now:
            raise ValueError(f"time went backwards: {now} < {self._now}")
        return now

    def _validate(self, sender: str, m: Message) -> None:
        if not isinstance(m, MESSAGES):
            raise ValueError(f"not an election message: {type(m).__name__}")
        if sender not in self.peers:
            raise ValueError(f"{sender!r} is not a peer of {self.node_id!r}")
        if isinstance(m, (PreVote, RequestVote)) and m.candidate != sender:
            raise ValueError(f"{sender!r} asked for votes for {m.candidate!r}")
        if isinstance(m, Heartbeat):
            if m.leader != sender:
                raise ValueError(f"{sender!r} sent a heartbeat as {m.leader!r}")
            if m.term == self._term and self._role is Role.LEADER:
                raise ValueError(f"{sender!r} claims to lead term {m.term}, which this node leads")
            if m.term == self._term and self._leader not in (None, sender):
                raise ValueError(f"{sender!r} claims to lead term {m.term}, which {self._leader!r} leads")
        if isinstance(m, VoteReply) and m.granted and m.term > self._term:
            raise ValueError(f"a vote granted for term {m.term}, in which this node never campaigned")
        if isinstance(m, PreVoteReply) and m.granted and m.term > self._term + 1:
            raise ValueError(f"a pre-vote granted for term {m.term}, which this node never proposed")

    # --- message handlers ------------------------------------------------------------

    def _on_pre_vote(self, sender: str, m: PreVote, now: float) -> None:
        if m.term <= self._term:
            # the refusal carries our term, so a pre-candidate left behind catches up
            self._send(sender, PreVoteReply(self._term, False))
        elif not self._in_lease(now):
            self._send(sender, PreVoteReply(m.term, True))
        # else: our leader is alive; stay silent (leader stickiness)

    def _on_pre_vote_reply(self, sender: str, m: PreVoteReply, now: float) -> None:
        if m.granted:
            if self._role is Role.PRE_CANDIDATE and m.term == self._term + 1:
                self._granted.add(sender)
                if len(self._granted) >= self.majority:
                    self._become_candidate(now)
        elif m.term > self._term:
            self._become_follower(now, m.term, None, HIGHER_TERM)

    def _on_request_vote(self, sender: str, m: RequestVote, now: float) -> None:
        if m.term < self._term:
            self._send(sender, VoteReply(self._term, False))
            return
        if self._in_lease(now):
            return  # leader stickiness: neither the term nor a vote moves while our leader is alive
        if m.term > self._term:
            self._become_follower(now, m.term, None, HIGHER_TERM)
        if self._voted_for in (None, sender):
            if self._voted_for is None:
                self._voted_for = sender
                self._persist()
            self._reset_election_timer(now)
            self._send(sender, VoteReply(self._term, True))
        else:
            self._send(sender, VoteReply(self._term, False))

    def _on_vote_reply(self, sender: str, m: VoteReply, now: float) -> None:
        if m.term > self._term:
            self._become_follower(now, m.term, None, HIGHER_TERM)
        elif m.term == self._term and m.granted and self._role is Role.CANDIDATE:
            self._granted.add(sender)
            if len(self._granted) >= self.majority:
                self._become_leader(now)

    def _on_heartbeat(self, sender: str, m: Heartbeat, now: float) -> None:
        if m.term >= self._term:
            # a leader of our term or a newer one: follow it (candidates of this term lost)
            self._become_follower(now, m.term, sender, HIGHER_TERM)
        # a stale leader learns our higher term from the reply and steps down: with stickiness a
        # node that moved on may otherwise never be heard again (etcd raft does the same)
        self._send(sender, HeartbeatReply(self._term, m.sent_at))

    def _on_heartbeat_reply(self, sender: str, m: HeartbeatReply, now: float) -> None:
        if m.term > self._term:
            self._become_follower(now, m.term, None, HIGHER_TERM)
        elif m.term == self._term and self._role is Role.LEADER and self._leader_since <= m.sent_at <= now:
            # an echo from before this leadership answers an older leader's heartbeat (the sender
            # has since moved to this term): it says nothing about following this one
            self._acked[sender] = max(self._acked.get(sender, -math.inf), m.sent_at)

    # --- transitions -----------------------------------------------------------------

    def _become_follower(self, now: float, term: int, leader: str | None, reason: str) -> None:
        """Follow ``leader`` (``None``: unknown yet) in ``term`` (>= the current term)."""
        if self._role is Role.LEADER:
            self._emit(SteppedDown(self._term, reason))
        if term > self._term:
            self._term = term
            self._voted_for = None
            self._persist()
        self._role = Role.FOLLOWER
        self._granted = set()
        self._acked = {}
        self._heartbeat_deadline = math.inf
        self._leader_since = -math.inf
        if leader is not None:
            self._leader_heard_at = now
        self._set_leader(leader)
        self._reset_election_timer(now)

    def _become_pre_candidate(self, now: float) -> None:
        self._role = Role.PRE_CANDIDATE
        self._set_leader(None)
        self._granted = {self.node_id}
        self._reset_election_timer(now)
        for peer in self.peers:
            self._send(peer, PreVote(self._term + 1, self.node_id))

    def _become_candidate(self, now: float) -> None:
        self._role = Role.CANDIDATE
        self._term += 1
        self._voted_for = self.node_id
        self._persist()
        self._set_leader(None)
        self._granted = {self.node_id}
        self._reset_election_timer(now)
        if len(self._granted) >= self.majority:
            self._become_leader(now)
            return
        for peer in self.peers:
            self._send(peer, RequestVote(self._term, self.node_id))

    def _become_leader(self, now: float) -> None:
        self._role = Role.LEADER
        self._granted = set()
        self._leader_since = now
        self._acked = {}
        self._election_deadline = math.inf
        self._emit(BecameLeader(self._term))
        self._set_leader(self.node_id)
        if self.peers:
            self._send_heartbeats(now)

    # --- helpers ---------------------------------------------------------------------

    def _send_heartbeats(self, now: float) -> None:
        for peer in self.peers:
            self._send(peer, Heartbeat(self._term, self.node_id, now))
        self._heartbeat_deadline = now + self.heartbeat_interval

    def _quorum_heard_at(self) -> float:
        """The newest time by which a majority (counting this node) had acknowledged it."""
        need = self.majority - 1
        heard = sorted(self._acked.values(), reverse=True)
        return heard[need - 1] if len(heard) >= need else -math.inf

    def _quorum_deadline(self) -> float:
        # a new leader gets one window from its victory to hear from a majority
        return max(self._quorum_heard_at(), self._leader_since) + self.election_timeout[0]

    def _in_lease(self, now: float) -> bool:
        """Whether this node believes a live leader exists (itself included) and so refuses votes."""
        if self._role is Role.FOLLOWER:
            return self._leader is not None and now < self._leader_heard_at + self.election_timeout[0]
        if self._role is Role.LEADER:
            return now < self._quorum_deadline()
        return False

    def _reset_election_timer(self, now: float) -> None:
        lo, hi = self.election_timeout
        self._election_deadline = now + self._rng.uniform(lo, hi)

    def _set_leader(self, leader: str | None) -> None:
        self._leader = leader
        key = (leader, self._term if leader is not None else -1)
        if key != self._announced:
            self._announced = key
            self._emit(LeaderChanged(leader, self._term))

    def _persist(self) -> None:
        # one fsync per input: a Persist not yet followed by a Send is superseded by this one
        for i in range(len(self._effects) - 1, -1, -1):
            effect = self._effects[i]
            if isinstance(effect, Send):
                break
            if isinstance(effect, Persist):
                del self._effects[i]
                break
        self._emit(Persist(self._term, self._voted_for))

    def _send(self, to: str, message: Message) -> None:
        self._emit(Send(to, message))

    def _emit(self, effect: Effect) -> None:
        self._effects.append(effect)
