"""The cluster cores one step at a time: the orchestrator's rebuild and routing, and a node's fencing."""

from __future__ import annotations

import random
from typing import Any

import pytest

from timesliced import errors
from timesliced.cluster.asks import Acquire, Alloc, Closed, Gone, HostRead, Measured, MoveDone, Register, Release
from timesliced.cluster.effects import Fail, Reply, Send
from timesliced.cluster.messages import Req
from timesliced.cluster.node import PENDING, ClusterNode
from timesliced.cluster.orchestrator import Orchestrator
from timesliced.cluster.report import NodeReport
from timesliced.core.residency import Options

ERA = (3, 1)
NOW = 100.0


def job(name: str, group: str, location: str, footprint: dict[str, int], span: list[int], **kw: Any) -> dict[str, Any]:
    return {
        "job": name,
        "group": group,
        "exclusive": False,
        "location": location,
        "footprint": footprint,
        "faulted": kw.get("faulted", ""),
        "span": span,
        "gone": kw.get("gone", False),
        "freezes": kw.get("freezes", True),
        "memory": kw.get("memory"),
        "memory_each": kw.get("memory_each"),
        "priority": kw.get("priority", 0),
        "weight": kw.get("weight", 1.0),
    }


def report(jobs: list[dict[str, Any]], sessions: list[tuple[int, str]], **kw: Any) -> dict[str, Any]:
    """A node's report as it travels (``rebuild`` takes it read: ``reports_of``)."""
    return {
        "devices": {"0": 100},
        "sessions": [{"conn": c, "job": j, "pids": [], "party": None} for c, j in sessions],
        "jobs": jobs,
        "holders": kw.get("holders", []),
        "waiting": kw.get("waiting", []),
        "fences": kw.get("fences", {}),
        "turns": kw.get("turns", []),
    }


def reports_of(reports: dict[int, dict[str, Any]]) -> dict[int, NodeReport]:
    return {slot: NodeReport.from_wire(r) for slot, r in reports.items()}


def messages(orch: Orchestrator, kind: str) -> list[tuple[int, dict[str, Any]]]:
    """The orchestrator's messages of ``kind`` so far, as they travel."""
    return [(o.slot, o.message.to_wire()) for o in orch.drain() if kind == o.message.K]


def acquire(orch: Orchestrator, slot: int, conn: int, rid: int) -> None:
    orch.handle(slot, Acquire(conn, rid), NOW)


def alloc(orch: Orchestrator, slot: int, conn: int, rid: int, nbytes: int = 60) -> None:
    orch.handle(slot, Alloc(conn, rid, 0, nbytes, nbytes), NOW)


def done(orch: Orchestrator, slot: int, op: int, nbytes: int = 60, now: float = NOW) -> None:
    orch.handle(slot, MoveDone(op, True, nbytes, 0.1), now)


# --- rebuild ------------------------------------------------------------------------------


def test_a_nodes_measured_memory_reaches_the_scheduler_on_cluster_gpus() -> None:
    span = [0, 100]
    a = {**job("A", "g", "resident", {}, span), "exclusive": True, "memory_each": 20}
    reports = {0: report([a], [(1, "A")]), 1: report([a], [(1, "A")])}
    orch, _ = Orchestrator.rebuild(ERA, reports_of(reports), [], NOW)
    orch.handle(1, Measured("A", {0: 35}), NOW)  # node 1's GPU 0
    job_a = orch.scheduler.jobs["A"]
    assert job_a.peak == {100: 35} and job_a.footprint == {0: 20, 100: 35}
    assert orch.scheduler.describe(NOW)["jobs"][0]["over_declared_bytes"] == 15


def test_a_streamed_restore_names_its_snapshots_to_the_nodes() -> None:
    orch = Orchestrator(ERA, {0: 100}, residency=Options(memory_headroom=0, stream_switches=True))
    orch.handle(0, Register(1, 1, "A", "g", (0,), (), True, memory={0: 70}), NOW)
    orch.handle(0, Register(2, 1, "B", "g", (0,), (), True, memory_each=60), NOW)
    acquire(orch, 0, 1, 2)
    ((_, snap),) = messages(orch, "move")  # 70 + 60 do not fit: B parks for A's first turn
    done(orch, 0, snap["op"])
    acquire(orch, 0, 2, 3)
    orch.handle(0, Release(1, 4), NOW)
    moves = {m["kind"]: m for _, m in messages(orch, "move")}
    assert moves["snapshot"]["job"] == "A" and moves["restore"]["job"] == "B"
    assert moves["restore"]["streams_with"] == [moves["snapshot"]["op"]]
    orch.scheduler.check_invariants()


