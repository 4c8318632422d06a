"""The pieces of a streamed offload swap, without a daemon: the relay's room, the client's room, the executor."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from typing import Any

import pytest

from timesliced import errors
from timesliced.backends.offload import Relay
from timesliced.client.directives import Room, Rooms, run_directive
from timesliced.client.offload import HostDeviceMemory, Offloader

MiB = 1 << 20
R = 2 * MiB  # one region of the fake memory


def relay(free: dict[int, int] | None = None) -> tuple[Relay, list[tuple[int, dict[str, Any]]]]:
    sent: list[tuple[int, dict[str, Any]]] = []
    r = Relay(free or {})
    r.attach(lambda directive, data: sent.append((directive, data)))
    return r, sent


# --- the relay (daemon side) ---------------------------------------------------------------------


def test_the_free_room_goes_at_once_and_freed_room_as_it_comes() -> None:
    r, sent = relay({0: 2 * R})
    assert r.incoming(7, {0: 4 * R}).room == {0: 2 * R}
    assert r.handed == 0
    r.freed({0: R})
    assert sent == [(7, {"room": {"0": R}})] and r.handed == R
    r.freed({0: 3 * R})  # more than it needs: it gets its need, the rest waits for another
    assert sent[-1] == (7, {"room": {"0": R}}) and r.granted[7] == {0: 4 * R}


def test_room_goes_to_the_processes_in_order_each_up_to_its_need_and_per_gpu() -> None:
    r, sent = relay()
    assert r.incoming(1, {0: R, 1: R}).room == {}
    assert r.incoming(2, {0: 2 * R}).room == {}
    r.freed({0: 2 * R, 1: R})
    assert sent == [(1, {"room": {"0": R, "1": R}}), (2, {"room": {"0": R}})]
    r.left(1)
    r.freed({1: R})  # nobody left needs GPU 1
    assert len(sent) == 2


def test_a_process_whose_need_is_unknown_takes_all_there_is() -> None:
    r, sent = relay({0: R})
    assert r.incoming(1, None).room == {0: R}
    r.freed({0: 5 * R})
    assert sent == [(1, {"room": {"0": 5 * R}})]


def test_rest_and_cancel_go_once_to_the_processes_still_at_work() -> None:
    r, sent = relay()
    r.incoming(1, {0: R})
    r.incoming(2, {0: R})
    r.left(1)
    r.rest()
    r.rest()
    r.freed({0: R})  # after the end no more room is relayed
    assert sent == [(2, {"rest": True})] and r.ended
    r.cancel("cut short")  # a rest lifts the limit; a cancel still calls off what maps
    r.cancel("again")
    r.rest()  # and nothing lifts a cancel
    assert sent[1:] == [(2, {"cancel": "cut short"})] and r.cancelled


def test_a_rest_never_follows_a_cancel() -> None:
    r, sent = relay()
    r.incoming(1, {0: R})
    r.cancel("the park failed")
    r.rest()
    assert sent == [(1, {"cancel": "the park failed"})]


@pytest.mark.parametrize(
    ("end", "opening"),
    [
        (lambda r: r.rest(), ({0: R}, {"rest": True})),  # the room there is, and no limit: a lone unpark
        (lambda r: r.cancel("the park failed"), ({}, {"cancel": "the park failed"})),  # no room, the cancel
        (lambda r: None, ({0: R}, None)),  # the relay runs on: room only
    ],
    ids=["rest", "cancel", "running"],
)
def test_an_unpark_told_after_the_relay_ended_gets_the_end_with_its_directive(end: Any, opening: Any) -> None:
    r, sent = relay({0: R})
    end(r)
    got = r.incoming(1, {0: 4 * R})
    assert (got.room, got.end) == opening
    assert sent == []  # it goes with the directive, not before it
    r.freed({0: R})
    r.rest()
    if opening[1] is not None:
        assert sent == []  # nothing follows an end
    else:
        assert sent == [(1, {"room": {"0": R}}), (1, {"rest": True})]


def test_room_freed_before_an_unpark_is_told_is_granted_as_it_is_told() -> None:
    r, sent = relay({0: R})
    r.freed({0: 2 * R})
    assert r.incoming(1, {0: 2 * R}).room == {0: 2 * R} and r.handed == R  # free room first
    assert r.incoming(2, None).room == {0: R} and r.handed == 2 * R
    assert sent == []


def test_an_unpark_told_while_the_park_is_held_back_gets_free_room_only() -> None:
    r, sent = relay({0: R})
    r.freed({0: R})  # nobody took it yet: an undo of the park re-maps into it
    r.holding = True
    assert r.incoming(1, None).room == {0: R} and r.handed == 0
    assert sent == []


def test_an_unpark_that_fails_in_one_process_is_called_off_in_the_others() -> None:
    r, sent = relay()
    for directive in (1, 2, 3):
        r.incoming(directive, {0: R})
    r.left(1)  # answered, fine
    assert sent == [] and not r.ended
    r.left(2, "the connection closed before it carried out the offload")
    assert sent == [
        (
            3,
            {
                "cancel": "another process of the unpark failed (the connection closed before it "
                "carried out the offload)"
            },
        )
    ]
    r.left(3, "the streamed unpark was called off: ...")  # its own answer calls nobody off again
    assert len(sent) == 1


def test_an_unpark_is_called_off_when_one_process_fails_even_after_the_limit_was_lifted() -> None:
    r, sent = relay()
    r.incoming(1, {0: R})
    r.incoming(2, {0: R})
    r.rest()
    r.left(1, "copy failed")  # the unpark is undone anyway: process 2 need not map the rest
    assert sent == [
        (1, {"rest": True}),
        (2, {"rest": True}),
        (2, {"cancel": "another process of the unpark failed (copy failed)"}),
    ]


def test_room_freed_after_a_failed_park_is_held_back() -> None:
    r, sent = relay()
    r.incoming(1, {0: 4 * R})
    r.holding = True
    r.freed({0: R})
    assert sent == [] and r.handed == 0


def test_what_is_granted_never_exceeds_the_free_room_plus_what_was_freed() -> None:
    rng = random.Random(14)
    for _ in range(200):
        free = {g: rng.randrange(0, 4) * R for g in range(2)}
        r, _sent = relay(free)
        freed = dict.fromkeys(range(2), 0)
        for directive in range(rng.randrange(1, 4)):
            need = None if rng.random() < 0.2 else {g: rng.randrange(0, 6) * R for g in range(2)}
            r.incoming(directive, need)
        for _ in range(rng.randrange(0, 8)):
            g = rng.randrange(2)
            freed[g] += R
            r.freed({g: R})
            if rng.random() < 0.1:
                r.left(rng.randrange(3))
        for g in range(2):
            total = sum(grants.get(g, 0) for grants in r.granted.values())
            assert total <= free[g] + freed[g]
        assert r.handed <= sum(freed.values())


def test_in_any_order_every_process_at_work_learns_the_end_and_no_rest_follows_a_cancel() -> None:
    """The relay's calls in random order: registrations before and after progress, ends and failures."""
    rng = random.Random(19)
    for _ in range(300):
        free = {0: rng.randrange(0, 3) * R}
        r, sent = relay(free)
        told: dict[int, list[dict[str, Any]]] = {}  # directive -> what reached it, in order
        freed, at_work, failed = 0, set(), False
        steps = ["rest", "cancel", "freed", "freed", "incoming", "incoming", "incoming", "left", "fail", "hold"]
        for _ in range(rng.randrange(1, 12)):
            step = rng.choice(steps)
            if step == "incoming":
                directive = len(told)
                opening = r.incoming(directive, None if rng.random() < 0.3 else {0: rng.randrange(1, 4) * R})
                told[directive] = [{"room": opening.room}] + ([opening.end] if opening.end else [])
                at_work.add(directive)
            elif step == "freed":
                freed += R
                r.freed({0: R})
            elif step in ("left", "fail") and at_work:
                directive = rng.choice(sorted(at_work))
                at_work.discard(directive)
                failed = failed or step == "fail"
                r.left(directive, "copy failed" if step == "fail" else None)
            elif step == "rest":
                r.rest()
            elif step == "cancel":
                r.cancel("cut short")
            elif step == "hold":
                r.holding = True
            for directive, data in sent:
                told[directive].append(data)
            sent.clear()
        assert sum(g.get(0, 0) for g in r.granted.values()) <= free[0] + freed
        for directive in at_work:  # whoever still maps was told how the relay ended
            ends = [sorted(d) for d in told[directive] if "room" not in d]
            if not r.ended:
                assert ends == []
            elif not r.cancelled:
                assert ends == [["rest"]]
            else:  # one cancel, last: perhaps after a rest, never before one
                assert ends in ([["cancel"]], [["rest"], ["cancel"]])
        assert not failed or r.cancelled  # a failed unpark calls the others off


