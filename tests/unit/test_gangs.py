"""Gang acquire in the core: all or nothing, withdrawn whole, and never deadlocked."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from timesliced import errors
from timesliced.core.events import AcquireRequested, FailRequest, GrantLock, NotifyJob, RestoreJob, SnapshotJob
from timesliced.core.policy import QueuePolicy

from ..helpers.harness import Harness, only

Make = Callable[..., Harness]
FOUR = {0: 100, 1: 100, 2: 100, 3: 100}


def grants(h: Harness) -> dict[str, str]:
    return {e.group: e.job for e in h.drain() if isinstance(e, GrantLock)}


def pools(harness: Make, **kw: object) -> tuple[Harness, dict[str, int]]:
    """Groups ``t`` (GPU 0) and ``s`` (GPU 1), a trainer and a sampler job in each, and rivals."""
    h = harness(FOUR, **kw)
    s = {
        "trainer": h.register("trainer", "t", (0,)),
        "sampler": h.register("sampler", "s", (1,)),
        "t2": h.register("t2", "t", (0,)),
        "s2": h.register("s2", "s", (1,)),
    }
    return h, s


def test_a_gang_is_granted_only_once_every_member_asked(harness: Make) -> None:
    h, s = pools(harness)
    h.acquire(s["trainer"], gang="sync", members=2)
    assert h.holder("t") is None and h.drain() == []  # alone it waits, though its group is free
    h.acquire(s["sampler"], gang="sync", members=2)
    assert grants(h) == {"t": "trainer", "s": "sampler"}
    assert h.s.queues.gangs == {}


def test_a_gang_waits_whole_for_a_busy_group(harness: Make) -> None:
    """All or nothing: the free group waits for the gang rather than grant its member alone."""
    h, s = pools(harness)
    h.acquire(s["s2"])
    h.drain()
    h.acquire(s["trainer"], gang="g1", members=2)
    h.acquire(s["sampler"], gang="g1", members=2)
    assert h.holder("t") is None and h.holder("s") == "s2" and h.drain() == []
    assert "gang 'g1': waiting for group s" in (h.s.groups["t"].waiting_for or "")
    h.acquire(s["t2"])  # a single acquire does not pass a gang that was chosen first
    assert h.holder("t") is None
    h.release(s["s2"])
    assert grants(h) == {"t": "trainer", "s": "sampler"}
    h.release(s["trainer"])  # releases are per member
    assert grants(h) == {"t": "t2"} and h.holder("s") == "sampler"


def test_members_switch_in_parallel_and_are_granted_together(harness: Make) -> None:
    h, s = pools(harness)
    h.alloc(s["trainer"], 50, 0)
    h.alloc(s["sampler"], 50, 1)
    for job, gpu in (("t2", 0), ("s2", 1)):
        h.alloc(s[job], 60, gpu)  # each pool is too small for both of its jobs: the gang's member is parked
        (snap,) = [e for e in h.drain() if isinstance(e, SnapshotJob)]
        h.finish(snap, nbytes=50)
    h.drain()
    h.acquire(s["trainer"], gang="g", members=2)
    h.acquire(s["sampler"], gang="g", members=2)
    snaps = [e for e in h.drain() if isinstance(e, SnapshotJob)]
    assert sorted(e.job for e in snaps) == ["s2", "t2"]
    h.finish(snaps[0], nbytes=60)
    (restore0,) = [e for e in h.drain() if isinstance(e, RestoreJob)]
    h.finish(restore0, nbytes=50)
    assert h.holder("t") is None and h.holder("s") is None  # one member ready: nobody holds yet
    h.finish(snaps[1], nbytes=60)
    (restore1,) = [e for e in h.drain() if isinstance(e, RestoreJob)]
    h.finish(restore1, nbytes=50)
    granted = [e for e in h.drain() if isinstance(e, GrantLock)]
    assert sorted((e.group, e.job, e.restored, e.switched) for e in granted) == [
        ("s", "sampler", True, True),
        ("t", "trainer", True, True),
    ]


@pytest.mark.parametrize("how", ["cancel", "timeout", "close", "exit"])
def test_one_member_leaving_withdraws_the_whole_gang(harness: Make, how: str) -> None:
    h, s = pools(harness)
    h.acquire(s["s2"])
    h.drain()
    rid_t = h.acquire(s["trainer"], 5.0, gang="g", members=2)
    rid_s = h.acquire(s["sampler"], gang="g", members=2)
    if how == "cancel":
        h.cancel(s["trainer"], rid_t)
    elif how == "timeout":
        h.timers(5.0)
    elif how == "close":
        h.close(s["trainer"])
    else:
        h.exit("trainer")
    failed = {e.ticket: e.error for e in h.drain() if isinstance(e, FailRequest)}
    assert isinstance(failed[(s["sampler"], rid_s)], errors.AcquireCancelled)
    assert "gang 'g'" in failed[(s["sampler"], rid_s)].message
    assert h.queue("t") == [] and h.queue("s") == [] and h.s.queues.gangs == {}
    h.release(s["s2"])
    assert h.drain() == []  # nobody waits any more: the sampler was not granted alone


def test_a_gang_not_yet_complete_withdraws_too(harness: Make) -> None:
    h, s = pools(harness)
    rid = h.acquire(s["trainer"], gang="g", members=3)
    h.cancel(s["trainer"], rid)
    assert h.s.queues.gangs == {} and h.queue("t") == []


def test_crossed_gangs_do_not_deadlock(harness: Make) -> None:
    """G1 and G2 both span t and s, their members arriving crossed (t: G1 first, s: G2 first).
    Each group orders them by when each was complete, so G2 (complete first) goes, then G1."""
    h, s = pools(harness)
    h.acquire(s["trainer"], gang="G1", members=2)
    h.acquire(s["s2"], gang="G2", members=2)
    h.acquire(s["t2"], gang="G2", members=2)
    assert grants(h) == {"t": "t2", "s": "s2"}
    h.acquire(s["sampler"], gang="G1", members=2)
    h.release(s["t2"])
    assert grants(h) == {}  # G1 waits whole for s
    h.release(s["s2"])
    assert grants(h) == {"t": "trainer", "s": "sampler"}


def test_gangs_rank_under_the_groups_policy(harness: Make) -> None:
    h = harness(FOUR, queue_policies={"*": QueuePolicy("priority")})
    hold = h.register("H", "t", (0,))
    low = h.register("low", "t", (0,))
    trainer = h.register("trainer", "t", (0,), priority=3)
    sampler = h.register("sampler", "s", (1,))
    h.acquire(hold)
    h.acquire(low)
    h.acquire(trainer, gang="g", members=2)
    h.acquire(sampler, gang="g", members=2)
    h.drain()
    h.release(hold)
    assert grants(h) == {"t": "trainer", "s": "sampler"}


@pytest.mark.parametrize(
    ("setup", "event", "match"),
    [
        ("", AcquireRequested(0, 99, gang="g", members=0), "1 to 64"),
        ("", AcquireRequested(0, 99, gang="g", members=65), "1 to 64"),
        ("member", AcquireRequested(0, 99, gang="g", members=3), "has 2 members"),
        ("member", AcquireRequested(-1, 99, gang="g", members=2), "already has a member in group 't'"),
        ("holds", AcquireRequested(0, 99, gang="g", members=2), "holds group 't' already"),
        ("waits", AcquireRequested(0, 99, gang="g", members=2), "already waits"),
        ("gang-waits", AcquireRequested(0, 99), "as a member of gang 'g'"),
        ("shared", AcquireRequested(0, 99, gang="g", members=2), "shares GPUs"),
    ],
)
def test_bad_gang_acquires_change_nothing(harness: Make, setup: str, event: AcquireRequested, match: str) -> None:
    h, s = pools(harness)
    sampler, t2 = s["sampler"], s["t2"]
    session = sampler
    if setup == "member":
        h.acquire(s["trainer"], gang="g", members=2)
    if setup == "member" and event.session == -1:
        session = t2
    if setup == "holds":
        h.acquire(s["trainer"])
        session = s["trainer"]
    if setup in ("waits", "gang-waits"):
        h.acquire(s["s2"])
        if setup == "waits":
            h.acquire(sampler)
        else:
            h.acquire(sampler, gang="g", members=2)
    if setup == "shared":
        other = h.register("other", "u", (1,))
        h.acquire(s["sampler"], gang="g", members=2)
        session = other
    h.drain()
    h.fails(
        AcquireRequested(session, event.request_id, gang=event.gang, members=event.members), errors.BadRequest, match
    )


def test_a_complete_gang_id_is_not_taken_again(harness: Make) -> None:
    h, s = pools(harness)
    h.acquire(s["s2"])
    h.acquire(s["trainer"], gang="solo", members=1)
    assert grants(h) == {"s": "s2", "t": "trainer"}  # a gang of one is an ordinary acquire
    h.release(s["trainer"])
    h.acquire(s["trainer"], gang="g", members=2)
    h.acquire(s["sampler"], gang="g", members=2)  # complete; waits for s
    h.fails(AcquireRequested(s["t2"], 500, gang="g", members=2), errors.BadRequest, "complete already")
    h.release(s["s2"])
    assert grants(h) == {"t": "trainer", "s": "sampler"}
    h.release(s["trainer"])
    h.release(s["sampler"])
    h.acquire(s["trainer"], gang="g", members=2)  # done with: the id is free again
    h.acquire(s["sampler"], gang="g", members=2)
    assert grants(h) == {"t": "trainer", "s": "sampler"}


def test_gangs_ranked_crossed_by_priority_do_not_deadlock(harness: Make) -> None:
    """Under ``priority``, G1 ranks first in t (its trainer is higher) and G2 first in s: were both
    chosen, each would wait for the other's group for ever. Only the gang complete first (G1) is a
    candidate in a group both wait in, so G1 goes, then G2."""
    h = harness(FOUR, queue_policies={"*": QueuePolicy("priority", aging_s=1000.0)})
    holders = {"t": h.register("ht", "t", (0,)), "s": h.register("hs", "s", (1,))}
    t_hi, t_lo = h.register("t_hi", "t", (0,), priority=5), h.register("t_lo", "t", (0,))
    s_hi, s_lo = h.register("s_hi", "s", (1,), priority=5), h.register("s_lo", "s", (1,))
    for s in holders.values():
        h.acquire(s)
    h.acquire(t_hi, gang="G1", members=2)
    h.acquire(s_lo, gang="G1", members=2)
    h.acquire(t_lo, gang="G2", members=2)
    h.acquire(s_hi, gang="G2", members=2)
    h.drain()
    h.release(holders["t"])
    h.release(holders["s"])
    assert grants(h) == {"t": "t_hi", "s": "s_lo"}
    h.release(t_hi)
    h.release(s_lo)
    assert grants(h) == {"t": "t_lo", "s": "s_hi"}


def crossing(harness: Make, party_s: str = "P") -> tuple[Harness, dict[str, int]]:
    """Party P holds ``t`` with job ``pt``; gang G (``gt``, ``gs``) waits for ``t`` and keeps ``s``."""
    h = harness(FOUR)
    s = {
        "pt": h.register("pt", "t", (0,), party="P"),
        "ps": h.register("ps", "s", (1,), party=party_s),
        "gt": h.register("gt", "t", (0,)),
        "gs": h.register("gs", "s", (1,)),
    }
    h.acquire(s["pt"])
    assert grants(h) == {"t": "pt"}
    h.acquire(s["gt"], gang="G", members=2)
    h.acquire(s["gs"], gang="G", members=2)
    assert h.holder("s") is None and h.drain() == []  # the gang keeps free ``s`` while it waits for ``t``
    return h, s


def test_a_party_that_holds_a_gangs_group_goes_before_the_gang_in_another(harness: Make) -> None:
    """A process that holds the trainers' group and asks for the samplers' by a single acquire would
    wait for a gang that waits for the trainers' group: it goes first, and the gang after it."""
    h, s = crossing(harness)
    h.acquire(s["ps"])
    effects = h.drain()
    assert {e.group: e.job for e in effects if isinstance(e, GrantLock)} == {"s": "ps"}
    (notice,) = [e for e in effects if isinstance(e, NotifyJob) and e.event == "policy"]
    assert notice.job == "ps" and notice.data["passed"] == "gs" and notice.data["gang"] == "G"
    assert "holds group 't'" in str(notice.data["reason"])
    h.release(s["ps"])
    assert h.holder("s") is None and h.drain() == []  # the gang still waits for ``t``
    h.release(s["pt"])
    assert grants(h) == {"t": "gt", "s": "gs"}


