"""The leader's half of a cluster node (pure): taking stock, and serving the nodes.

While its node leads, the ``Leader`` opens eras (``Sync`` to every member, itself included),
collects the reports, rebuilds the cluster's scheduler from them (``Orchestrator.rebuild``) and
sends ``Ready``; then it feeds the orchestrator the nodes' requests and notices and routes what it
decided to the nodes. Its outputs are effects (``drain()``): ``Send`` (to a member, its own node
included: the node puts those in its own inbox), ``Noted`` and ``RecordGrant``.

Never half-changed: a rebuild builds a new orchestrator and the leader takes it only once it is
whole, so a rebuild that raises leaves the leader as it was (the report that came in is not
kept). An orchestrator that raised after its scheduler changed (``broken``, a bug) is ahead of
what the nodes were told: the leader drops it and takes stock again, then lets the error go on.
"""

from __future__ import annotations

from typing import Any

from .. import errors
from ..core.election import Election
from ..core.events import DrainRequested, FaultCleared, ForceReleaseRequested
from ..core.policy import QueuePolicy
from ..core.residency import Options
from ..core.scheduler import Scheduler
from ..core.slices import SlicePolicy
from .asks import Notice, Request, WireError
from .effects import Noted, RecordGrant, Send
from .messages import Era, FromLeader, FromNode, Note, Ready, Report, Req, Res, Resync, Sync
from .orchestrator import Orchestrator
from .report import NodeReport

Effect = Send | Noted | RecordGrant