# --- the room (client side) ----------------------------------------------------------------------


def test_a_take_waits_for_its_room_and_a_call_off_ends_the_wait() -> None:
    room = Room({0: R})
    room.take(0, R)
    assert not room.fits(0, R) and not room.fits(1, 1)
    got: list[str] = []
    t = threading.Thread(target=lambda: (room.take(0, R), got.append("took")))
    t.start()
    t.join(0.05)
    assert got == []  # no room yet
    room.grant({0: R})
    t.join(5)
    assert got == ["took"]
    room.end("the daemon went away")
    with pytest.raises(errors.BackendError, match="called off: the daemon went away"):
        room.take(0, 0)


def test_an_open_room_has_no_limit() -> None:
    room = Room()
    room.open()
    room.take(3, 1 << 40)
    room.wait_open()


def test_a_call_off_after_the_limit_was_lifted_stops_the_next_take() -> None:
    room = Room()
    room.open()
    room.take(0, R)
    room.end("another process of the unpark failed (copy failed)")  # the daemon's cancel after its rest
    with pytest.raises(errors.BackendError, match="called off: another process") as caught:
        room.take(0, R)
    assert caught.value.details["cancelled"]


def test_the_rooms_of_a_client_follow_its_pushes_and_end_with_its_connection() -> None:
    rooms = Rooms()
    rooms.opened(1, {"directive": 4, "action": "unpark", "room": {"0": R}})
    rooms.opened(1, {"directive": 5, "action": "park", "stream": True})  # a park has no room
    assert rooms.room(1, 5) is None
    room = rooms.room(1, 4)
    assert room is not None and room.fits(0, R) and not room.fits(0, 2 * R)
    assert rooms.room(2, 4) is None  # another connection's directive 4 is another directive
    rooms.relayed(1, {"directive": 4, "room": {"0": R, "x": 5, "1": -1}})  # what is not a GPU's bytes is left out
    assert room.fits(0, 2 * R) and not room.fits(1, 1)
    rooms.relayed(2, {"directive": 4, "rest": True})  # not this connection's: its room stays limited
    assert not room.fits(0, 3 * R)
    rooms.relayed(1, {"directive": 99, "rest": True})  # over already: nothing to do
    rooms.lost("connection reset", 1)
    with pytest.raises(errors.BackendError, match="connection reset"):
        room.take(0, 1)
    rooms.closed(1, 4)
    assert rooms.room(1, 4) is None


