"""The wire codec, message validation and the error mapping (pure)."""

from __future__ import annotations

import itertools
import struct
from typing import Any

import msgpack  # type: ignore[import-untyped]
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from timesliced import errors
from timesliced.wire.codec import DEFAULT_MAX_FRAME, HEADER, FrameDecoder, decode_body, encode
from timesliced.wire.messages import (
    MAX_REQUEST_ID,
    Push,
    Reply,
    Request,
    arg_int,
    arg_int_list,
    arg_opt_float,
    arg_str,
    parse_incoming,
    parse_request,
    request_id_of,
)


def frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def packed(obj: Any) -> bytes:
    return frame(msgpack.packb(obj, use_bin_type=True))


MESSAGES: list[dict[str, Any]] = [
    {},
    {"id": 1, "op": "acquire", "args": {"timeout": 2.5}},
    {"id": MAX_REQUEST_ID, "ok": True, "result": {"fence": 7, "restored": False, "waited_s": 0.0}},
    {"id": 3, "ok": False, "error": {"code": "not_holder", "message": "no", "details": {"gpu": 0}}},
    {"push": "faulted", "data": {"job": "ünïcode ✓", "reason": None}},
    {"blob": b"\x00\xff" * 100, "nested": [[1, [2, [3]]], {"k": [True, False, None]}], "neg": -(1 << 63)},
]


# --- framing ----------------------------------------------------------------------------


@pytest.mark.parametrize("message", MESSAGES)
def test_round_trip(message: dict[str, Any]) -> None:
    data = encode(message)
    assert data[: HEADER.size] == struct.pack(">I", len(data) - HEADER.size)
    assert FrameDecoder().feed(data) == [message]
    assert decode_body(data[HEADER.size :]) == message


def test_frame_split_byte_by_byte() -> None:
    message = MESSAGES[3]
    data = encode(message)
    decoder = FrameDecoder()
    for i, byte in enumerate(data[:-1]):
        assert decoder.feed(bytes([byte])) == []
        assert decoder.pending == i + 1
    assert decoder.feed(data[-1:]) == [message]
    assert decoder.pending == 0


def test_several_frames_in_one_chunk() -> None:
    data = b"".join(encode(m) for m in MESSAGES)
    tail = encode(MESSAGES[1])
    decoder = FrameDecoder()
    assert decoder.feed(data + tail[:5]) == MESSAGES
    assert decoder.pending == 5
    assert decoder.feed(tail[5:]) == [MESSAGES[1]]
    assert decoder.feed(b"") == []


def test_empty_feed() -> None:
    decoder = FrameDecoder()
    assert decoder.feed(b"") == []
    assert decoder.feed(b"\x00\x00") == []  # half a header: wait for the rest
    assert decoder.pending == 2


def test_encode_refuses_oversized_frames() -> None:
    body_len = len(msgpack.packb({"x": "a" * 100}))
    assert len(encode({"x": "a" * 100}, max_frame=body_len)) == body_len + HEADER.size
    with pytest.raises(errors.FrameTooLarge, match=f"frame of {body_len} B exceeds the limit of {body_len - 1} B"):
        encode({"x": "a" * 100}, max_frame=body_len - 1)


def test_frame_of_exactly_the_limit_is_accepted() -> None:
    data = encode({"x": "a" * 100})
    limit = len(data) - HEADER.size
    assert FrameDecoder(limit).feed(data) == [{"x": "a" * 100}]
    with pytest.raises(errors.FrameTooLarge):
        FrameDecoder(limit - 1).feed(data)


