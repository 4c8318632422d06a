"""Fuzzing the wire codec and the request validation (pure, hypothesis).

test_wire.py checks that valid messages survive any chunking and that random
chunks only raise ``ProtocolError``. Here: any byte stream, cut anywhere, and
mutated real frames are decoded the same however they arrive, fail only with
``ProtocolError``, and never make the decoder hold more than one frame; what
the decoder lets through is what msgpack says, nested at most ``MAX_DEPTH``
levels; and ``parse_request``, ``parse_incoming`` and the ``arg_*`` helpers
turn any value into a valid result or a ``ProtocolError``.
"""

from __future__ import annotations

import itertools
import math
import struct
from typing import Any

import msgpack  # type: ignore[import-untyped]
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from timesliced import errors
from timesliced.wire.codec import DEFAULT_MAX_FRAME, HEADER, MAX_DEPTH, FrameDecoder, decode_body, encode
from timesliced.wire.messages import (
    MAX_OP_CHARS,
    MAX_REQUEST_ID,
    Push,
    Reply,
    Request,
    arg_int,
    arg_int_list,
    arg_opt_float,
    arg_str,
    arg_str_list,
    parse_incoming,
    parse_request,
    request_id_of,
)

FUZZ = settings(max_examples=300, deadline=None, derandomize=True, database=None)

# --- strategies ---------------------------------------------------------------------------------

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(1 << 63), (1 << 64) - 1),
    st.sampled_from([0, 1, -1, MAX_REQUEST_ID, MAX_REQUEST_ID + 1, (1 << 64) - 1, -(1 << 63)]),
    st.floats(),  # NaN and infinities included
    st.text(max_size=12),
    st.binary(max_size=12),
    st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=6)),
    st.builds(msgpack.Timestamp, st.integers(0, 2**33), st.integers(0, 999_999_999)),
)
keys = st.one_of(st.sampled_from(["id", "op", "args", "ok", "push", "data", "error", "code"]), st.text(max_size=6))
# what msgpack can carry (bytes keys too: strict_map_key admits them)
values = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(keys | st.binary(max_size=3), children, max_size=4)
    ),
    max_leaves=16,
)
maps = st.dictionaries(keys, values, max_size=6)
OPS = ["hello", "register", "acquire", "release", "cancel", "sim_alloc", "sim_free", "offload_done", "status", "ping"]
requests = st.fixed_dictionaries(
    {
        "id": st.integers(0, MAX_REQUEST_ID),
        "op": st.sampled_from(OPS),
        "args": st.dictionaries(keys, values, max_size=4),
    }
)
# any Python value a handler could be given, ints past 64 bits included
anything = st.one_of(values, st.integers(), st.lists(st.integers(), max_size=70), st.lists(st.text(max_size=3)))


def frame(body: bytes) -> bytes:
    return HEADER.pack(len(body)) + body