def test_a_room_lives_and_dies_with_its_own_connection() -> None:
    """A restarted daemon numbers its directives afresh: directive 1 of connection 2 is not that of connection 1."""
    rooms = Rooms()
    rooms.opened(1, {"directive": 1, "room": {"0": 0}})  # daemon A's unpark 1, streamed
    old = rooms.room(1, 1)
    rooms.lost("the daemon closed the connection", 1)  # A dies; the worker's take raises, it puts regions back
    rooms.opened(2, {"directive": 1, "room": {"0": 0}})  # restarted daemon B's own unpark 1, queued behind it
    new = rooms.room(2, 1)
    assert old is not None and new is not None and new is not old
    rooms.closed(1, 1)  # the old worker's finally (ShellBase._directive)
    assert rooms.room(2, 1) is new, "B's unpark 1 finds no room: it would run unlimited (room=None)"
    rooms.lost("an old connection's end, read late", 1)
    assert new.fits(0, 0), "an old connection's end ends no room of a newer one"
    rooms.lost("the client closed")  # every connection
    assert not new.fits(0, 0)


def test_a_room_opened_for_a_connection_already_gone_is_ended_at_once() -> None:
    rooms = Rooms()
    rooms.lost("the daemon closed the connection", 3)
    rooms.opened(2, {"directive": 7, "room": {"0": R}})  # read before the end, carried out after it
    room = rooms.room(2, 7)
    assert room is not None
    with pytest.raises(errors.BackendError, match="the daemon closed the connection"):
        room.take(0, 1)
    rooms.opened(4, {"directive": 7, "room": {"0": R}})  # the next connection's
    assert rooms.room(4, 7) is not None and rooms.room(4, 7).fits(0, R)  # type: ignore[union-attr]