def test_oversized_header_is_rejected_before_the_body_arrives() -> None:
    decoder = FrameDecoder(max_frame=1000)
    assert decoder.feed(encode({"ok": 1})) == [{"ok": 1}]
    with pytest.raises(errors.FrameTooLarge, match="frame of 1001 B exceeds the limit of 1000 B"):
        decoder.feed(struct.pack(">I", 1001))  # the header alone
    with pytest.raises(errors.FrameTooLarge):
        FrameDecoder().feed(b"\xff\xff\xff\xff")
    assert DEFAULT_MAX_FRAME == 1 << 20


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (b"", "not valid msgpack"),
        (b"\xc1", "not valid msgpack"),  # a byte msgpack never uses
        (b"\x82\xa1a\x01", "not valid msgpack"),  # a map cut short
        (msgpack.packb({"a": 1}) + b"\x00", "not valid msgpack"),  # trailing bytes in the frame
        (msgpack.packb({1: "int key"}), "not valid msgpack"),
        (b"\x91" * 100_000 + b"\xc0", "not valid msgpack"),  # nested too deep
        (msgpack.packb([1, 2]), "holds a list, expected a map"),
        (msgpack.packb(7), "holds a int, expected a map"),
        (msgpack.packb("hello"), "holds a str, expected a map"),
        (msgpack.packb(None), "holds a NoneType, expected a map"),
        (msgpack.packb(b"raw", use_bin_type=True), "holds a bytes, expected a map"),
    ],
)
def test_malformed_bodies(body: bytes, match: str) -> None:
    with pytest.raises(errors.MalformedMessage, match=match):
        decode_body(body)
    decoder = FrameDecoder()
    with pytest.raises(errors.MalformedMessage, match=match):
        decoder.feed(frame(body))


@pytest.mark.parametrize(
    "bad",
    [frame(b"\xc1"), packed([1]), struct.pack(">I", DEFAULT_MAX_FRAME + 1)],
    ids=["malformed", "not-a-map", "oversized"],
)
def test_decoder_stays_broken_after_an_error(bad: bytes) -> None:
    decoder = FrameDecoder()
    with pytest.raises(errors.ProtocolError):
        decoder.feed(bad)
    for data in (encode({"fine": True}), b""):
        with pytest.raises(errors.MalformedMessage, match="already failed"):
            decoder.feed(data)


def test_frame_error_classes_are_protocol_errors() -> None:
    assert issubclass(errors.FrameTooLarge, errors.ProtocolError)
    assert issubclass(errors.MalformedMessage, errors.ProtocolError)
    assert issubclass(errors.BadRequest, errors.ProtocolError)


# --- requests, replies, pushes ----------------------------------------------------------


def test_parse_request() -> None:
    assert parse_request({"id": 0, "op": "ping"}) == Request(0, "ping", {})
    assert parse_request({"id": 5, "op": "acquire", "args": {"timeout": 1}}) == Request(5, "acquire", {"timeout": 1})
    request = Request(9, "release", {"x": [1]})
    assert parse_request(decode_body(encode(request.to_wire())[HEADER.size :])) == request


@pytest.mark.parametrize(
    ("message", "match", "named_id"),
    [
        ({"op": "ping"}, "'id' must be", None),
        ({"id": "1", "op": "ping"}, "'id' must be", None),
        ({"id": 1.0, "op": "ping"}, "'id' must be", None),
        ({"id": True, "op": "ping"}, "'id' must be", None),
        ({"id": False, "op": "ping"}, "'id' must be", None),
        ({"id": -1, "op": "ping"}, "'id' must be", None),
        ({"id": MAX_REQUEST_ID + 1, "op": "ping"}, "'id' must be", None),
        ({"id": None, "op": "ping"}, "'id' must be", None),
        ({"id": 4}, "'op' must be", 4),
        ({"id": 4, "op": ""}, "'op' must be", 4),
        ({"id": 4, "op": 7}, "'op' must be", 4),
        ({"id": 4, "op": b"ping"}, "'op' must be", 4),
        ({"id": 4, "op": "ping", "args": [1]}, "'args' must be a map", 4),
        ({"id": 4, "op": "ping", "args": None}, "'args' must be a map", 4),
        ({"id": 4, "op": "ping", "args": "x"}, "'args' must be a map", 4),
    ],
)
def test_parse_request_rejects(message: dict[str, Any], match: str, named_id: int | None) -> None:
    with pytest.raises(errors.BadRequest, match=match) as info:
        parse_request(message)
    assert info.value.details.get("id") == named_id
    assert request_id_of(message) == named_id


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        ({"id": 0}, 0),
        ({"id": 12, "op": 3}, 12),
        ({"id": True}, None),
        ({"id": -3}, None),
        ({"id": 1.5}, None),
        ({}, None),
    ],
)
def test_request_id_of(message: dict[str, Any], expected: int | None) -> None:
    assert request_id_of(message) == expected