def test_a_single_acquire_of_another_party_does_not_pass_a_gang(harness: Make) -> None:
    """The same acquire from a process that holds none of the gang's groups waits behind the gang
    (and were ``pt`` waiting for ``ps``, this is the deadlock the party rule breaks)."""
    h, s = crossing(harness, party_s="Q")
    h.acquire(s["ps"])
    assert h.holder("s") is None and h.drain() == []
    h.release(s["pt"])
    assert grants(h) == {"t": "gt", "s": "gs"}
    h.release(s["gs"])
    assert grants(h) == {"s": "ps"}


def test_a_party_that_let_its_group_go_no_longer_passes(harness: Make) -> None:
    h, s = crossing(harness)
    h.close(s["pt"])  # its session ends: it holds nothing, and its party is forgotten
    assert grants(h) == {"t": "gt", "s": "gs"}
    assert set(h.s.registry.parties) == {s["ps"]}
    h.acquire(s["ps"])
    assert h.holder("s") == "gs" and h.drain() == []


def refusals(effects: list[object]) -> list[FailRequest]:
    return [e for e in effects if isinstance(e, FailRequest)]


def test_a_party_passes_a_gang_once_per_wait_and_is_refused_the_second_time(harness: Make) -> None:
    """Party P holds ``t``, asks ``s`` (it passes the gang), lets ``t`` go and asks ``t`` while it holds
    ``s``: that second pass in one wait of the gang would let it pass for ever (it always holds one of
    the gang's groups), and behind the gang it would deadlock, so it is refused at once."""
    h, s = crossing(harness)
    h.acquire(s["ps"])
    assert grants(h) == {"s": "ps"}  # the first pass
    assert h.s.queues.gangs["G"].passes == {"P": ("s", h.s.queues.gangs["G"].passes["P"][1])}
    h.release(s["pt"])
    assert h.holder("t") is None and h.drain() == []  # the gang takes free ``t`` and waits for ``s``
    h.acquire(s["pt"])
    effects = h.drain()
    (failed,) = refusals(effects)
    assert h.s.sessions[failed.ticket[0]] == "pt" and isinstance(failed.error, errors.GangWaiting)
    message = failed.error.message
    for named in ("'pt'", "group 't'", "holds group 's'", "gang 'G'", "groups s, t", "Release group 's'", "gang("):
        assert named in message, (named, message)
    assert failed.error.code == "gang_waiting" and failed.error.details["gang_groups"] == ["s", "t"]
    (notice,) = [e for e in effects if isinstance(e, NotifyJob) and e.event == "policy"]
    assert (notice.job, notice.data["refused"], notice.data["gang"], notice.data["passed"]) == (
        "pt",
        "gang_waiting",
        "G",
        "gt",
    )
    assert h.queue("t") == ["gt"] and not [e for e in effects if isinstance(e, GrantLock)]
    h.release(s["ps"])  # the party lets its last group go: the gang goes
    assert grants(h) == {"t": "gt", "s": "gs"}
    assert h.s.queues.gangs == {}