def test_rebuild_keeps_what_each_node_declared_for_its_jobs() -> None:
    span = [0, 100]
    a = {**job("A", "g", "parked", {}, span), "exclusive": True}
    reports = {
        0: report([{**a, "memory": {"0": 30}}], [(1, "A")]),
        1: report([{**a, "memory_each": 20}], [(1, "A")]),
    }
    orch, problems = Orchestrator.rebuild(ERA, reports_of(reports), [], NOW)
    assert problems == []
    jobs = orch.scheduler.jobs
    assert jobs["A"].declared == {0: 30, 100: 20}  # node 1's GPU 0 is GPU 100 cluster-wide
    assert jobs["A"].footprint == {0: 30, 100: 20}  # planned with it: a parked job is restored into that room
    orch.scheduler.check_invariants()


def test_rebuild_keeps_the_holder_its_fence_and_the_queue_in_the_old_order() -> None:
    span = [0, 100]
    reports = {
        0: report(
            [job("A", "g", "resident", {"0": 40}, span), job("B", "g", "parked", {"0": 40}, span)],
            [(1, "A"), (2, "B")],
            holders=[{"group": "g", "job": "A", "fence": 7, "conns": [1]}],
            waiting=[{"conn": 2, "rid": 5, "seq": 12, "order": 1, "deadline_in": None, "gang": None, "members": 0}],
            fences={"g": 7},
        ),
        1: report(
            [job("C", "g", "parked", {"0": 40}, span), job("A", "g", "resident", {}, span)],
            [(1, "C"), (2, "A")],
            holders=[{"group": "g", "job": "A", "fence": 7, "conns": [2]}],
            waiting=[{"conn": 1, "rid": 9, "seq": 11, "order": 4, "deadline_in": 30.0, "gang": None, "members": 0}],
            fences={"g": 7},
        ),
    }
    orch, problems = Orchestrator.rebuild(ERA, reports_of(reports), [], NOW)
    assert problems == []
    g = orch.scheduler.groups["g"]
    assert (g.holder, g.fence, g.gpus) == ("A", 7, (0, 100))
    assert g.holder_sessions == {1, (1 << 40) + 2}
    assert [w.job for w in g.queue] == ["C", "B"]  # seq 11 before seq 12, whatever node they are on
    assert orch.scheduler.next_deadline() == NOW + 30.0
    orch.scheduler.check_invariants()


def test_rebuild_freezes_groups_on_a_node_that_did_not_report() -> None:
    reports = {0: report([job("A", "g", "parked", {"0": 40}, [0, 200])], [(1, "A")])}
    reports[0]["waiting"] = [
        {"conn": 1, "rid": 1, "seq": None, "order": 1, "deadline_in": None, "gang": None, "members": 0}
    ]
    orch, _ = Orchestrator.rebuild(ERA, reports_of(reports), [2], NOW)
    assert orch.scheduler.frozen("g")
    assert messages(orch, "move") == [] and messages(orch, "grant") == []  # nothing moves, nothing granted


def test_rebuild_parks_a_half_switched_job_before_granting_it() -> None:
    span = [0, 100]
    reports = {
        0: report([job("A", "g", "parked", {"0": 60}, span)], [(1, "A")]),
        1: report(
            [job("A", "g", "resident", {"0": 60}, span)],
            [(1, "A")],
            waiting=[{"conn": 1, "rid": 1, "seq": 3, "order": 1, "deadline_in": None, "gang": None, "members": 0}],
        ),
    }
    orch, _ = Orchestrator.rebuild(ERA, reports_of(reports), [], NOW)
    a = orch.scheduler.jobs["A"]
    assert a.location.value == "parking"
    assert a.footprint == {100: 60}  # what the GPUs hold now
    moves = messages(orch, "move")
    assert {slot for slot, _ in moves} == {0, 1} and {m["kind"] for _, m in moves} == {"snapshot"}
    op = moves[0][1]["op"]
    for slot in (0, 1):
        done(orch, slot, op, now=NOW + 1)
    assert orch.scheduler.jobs["A"].footprint == {0: 60, 100: 60}  # all of it once parked everywhere
    assert {m["kind"] for _, m in messages(orch, "move")} == {"restore"}  # then it comes back for its grant


