"""The peer protocol at its boundary: round trips are exact, and every wrong field is refused by name.

Each sample below fills every field of its message (lists and maps not empty), so the sweep that
replaces each value in its wire map by one of another type reaches every field, nested ones too.
The range table then goes past the end of each field's range.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest

from timesliced.cluster.asks import (
    Acquire,
    Alloc,
    Cancel,
    Closed,
    Freed,
    Gone,
    HostRead,
    Measured,
    MoveDone,
    Register,
    Registered,
    Release,
    WireError,
)
from timesliced.cluster.messages import (
    Allotted,
    Elect,
    Failed,
    Grant,
    GrantInfo,
    MalformedPeerMessage,
    Move,
    Note,
    Notify,
    PeerMessage,
    Queued,
    Ready,
    Report,
    Req,
    Res,
    Resync,
    Span,
    Sync,
    message_from_wire,
)
from timesliced.cluster.report import (
    NodeReport,
    ReportedHolder,
    ReportedJob,
    ReportedSession,
    ReportedTurn,
    ReportedWait,
)
from timesliced.core import election
from timesliced.core.location import Location
from timesliced.wire.codec import HEADER, decode_body, encode

ERA = (3, 2)
REPORT = NodeReport(
    devices={0: 100, 1: 80},
    sessions=(ReportedSession(4, "job-a", (11, 12), "host:11:5e"),),
    jobs=(
        ReportedJob(
            "job-a", "pool", True, Location.PARKED, {0: 60}, "it broke", (0, 101), True, memory={0: 64}, memory_each=32
        ),
    ),
    holders=(ReportedHolder("pool", "job-a", 7, (4, 5)),),
    waiting=(ReportedWait(4, 9, 12, 3, 2.5, "sync", 2),),
    fences={"pool": 7},
    turns=(ReportedTurn("job-a", -1, 0, 30.0),),
)
INFO = GrantInfo("pool", "job-a", 7, 0.5, 1.25, True, 3)
SAMPLES: dict[str, PeerMessage] = {
    "elect pre_vote": Elect(election.PreVote(4, "b")),
    "elect pre_vote_reply": Elect(election.PreVoteReply(4, True)),
    "elect request_vote": Elect(election.RequestVote(4, "b")),
    "elect vote_reply": Elect(election.VoteReply(4, False)),
    "elect heartbeat": Elect(election.Heartbeat(4, "b", 1.5)),
    "elect heartbeat_reply": Elect(election.HeartbeatReply(4, 1.5)),
    "sync": Sync(ERA),
    "resync": Resync(ERA),
    "report": Report(ERA, REPORT),
    "ready": Ready(ERA),
    "req register": Req(
        ERA,
        1,
        Register(
            4,
            9,
            "job-a",
            "pool",
            (0, 1),
            (11,),
            True,
            {"session": 4, "park": "sim"},
            memory={0: 1024},
            memory_each=2048,
            party="host:11:5e",
        ),
    ),
    "req acquire": Req(ERA, 2, Acquire(4, 10, 30.0, "sync", 2)),
    "req cancel": Req(ERA, 3, Cancel(4, 11, 10)),
    "req release": Req(ERA, 4, Release(4, 12)),
    "req alloc": Req(ERA, 5, Alloc(4, 13, 1, 64, 60)),
    "note closed": Note(ERA, Closed(4)),
    "note freed": Note(ERA, Freed("job-a", 1, 64)),
    "note gone": Note(ERA, Gone("job-a")),
    "note move_done": Note(ERA, MoveDone(17, False, 64, 0.5, "it broke", True, "insufficient_host_memory")),
    "note measured": Note(ERA, Measured("job-a", {0: 4096, 1: 2048})),
    "note host_read": Note(
        ERA, HostRead(-5, 300, {"cgroup:/a": 70}, {"job-a": ("cgroup:/a",)}, {"job-a": 64}, {"host": "MemAvailable"})
    ),
    "res register": Res(ERA, 1, "register", Registered("job-a", "pool", (0, 101), Location.RESIDENT)),
    "res release": Res(ERA, 4, "release", {"group": "pool", "fence": 7, "held_s": 1.5, "tags": ["x", None]}),
    "res error": Res(ERA, 2, "acquire", error=WireError("not_holder", "no", {"group": "pool"})),
    "grant": Grant(ERA, ((4, 10), (5, 3)), INFO, True),
    "fail": Failed(ERA, 4, 10, WireError("job_faulted", "job 'job-a' is faulted")),
    "queued": Queued(ERA, 4, 10, 12),
    "notify": Notify(ERA, "job-a", "faulted", {"reason": "it broke", "until_resync": True}),
    "move": Move(ERA, 17, "restore", "job-a", (15, 16)),
    "span": Span(ERA, "pool", (0, 101)),
    "alloc": Allotted(ERA, 4, 13, "job-a", 1, 64, 60),
}
PLAIN = {"result", "extra", "details", "data"}  # plain data: a peer passes it on to a client as it is
KEYED = {
    "devices",
    "footprint",
    "held",
    "fences",
    "pools",
    "members",
    "sizes",
    "source",
    "memory",
}  # maps keyed by data, not names
OPTIONAL = {
    "gpus",
    "timeout",
    "seq",
    "deadline_in",
    "limit",
    "memory",
    "memory_each",
    "gang",
}  # fields that may be null


def wire(message: PeerMessage) -> dict[str, Any]:
    """As the transport carries it: through msgpack and back."""
    frame = encode(message.to_wire())
    return decode_body(frame[HEADER.size :])


def refused(value: Any, *names: str) -> str:
    with pytest.raises(MalformedPeerMessage) as info:
        message_from_wire(value)
    text = str(info.value)
    for name in names:
        assert name in text, f"{text!r} does not name {name!r}"
    return text


# --- round trips ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_a_message_comes_back_as_it_was_sent(name: str) -> None:
    message = SAMPLES[name]
    data = wire(message)
    assert message_from_wire(data) == message
    assert message_from_wire(data).to_wire() == message.to_wire() == data


def test_every_kind_of_message_and_ask_has_a_sample() -> None:
    from timesliced.cluster import messages

    assert {m.K for m in SAMPLES.values()} == {cls.K for cls in messages.MESSAGES}
    asked = {m.request.OP for m in SAMPLES.values() if isinstance(m, Req)}
    noted = {m.notice.OP for m in SAMPLES.values() if isinstance(m, Note)}
    assert asked == set(messages.REQUESTS) and noted == set(messages.NOTICES)


def test_the_wire_keeps_its_keys() -> None:
    assert wire(SAMPLES["req acquire"]) == {
        "k": "req",
        "era": [3, 2],
        "id": 2,
        "op": "acquire",
        "args": {"conn": 4, "rid": 10, "timeout": 30.0, "gang": "sync", "members": 2},
    }
    assert wire(SAMPLES["grant"]) == {
        "k": "grant",
        "era": [3, 2],
        "tickets": [[4, 10], [5, 3]],
        "info": {
            "group": "pool",
            "job": "job-a",
            "fence": 7,
            "waited_s": 0.5,
            "switch_s": 1.25,
            "restored": True,
            "term": 3,
        },
        "again": True,
    }
    assert wire(SAMPLES["res error"])["error"] == {"code": "not_holder", "message": "no", "details": {"group": "pool"}}
    assert "details" not in wire(SAMPLES["fail"])["error"]  # as errors.to_wire writes it
    report = wire(SAMPLES["report"])["report"]
    assert report["devices"] == {"0": 100, "1": 80} and report["jobs"][0]["footprint"] == {"0": 60}
    assert report["jobs"][0]["location"] == "parked"


# --- every field of another type is refused, by name --------------------------------------------


def plain(name: str) -> set[str]:
    return PLAIN - {"result"} if name == "res register" else PLAIN  # a register's result is typed


def leaves(value: Any, skip: set[str], path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """Every value in a wire map with its path (lists and maps too), but not inside ``skip`` fields."""
    if path and path[-1] in skip:
        yield path, value
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if k != "k":
                yield from leaves(v, skip, (*path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from leaves(v, skip, (*path, i))
    if path:
        yield path, value


def replaced(data: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(data, dict):
        return {**data, head: replaced(data[head], rest, value)}
    return [replaced(v, rest, value) if i == head else v for i, v in enumerate(data)]


def others(value: Any) -> list[Any]:
    """Values of other wire types than ``value``'s (an int passes for a float: not offered)."""
    if isinstance(value, bool):
        return [1, "true"]
    if isinstance(value, int):
        return ["7", 7.5, True]
    if isinstance(value, float):
        return ["7.0", True, [7.0]]
    if isinstance(value, str):
        return [7, [value]]
    if isinstance(value, list):
        return ["x", {}]
    if isinstance(value, dict):
        return ["x", []]
    return ["x", 7]  # null