def test_a_party_that_alternates_its_groups_no_longer_starves_a_gang(harness: Make) -> None:
    """The trainer/sampler hand-off of one party, hold one group while asking the other, every round:
    the gang is granted in the first round (it used to be passed every time, for ever)."""
    h, s = crossing(harness)
    rounds = []
    for _ in range(5):
        h.acquire(s["ps"])
        h.release(s["pt"])
        h.acquire(s["pt"])
        h.release(s["ps"])
        rounds.append(grants(h))
        if rounds[-1]:
            break
    assert rounds == [{"t": "gt", "s": "gs"}]


def test_each_party_passes_a_gang_once(harness: Make) -> None:
    """Passes are counted per party: another party's first pass in the same wait is let."""
    h = harness(FOUR)
    s = {
        "pt": h.register("pt", "t", (0,), party="P"),
        "ps": h.register("ps", "s", (1,), party="P"),
        "qu": h.register("qu", "u", (2,), party="Q"),
        "qs": h.register("qs", "s", (1,), party="Q"),
        "gt": h.register("gt", "t", (0,)),
        "gs": h.register("gs", "s", (1,)),
        "gu": h.register("gu", "u", (2,)),
    }
    h.acquire(s["pt"])
    h.acquire(s["qu"])
    for m in ("gt", "gs", "gu"):
        h.acquire(s[m], gang="G", members=3)
    assert grants(h) == {"t": "pt", "u": "qu"}
    h.acquire(s["ps"])
    h.acquire(s["qs"])  # Q's pass in ``s`` too, while P's is under way
    assert grants(h) == {"s": "ps"}
    assert sorted(h.s.queues.gangs["G"].passes) == ["P"]
    h.release(s["ps"])
    assert grants(h) == {"s": "qs"}  # Q's first pass
    assert sorted(h.s.queues.gangs["G"].passes) == ["P", "Q"]
    h.release(s["qs"])
    h.release(s["pt"])
    h.release(s["qu"])
    assert grants(h) == {"t": "gt", "s": "gs", "u": "gu"}