def test_parse_incoming_replies_and_pushes() -> None:
    assert parse_incoming({"id": 3, "ok": True, "result": {"a": 1}}) == Reply(3, True, {"a": 1})
    assert parse_incoming({"id": 3, "ok": True}) == Reply(3, True, None)
    reply = parse_incoming({"id": 4, "ok": False, "error": {"code": "not_holder", "message": "nope"}})
    assert isinstance(reply, Reply) and not reply.ok
    assert isinstance(reply.error, errors.NotHolder) and reply.error.message == "nope"
    assert parse_incoming({"push": "faulted", "data": {"reason": "x"}}) == Push("faulted", {"reason": "x"})
    assert parse_incoming({"push": "lock_lost"}) == Push("lock_lost", {})
    # a reply whose error is not a map still surfaces as an error, not a crash
    odd = parse_incoming({"id": 5, "ok": False, "error": "boom"})
    assert isinstance(odd, Reply) and isinstance(odd.error, errors.ProtocolError)


@pytest.mark.parametrize(
    "message",
    [
        {"id": True, "ok": True},  # bool ids would answer request 1
        {"id": False, "ok": True},
        {"id": "3", "ok": True},
        {"id": None, "ok": True},
        {"ok": True},
        {"id": 3},
        {"id": 3, "ok": 1},
        {"id": 3, "ok": "true"},
        {"push": 7, "data": {}},
        {"push": "faulted", "data": [1]},
        {"push": "faulted", "data": None},
    ],
)
def test_parse_incoming_rejects(message: dict[str, Any]) -> None:
    with pytest.raises(errors.MalformedMessage):
        parse_incoming(message)


def test_reply_and_push_round_trip() -> None:
    decoder = FrameDecoder()
    ok = Reply(1, True, {"fence": 2})
    bad = Reply(2, False, error=errors.OutOfMemory("GPU 0 is full", gpu=0))
    push = Push("faulted", {"job": "a"})
    got = [parse_incoming(m) for m in decoder.feed(b"".join(encode(x.to_wire()) for x in (ok, bad, push)))]
    assert got[0] == ok and got[2] == push
    assert isinstance(got[1], Reply) and isinstance(got[1].error, errors.OutOfMemory)
    assert got[1].error.message == "GPU 0 is full" and got[1].error.details == {"gpu": 0}


# --- argument helpers ----------------------------------------------------------------------


def test_arg_str() -> None:
    assert arg_str({"job": "a"}, "job") == "a"
    assert arg_str({}, "job", default="x") == "x"
    for args in ({}, {"job": ""}, {"job": 1}, {"job": None}, {"job": b"a"}):
        with pytest.raises(errors.BadRequest, match="'job' must be a non-empty string"):
            arg_str(args, "job")
    with pytest.raises(errors.BadRequest, match="longer than 3"):
        arg_str({"job": "abcd"}, "job", max_len=3)


def test_arg_int() -> None:
    assert arg_int({"n": 3}, "n") == 3
    assert arg_int({}, "n", default=0) == 0
    for args in ({}, {"n": -1}, {"n": True}, {"n": 1.0}, {"n": "1"}):
        with pytest.raises(errors.BadRequest, match="'n' must be an integer >= 0"):
            arg_int(args, "n")
    with pytest.raises(errors.BadRequest, match=">= 1"):
        arg_int({"n": 0}, "n", minimum=1)