def chunked(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    return [data[a:b] for a, b in itertools.pairwise([0, *points, len(data)])]


def mutate(data: bytes, mutations: list[tuple[str, int, int]]) -> bytes:
    """Flip, insert, delete, truncate, re-prefix or duplicate at the drawn positions."""
    out = bytearray(data)
    for kind, where, byte in mutations:
        at = where % (len(out) + 1)
        if kind == "flip" and out:
            out[at % len(out)] ^= byte or 1
        elif kind == "insert":
            out[at:at] = bytes([byte])
        elif kind == "delete":
            del out[at : at + 1 + byte % 4]
        elif kind == "truncate":
            del out[at:]
        elif kind == "prefix":  # a plausible length where a header may be
            out[at : at + 4] = struct.pack(">I", byte * 7)
        elif kind == "duplicate":
            out += out[at:]
    return bytes(out)


mutations = st.lists(
    st.tuples(
        st.sampled_from(["flip", "insert", "delete", "truncate", "prefix", "duplicate"]),
        st.integers(0, 1 << 16),
        st.integers(0, 255),
    ),
    max_size=4,
)
streams = st.one_of(
    st.binary(max_size=400),
    st.builds(
        lambda ms, junk: b"".join(encode(m) for m in ms) + junk, st.lists(maps, max_size=4), st.binary(max_size=20)
    ),
    st.builds(
        lambda rs, ms: mutate(b"".join(encode(r) for r in rs), ms),
        st.lists(requests, min_size=1, max_size=4),
        mutations,
    ),
)
max_frames = st.sampled_from([0, 1, 7, 64, 300, DEFAULT_MAX_FRAME])


def depth(value: Any) -> int:
    """Levels of maps and lists (a scalar: 0)."""
    if isinstance(value, dict):
        return 1 + max(map(depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(depth, value), default=0)
    return 0


def same(a: Any, b: Any) -> bool:
    """Equal as msgpack sees it (NaN equals NaN)."""
    return bool(msgpack.packb(a, use_bin_type=True) == msgpack.packb(b, use_bin_type=True))


def feed_all(decoder: FrameDecoder, chunks: list[bytes]) -> tuple[list[dict[str, Any]], type[Exception] | None]:
    """Messages until the first error, and that error's class; asserts the decoder's promises on the way."""
    out: list[dict[str, Any]] = []
    for chunk in chunks:
        try:
            out += decoder.feed(chunk)
        except errors.ProtocolError as exc:  # any other exception fails the test
            return out, type(exc)
        assert decoder.pending < HEADER.size + decoder.max_frame  # never more than one frame held
    return out, None


# --- the frame decoder ------------------------------------------------------------------------------


@pytest.mark.slow
@FUZZ
@given(data=streams, cuts=st.lists(st.integers(0, 1 << 12), max_size=10), max_frame=max_frames)
def test_any_stream_decodes_the_same_however_it_is_cut(data: bytes, cuts: list[int], max_frame: int) -> None:
    bytewise, error = feed_all(FrameDecoder(max_frame), [data[i : i + 1] for i in range(len(data))])
    for m in bytewise:
        assert isinstance(m, dict) and depth(m) <= MAX_DEPTH
    for chunks in ([data], chunked(data, cuts)):
        decoder = FrameDecoder(max_frame)
        got, got_error = feed_all(decoder, chunks)
        assert got_error is error
        # feed() raising loses the messages it decoded in the same call, before the bad frame (see
        # test_requests_before_a_broken_frame_are_answered_however_they_arrive in the integration tests)
        assert same(got, bytewise) if error is None else same(got, bytewise[: len(got)])
    if error is not None:  # broken for good: the connection must be closed
        for more in (b"", encode({"id": 1, "op": "ping"})):
            with pytest.raises(errors.MalformedMessage, match="already failed"):
                decoder.feed(more)


@pytest.mark.slow
@settings(FUZZ, max_examples=150)
@given(rs=st.lists(requests, min_size=1, max_size=5), ms=mutations, cuts=st.lists(st.integers(0, 1 << 12), max_size=8))
def test_mutated_requests_yield_requests_or_protocol_errors(
    rs: list[dict[str, Any]], ms: list[tuple[str, int, int]], cuts: list[int]
) -> None:
    data = mutate(b"".join(encode(r) for r in rs), ms)
    messages, _ = feed_all(FrameDecoder(), chunked(data, cuts))
    for m in messages:
        try:
            request = parse_request(m)
        except errors.BadRequest as exc:
            assert exc.details.get("id") == request_id_of(m)  # the error reply names the right request
            continue
        assert request_id_of(m) == request.id
    if not ms:
        assert same(messages, rs)


@pytest.mark.slow
@FUZZ
@given(body=st.one_of(st.binary(max_size=64), st.builds(msgpack.packb, values), st.builds(msgpack.packb, maps)))
def test_decode_body_agrees_with_msgpack(body: bytes) -> None:
    try:
        expected = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except Exception:
        expected = None
    if isinstance(expected, dict) and depth(expected) <= MAX_DEPTH:
        assert same(decode_body(body), expected)
    else:
        with pytest.raises(errors.MalformedMessage):
            decode_body(body)


def nested(levels: int, shape: list[bool]) -> Any:
    """``levels`` maps and lists inside one another (``shape[i]``: a map at level i)."""
    value: Any = None
    for level in reversed(range(levels)):
        value = {"k": value} if shape[level % len(shape)] or level == 0 else [value]
    return value


@FUZZ
@given(levels=st.integers(1, MAX_DEPTH + 8), shape=st.lists(st.booleans(), min_size=1, max_size=8), wide=st.booleans())
def test_nesting_is_limited_to_max_depth(levels: int, shape: list[bool], wide: bool) -> None:
    message = nested(levels, shape)
    if wide:  # the deep branch is not the first one looked at
        message = {"a": [1, [2], {"b": []}], "deep": message, "z": [[[]]]}
    body = msgpack.packb(message)
    if depth(message) <= MAX_DEPTH:
        assert decode_body(body) == message
        assert FrameDecoder().feed(frame(body)) == [message]
    else:
        with pytest.raises(errors.MalformedMessage, match=f"deeper than {MAX_DEPTH} levels"):
            decode_body(body)


@pytest.mark.parametrize("levels", [MAX_DEPTH + 1, 1000, 1100, 100_000])
def test_deep_frames_are_refused_before_anyone_walks_them(levels: int) -> None:
    # msgpack decodes up to 1024 levels itself; a repr() of 1000 levels raises RecursionError
    body = b"\x81\xa1k" + b"\x91" * (levels - 1) + b"\xc0"
    with pytest.raises(errors.MalformedMessage):
        FrameDecoder().feed(frame(body))


# --- request and reply validation -----------------------------------------------------------------


@pytest.mark.slow
@FUZZ
@given(msg=st.one_of(maps, requests, st.builds(lambda r, extra: {**r, **extra}, requests, maps)))
@example({"id": 1, "op": "x" * (MAX_OP_CHARS + 1)})
@example({"id": 1, "op": "\0" * 300_000})
def test_parse_request_takes_any_map(msg: dict[str, Any]) -> None:
    try:
        request = parse_request(msg)
    except errors.BadRequest as exc:
        assert exc.details.get("id") == request_id_of(msg)
        return
    assert isinstance(request, Request)
    assert type(request.id) is int and 0 <= request.id <= MAX_REQUEST_ID and request.id == request_id_of(msg)
    assert isinstance(request.op, str) and 0 < len(request.op) <= MAX_OP_CHARS
    assert isinstance(request.args, dict)


@pytest.mark.slow
@FUZZ
@given(msg=st.one_of(maps, st.builds(lambda m, e: {**m, "ok": False, "error": e}, maps, values)))
def test_parse_incoming_takes_any_map(msg: dict[str, Any]) -> None:
    try:
        incoming = parse_incoming(msg)
    except errors.ProtocolError:
        return
    if isinstance(incoming, Push):
        assert isinstance(incoming.event, str) and isinstance(incoming.data, dict)
        return
    assert isinstance(incoming, Reply) and type(incoming.id) is int
    if incoming.ok:
        assert incoming.error is None
    else:
        assert isinstance(incoming.error, errors.TimeslicedError) and isinstance(incoming.error.message, str)


# --- argument helpers -------------------------------------------------------------------------------

present = st.one_of(anything.map(lambda v: {"v": v}), st.just({}))


@FUZZ
@given(args=present, max_len=st.integers(1, 300), default=st.one_of(st.none(), st.text(max_size=4)))
def test_arg_str(args: dict[str, Any], max_len: int, default: str | None) -> None:
    try:
        value = arg_str(args, "v", max_len=max_len, default=default)
    except errors.BadRequest:
        return
    assert isinstance(value, str) and 0 < len(value) <= max_len and value == args.get("v", default)


@FUZZ
@given(args=present, minimum=st.integers(-5, 5), default=st.one_of(st.none(), st.integers(-3, 3)))
def test_arg_int(args: dict[str, Any], minimum: int, default: int | None) -> None:
    try:
        value = arg_int(args, "v", minimum=minimum, default=default)
    except errors.BadRequest:
        return
    assert type(value) is int and value >= minimum and value == args.get("v", default)


@FUZZ
@given(args=present)
@example({"v": 1 << 1024})  # past every float: once an OverflowError
@example({"v": -(1 << 1024)})
@example({"v": (1 << 64) - 1})
def test_arg_opt_float(args: dict[str, Any]) -> None:
    try:
        value = arg_opt_float(args, "v")
    except errors.BadRequest:
        return
    if value is None:
        assert args.get("v") is None
    else:
        assert type(value) is float and math.isfinite(value) and value >= 0 and value == float(args["v"])


@FUZZ
@given(args=present, max_len=st.integers(0, 80))
def test_arg_int_list(args: dict[str, Any], max_len: int) -> None:
    try:
        value = arg_int_list(args, "v", max_len=max_len)
    except errors.BadRequest:
        return
    if value is None:
        assert args.get("v") is None
    else:
        assert len(value) <= max_len and all(type(n) is int and n >= 0 for n in value) and value == args["v"]


@FUZZ
@given(args=present, max_len=st.integers(0, 80), max_chars=st.integers(1, 4))
def test_arg_str_list(args: dict[str, Any], max_len: int, max_chars: int) -> None:
    try:
        value = arg_str_list(args, "v", max_len=max_len, max_chars=max_chars)
    except errors.BadRequest:
        return
    assert len(value) <= max_len and all(isinstance(s, str) and 0 < len(s) <= max_chars for s in value)
    assert value == (args.get("v") or [])