# --- the executor ----------------------------------------------------------------------------------


def traced(regions: int = 3) -> tuple[Offloader, list[tuple[str, int]], list[Any]]:
    events: list[tuple[str, int]] = []
    memory = HostDeviceMemory(gpus=1, trace=lambda event, gpu, n: events.append((event, n)))
    off = Offloader(memory)
    mine = [off.alloc(R, tag="w") for _ in range(regions)]
    for i, r in enumerate(mine):
        r.write(bytes([i + 1]) * 16)
    events.clear()
    return off, events, mine


def test_a_streamed_park_frees_each_region_before_it_says_so() -> None:
    off, events, _ = traced()
    off.park(freed=lambda gpus: events.append(("freed", gpus[0])))
    assert events == [("unmap", R), ("freed", R)] * 3
    assert off.resident() == {}


def test_a_streamed_park_that_fails_part_way_rolls_nothing_back() -> None:
    off, _events, mine = traced()
    calls = {"n": 0}
    unmap = off.memory.unmap

    def failing(va: int, nbytes: int) -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            raise errors.BackendError("unmap fell over")
        unmap(va, nbytes)

    off.memory.unmap = failing  # type: ignore[method-assign]
    told: list[dict[int, int]] = []
    with pytest.raises(errors.BackendError, match="unmap fell over") as err:
        off.park(freed=told.append)
    assert told == [{0: R}]  # only the region that was freed
    assert err.value.details["parked"] == [mine[0].name]
    assert err.value.details["resident"] == [mine[1].name, mine[2].name]
    off.memory.unmap = unmap  # type: ignore[method-assign]
    off.park()  # finishing it parks the rest
    off.unpark()
    assert [r.read(0, 16) for r in mine] == [bytes([i + 1]) * 16 for i in range(3)]


def test_a_streamed_unpark_maps_only_into_the_room_it_was_granted() -> None:
    off, events, mine = traced()
    off.park()
    events.clear()
    room = Room({0: R})
    done = threading.Event()
    t = threading.Thread(target=lambda: (off.unpark(room=room), done.set()))
    t.start()
    for granted in (1, 2):
        t.join(0.05)
        assert [e for e in events if e[0] == "map"] == [("map", R)] * granted and not done.is_set()
        room.grant({0: R})
    t.join(5)
    assert done.is_set() and [r.read(0, 16) for r in mine] == [bytes([i + 1]) * 16 for i in range(3)]


def test_a_streamed_unpark_that_is_called_off_leaves_every_region_parked() -> None:
    off, _events, mine = traced()
    off.park()
    room = Room({0: R})
    room_end = threading.Timer(0.05, room.end, ("the park failed",))
    room_end.start()
    with pytest.raises(errors.BackendError, match="called off: the park failed") as err:
        off.unpark(room=room)
    room_end.join()
    assert err.value.details["parked"] == [r.name for r in mine]
    assert off.resident() == {} and off.memory.used_bytes() == 0
    off.unpark()  # nothing was lost
    assert mine[2].read(0, 16) == bytes([3]) * 16