def test_rebuild_continues_fences_above_what_any_node_saw() -> None:
    reports = {
        0: report([job("A", "g", "resident", {}, [0])], [(1, "A")], fences={"g": 41}),
    }
    reports[0]["waiting"] = [
        {"conn": 1, "rid": 1, "seq": None, "order": 1, "deadline_in": None, "gang": None, "members": 0}
    ]
    orch, _ = Orchestrator.rebuild(ERA, reports_of(reports), [], NOW, fence_floor={"g": 50})
    ((_, grant),) = messages(orch, "grant")
    assert grant["info"]["fence"] == 51 and grant["info"]["term"] == ERA[0] and grant["era"] == list(ERA)


def test_rebuild_tells_a_second_claimed_holder_it_lost_the_lock() -> None:
    reports = {
        0: report(
            [job("A", "g", "resident", {}, [0, 100])],
            [(1, "A")],
            holders=[{"group": "g", "job": "A", "fence": 4, "conns": [1]}],
        ),
        1: report(
            [job("B", "g", "resident", {}, [0, 100])],
            [(1, "B")],
            holders=[{"group": "g", "job": "B", "fence": 5, "conns": [1]}],
        ),
    }
    orch, _ = Orchestrator.rebuild(ERA, reports_of(reports), [], NOW)
    assert orch.scheduler.groups["g"].holder == "B"
    lost = [(s, m) for s, m in messages(orch, "notify") if m["event"] == "lock_lost"]
    assert lost == [(0, {"k": "notify", "job": "A", "event": "lock_lost", "data": lost[0][1]["data"], "era": [3, 1]})]


# --- moves across nodes ----------------------------------------------------------------------


def two_node_orchestrator() -> Orchestrator:
    orch = Orchestrator(ERA, {0: 100, 100: 100}, op_timeout=10.0)
    for slot in (0, 1):
        for conn, name in ((1, "A"), (2, "B")):
            orch.handle(slot, Register(conn, 1, name, "g", (0,)), NOW)
    orch.drain()
    return orch


def test_a_move_finishes_when_every_node_did_its_part() -> None:
    orch = two_node_orchestrator()
    acquire(orch, 0, 1, 1)
    alloc(orch, 0, 1, 2)
    orch.handle(0, Release(1, 3), NOW)
    acquire(orch, 0, 2, 3)
    alloc(orch, 0, 2, 4)
    moves = messages(orch, "move")
    assert [(s, m["kind"], m["job"]) for s, m in moves] == [(0, "snapshot", "A"), (1, "snapshot", "A")]
    op = moves[0][1]["op"]
    done(orch, 0, op, now=NOW + 1)
    assert orch.scheduler.jobs["A"].location.value == "parking"  # node 1 has not answered yet
    done(orch, 1, op, nbytes=0, now=NOW + 1)
    assert orch.scheduler.jobs["A"].location.value == "parked"
    assert orch.scheduler.jobs["A"].bytes_moved == 60


def test_a_node_that_drops_off_mid_restore_faults_the_job_and_keeps_its_memory() -> None:
    orch = two_node_orchestrator()
    acquire(orch, 0, 1, 1)
    alloc(orch, 0, 1, 2)
    orch.handle(0, Release(1, 3), NOW)
    acquire(orch, 0, 2, 3)
    alloc(orch, 0, 2, 4)
    (op,) = {m["op"] for _, m in messages(orch, "move")}
    for slot in (0, 1):
        done(orch, slot, op)
    orch.handle(0, Release(2, 5), NOW)
    acquire(orch, 0, 1, 5)  # A comes back: B is parked first
    (snap,) = {m["op"] for _, m in messages(orch, "move")}
    for slot in (0, 1):
        done(orch, slot, snap)
    restore = {m["op"] for _, m in messages(orch, "move") if m["kind"] == "restore"}
    assert len(restore) == 1
    done(orch, 0, restore.pop())
    orch.node_offline(1, NOW + 1)
    a = orch.scheduler.jobs["A"]
    assert a.faulted.startswith("restore failed: node 1 is out of reach")
    assert a.location.value == "resident"  # counted as on the GPU: nothing else is put there
    notify = [m for _, m in messages(orch, "notify") if m["event"] == "faulted"]
    assert notify and notify[0]["data"]["until_resync"] is True
    assert orch.scheduler.frozen("g")
    orch.scheduler.check_invariants()