def test_arg_opt_float() -> None:
    assert arg_opt_float({}, "t") is None
    assert arg_opt_float({"t": None}, "t") is None
    assert arg_opt_float({"t": 2}, "t") == 2.0
    assert arg_opt_float({"t": 0.5}, "t") == 0.5
    for value in (-0.1, float("nan"), float("inf"), True, "1"):
        with pytest.raises(errors.BadRequest, match="finite number >= 0"):
            arg_opt_float({"t": value}, "t")


def test_arg_int_list() -> None:
    assert arg_int_list({}, "gpus") is None
    assert arg_int_list({"gpus": [0, 2]}, "gpus") == [0, 2]
    for value in ([-1], [True], [1.0], "01", (0,), [0, 1, 2]):
        with pytest.raises(errors.BadRequest, match="list of at most 2"):
            arg_int_list({"gpus": value}, "gpus", max_len=2)


# --- errors across the wire --------------------------------------------------------------

# The codes are part of the protocol: renaming one breaks older clients.
STABLE_CODES = {
    errors.TimeslicedError: "error",
    errors.ConnectionLost: "connection_lost",
    errors.ProtocolError: "protocol_error",
    errors.FrameTooLarge: "frame_too_large",
    errors.MalformedMessage: "malformed_message",
    errors.BadRequest: "bad_request",
    errors.UnknownOp: "unknown_op",
    errors.VersionMismatch: "version_mismatch",
    errors.HandshakeRequired: "handshake_required",
    errors.NotRegistered: "not_registered",
    errors.AlreadyRegistered: "already_registered",
    errors.GroupMismatch: "group_mismatch",
    errors.UnknownDevice: "unknown_device",
    errors.NotHolder: "not_holder",
    errors.AcquireTimeout: "acquire_timeout",
    errors.AcquireCancelled: "acquire_cancelled",
    errors.JobFaulted: "job_faulted",
    errors.LimitExceeded: "limit_exceeded",
    errors.PermissionDenied: "permission_denied",
    errors.OutOfMemory: "out_of_memory",
    errors.NotResident: "not_resident",
    errors.UnknownRegion: "unknown_region",
    errors.BackendError: "backend_error",
    errors.InternalError: "internal",
    errors.PreemptionUnsafe: "preempt_unsafe",
    errors.SwitchFailed: "switch_failed",
    errors.ParkRefused: "park_refused",
    errors.RestoreRefused: "restore_refused",
    errors.InsufficientHostMemory: "insufficient_host_memory",
}


def test_error_codes_are_unique_and_stable() -> None:
    for cls, code in STABLE_CODES.items():
        assert cls.code == code, cls
        assert errors.ERRORS_BY_CODE[code] is cls
    # unique over every class of the tree, including any added since this table was written
    tree: list[type[errors.TimeslicedError]] = [errors.TimeslicedError]
    for cls in tree:  # grows while it is walked: every subclass, however deep
        tree.extend(cls.__subclasses__())
    codes = [cls.code for cls in tree]
    assert len(codes) == len(set(codes)), sorted(codes)
    assert set(errors.ERRORS_BY_CODE.values()) == set(tree)


@pytest.mark.parametrize("cls", list(errors.ERRORS_BY_CODE.values()), ids=list(errors.ERRORS_BY_CODE))
def test_error_round_trip(cls: type[errors.TimeslicedError]) -> None:
    exc = cls("something broke", gpu=1, job="a")
    wire = errors.to_wire(exc)
    assert wire == {"code": cls.code, "message": "something broke", "details": {"gpu": 1, "job": "a"}}
    back = errors.from_wire(decode_body(encode(wire)[HEADER.size :]))
    assert type(back) is cls
    assert back.code == cls.code and back.message == "something broke" and str(back) == "something broke"
    assert back.details == {"gpu": 1, "job": "a"}
    # without a message or details
    plain = errors.to_wire(cls())
    assert set(plain) == {"code", "message"} and plain["message"]
    assert type(errors.from_wire(plain)) is cls