@pytest.mark.parametrize("ends", ["granted", "withdrawn"])
def test_the_pass_count_restarts_with_the_gangs_next_wait(harness: Make, ends: str) -> None:
    h, s = crossing(harness)
    h.acquire(s["ps"])
    h.release(s["ps"])
    h.drain()
    if ends == "granted":
        h.release(s["pt"])
        assert grants(h) == {"t": "gt", "s": "gs"}
        h.release(s["gt"])
        h.release(s["gs"])
        h.acquire(s["pt"])
        assert grants(h) == {"t": "pt"}
    else:
        h.cancel(s["gs"], next(t[1] for w in h.s.groups["s"].queue for t in w.tickets))
        assert len(refusals(h.drain())) == 2  # ``gt`` fails too: the gang is withdrawn whole
    h.acquire(s["gt"], gang="G", members=2)  # the same gang's next wait
    h.acquire(s["gs"], gang="G", members=2)
    assert h.s.queues.gangs["G"].passes == {}
    h.acquire(s["ps"])
    assert grants(h) == {"s": "ps"}  # P may pass it once again (were the count kept, this would be refused)


def test_the_acquire_that_passed_is_not_refused_when_it_is_chosen_again(harness: Make) -> None:
    """The passing acquire waits for room (a holder of another group on its GPU) and is chosen again
    once that holder yields: it is the same pass, so it goes on (it is not a second one)."""
    h = harness(FOUR)
    ps = h.register("ps", "s", (1,), party="P")
    h.acquire(ps)
    h.alloc(ps, 60, 1)
    h.release(ps)
    x = h.register("x", "x", (1,))
    h.acquire(x)
    h.drain()
    h.alloc(x, 60, 1)  # parks idle ``ps`` for its room
    (snap,) = only(h.drain(), SnapshotJob)
    h.finish(snap, nbytes=60)
    h.drain()
    pt, gt, gs = h.register("pt", "t", (0,), party="P"), h.register("gt", "t", (0,)), h.register("gs", "s", (1,))
    h.acquire(pt)
    h.acquire(gt, gang="G", members=2)
    h.acquire(gs, gang="G", members=2)
    assert grants(h) == {"t": "pt"}
    h.acquire(ps)  # passes the gang in ``s``, and waits for ``x``'s room
    assert h.s.groups["s"].blocked == "ps" and h.queue("s") == ["ps", "gs"]
    assert [e.event for e in h.drain()] == ["policy"]  # the pass, told once
    h.release(x)
    effects = h.drain()
    assert not refusals(effects) and not only(effects, NotifyJob)  # chosen again: the same pass, not told again
    (snap,) = only(effects, SnapshotJob)  # ``x`` is parked for it
    h.finish(snap, nbytes=60)
    (restore,) = only(h.drain(), RestoreJob)
    h.finish(restore)
    assert grants(h) == {"s": "ps"}