def field_name(path: tuple[Any, ...]) -> str:
    """The last field name on ``path`` (a map key of a KEYED map names its map)."""
    names = [p for i, p in enumerate(path) if isinstance(p, str) and (i == 0 or path[i - 1] not in KEYED)]
    return "elect.m" if path[0] == "m" else names[-1]


SWEEP = [
    (name, path, bad)
    for name, message in sorted(SAMPLES.items())
    for path, value in leaves(message.to_wire(), plain(name))
    if path[-1] not in plain(name)
    for bad in others(value)
]


def test_the_sweep_reaches_every_field() -> None:
    assert len(SWEEP) > 300
    swept = {field_name(path) for _, path, _ in SWEEP}
    assert {"era", "tickets", "info", "waited_s", "report", "footprint", "kept_for", "args", "nbytes", "op"} <= swept


@pytest.mark.parametrize(
    ("name", "path", "bad"), SWEEP, ids=[f"{n}:{'.'.join(map(str, p))}={b!r}" for n, p, b in SWEEP]
)
def test_a_field_of_another_type_is_refused_by_name(name: str, path: tuple[Any, ...], bad: Any) -> None:
    data = replaced(SAMPLES[name].to_wire(), path, bad)
    refused(data, field_name(path) if path != ("op",) else "op")


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_a_missing_field_is_refused_by_name(name: str) -> None:
    data = SAMPLES[name].to_wire()
    for path, _ in leaves(data, plain(name)):
        if isinstance(path[-1], str) and path[-1] != "details" and (len(path) < 2 or path[-2] not in KEYED):
            refused(_without(data, path), field_name(path))