def test_a_group_stops_spanning_a_node_its_last_job_left() -> None:
    orch = Orchestrator(ERA, {0: 100, 100: 100, 200: 100})
    orch.handle(0, Register(1, 1, "A", "g", (0,)), NOW)
    orch.handle(1, Register(1, 1, "A", "g", (0,)), NOW)
    orch.handle(2, Register(1, 1, "B", "g", (0,)), NOW)
    assert orch.scheduler.groups["g"].gpus == (0, 100, 200)
    orch.handle(2, Closed(1), NOW)
    orch.handle(2, Gone("B"), NOW)
    orch.drain()
    (reclaim,) = [m for m in orch.scheduler._moves.values() if m.kind == "reclaim"]
    orch.handle(2, MoveDone(reclaim.op, True), NOW)
    assert orch.scheduler.groups["g"].gpus == (0, 100)
    spans = messages(orch, "span")
    assert sorted(s for s, _ in spans) == [0, 1] and spans[0][1]["gpus"] == [0, 100]
    # with its last job gone too, the group is forgotten; its fence stays the floor
    orch.scheduler.groups["g"].fence = 9
    for slot in (0, 1):
        orch.handle(slot, Closed(1), NOW)
        orch.handle(slot, Gone("A"), NOW)
    (reclaim,) = [m for m in orch.scheduler._moves.values() if m.kind == "reclaim"]
    for slot in (0, 1):
        orch.handle(slot, MoveDone(reclaim.op, True), NOW)
    assert "g" not in orch.scheduler.groups and orch.fence_floor == {"g": 9}
    orch.handle(2, Register(2, 1, "C", "g", (0,)), NOW)
    assert orch.scheduler.groups["g"].gpus == (200,) and orch.scheduler.groups["g"].fence == 9


# --- a node's fencing -------------------------------------------------------------------------


def node(name: str = "b") -> ClusterNode:
    n = ClusterNode(name, ("a", "b", "c"), {0: 100}, rng=random.Random(1))
    n.start(0.0)
    n.drain()
    return n


def follow(n: ClusterNode, leader: str, term: int, gen: int = 1) -> None:
    """Make ``n`` follow ``leader`` in ``term`` and take its sync and ready."""
    n.receive(leader, {"k": "elect", "m": {"type": "heartbeat", "term": term, "leader": leader, "sent_at": 0.0}}, 0.1)
    n.receive(leader, {"k": "sync", "era": [term, gen]}, 0.1)
    n.receive(leader, {"k": "ready", "era": [term, gen]}, 0.1)
    n.drain()


def registered(n: ClusterNode, leader: str, term: int, conn: int = 1) -> None:
    assert n.request(Register(conn, 1, "A", "g", (0,)), 0.2) is PENDING
    (send,) = [e for e in n.drain() if isinstance(e, Send)]
    assert send.to == leader and isinstance(send.message, Req) and send.message.era == (term, 1)
    result = {"job": "A", "group": "g", "gpus": [100], "location": "resident"}
    res = {"k": "res", "id": send.message.id, "op": "register", "ok": True, "result": result, "era": [term, 1]}
    n.receive(leader, res, 0.2)
    (reply,) = n.drain()
    assert isinstance(reply, Reply) and reply.result["gpus"] == [0]


def grant(term: int, fence: int, rid: int, again: bool = False) -> dict[str, Any]:
    info = {"group": "g", "job": "A", "fence": fence, "waited_s": 0.0, "switch_s": 0.0, "restored": False}
    return {"k": "grant", "tickets": [[1, rid]], "info": {**info, "term": term}, "again": again, "era": [term, 1]}


def test_a_node_refuses_directions_from_anyone_but_its_leader_in_its_era() -> None:
    n = node()
    follow(n, "a", 2)
    registered(n, "a", 2)
    n.request(Acquire(1, 2), 0.3)
    n.drain()
    n.receive("c", grant(2, 1, 2), 0.3)  # not the leader
    n.receive("a", {**grant(2, 1, 2), "era": [2, 0]}, 0.3)  # an older era of the leader
    assert n.drain() == [] and n.refused == 2
    n.receive("a", grant(2, 1, 2), 0.3)
    (reply,) = n.drain()
    assert isinstance(reply, Reply) and reply.result["fence"] == 1 and n.holders["g"].fence == 1