def test_a_party_that_let_all_of_the_gangs_groups_go_may_pass_it_again(harness: Make) -> None:
    """A party's pass is forgotten once it holds none of the gang's groups: its next pass is not the
    endless one. Here ``priority`` grants ``pt`` before the gang's member while the gang waits for
    ``s`` (a loner holds it), so P holds ``t`` again and passes in ``s`` a second time."""
    h = harness(FOUR, queue_policies={"*": QueuePolicy("priority", aging_s=1000.0)})
    s = {
        "pt": h.register("pt", "t", (0,), party="P", priority=1),
        "ps": h.register("ps", "s", (1,), party="P"),
        "lone": h.register("lone", "s", (1,), priority=1),
        "gt": h.register("gt", "t", (0,)),
        "gs": h.register("gs", "s", (1,)),
    }
    h.acquire(s["pt"])
    h.acquire(s["gt"], gang="G", members=2)
    h.acquire(s["gs"], gang="G", members=2)
    h.acquire(s["ps"])
    assert grants(h) == {"t": "pt", "s": "ps"}  # the first pass
    h.acquire(s["lone"])
    h.release(s["ps"])
    assert grants(h) == {"s": "lone"}  # by priority
    h.release(s["pt"])  # P holds none of the gang's groups now: its pass is forgotten
    assert h.s.queues.gangs["G"].passes == {} and h.drain() == []
    h.acquire(s["pt"])
    assert grants(h) == {"t": "pt"}  # by priority, before ``gt`` (which waits for ``s``)
    h.acquire(s["ps"])
    h.release(s["lone"])
    effects = h.drain()
    assert not refusals(effects) and {e.group: e.job for e in effects if isinstance(e, GrantLock)} == {"s": "ps"}
    h.release(s["ps"])
    h.release(s["pt"])
    assert grants(h) == {"t": "gt", "s": "gs"}