def _without(data: Any, path: tuple[Any, ...]) -> Any:
    head, rest = path[0], path[1:]
    if not rest:
        return {k: v for k, v in data.items() if k != head}
    if isinstance(data, dict):
        return {**data, head: _without(data[head], rest)}
    return [_without(v, rest) if i == head else v for i, v in enumerate(data)]


# --- ranges ----------------------------------------------------------------------------------------

MAX = (1 << 63) - 1
RANGES = [
    # (sample, path, bad value, the field the error names)
    ("sync", ("era",), [3], "era"),
    ("sync", ("era",), [3, 2, 1], "era"),
    ("sync", ("era", 0), -1, "era"),
    ("sync", ("era", 1), MAX + 1, "era"),
    ("req acquire", ("id",), 0, "id"),
    ("req acquire", ("op",), "frobnicate", "op"),
    ("req acquire", ("args", "conn"), -1, "conn"),
    ("req acquire", ("args", "conn"), 1 << 40, "conn"),
    ("req acquire", ("args", "rid"), -1, "rid"),
    ("req acquire", ("args", "timeout"), -1.0, "timeout"),
    ("req acquire", ("args", "timeout"), math.inf, "timeout"),
    ("req acquire", ("args", "timeout"), math.nan, "timeout"),
    ("req register", ("args", "job"), "", "job"),
    ("req register", ("args", "job"), "j" * 257, "job"),
    ("req register", ("args", "group"), "", "group"),
    ("req register", ("args", "gpus", 0), -1, "gpus"),
    ("req register", ("args", "pids", 0), -1, "pids"),
    ("req register", ("args", "extra"), "x", "extra"),
    ("req register", ("args", "extra"), {"a": math.nan}, "extra"),
    ("req register", ("args", "extra"), {"a": {"b": object()}}, "extra"),
    ("req alloc", ("args", "nbytes"), 0, "nbytes"),
    ("req alloc", ("args", "requested"), 0, "requested"),
    ("req cancel", ("args", "request"), -1, "request"),
    ("note freed", ("args", "nbytes"), -1, "nbytes"),
    ("note freed", ("op",), "acquire", "op"),  # a request is not a notice
    ("note move_done", ("args", "op"), -1, "op"),
    ("note move_done", ("args", "seconds"), math.inf, "seconds"),
    ("res register", ("op",), "teleport", "op"),
    ("res register", ("result", "gpus"), [-1], "gpus"),
    ("res register", ("result", "location"), "moon", "location"),
    ("res register", ("result",), None, "result"),
    ("res release", ("result",), {"held_s": math.inf}, "result"),
    ("res release", ("result",), {"deep": [[[[[[[[[1]]]]]]]]]}, "result"),
    ("res error", ("error",), {"message": "no"}, "code"),
    ("res error", ("error", "details"), [], "details"),
    ("res release", ("result",), {1: 2}, "result"),
    ("grant", ("tickets", 0), [4], "tickets"),
    ("grant", ("tickets", 0, 0), 1 << 40, "tickets"),
    ("grant", ("info", "fence"), -1, "fence"),
    ("grant", ("info", "waited_s"), math.nan, "waited_s"),
    ("grant", ("info", "group"), "", "group"),
    ("fail", ("rid",), -1, "rid"),
    ("queued", ("seq",), 0, "seq"),
    ("notify", ("event",), "", "event"),
    ("notify", ("data",), "x", "data"),
    ("notify", ("data",), {"reason": math.inf}, "data"),
    ("move", ("kind",), "teleport", "kind"),
    ("move", ("op",), -1, "op"),
    ("span", ("gpus", 0), -1, "gpus"),
    ("alloc", ("gpu",), 100, "gpu"),  # a node's GPU index is below 100 (core/ids.py)
    ("alloc", ("nbytes",), 0, "nbytes"),
    ("report", ("report", "devices"), {"100": 80}, "devices"),
    ("report", ("report", "devices"), {"x": 80}, "devices"),
    ("report", ("report", "devices"), {"-1": 80}, "devices"),
    ("report", ("report", "devices", "0"), -1, "devices"),
    ("report", ("report", "jobs", 0, "location"), "moon", "location"),
    ("report", ("report", "jobs", 0, "footprint"), {"0": -5}, "footprint"),
    ("report", ("report", "jobs", 0, "footprint"), {"01x": 5}, "footprint"),
    ("report", ("report", "holders", 0, "conns", 0), 1 << 40, "conns"),
    ("report", ("report", "waiting", 0, "seq"), -1, "seq"),
    ("report", ("report", "waiting", 0, "deadline_in"), -0.5, "deadline_in"),
    ("report", ("report", "turns", 0, "seq"), -2, "seq"),
    ("report", ("report", "turns", 0, "kept_for"), math.nan, "kept_for"),
    ("report", ("report", "fences"), {"": 3}, "fences"),
    ("elect heartbeat", ("m", "term"), 0, "elect.m"),
    ("elect heartbeat", ("m", "type"), "coup", "elect.m"),
]