def test_a_node_never_delivers_an_older_grant_of_a_group() -> None:
    n = node()
    follow(n, "a", 2)
    registered(n, "a", 2)
    n.request(Acquire(1, 2), 0.3)
    n.receive("a", grant(2, 5, 2), 0.3)
    n.request(Release(1, 3), 0.3)
    n.request(Acquire(1, 4), 0.3)
    n.drain()
    n.receive("a", grant(2, 4, 4), 0.3)  # a fence below the last one delivered
    n.receive("a", grant(2, 5, 4), 0.3)  # the same fence, not as "again"
    assert [e for e in n.drain() if isinstance(e, Reply)] == [] and n.refused == 2
    n.receive("a", grant(2, 6, 4), 0.3)
    assert [e.result["fence"] for e in n.drain() if isinstance(e, Reply)] == [6]


def test_a_new_leaders_sync_is_answered_with_a_report_once_moves_are_done() -> None:
    n = node()
    follow(n, "a", 2)
    registered(n, "a", 2)
    n.receive("a", {"k": "move", "op": 7, "kind": "snapshot", "job": "A", "era": [2, 1], "streams_with": []}, 0.4)
    (run,) = n.drain()
    # a new leader in term 3 asks for a report while the snapshot runs
    n.receive("c", {"k": "elect", "m": {"type": "heartbeat", "term": 3, "leader": "c", "sent_at": 0.0}}, 0.5)
    n.receive("c", {"k": "sync", "era": [3, 1]}, 0.5)
    assert not [e for e in n.drain() if isinstance(e, Send) and e.message.K == "report"]
    n.move_finished(run.key, True, 60, 0.1, "", 0.6)
    sends = [e for e in n.drain() if isinstance(e, Send)]
    assert [(s.to, s.message.K) for s in sends] == [("c", "report")]  # the old era's move_done goes nowhere
    (j,) = sends[0].message.to_wire()["report"]["jobs"]
    assert (j["job"], j["location"]) == ("A", "parked")
    n.receive("a", grant(2, 9, 2), 0.7)  # the deposed leader can no longer grant
    assert n.drain() == [] and n.refused == 1


def test_requests_wait_for_a_leader_and_fail_cleanly_when_refused() -> None:
    n = node()
    assert n.request(Register(1, 1, "A", "g", (0,)), 0.1) is PENDING
    assert [e for e in n.drain() if isinstance(e, Send) and isinstance(e.message, Req)] == []  # no leader yet
    follow(n, "a", 2)
    n.receive("a", {"k": "ready", "era": [2, 1]}, 0.2)
    req = next(e.message for e in n.drain() if isinstance(e, Send) and isinstance(e.message, Req))
    error = errors.to_wire(errors.GroupMismatch("no"))
    res = {"k": "res", "id": req.id, "op": "register", "ok": False, "error": error, "era": [2, 1]}
    n.receive("a", res, 0.3)
    (fail,) = n.drain()
    assert isinstance(fail, Fail) and isinstance(fail.error, errors.GroupMismatch)
    with pytest.raises(errors.NotRegistered):
        n.request(Acquire(1, 2), 0.3)


def test_a_single_node_leads_at_once_and_answers_within_the_call() -> None:
    n = ClusterNode("solo", ("solo",), {0: 100, 1: 100}, rng=random.Random(1))
    n.start(0.0)
    assert n.leading and n.ready
    result = n.request(Register(1, 1, "A", "g"), 0.1)
    assert result["gpus"] == [0, 1]
    assert n.request(Acquire(1, 2), 0.1) is PENDING
    (reply,) = [e for e in n.drain() if isinstance(e, Reply)]
    assert reply.rid == 2 and reply.result["fence"] == 1 and reply.result["term"] == 1
    assert [type(e).__name__ for e in n.drain()] == []