class Whole:
    """An executor that cannot stream: it unparks all at once."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def park(self, tags: Any = (), *, verify: bool | None = None) -> dict[str, Any]:
        self.calls.append("park")
        return {"nbytes": 1}

    def unpark(self, tags: Any = (), *, verify: bool | None = None) -> dict[str, Any]:
        self.calls.append("unpark")
        return {"nbytes": 1}


def test_an_executor_that_cannot_stream_unparks_once_the_park_ended_and_parks_as_ever() -> None:
    executor = Whole()
    room = Room({0: 10 * R})
    answers: list[dict[str, Any]] = []
    t = threading.Thread(
        target=lambda: answers.append(run_directive(executor, {"directive": 1, "action": "unpark"}, room=room))
    )
    t.start()
    t.join(0.05)
    assert executor.calls == []  # free room is not enough: it maps all at once, so it waits for the rest
    room.open()
    t.join(5)
    assert executor.calls == ["unpark"] and answers[0]["ok"]
    told: list[Any] = []
    park = {"directive": 2, "action": "park", "stream": True}
    assert run_directive(executor, park, freed=told.append)["ok"] and told == []


# --- the daemon's side: the backend's swap over the directives, connections faked ------------------


class Conn:
    """A job process's connection as the directives see it: it records what is pushed to it."""

    def __init__(self, conn_id: int) -> None:
        self.id = conn_id
        self.pushed: list[tuple[str, dict[str, Any]]] = []

    def push(self, event: str, data: dict[str, Any]) -> None:
        self.pushed.append((event, data))

    def directives(self, action: str | None = None) -> list[dict[str, Any]]:
        return [d for e, d in self.pushed if e == "offload" and action in (None, d["action"])]

    def rooms(self) -> list[dict[str, Any]]:
        return [d for e, d in self.pushed if e == "offload_room"]


def swap_setup(jobs: dict[str, list[Conn]] | None = None, direct: Any = None) -> tuple[Any, Conn, Conn, Any]:
    """Job ``a`` swapped out for ``b``; ``jobs``: each job's connections (read at each directive, as
    the daemon does); ``direct(directives)``: the backend's directives instead of the daemon's."""
    from timesliced.backends.base import JobTarget
    from timesliced.backends.offload import OffloadBackend
    from timesliced.daemon.directives import Directives
    from timesliced.wire.park import ParkSpec

    a, b = Conn(1), Conn(2)
    conns = jobs if jobs is not None else {"a": [a], "b": [b]}
    directives = Directives(lambda job: list(conns[job]))
    backend = OffloadBackend(directives.direct if direct is None else direct(directives))
    spec = ParkSpec("offload")
    targets = (JobTarget("a", (0,), (), spec), JobTarget("b", (0,), (), spec))
    return directives, a, b, (backend, targets)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def answer(directives: Any, conn: Conn, directive: dict[str, Any], **kw: Any) -> None:
    directives.answered(conn, {"directive": directive["directive"], **kw}, {0})


def test_the_backend_relays_each_freed_region_to_the_restore_and_lifts_the_limit_at_the_end() -> None:
    async def body() -> None:
        directives, a, b, (backend, (out, in_)) = swap_setup()
        swap = asyncio.ensure_future(backend.swap(out, in_))
        await settle()
        (park,), (unpark,) = a.directives("park"), b.directives("unpark")
        assert park["stream"] and unpark["room"] == {}  # no free room read on a simulated GPU
        directives.progressed(a, {"directive": park["directive"], "freed": {"0": R}}, {0})
        assert b.rooms() == [{"directive": unpark["directive"], "room": {"0": R}}]
        answer(directives, a, park, ok=True, nbytes=2 * R, footprint={"0": 2 * R})
        await settle()
        assert b.rooms()[-1] == {"directive": unpark["directive"], "rest": True}
        answer(directives, b, unpark, ok=True, nbytes=2 * R, footprint={"0": 2 * R})
        result = await swap
        assert result.park.nbytes == 2 * R and result.restore.nbytes == 2 * R

    asyncio.run(body())


def test_a_park_refused_before_any_room_went_on_is_undone_and_the_restore_called_off() -> None:
    async def body() -> None:
        directives, a, b, (backend, (out, in_)) = swap_setup()
        swap = asyncio.ensure_future(backend.swap(out, in_))
        await settle()
        (park,), (unpark,) = a.directives("park"), b.directives("unpark")
        answer(directives, a, park, ok=False, error="copy failed")
        await settle()
        (undo,) = a.directives("unpark")  # the lone park's undo
        answer(directives, a, undo, ok=True, nbytes=0)
        await settle()
        assert b.rooms() == [{"directive": unpark["directive"], "cancel": unpark_cancel(b)}]
        answer(directives, b, unpark, ok=False, error="the streamed unpark was called off: ...")
        await settle()
        (repark,) = b.directives("park")  # the restore's undo
        answer(directives, b, repark, ok=True, nbytes=0)
        result = await swap
        assert isinstance(result.park, errors.ParkRefused) and isinstance(result.restore, errors.RestoreRefused)
        assert "could not be parked" in str(result.restore)

    asyncio.run(body())