@pytest.mark.parametrize(("name", "path", "bad", "field"), RANGES, ids=[f"{n}:{f}={b!r}" for n, _, b, f in RANGES])
def test_a_field_out_of_its_range_is_refused_by_name(name: str, path: tuple[Any, ...], bad: Any, field: str) -> None:
    refused(replaced(SAMPLES[name].to_wire(), path, bad), field)


@pytest.mark.parametrize(
    "value",
    [None, [], "sync", {}, {"k": None}, {"k": "coup", "era": [1, 1]}, {"k": ["sync"]}],
    ids=repr,
)
def test_what_is_no_message_at_all_is_refused(value: Any) -> None:
    refused(value)


def test_unknown_keys_are_ignored() -> None:
    assert message_from_wire({**SAMPLES["ready"].to_wire(), "later": 1}) == SAMPLES["ready"]


def test_a_message_of_a_wrong_shape_built_here_is_refused_where_it_is_read() -> None:
    """Building is not checked at run time (it is on the lock's path; mypy checks the types): the reader is."""
    for wrong, field in [
        (Queued(ERA, 4, 10, 0), "seq"),
        (Span(ERA, "pool", (0, -1)), "gpus"),
        (Res(ERA, 1, "register", {"gpus": [0]}), "result"),  # a register's result is a Registered
    ]:
        with pytest.raises(MalformedPeerMessage, match=field):
            message_from_wire(wire(wrong))