def test_a_sessions_party_reaches_the_leader_and_survives_a_rebuild() -> None:
    """A node reports each session's party; a new leader registers the session with it again."""
    n = ClusterNode("solo", ("solo",), {0: 100}, rng=random.Random(1))
    n.start(0.0)
    n.request(Register(1, 1, "A", "g", party="host:42:ab"), 0.1)
    n.request(Register(2, 2, "A", "g"), 0.1)
    assert n.scheduler is not None and n.scheduler.registry.parties == {1: "host:42:ab"}
    picture = n._report(0.2)
    assert [(s.conn, s.party) for s in picture.sessions] == [(1, "host:42:ab"), (2, None)]
    orch, problems = Orchestrator.rebuild(ERA, {0: picture}, [], NOW)
    assert problems == [] and list(orch.scheduler.registry.parties.values()) == ["host:42:ab"]
    n.closed(1, 0.3)
    assert n.parties == {} and n.scheduler.registry.parties == {}
    orch.scheduler.check_invariants()


def test_a_leader_that_takes_stock_again_keeps_its_figures() -> None:
    reports = {0: report([job("A", "g", "resident", {}, [0])], [(1, "A")])}
    old, _ = Orchestrator.rebuild(ERA, reports_of(reports), [], NOW)
    for rid in (2, 4, 6):
        old.handle(0, Acquire(1, rid), NOW)
        old.handle(0, Release(1, rid + 1), NOW + 1)
    reports[0]["fences"] = {"g": 3}
    new, _ = Orchestrator.rebuild((3, 2), reports_of(reports), [], NOW + 2)
    assert (new.scheduler.groups["g"].grants, new.scheduler.jobs["A"].slices) == (0, 0)
    new.scheduler.carry_figures(old.scheduler)
    g = new.scheduler.groups["g"]
    assert (g.grants, g.fence, g.held_total_s, new.scheduler.jobs["A"].slices) == (3, 3, 3.0, 3)


# --- durability: a restarted node takes its jobs up again -----------------------------------


def test_a_restarted_node_keeps_the_holders_turn_first_then_the_queue_order() -> None:
    old = ClusterNode("solo", ("solo",), {0: 100}, rng=random.Random(1))
    old.start(0.0)
    for conn, name in ((1, "A"), (2, "B"), (3, "C")):
        old.request(Register(conn, 1, name, "g", pids=(100 + conn,)), 0.1)
    for conn in (1, 3, 2):  # A is granted, then C and B wait, in that order
        old.request(Acquire(conn, 2), 0.2)
    picture = old.durable(0.3)
    assert picture["turns"] == {"A": -1, "C": 2, "B": 3}  # the holder, then the order the leader queued them
    assert {j["job"]: j["pids"] for j in picture["jobs"]} == {"A": [101], "B": [102], "C": [103]}

    new = ClusterNode("solo", ("solo",), {0: 100}, rng=random.Random(2))
    new.restore(picture, 10.0, keep_turns_for=30.0)
    new.start(10.0)
    sched = new.scheduler
    assert sched is not None and [w.job for w in sched.groups["g"].queue] == ["A", "C", "B"]
    assert sched.groups["g"].fence >= 1  # new grants go above the ones given before the restart
    # B comes back first, but A's kept turn holds the group until A asks again.
    new.request(Register(7, 1, "B", "g", pids=(102,)), 11.0)
    new.request(Acquire(7, 2), 11.0)
    assert not [e for e in new.drain() if isinstance(e, Reply) and e.rid == 2]
    new.request(Register(8, 1, "A", "g", pids=(101,)), 12.0)
    new.request(Acquire(8, 2), 12.0)
    (grant,) = [e for e in new.drain() if isinstance(e, Reply) and e.rid == 2]
    assert grant.conn == 8 and grant.result["job"] == "A"
    # C never comes back: its turn lapses, and B is next once A yields.
    new.request(Release(8, 3), 13.0)
    new.handle_timers(40.0)
    (grant,) = [e for e in new.drain() if isinstance(e, Reply) and e.rid == 2]
    assert grant.conn == 7 and grant.result["job"] == "B"


@pytest.mark.parametrize(
    "picture",
    [
        {},
        {"jobs": [{"job": "a"}], "turns": {}, "fences": {}},
        {"jobs": [], "fences": {}},
        {"jobs": [], "turns": {}, "fences": {"g": 3}},
        {"jobs": "no", "turns": {}, "fences": {}},
    ],
)
def test_a_journal_picture_of_another_shape_is_refused_and_nothing_is_taken_up(picture: dict[str, Any]) -> None:
    n = node()
    with pytest.raises(ValueError, match="not a picture of this release's journal"):
        n.restore(picture, NOW, 30.0)
    assert n.jobs == {} and n.turns == {} and n.fences == {}