def unpark_cancel(conn: Conn) -> str:
    return str(conn.rooms()[0].get("cancel"))


def test_a_park_that_fails_after_room_went_on_is_finished() -> None:
    async def body() -> None:
        directives, a, b, (backend, (out, in_)) = swap_setup()
        swap = asyncio.ensure_future(backend.swap(out, in_))
        await settle()
        (park,), (unpark,) = a.directives("park"), b.directives("unpark")
        directives.progressed(a, {"directive": park["directive"], "freed": {"0": R}}, {0})
        answer(directives, a, park, ok=False, error="unmap failed")
        await settle()
        with pytest.raises(errors.BadRequest, match="no offload directive"):  # its answer came: it is over
            directives.progressed(a, {"directive": park["directive"], "freed": {"0": R}}, {0})
        (again,) = a.directives("park")[1:]
        assert "stream" not in again  # finishing: a plain park
        answer(directives, a, again, ok=True, nbytes=R)
        await settle()
        assert b.rooms() == [
            {"directive": unpark["directive"], "room": {"0": R}},
            {"directive": unpark["directive"], "rest": True},
        ]
        answer(directives, b, unpark, ok=True, nbytes=2 * R)
        result = await swap
        assert result.park.nbytes >= R and result.restore.nbytes == 2 * R

    asyncio.run(body())


def test_a_swap_cut_short_calls_the_unpark_off() -> None:
    async def body() -> None:
        _directives, _a, b, (backend, (out, in_)) = swap_setup()
        swap = asyncio.ensure_future(backend.swap(out, in_))
        await settle()
        (unpark,) = b.directives("unpark")
        swap.cancel()
        with pytest.raises(asyncio.CancelledError):
            await swap
        assert b.rooms() == [{"directive": unpark["directive"], "cancel": "the swap was cut short"}]

    asyncio.run(body())


# --- the order of the two halves never matters ---------------------------------------------------


def test_a_swap_whose_outgoing_job_has_no_connection_lifts_the_unpark_limit_at_once() -> None:
    """The park fails before the unpark is told; the unpark still learns the limit is gone."""

    async def body() -> None:
        b = Conn(2)
        directives, _a, _b, (backend, (out, in_)) = swap_setup({"a": [], "b": [b]})
        swap = asyncio.ensure_future(backend.swap(out, in_))
        await settle()
        (unpark,) = b.directives("unpark")
        assert unpark["room"] == {}  # no free room read (simulated GPU): it may map nothing by room alone
        assert b.rooms() == [{"directive": unpark["directive"], "rest": True}]  # right after its directive
        assert b.pushed[0][0] == "offload"  # the client opens the room on the directive, then lifts it
        answer(directives, b, unpark, ok=True, nbytes=2 * R, footprint={"0": 2 * R})
        result = await swap
        assert isinstance(result.park, errors.BackendError) and not errors.state_intact(result.park)
        assert "no connection" in str(result.park)
        assert result.restore.nbytes == 2 * R  # the intact job came in

    asyncio.run(body())


def test_a_park_refused_before_the_unpark_is_told_calls_the_unpark_off_with_its_directive() -> None:
    def direct(directives: Any) -> Any:
        async def refusing(job: str, action: str, args: dict[str, Any], *, relay: Relay | None = None) -> Any:
            if job == "a" and action == "park" and relay is not None:
                raise errors.ParkRefused("job 'a' is in a phase that cannot park; the daemon retries later")
            return await directives.direct(job, action, args, relay=relay)

        return refusing

    async def body() -> None:
        directives, _a, b, (backend, (out, in_)) = swap_setup(direct=direct)
        swap = asyncio.ensure_future(backend.swap(out, in_))
        await settle()
        (unpark,) = b.directives("unpark")
        ((_, cancel),) = [(d, c) for d, c in b.pushed if d == "offload_room"]
        assert cancel["directive"] == unpark["directive"] and "cannot park" in cancel["cancel"]
        answer(directives, b, unpark, ok=False, error=f"the streamed unpark was called off: {cancel['cancel']}")
        await settle()
        (repark,) = b.directives("park")  # the restore's undo
        answer(directives, b, repark, ok=True, nbytes=0)
        result = await swap
        assert isinstance(result.park, errors.ParkRefused) and isinstance(result.restore, errors.RestoreRefused)
        assert "could not be parked" in str(result.restore)

    asyncio.run(body())


