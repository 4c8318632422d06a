"""Election cores on an in-memory network, with a deterministic clock and seeded chaos.

A ``Network`` plays the shell for every node: it carries out each node's
effects in order (``Persist`` into the node's durable state, ``Send`` into the
network), delivers messages after a random delay unless the link is cut or the
message is dropped, and fires each node's timers exactly at ``next_deadline()``.
Nodes crash (sometimes half way through carrying out a drain, which is where a
``Send`` before its ``Persist`` would be caught) and restart from their last
durable state.

After every event the network checks, over all nodes and all time:

- at most one leader per term (every ``BecameLeader`` and every live leader);
- a node's term never decreases within a life, its durable term never
  decreases, and its durable vote in a term never changes;
- every message a node sends carries its durable term (``PreVote``: + 1), a
  granted vote is already durable, and a leader's self-vote is durable;
- a node grants at most one vote per term, across restarts;
- a node that has led for ``lo`` (the check-quorum window) or longer has
  acknowledgements delivered from a majority within the last ``lo``.

Liveness: after the network heals, exactly one node leads with quorum and every
node follows it within ``10 * hi``, and it stays so through a quiet period.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections import Counter
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from timesliced.core.election import (
    LOST_QUORUM,
    BecameLeader,
    Effect,
    Election,
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

LO, HI = 1.0, 2.0
HEARTBEAT = 0.25


ACTIONS = ("advance", "cut", "isolate", "mend", "recover", "drop", "duplicate", "crash", "restart", "weather")
WEIGHTS = (60, 4, 2, 3, 3, 3, 3, 2, 4, 2)


@dataclass(order=True)
class _InFlight:
    deliver_at: float
    seq: int
    src: str = field(compare=False)
    dst: str = field(compare=False)
    message: Message = field(compare=False)


class Network:
    """N election cores, the links between them, and the invariants over their history."""

    def __init__(self, n: int, seed: int, *, pre_vote: bool = True) -> None:
        self.names = tuple(f"n{i}" for i in range(n))
        self.majority = n // 2 + 1
        self.pre_vote = pre_vote
        self.rng = random.Random(seed)
        self.now = 0.0
        self.nodes: dict[str, Election | None] = {}
        self.durable = {name: Persisted() for name in self.names}
        self.flight: list[_InFlight] = []
        self.cuts: set[frozenset[str]] = set()
        self.drop_rate = 0.0
        self.max_delay = 0.05
        self.crash_mid_drain = 0.0  # chance, per drain carried out, to crash part way through it
        self._seq = itertools.count()
        # history
        self.leaders: dict[int, str] = {}  # term -> its leader
        self.votes: dict[tuple[str, int], str] = {}  # (voter, term) -> candidate
        self.life_term: dict[str, int] = {}  # the term each live node had after its last step
        self.acks: dict[tuple[str, int], dict[str, float]] = {}  # (leader, term) -> peer -> newest sent_at
        self.stats: Counter[str] = Counter()
        self.heal_times: list[float] = []
        for name in self.names:
            self.restart(name)

    # --- nodes ------------------------------------------------------------------------

    def live(self) -> dict[str, Election]:
        return {name: e for name, e in self.nodes.items() if e is not None}

    def crash(self, name: str) -> None:
        self.nodes[name] = None
        self.life_term.pop(name, None)
        self.stats["crashes"] += 1

    def restart(self, name: str) -> None:
        """Rebuild the node from its last durable state, as a daemon would from its state dir."""
        assert self.nodes.get(name) is None
        core = Election(
            name,
            tuple(p for p in self.names if p != name),
            # distinct per node and life even if the network's own randomness is degenerate
            rng=random.Random(f"{name}/{self.stats['restarts']}/{self.rng.getrandbits(64)}"),
            election_timeout=(LO, HI),
            heartbeat_interval=HEARTBEAT,
            pre_vote=self.pre_vote,
            persisted=self.durable[name],
        )
        assert (core.term, core.voted_for) == (self.durable[name].term, self.durable[name].voted_for)
        self.nodes[name] = core
        self.life_term[name] = core.term
        self.stats["restarts"] += 1
        core.start(self.now)
        self._carry_out(name)

    # --- the shell --------------------------------------------------------------------

    def _carry_out(self, name: str) -> None:
        core = self.nodes[name]
        assert core is not None
        effects = core.drain()
        if effects and self.rng.random() < self.crash_mid_drain:
            for effect in effects[: self.rng.randrange(len(effects))]:
                self._effect(name, effect)
            self.stats["crashes mid-drain"] += 1
            self.crash(name)
            return
        for effect in effects:
            self._effect(name, effect)

    def _effect(self, name: str, effect: Effect) -> None:
        durable = self.durable[name]
        if isinstance(effect, Persist):
            assert effect.term >= durable.term, f"{name}: durable term went back {durable} -> {effect}"
            if effect.term == durable.term:
                assert durable.voted_for in (None, effect.voted_for), f"{name} changed its vote: {durable} -> {effect}"
            self.durable[name] = effect.state
        elif isinstance(effect, Send):
            self._check_send(name, effect.to, effect.message, durable)
            self._post(name, effect.to, effect.message)
        elif isinstance(effect, BecameLeader):
            assert (durable.term, durable.voted_for) == (effect.term, name), f"{name} leads without a durable self-vote"
            prior = self.leaders.setdefault(effect.term, name)
            assert prior == name, f"two leaders in term {effect.term}: {prior} and {name}"
            self.stats["elections"] += 1
        elif isinstance(effect, SteppedDown):
            self.stats[f"stepped down: {effect.reason}"] += 1
        else:
            assert isinstance(effect, LeaderChanged)

    def _check_send(self, name: str, to: str, m: Message, durable: Persisted) -> None:
        assert message_from_wire(m.to_wire()) == m
        if isinstance(m, PreVote):
            assert m.term == durable.term + 1, (name, m, durable)
        elif isinstance(m, PreVoteReply) and m.granted:
            assert m.term > durable.term, (name, m, durable)
        else:
            assert m.term == durable.term, f"{name} sent {m} before term {m.term} was durable ({durable})"
        if isinstance(m, VoteReply) and m.granted:
            assert durable.voted_for == to, f"{name} granted {to} a vote that is not durable ({durable})"
            prior = self.votes.setdefault((name, m.term), to)
            assert prior == to, f"{name} voted for {prior} and {to} in term {m.term}"

    def _post(self, src: str, dst: str, m: Message) -> None:
        if frozenset((src, dst)) in self.cuts or self.rng.random() < self.drop_rate:
            self.stats["lost"] += 1
            return
        delay = self.rng.uniform(0.0, self.max_delay)
        heapq.heappush(self.flight, _InFlight(self.now + delay, next(self._seq), src, dst, m))

    def _deliver(self, msg: _InFlight) -> None:
        core = self.nodes[msg.dst]
        if core is None or frozenset((msg.src, msg.dst)) in self.cuts:
            self.stats["lost"] += 1
            return
        m = msg.message
        if isinstance(m, HeartbeatReply):
            acks = self.acks.setdefault((msg.dst, m.term), {})
            acks[msg.src] = max(acks.get(msg.src, -math.inf), m.sent_at)
        core.receive(msg.src, m, self.now)
        self.stats["delivered"] += 1
        self._carry_out(msg.dst)

    # --- time -------------------------------------------------------------------------

    def advance(self, duration: float) -> None:
        """Run every delivery and timer up to ``now + duration``, in time order."""
        until = self.now + duration
        while True:
            deadlines = [(d, name) for name, e in self.live().items() if (d := e.next_deadline()) is not None]
            timer = min(deadlines, default=(math.inf, ""))
            arrival = self.flight[0].deliver_at if self.flight else math.inf
            at = min(timer[0], arrival)
            if at > until:
                break
            self.now = max(self.now, at)
            if arrival < timer[0]:  # on a tie the timer first: a due check-quorum is never late
                self._deliver(heapq.heappop(self.flight))
            else:
                core = self.nodes[timer[1]]
                assert core is not None
                core.handle_timers(self.now)
                self._carry_out(timer[1])
            self.check()
        self.now = until
        self.check()

    # --- chaos ------------------------------------------------------------------------

    def cut(self, a: str, b: str) -> None:
        self.cuts.add(frozenset((a, b)))

    def isolate(self, a: str) -> None:
        for b in self.names:
            if b != a:
                self.cut(a, b)

    def recover(self) -> None:
        self.cuts.clear()

    def random_step(self) -> None:
        n = len(self.names)
        self.step(self.rng.choices(ACTIONS, WEIGHTS)[0], self.rng.randrange(n), self.rng.randrange(n))

    def step(self, action: str, i: int, j: int) -> None:
        """One chaos action on nodes ``i`` and ``j`` (modulo N); one that does not apply is a no-op."""
        rng = self.rng
        a, b = self.names[i % len(self.names)], self.names[j % len(self.names)]
        if action == "advance":
            self.advance(rng.uniform(0.0, 0.4))
        elif action == "cut" and a != b:
            self.cut(a, b)
        elif action == "isolate":
            self.isolate(a)
        elif action == "mend":
            self.cuts.discard(frozenset((a, b)))
        elif action == "recover":
            self.recover()
        elif action == "drop" and self.flight:
            self.flight.pop(rng.randrange(len(self.flight)))
            heapq.heapify(self.flight)
            self.stats["lost"] += 1
        elif action == "duplicate" and self.flight:
            msg = rng.choice(self.flight)
            self._post(msg.src, msg.dst, msg.message)
        elif action == "crash" and self.nodes[a] is not None:
            self.crash(a)
        elif action == "restart" and self.nodes[a] is None:
            self.restart(a)
        elif action == "weather":
            self.drop_rate = rng.choice([0.0, 0.0, 0.1, 0.3])
            self.max_delay = rng.choice([0.005, 0.05, 0.2, 1.5])  # past ``lo``: stale, reordered messages
        self.check()

    def heal(self) -> None:
        self.recover()
        self.drop_rate = 0.0
        self.max_delay = 0.05
        self.crash_mid_drain = 0.0
        for name in [name for name, e in self.nodes.items() if e is None]:
            self.restart(name)

    # --- invariants -------------------------------------------------------------------

    def check(self) -> None:
        for name, core in self.live().items():
            assert core.term >= self.life_term[name], f"{name}: term went back to {core.term}"
            self.life_term[name] = core.term
            if core.role is Role.LEADER:
                prior = self.leaders.setdefault(core.term, name)
                assert prior == name, f"two leaders in term {core.term}: {prior} and {name}"
                since = core.describe(self.now)["leader_since"]
                deadline = core.next_deadline()
                due = deadline is not None and deadline <= self.now  # fires next, at this same instant
                if self.now - since >= LO and not due:
                    acks = self.acks.get((name, core.term), {})
                    fresh = [p for p, sent_at in acks.items() if sent_at > self.now - LO]
                    assert len(fresh) + 1 >= self.majority, f"{name} leads term {core.term} without a majority"
                    assert core.is_leader_with_quorum(self.now)

    def stable(self) -> tuple[str, int] | None:
        """(leader, term) if every node is up and follows one node that leads with quorum."""
        live = self.live()
        leaders = [name for name, e in live.items() if e.is_leader_with_quorum(self.now)]
        if len(live) != len(self.names) or len(leaders) != 1:
            return None
        term = live[leaders[0]].term
        if all(e.leader == leaders[0] and e.term == term for e in live.values()):
            return leaders[0], term
        return None

    def settle(self) -> tuple[str, int]:
        """Heal; within ``10 * hi`` one leader must emerge that then holds through a quiet period.

        Timers armed and messages sent before healing (delays are below ``hi``) may still upset a
        state that looked settled, so the state is trusted only once ``hi`` has passed since healing.
        """
        self.heal()
        healed_at = self.now
        seen, since = self.stable(), self.now
        while seen is None or self.now < healed_at + HI:
            assert self.now - healed_at <= 10 * HI, f"no stable leader {self.now - healed_at:.1f}s after healing"
            self.advance(0.05)
            if (now_seen := self.stable()) != seen:
                seen, since = now_seen, self.now
        self.heal_times.append(since - healed_at)
        for _ in range(int(3 * HI / 0.1)):
            self.advance(0.1)
            assert self.stable() == seen, f"the leader changed on a healthy network: {seen} -> {self.stable()}"
        return seen


def run_chaos(n: int, seed: int, *, pre_vote: bool, rounds: int, steps: int) -> Network:
    net = Network(n, seed, pre_vote=pre_vote)
    for _ in range(rounds):
        net.crash_mid_drain = 0.003
        for _ in range(steps):
            net.random_step()
        net.settle()
    return net


# --- randomized runs -----------------------------------------------------------------


@pytest.mark.parametrize("pre_vote", [True, False], ids=["pre-vote", "no-pre-vote"])
@pytest.mark.parametrize("n", [3, 5])
@pytest.mark.parametrize("seed", range(4))
def test_chaos_keeps_safety_and_heals(n: int, seed: int, pre_vote: bool) -> None:
    net = run_chaos(n, seed * 1000 + n, pre_vote=pre_vote, rounds=8, steps=800)
    # the run reached the states it is meant to test
    assert net.stats["elections"] >= 4
    assert net.stats[f"stepped down: {LOST_QUORUM}"] >= 1
    assert net.stats["crashes"] >= 1
    assert len(net.leaders) >= 4
    assert all(t <= 10 * HI for t in net.heal_times)


def test_chaos_covers_crashes_part_way_through_a_drain() -> None:
    stats: Counter[str] = Counter()
    for seed in range(3):
        stats += run_chaos(3, 77 + seed, pre_vote=True, rounds=2, steps=600).stats
    assert stats["crashes mid-drain"] >= 1


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.sampled_from([3, 5]),
    pre_vote=st.booleans(),
    steps=st.lists(st.tuples(st.sampled_from(ACTIONS), st.integers(0, 4), st.integers(0, 4)), max_size=200),
)
def test_chaos_chosen_steps(seed: int, n: int, pre_vote: bool, steps: list[tuple[str, int, int]]) -> None:
    """The same checks over step lists that hypothesis chooses (and shrinks, should one fail)."""
    net = Network(n, seed, pre_vote=pre_vote)
    net.crash_mid_drain = 0.01
    for action, i, j in steps:
        net.step(action, i, j)
    net.settle()


# --- scenarios -----------------------------------------------------------------------


def test_cluster_of_one_leads_at_once() -> None:
    net = Network(1, 0)
    core = net.nodes["n0"]
    assert core is not None and core.role is Role.LEADER and core.term == 1
    assert net.durable["n0"] == Persisted(1, "n0")
    net.advance(10.0)
    assert core.role is Role.LEADER and core.is_leader_with_quorum(net.now)


@pytest.mark.parametrize("n", [3, 5])
def test_isolated_leader_steps_down_within_the_window_and_the_rest_elect(n: int) -> None:
    net = Network(n, 5)
    old, term = net.settle()
    net.isolate(old)
    isolated_at = net.now
    core = net.nodes[old]
    assert core is not None
    while core.role is Role.LEADER:
        net.advance(0.01)
    assert net.now - isolated_at <= LO + 0.01  # its last acknowledgement was sent before the cut
    assert core.term == term  # it stepped down on its own, not because it heard a newer term
    others = [e for name, e in net.live().items() if name != old]
    while not any(e.is_leader_with_quorum(net.now) for e in others):
        assert net.now - isolated_at <= 10 * HI
        net.advance(0.05)
    assert core.term == term  # pre-vote: the isolated node did not move
    assert net.settle()[1] > term


@pytest.mark.parametrize("pre_vote", [True, False])
def test_rejoining_follower_disrupts_the_leader_only_without_pre_vote(pre_vote: bool) -> None:
    net = Network(3, 11, pre_vote=pre_vote)
    leader, term = net.settle()
    follower = next(name for name in net.names if name != leader)
    net.isolate(follower)
    net.advance(20 * HI)
    core = net.nodes[follower]
    assert core is not None
    assert (core.term == term) is pre_vote  # without pre-vote it campaigned again and again
    net.recover()
    net.advance(3 * HI)
    after, after_term = net.settle()
    if pre_vote:
        assert (after, after_term) == (leader, term)
    else:
        assert after_term > term


@pytest.mark.parametrize("pre_vote", [True, False])
def test_node_cut_off_from_the_leader_alone_cannot_take_over(pre_vote: bool) -> None:
    """Leader stickiness: the follower in the middle still hears the leader, so it helps no one."""
    net = Network(3, 4, pre_vote=pre_vote)
    leader, term = net.settle()
    middle, cut_off = (name for name in net.names if name != leader)
    net.cut(leader, cut_off)
    for _ in range(300):
        net.advance(0.1)
        core = net.nodes[leader]
        assert core is not None and core.role is Role.LEADER and core.term == term
        assert net.nodes[middle] is not None and net.nodes[middle].leader == leader  # type: ignore[union-attr]
    # with pre-vote the cut-off node never moved to a newer term, so mending the link changes nothing
    net.recover()
    net.advance(5 * HI)
    assert (net.settle() == (leader, term)) is pre_vote


def test_minority_side_never_leads() -> None:
    net = Network(5, 3)
    net.settle()
    minority, majority = net.names[:2], net.names[2:]
    for a in minority:
        for b in majority:
            net.cut(a, b)
    for _ in range(200):
        net.advance(0.1)
        for name in minority:
            core = net.nodes[name]
            assert core is not None
            assert not core.is_leader_with_quorum(net.now)
    assert any(e.is_leader_with_quorum(net.now) for name, e in net.live().items() if name in majority)


def test_restarted_voter_keeps_its_vote() -> None:
    """A node that voted, crashed and came back refuses the same term's other candidate."""
    net = Network(3, 1)
    net.settle()
    for name in net.names:
        net.crash(name)
    net.durable["n0"] = Persisted(9, "n1")
    net.restart("n0")
    core = net.nodes["n0"]
    assert core is not None and core.voted_for == "n1" and core.term == 9
    core.receive("n2", RequestVote(9, "n2"), net.now)
    assert [e for e in core.drain() if isinstance(e, Send)] == [Send("n2", VoteReply(9, False))]


def test_the_checker_catches_a_vote_sent_before_it_is_durable() -> None:
    """A shell that carried out Sends before Persists would let a restarted node vote twice."""

    class Reordered(Election):
        def drain(self) -> list[Effect]:
            effects = super().drain()
            return [e for e in effects if not isinstance(e, Persist)] + [e for e in effects if isinstance(e, Persist)]

    net = Network(3, 2)
    for name in net.names:
        net.crash(name)
        core = Reordered(name, tuple(p for p in net.names if p != name), rng=random.Random(name))
        net.nodes[name] = core
        net.life_term[name] = core.term
        core.start(net.now)
    with pytest.raises(AssertionError, match=r"before term|not durable"):
        net.advance(10 * HI)