# --- host memory, moves that leave a job whole, freezing --------------------------------------


def parked_on_two_nodes(orch: Orchestrator) -> int:
    """A held and allocated 60 on both nodes, then B came: A is parked; returns the op of B's switch park."""
    acquire(orch, 0, 1, 1)
    alloc(orch, 0, 1, 2)
    orch.handle(0, Release(1, 3), NOW)
    acquire(orch, 0, 2, 3)
    alloc(orch, 0, 2, 4)
    (op,) = {m["op"] for _, m in messages(orch, "move")}
    return op


def test_each_node_counts_what_its_part_of_a_park_takes() -> None:
    orch = two_node_orchestrator()
    op = parked_on_two_nodes(orch)
    done(orch, 0, op, nbytes=60)
    done(orch, 1, op, nbytes=0)  # its part had nothing on this node's GPUs
    assert orch.scheduler.jobs["A"].parked == {0: 60}
    orch.handle(1, HostRead(40, None, {}, {}, {"B": 7}, {"host": "MemAvailable 1 GiB"}), NOW)
    assert orch.scheduler.host.nodes[1].budget == 40 and orch.scheduler.host.nodes[1].sizes == {"B": 7}
    assert orch.scheduler.describe(NOW)["host"][0]["slot"] == 1


def test_a_move_is_intact_only_if_no_node_moved_its_part() -> None:
    orch = two_node_orchestrator()
    op = parked_on_two_nodes(orch)
    orch.handle(0, MoveDone(op, False, 0, 0.1, "no space left", intact=True, code="insufficient_host_memory"), NOW)
    orch.handle(1, MoveDone(op, False, 0, 0.1, "no space either", intact=True, code="insufficient_host_memory"), NOW)
    a = orch.scheduler.jobs["A"]
    assert not a.faulted and a.location.value == "resident" and a.refusal is not None
    assert a.refusal.code == "insufficient_host_memory"
    assert a.refusal.reason == "snapshot failed: node 0: no space left; node 1: no space either"
    fail = [m for _, m in messages(orch, "fail")]
    assert fail and fail[0]["error"]["code"] == "out_of_memory"  # B's allocation waited for the park

    orch = two_node_orchestrator()
    op = parked_on_two_nodes(orch)
    done(orch, 0, op)  # node 0 parked its part: the job is half parked, not intact
    orch.handle(1, MoveDone(op, False, 0, 0.1, "no space", intact=True), NOW)
    assert orch.scheduler.jobs["A"].faulted.startswith("snapshot failed: node 1: no space")


def test_a_nodes_job_that_cannot_be_frozen_is_refused_by_a_preempting_leader() -> None:
    from timesliced.core.slices import SlicePolicy

    orch = Orchestrator(ERA, {0: 100}, policies={"g": SlicePolicy(5.0, "preempt")})
    with pytest.raises(errors.PreemptionUnsafe):
        orch.handle(0, Register(1, 1, "A", "g", exclusive=True, freezes=False), NOW)
    orch.handle(0, Register(1, 1, "A", "w", exclusive=True, freezes=False), NOW)
    assert orch.scheduler.jobs["A"].freezes is False


def test_a_node_sends_its_latest_host_reading_to_every_new_leader() -> None:
    node = ClusterNode("n0", ("n0", "n1"), {0: 100}, rng=random.Random(1))
    node.start(NOW)
    node.drain()
    node.host_read(HostRead(10), NOW)
    node.host_read(HostRead(20), NOW)  # not ready: nothing piles up, the latest is kept
    assert node.host == HostRead(20) and not node._notes
    node.era, node.leader = (1, 1), "n1"  # as a sync from n1 leaves it
    node._on_ready()
    notes = [e.message for e in node.drain() if isinstance(e, Send) and e.message.K == "note"]
    assert [n.notice for n in notes] == [HostRead(20)]
    node.host_read(HostRead(30), NOW)  # ready: straight to the leader
    notes = [e.message for e in node.drain() if isinstance(e, Send) and e.message.K == "note"]
    assert [n.notice for n in notes] == [HostRead(30)]
    assert not node.moving