def test_an_incoming_process_that_disconnects_calls_the_unpark_off_in_the_others_at_once() -> None:
    async def body() -> None:
        a, b1, b2 = Conn(1), Conn(2), Conn(3)
        jobs = {"a": [a], "b": [b1, b2]}
        directives, _a, _b, (backend, (out, in_)) = swap_setup(jobs)
        swap = asyncio.ensure_future(backend.swap(out, in_))
        await settle()
        (park,), (u1,), _ = a.directives("park"), b1.directives("unpark"), b2.directives("unpark")
        jobs["b"].remove(b2)  # the daemon forgets a closed connection in the step it closes
        directives.connection_closed(b2.id)
        # The park still runs, but process 1 need not wait for room: the unpark is undone anyway.
        (cancel,) = b1.rooms()
        assert cancel["directive"] == u1["directive"] and "connection closed" in cancel["cancel"]
        directives.progressed(a, {"directive": park["directive"], "freed": {"0": R}}, {0})
        answer(directives, a, park, ok=True, nbytes=R, footprint={"0": R})
        await settle()
        assert b1.rooms() == [cancel]  # neither room nor rest follows the call-off
        answer(directives, b1, u1, ok=False, error=f"the streamed unpark was called off: {cancel['cancel']}")
        await settle()
        (repark,) = b1.directives("park")
        answer(directives, b1, repark, ok=True, nbytes=0)
        result = await swap
        assert result.park.nbytes == R  # the park went on
        # A process gone cannot say where its memory is: the job is faulted, and the error names why
        # (the failed process, not the first one, which was only called off).
        assert isinstance(result.restore, errors.BackendError) and not errors.state_intact(result.restore)
        assert "failed: the connection closed before it carried out the offload" in str(result.restore)

    asyncio.run(body())


# --- directive numbers across daemon restarts -------------------------------------------------------


def sent_directives(directives: Any, conn: Conn, n: int) -> list[int]:
    """``n`` parks told to ``conn`` and answered; their numbers."""

    async def body() -> list[int]:
        for _ in range(n):
            park = asyncio.ensure_future(directives.direct("a", "park", {"tags": []}))
            await settle()
            answer(directives, conn, conn.directives()[-1], ok=True, nbytes=0)
            await park
        return [d["directive"] for d in conn.directives()]

    return asyncio.run(body())


def test_a_restarted_daemon_numbers_its_directives_above_the_ones_before() -> None:
    from timesliced.daemon.directives import Directives

    before = time.time_ns() // 1000
    a = Conn(1)
    old = Directives(lambda job: [a])
    numbers = sent_directives(old, a, 3)
    assert numbers[0] >= before and numbers == list(range(numbers[0], numbers[0] + 3)) and old.last == numbers[-1]
    # The restart, a while later: its numbers start from the clock, above the old daemon's (which
    # sent fewer directives than microseconds it ran). From 1, as they did, they would repeat.
    b = Conn(1)
    restarted = Directives(lambda job: [b], first=numbers[0] + 1_000_000)
    assert restarted.last == 0
    assert sent_directives(restarted, b, 1)[0] > max(numbers)


def test_directive_numbers_fit_the_wire_and_json() -> None:
    from timesliced.daemon.directives import Directives
    from timesliced.wire.codec import decode_body, encode

    a = Conn(1)
    (first,) = sent_directives(Directives(lambda job: [a]), a, 1)
    assert first < 2**53  # exact as a JSON number (a status page, a log line read by a tool)
    assert decode_body(encode({"directive": first})[4:]) == {"directive": first}