def test_from_wire_tolerates_odd_errors() -> None:
    newer = errors.from_wire({"code": "from_the_future", "message": "hm"})
    assert type(newer) is errors.TimeslicedError and newer.code == "from_the_future" and newer.message == "hm"
    assert errors.TimeslicedError.code == "error"  # the class is untouched
    for odd in (None, "boom", 3, ["code"]):
        assert isinstance(errors.from_wire(odd), errors.ProtocolError)
    nameless = errors.from_wire({"code": 5, "message": None, "details": "not a map"})
    assert type(nameless) is errors.TimeslicedError and nameless.details == {}


# --- properties ------------------------------------------------------------------------------

json_like = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(1 << 63), (1 << 64) - 1)
    | st.floats(allow_nan=False)
    | st.text()
    | st.binary(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)


def chunked(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    bounds = [0, *points, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds)]


@pytest.mark.slow
@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(
    messages=st.lists(st.dictionaries(st.text(max_size=8), json_like, max_size=5), max_size=5),
    cuts=st.lists(st.integers(0, 10_000), max_size=12),
)
def test_any_chunking_round_trips(messages: list[dict[str, Any]], cuts: list[int]) -> None:
    data = b"".join(encode(m) for m in messages)
    decoder = FrameDecoder()
    got = [m for chunk in chunked(data, cuts) for m in decoder.feed(chunk)]
    assert got == messages
    assert decoder.pending == 0


garbage = st.one_of(
    st.binary(max_size=300),
    # a plausible header in front of random bytes, so bodies get decoded too
    st.builds(lambda body, extra: frame(body) + extra, st.binary(max_size=200), st.binary(max_size=50)),
    st.builds(packed, json_like),
)


@pytest.mark.slow
@settings(max_examples=500, deadline=None, derandomize=True, database=None)
@given(
    chunks=st.lists(garbage, min_size=1, max_size=6),
    max_frame=st.sampled_from([0, 1, 16, 256, DEFAULT_MAX_FRAME]),
)
def test_random_bytes_only_raise_protocol_errors(chunks: list[bytes], max_frame: int) -> None:
    decoder = FrameDecoder(max_frame)
    for chunk in chunks:
        try:
            messages = decoder.feed(chunk)
        except errors.ProtocolError:
            continue  # any exception that is not a ProtocolError fails the test
        assert all(isinstance(m, dict) for m in messages)
        for m in messages:
            for parse in (parse_request, parse_incoming):
                try:
                    parse(m)
                except errors.ProtocolError:
                    pass


# --- register's priority and weight, acquire's gang ------------------------------------------------


@pytest.mark.parametrize(
    ("args", "expected"),
    [({}, (0, 1.0, None, 0)), ({"priority": -3, "weight": 2, "gang": "g", "members": 2}, (-3, 2.0, "g", 2))],
)
def test_policy_and_gang_args(args: dict[str, object], expected: tuple[object, ...]) -> None:
    from timesliced.wire.messages import arg_gang, arg_priority, arg_weight

    assert (arg_priority(args), arg_weight(args), *arg_gang(args)) == expected


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ({"priority": 1.5}, "priority"),
        ({"priority": True}, "priority"),
        ({"priority": 10**7}, "priority"),
        ({"weight": 0}, "weight"),
        ({"weight": float("nan")}, "weight"),
        ({"weight": "2"}, "weight"),
        ({"gang": "g"}, "members"),
        ({"members": 2}, "gang"),
        ({"gang": "", "members": 2}, "gang"),
        ({"gang": "g", "members": 65}, "members"),
    ],
)
def test_bad_policy_and_gang_args_are_refused(args: dict[str, object], match: str) -> None:
    from timesliced.errors import BadRequest
    from timesliced.wire.messages import arg_gang, arg_priority, arg_weight

    with pytest.raises(BadRequest, match=match):
        arg_priority(args)
        arg_weight(args)
        arg_gang(args)