def passer_waiting_for_room(harness: Make) -> tuple[Harness, dict[str, int]]:
    """Party P holds ``t``; gang G waits for ``t`` and keeps ``s``; P's ``ps`` asks for ``s``, passes the
    gang, and waits for room that the holder ``x`` of another group on GPU 1 takes."""
    h = harness(FOUR)
    s = {"ps": h.register("ps", "s", (1,), party="P"), "x": h.register("x", "x", (1,))}
    s["ps2"] = h.register("ps", "s", (1,), party="P")  # another process of ``ps``, of the same party
    h.acquire(s["ps"])
    h.alloc(s["ps"], 60, 1)
    h.release(s["ps"])
    h.acquire(s["x"])
    h.drain()
    h.alloc(s["x"], 60, 1)  # parks idle ``ps`` for its room
    (snap,) = only(h.drain(), SnapshotJob)
    h.finish(snap, nbytes=60)
    h.drain()
    s |= {"pt": h.register("pt", "t", (0,), party="P"), "gt": h.register("gt", "t", (0,))}
    s["gs"] = h.register("gs", "s", (1,))
    h.acquire(s["pt"])
    h.acquire(s["gt"], gang="G", members=2)
    h.acquire(s["gs"], gang="G", members=2)
    assert grants(h) == {"t": "pt"}
    return h, s


@pytest.mark.parametrize("how", ["timeout", "cancel", "closed"])
def test_a_pass_whose_acquire_stops_waiting_before_its_grant_is_forgotten(harness: Make, how: str) -> None:
    """The pass is counted when its acquire is chosen: one that then waits for room and gives up never
    went before the gang, so the party's next ask is a first pass again, not refused (``GangWaiting``)."""
    h, s = passer_waiting_for_room(harness)
    rid = h.acquire(s["ps"], deadline=h.now + 5.0)
    assert h.s.groups["s"].blocked == "ps" and h.queue("s") == ["ps", "gs"]
    assert [e.event for e in h.drain()] == ["policy"]  # the pass, told
    assert list(h.s.queues.gangs["G"].passes) == ["P"]
    if how == "timeout":
        h.timers(h.now + 5.0)
    elif how == "cancel":
        h.cancel(s["ps"], rid)
    else:
        h.close(s["ps"])
    h.drain()
    assert h.s.queues.gangs["G"].passes == {} and h.holder("s") is None and h.holder("t") == "pt"
    h.acquire(s["ps2"])  # P asks again, still holding ``t``
    effects = h.drain()
    assert not refusals(effects) and [e.event for e in only(effects, NotifyJob)] == ["policy"]  # a first pass
    assert h.s.groups["s"].blocked == "ps" and h.queue("s") == ["ps", "gs"]
    h.release(s["x"])
    (snap,) = only(h.drain(), SnapshotJob)
    h.finish(snap, nbytes=60)
    (restore,) = only(h.drain(), RestoreJob)
    h.finish(restore)
    assert grants(h) == {"s": "ps"}
    h.release(s["ps2"])
    h.release(s["pt"])
    assert grants(h) == {"t": "gt", "s": "gs"}


def test_a_pass_stays_while_its_acquire_has_a_request_of_the_party(harness: Make) -> None:
    """Two processes of the party wait on the passing place: one giving up leaves the pass to the other
    (the party still goes before the gang), and it goes with the party's last request, even though the
    place still waits for a request of another party's process (which does not pass the gang)."""
    h, s = passer_waiting_for_room(harness)
    s["psq"] = h.register("ps", "s", (1,), party="Q")  # ``ps``'s process of another party
    first = h.acquire(s["ps"])
    second = h.acquire(s["ps2"])
    h.drain()
    passes = dict(h.s.queues.gangs["G"].passes)
    assert list(passes) == ["P"]
    h.cancel(s["ps"], first)
    assert h.s.queues.gangs["G"].passes == passes and h.queue("s") == ["ps", "gs"]
    h.acquire(s["psq"])
    h.cancel(s["ps2"], second)
    assert h.s.queues.gangs["G"].passes == {}
    assert h.queue("s") == ["gs", "ps"]  # Q holds none of the gang's groups: its request waits behind the gang
    assert [(f.ticket, type(f.error)) for f in refusals(h.drain())] == [
        ((s["ps"], first), errors.AcquireCancelled),
        ((s["ps2"], second), errors.AcquireCancelled),
    ]