class Leader:
    def __init__(
        self,
        node_id: str,
        members: tuple[str, ...],
        election: Election,
        *,
        max_waiters: int,
        op_timeout: float,
        sync_timeout: float,
        policies: dict[str, SlicePolicy],
        residency: Options | None = None,
        queue_policies: dict[str, QueuePolicy] | None = None,
    ) -> None:
        self.node_id = node_id
        self.members = members
        self.majority = len(members) // 2 + 1
        self.election = election  # its node's, read for the term only
        self.max_waiters = max_waiters
        self.op_timeout = op_timeout
        self.sync_timeout = sync_timeout
        self.policies = policies
        self.residency = residency
        self.queue_policies = dict(queue_policies or {})
        self.orch: Orchestrator | None = None  # once the era is taken stock of
        self.linked: set[str] = set()  # peers whose link is up (they can answer a sync)
        self.reporters: set[str] = set()  # who reported in the current era
        self.problems: list[str] = []
        self._gen = 0
        self._fence_floor: tuple[int, dict[str, int]] = (0, {})  # (term, group -> highest fence given)
        self._figures: Scheduler | None = None  # the scheduler of this leader's previous era, for its figures
        self._collect: dict[str, NodeReport] | None = None  # the reports so far, while taking stock
        self._collect_era: Era | None = None
        self._collect_deadline = float("inf")
        self._effects: list[Effect] = []

    # --- queries -------------------------------------------------------------------------

    def next_deadline(self) -> float | None:
        times = [self._collect_deadline]
        if self.orch is not None and (d := self.orch.next_deadline()) is not None:
            times.append(d)
        deadline = min(times)
        return None if deadline == float("inf") else deadline

    def offline(self) -> list[str]:
        return sorted(self.members[s] for s in self.orch.offline) if self.orch else []

    def drain(self) -> list[Effect]:
        out, self._effects = self._effects, []
        return out

    # --- inputs --------------------------------------------------------------------------

    def start_sync(self, now: float) -> None:
        """Open a new era: every member (this node too) is asked for its report."""
        era = (self.election.term, self._gen + 1)
        floor = dict(self._fence_floor[1]) if self._fence_floor[0] == era[0] else {}
        figures = None
        if self.orch is not None and self.orch.era[0] == era[0]:  # fences go on growing within a term
            floor.update(self.orch.fence_floor)
            floor.update({g.name: g.fence for g in self.orch.scheduler.groups.values()})
            figures = self.orch.scheduler  # and so do the figures
        self._gen = era[1]
        self._fence_floor, self._figures = (era[0], floor), figures
        self.orch = None
        self._collect, self._collect_era = {}, era
        self._collect_deadline = now + self.sync_timeout
        for member in self.members:
            self._effects.append(Send(member, Sync(era)))

    def step_down(self) -> None:
        self.orch, self._collect, self._collect_deadline = None, None, float("inf")

    def receive(self, sender: str, message: FromNode, now: float) -> None:
        """A message for the leader from ``sender`` (any member, this node too)."""
        match message:
            case Report():
                if self._collect is not None and message.era == self._collect_era:
                    self._maybe_build({**self._collect, sender: message.report}, now)
            case Resync():
                if self._collect is not None and self._collect_era is not None:
                    self._effects.append(Send(sender, Sync(self._collect_era)))
                elif self.orch is not None:
                    self.start_sync(now)
            case Req():
                if self.orch is not None and message.era == self.orch.era:
                    self._answer(self.orch, self.members.index(sender), message, now)
            case Note():
                if self.orch is not None and message.era == self.orch.era:
                    self._noticed(self.orch, self.members.index(sender), message.notice, now)
            # else: an older era's request: the node resends it once the new era is ready

    def request(self, slot: int, ask: Request, now: float) -> Any:
        """The own node's client's request, answered within the call; raises ``TimeslicedError``."""
        assert self.orch is not None
        with self._guard(self.orch, now):
            return self.orch.handle(slot, ask, now)

    def admin(self, event: ForceReleaseRequested | DrainRequested | FaultCleared, now: float) -> Any:
        assert self.orch is not None
        with self._guard(self.orch, now):
            return self.orch.admin(event, now)

    def link(self, peer: str, up: bool, now: float) -> bool:
        """The link to ``peer`` came up or went down; whether this node leads (an era is ready) after it."""
        was = peer in self.linked
        if up:
            self.linked.add(peer)
        else:
            self.linked.discard(peer)
        if self._collect is not None and not up:
            self._maybe_build(self._collect, now)
        if self.orch is None:
            return False
        if not up and was:
            with self._guard(self.orch, now):
                self.orch.node_offline(self.members.index(peer), now)
        elif up and not was and self._collect is None:
            self.start_sync(now)  # it may have missed messages, or it is new: take stock again
        return True

    def handle_timers(self, now: float) -> None:
        if self.orch is not None:
            with self._guard(self.orch, now):
                self.orch.handle_timers(now)
        if self._collect is not None and now >= self._collect_deadline:
            # A timer that fired is spent even if what it does raises: a bug must not spin the shell.
            self._collect_deadline = now + self.sync_timeout
            if len(self._collect) >= self.majority:
                self._build(self._collect, now)

    # --- taking stock ------------------------------------------------------------------------

    def _maybe_build(self, collect: dict[str, NodeReport], now: float) -> None:
        """Build once every member that can answer has: a member whose link is down will not."""
        reachable = {self.node_id} | self.linked
        if reachable <= set(collect) and len(collect) >= self.majority:
            self._build(collect, now)
        else:
            self._collect = collect

    def _build(self, collect: dict[str, NodeReport], now: float) -> None:
        assert self._collect_era is not None
        reports = {self.members.index(m): r for m, r in collect.items()}
        missing = [i for i, m in enumerate(self.members) if m not in collect]
        orch, problems = Orchestrator.rebuild(
            self._collect_era,
            reports,
            missing,
            now,
            max_waiters=self.max_waiters,
            op_timeout=self.op_timeout,
            fence_floor=self._fence_floor[1],
            policies=self.policies,
            residency=self.residency,
            queue_policies=self.queue_policies,
        )
        if self._figures is not None:
            orch.scheduler.carry_figures(self._figures)
        # the new orchestrator is whole: take it
        self.orch, self._figures = orch, None
        self.reporters = set(collect)
        self._collect, self._collect_deadline = None, float("inf")
        self.problems.extend(problems)
        self._effects.extend(Noted("problem", text) for text in problems)
        for member in sorted(self.reporters):
            self._to_node(self.members.index(member), Ready(orch.era))
        self._route(orch)

    # --- serving the nodes ----------------------------------------------------------------------

    def _answer(self, orch: Orchestrator, slot: int, message: Req, now: float) -> None:
        with self._guard(orch, now):
            op = message.request.OP
            try:
                result = orch.handle(slot, message.request, now)
            except errors.TimeslicedError as exc:
                answer = Res(orch.era, message.id, op, error=WireError.of(exc))
            else:
                answer = Res(orch.era, message.id, op, result=result)
        self._to_node(slot, answer)

    def _noticed(self, orch: Orchestrator, slot: int, notice: Notice, now: float) -> None:
        with self._guard(orch, now):
            try:
                orch.handle(slot, notice, now)
            except errors.TimeslicedError as exc:  # nobody to answer: the log hears of it
                text = f"a {notice.OP} notice of node {self.members[slot]!r} was refused: {exc.message}"
                self.problems.append(text)
                self._effects.append(Noted("problem", text))

    def _guard(self, orch: Orchestrator, now: float) -> _Guard:
        """Around one input to ``orch``: route what it decided, or take stock again if it broke."""
        return _Guard(self, orch, now)

    def _broke(self, orch: Orchestrator, now: float) -> None:
        if orch.broken and orch is self.orch:
            text = f"the leader's state of era {list(orch.era)} broke on a bug: taking stock again"
            self.problems.append(text)
            self._effects.append(Noted("problem", text))
            self.start_sync(now)

    def _route(self, orch: Orchestrator) -> None:
        for out in orch.drain():
            self._to_node(out.slot, out.message)
        grants, orch.grants = orch.grants, []
        self._effects.extend(RecordGrant(g) for g in grants)
        notices, orch.notices = orch.notices, []
        for n in notices:
            group = n.data.get("group")
            reason = str(n.data.get("reason", ""))
            self._effects.append(Noted(n.event, reason, job=n.job, group=group if isinstance(group, str) else None))

    def _to_node(self, slot: int, message: FromLeader) -> None:
        self._effects.append(Send(self.members[slot], message))


class _Guard:
    """See ``Leader._guard``; a class rather than a generator context manager: it is on the lock's path."""

    __slots__ = ("leader", "now", "orch")

    def __init__(self, leader: Leader, orch: Orchestrator, now: float) -> None:
        self.leader, self.orch, self.now = leader, orch, now

    def __enter__(self) -> None:
        pass

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        if kind is not None or self.orch.broken:  # an error caught inside the guard may have broken it
            self.leader._broke(self.orch, self.now)
        else:
            self.leader._route(self.orch)
