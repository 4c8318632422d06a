"""Fuzzing the live daemon's client socket while well-behaved jobs keep working.

A real daemon (embedded, simulated GPUs) serves three bystander jobs that take
turns on real simulated bytes and check every byte after each grant. Meanwhile a
separate fuzzer process opens connection after connection and sends random
bytes, frames holding random msgpack values, mutated real request sequences and
abusive ones (acquire before register, cancelling another connection's request,
freeing another job's region, dying while holding the lock, ...).

What must hold: every frame is answered or the connection is closed with an
error, within a short timeout; no handler ever fails (``internal_errors`` stays
0); the bystanders see no error, lose no byte and keep getting the lock; and
once the fuzzer is gone the daemon has no trace of its jobs, waiters or
connections and serves a new client as before.

The fuzzer is seeded (``TIMESLICED_FUZZ_SEED``, ``TIMESLICED_FUZZ_CASES``); case
``i`` of seed ``s`` draws from ``random.Random(f"{s}:{i}")``, so one case can be
rerun by itself with ``fuzz_main``. It runs in its own process so that its jobs
are reclaimed when it exits, as they would be for any client program.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import random
import select
import socket
import struct
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgpack  # type: ignore[import-untyped]
import pytest

import timesliced
from timesliced.client.sync import daemon_status
from timesliced.daemon.embedded import EmbeddedDaemon
from timesliced.util.processes import PID_MAX
from timesliced.wire.codec import DEFAULT_MAX_FRAME, MAX_DEPTH
from timesliced.wire.messages import MAX_REQUEST_ID

from ..helpers.daemon import Raw
from ..helpers.processes import spawn_python, wait_for

MiB = 1 << 20

SEED = int(os.environ.get("TIMESLICED_FUZZ_SEED", "1912"))
CASES = int(os.environ.get("TIMESLICED_FUZZ_CASES", "1500"))
WORKERS = 6  # fuzz connections in flight at once
BATCHES = 3  # fuzzer processes, one after the other
REPLY_TIMEOUT = 5.0  # the daemon's own timeouts (stall 0.5 s, handshake 1 s) fit well inside
SENTINEL_BASE = 7_000_000_000  # request ids no mutation produces: the ping that ends a case
DEFERRED_OPS = ("acquire", "sim_alloc")  # a valid request of these may be answered later
OPS: tuple[str, ...] = ("hello", "auth", "register", "acquire", "release", "cancel", "sim_alloc", "sim_free")
OPS += ("offload_done", "status", "ping")
UNKNOWN_OPS = ("Acquire", "acquire ", "release\x00", "hello2", "_ops", "__init__", "status" * 40, "ü", "\U0001f600")

BYSTANDERS = (("bystander-0", "steady", 0), ("bystander-1", "steady", 0), ("bystander-2", "solo", 1))
REGION_BYTES = 6 * MiB


# --- values -------------------------------------------------------------------------------

NAN, INF = math.nan, math.inf
INTERESTING_INTS: tuple[int, ...] = (0, 1, -1, 2, 7, 255, 256, -129, 2**31 - 1, 2**31, 2**32, 2**32 + 1, 2**53 + 1)
INTERESTING_INTS += (MAX_REQUEST_ID, MAX_REQUEST_ID + 1, 2**64 - 1, -(2**63), -(2**31))
INTERESTING_FLOATS = (0.0, -0.0, 0.5, 1e-300, 5e-324, 1e308, 1.7976931348623157e308, NAN, INF, -INF, -1.5)
WEIRD: tuple[Any, ...] = (None, True, False, *INTERESTING_INTS, *INTERESTING_FLOATS, "", "0", "1", "x" * 300)
WEIRD += ("\u00fcn\u00efc\u00f6d\u00e9 \u2713", "a/../b", "\x00", b"", b"\x00\xff" * 8, [], [0], [-1], [None], [[0]])
WEIRD += ({}, {"a": 1}, {"": None}, msgpack.ExtType(5, b"ext"), msgpack.Timestamp(0, 0))
DEEP = msgpack.ExtType(99, b"DEEPDEEP")  # packed as b"\xd7\x63DEEPDEEP"; replaced by deeply nested lists
DEEP_PACKED = msgpack.packb(DEEP)


def random_int(rng: random.Random) -> int:
    if rng.random() < 0.6:
        return rng.choice(INTERESTING_INTS)
    bits = rng.choice((7, 16, 32, 63, 64))
    value = rng.getrandbits(bits)
    return value if bits == 64 or rng.random() < 0.7 else -value


def random_str(rng: random.Random) -> str:
    alphabet = "abcxyz019 _-/.:\x00\x7f\u00e9\u4e2d\U0001f600"
    n = rng.choice((0, 1, 3, 8, 40, rng.randint(0, 300)))
    return "".join(rng.choice(alphabet) for _ in range(n))


def random_value(rng: random.Random, depth: int = 0) -> Any:
    """Any msgpack value: nested maps and lists, extreme numbers, bytes, odd strings, ext types."""
    pick = rng.random()
    if depth < 4 and pick < 0.25:
        return [random_value(rng, depth + 1) for _ in range(rng.choice((0, 1, 2, 5)))]
    if depth < 4 and pick < 0.45:
        return {random_key(rng): random_value(rng, depth + 1) for _ in range(rng.choice((0, 1, 2, 5)))}
    return rng.choice(
        (
            lambda: rng.choice(WEIRD),
            lambda: random_int(rng),
            lambda: rng.choice(INTERESTING_FLOATS) if rng.random() < 0.5 else rng.uniform(-1e6, 1e6),
            lambda: random_str(rng),
            lambda: rng.randbytes(rng.choice((0, 1, 16, 200))),
            lambda: msgpack.ExtType(rng.randint(0, 127), rng.randbytes(rng.randint(0, 9))),
        )
    )()


def random_key(rng: random.Random) -> Any:
    roll = rng.random()
    if roll < 0.5:
        return rng.choice(("id", "op", "args", "job", "group", "timeout", "request", "region", "nbytes", "gpu"))
    if roll < 0.9:
        return random_str(rng)
    return rng.randbytes(3)  # bytes keys pass strict_map_key


def pack(value: Any, deep: int = 0) -> bytes:
    body: bytes = msgpack.packb(value, use_bin_type=True)
    if deep:
        body = body.replace(DEEP_PACKED, b"\x91" * deep + b"\xc0")
    return body


def frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def padded_ping(size: int) -> bytes:
    """A ping whose frame body is exactly ``size`` bytes (``size`` >= 40)."""
    head = b"\x83\xa2id\x01\xa2op\xa4ping\xa4args\x81\xa3pad\xc6"  # {"id": 1, "op": "ping", "args": {"pad": bin32
    n = size - len(head) - 4
    return frame(head + struct.pack(">I", n) + bytes(n))


def valid_id(rid: Any) -> bool:
    return isinstance(rid, int) and not isinstance(rid, bool) and 0 <= rid <= MAX_REQUEST_ID


def harmless_pids(value: Any) -> Any:
    """Keep other live processes out of a fuzzed ``pids``: a job that follows one would outlive the fuzzer."""
    args: Any = value.get("args") if isinstance(value, dict) else None
    pids = args.get("pids") if isinstance(args, dict) else None
    if isinstance(pids, list):
        me = os.getpid()
        args["pids"] = [p if not isinstance(p, int) or p == me or not 2 <= p <= PID_MAX else -p for p in pids]
    return value


def well_formed_request(value: Any) -> bool:
    """What the protocol accepts as a request (written out here, not taken from the code under test)."""
    if not isinstance(value, dict) or not valid_id(value.get("id")):
        return False
    op, args = value.get("op"), value.get("args", {})
    return isinstance(op, str) and op != "" and isinstance(args, dict)


# --- one fuzz connection -----------------------------------------------------------------------


class FuzzFailure(AssertionError):
    """The daemon misbehaved towards a fuzz connection."""


class Wire:
    """A raw protocol connection whose every wait is bounded by ``REPLY_TIMEOUT``."""

    def __init__(self, path: str, log: list[str]) -> None:
        self.log = log
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(REPLY_TIMEOUT)
        deadline = time.monotonic() + REPLY_TIMEOUT
        while True:
            try:
                self.sock.connect(path)
                break
            except BlockingIOError:  # the accept backlog is momentarily full
                if time.monotonic() > deadline:
                    raise FuzzFailure("the daemon stopped accepting connections") from None
                time.sleep(0.01)
        self.buf = bytearray()
        self.eof = False
        self.hung_up = False  # our own end is closed
        self.received: list[dict[str, Any]] = []  # every message, in order
        self.stash: list[dict[str, Any]] = []  # read while waiting for something else
        self.next_id = 1
        self.frames = 0
        self.cooperative = False  # answer offload directives at once, as every real client does

    def send(self, data: bytes, *, frames: int = 1) -> bool:
        """False once the daemon has hung up on us.

        Reads while it writes, as a client must: a daemon that is answering (or closing
        after an error) may wait for us to read before it reads again.
        """
        self.frames += frames
        view = memoryview(data)
        deadline = time.monotonic() + REPLY_TIMEOUT
        while view:
            if self.eof:
                return False
            left = deadline - time.monotonic()
            readable, writable, _ = select.select([self.sock], [self.sock], [], max(0.0, left))
            if not readable and not writable:
                raise FuzzFailure(f"the daemon neither read nor wrote for {REPLY_TIMEOUT}s")
            if readable:
                self._fill()
            if writable and not self.eof:
                try:
                    sent = self.sock.send(view[: 1 << 16])
                except (BrokenPipeError, ConnectionResetError):
                    return False
                except BlockingIOError:
                    continue
                view = view[sent:]
                deadline = time.monotonic() + REPLY_TIMEOUT
        return True

    def _fill(self) -> None:
        """Read what the daemon sent (without waiting)."""
        try:
            data = self.sock.recv(1 << 16, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        except ConnectionResetError:  # the daemon closed while our bytes were unread
            data = b""
        if data:
            self.buf += data
        else:
            self.eof = True

    def send_value(self, value: Any, deep: int = 0) -> bool:
        self.log.append(f"frame {short(value)}" + (f" with {deep} nested lists at the marker" if deep else ""))
        return self.send(frame(pack(value, deep)))

    def request(self, op: str, args: dict[str, Any] | None = None) -> int:
        rid = self.next_id
        self.next_id += 1
        self.send_value({"id": rid, "op": op, "args": args or {}})
        return rid

    def next_message(self, deadline: float) -> dict[str, Any] | None:
        """The next message from the daemon, or None once it closed the connection."""
        while True:
            if len(self.buf) >= 4:
                (n,) = struct.unpack_from(">I", self.buf)
                if len(self.buf) >= 4 + n:
                    body = bytes(self.buf[4 : 4 + n])
                    del self.buf[: 4 + n]
                    message = check_message(body)
                    self.received.append(message)
                    if self.cooperative and message.get("push") == "offload":
                        answer = {"directive": message["data"].get("directive"), "ok": True, "nbytes": 0}
                        self.request("offload_done", answer)
                        continue
                    return message
            if self.eof:
                if self.buf:
                    raise FuzzFailure(f"the daemon closed the connection in the middle of a frame: {bytes(self.buf)!r}")
                return None
            left = deadline - time.monotonic()
            if left <= 0:
                raise FuzzFailure(f"no answer and no close within {REPLY_TIMEOUT}s")
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(1 << 16)
            except TimeoutError:
                raise FuzzFailure(f"no answer and no close within {REPLY_TIMEOUT}s") from None
            except ConnectionResetError:  # the daemon closed while our bytes were unread
                data = b""
            if data:
                self.buf += data
            else:
                self.eof = True

    def reply_to(self, rid: int, timeout: float = REPLY_TIMEOUT) -> dict[str, Any]:
        """The reply to request ``rid``; other messages are stashed."""
        return self._take(lambda m: m.get("id") == rid and "push" not in m, f"request {rid}", "answering", timeout)

    def push(self, event: str) -> dict[str, Any]:
        """The data of the next push ``event``; other messages are stashed."""
        message = self._take(lambda m: m.get("push") == event, f"push {event!r}", "pushing it", REPLY_TIMEOUT)
        return dict(message["data"])

    def _take(self, wanted: Callable[[dict[str, Any]], bool], what: str, doing: str, timeout: float) -> dict[str, Any]:
        """The first message (stashed, or arriving within ``timeout``) that is ``wanted``; others are stashed."""
        for i, m in enumerate(self.stash):
            if wanted(m):
                return self.stash.pop(i)
        deadline = time.monotonic() + timeout
        while True:
            try:
                message = self.next_message(deadline)
            except FuzzFailure as exc:
                raise FuzzFailure(f"{what}: {exc}") from None
            if message is None:
                raise FuzzFailure(f"the daemon closed the connection instead of {doing} ({what})")
            if wanted(message):
                return message
            self.stash.append(message)

    def quiet(self, rid: int, wait: float = 0.05) -> bool:
        """Whether request ``rid`` is still unanswered after ``wait`` (a waiting acquire)."""
        try:
            self.reply_to(rid, wait)
        except FuzzFailure:
            return not self.eof
        return False

    def call(self, op: str, args: dict[str, Any] | None = None) -> dict[str, Any]:
        return self.reply_to(self.request(op, args))

    def close(self) -> None:
        if not self.hung_up:
            self.hung_up = True
            self.sock.close()


def check_message(body: bytes) -> dict[str, Any]:
    """A message from the daemon must be a well-formed reply or push, and never an internal error."""
    try:
        m = msgpack.unpackb(body, raw=False, strict_map_key=False)
    except Exception as exc:
        raise FuzzFailure(f"the daemon sent a frame that is not msgpack: {exc!r}") from None
    if not isinstance(m, dict):
        raise FuzzFailure(f"the daemon sent a {type(m).__name__}, not a map")
    if "push" in m:
        if not isinstance(m["push"], str) or not isinstance(m.get("data", {}), dict):
            raise FuzzFailure(f"malformed push {short(m)}")
        return m
    if not (m.get("id") is None or valid_id(m.get("id"))) or not isinstance(m.get("ok"), bool):
        raise FuzzFailure(f"malformed reply {short(m)}")
    if m["ok"] is False:
        error = m.get("error")
        if not isinstance(error, dict) or not isinstance(error.get("code"), str):
            raise FuzzFailure(f"malformed error reply {short(m)}")
        if not isinstance(error.get("message"), str) or not error["message"]:
            raise FuzzFailure(f"error reply without a message {short(m)}")
        if error["code"] == "internal":
            raise FuzzFailure(f"internal error: {error['message'][:300]}")
    return m


def short(value: Any, limit: int = 240) -> str:
    text = repr(value) if not isinstance(value, (bytes, bytearray)) else bytes(value[:120]).hex()
    return text if len(text) <= limit else text[:limit] + f"...({len(text)} chars)"


# --- the fuzzer ----------------------------------------------------------------------------------


@dataclass
class Case:
    index: int
    rng: random.Random
    path: str
    kind: str = ""
    tags: list[str] = field(default_factory=list)  # what the case tried, for the report
    log: list[str] = field(default_factory=list)
    wires: list[Wire] = field(default_factory=list)

    def wire(self) -> Wire:
        w = Wire(self.path, self.log)
        self.wires.append(w)
        return w

    def name(self, what: str) -> str:
        return f"fz{self.index}-{what}"

    @property
    def sentinel(self) -> int:
        return SENTINEL_BASE + self.index


def hello(w: Wire) -> None:
    reply = w.call("hello", {"version": 1, "role": "client", "pid": os.getpid(), "program": "fuzz"})
    if not reply["ok"]:
        raise FuzzFailure(f"hello refused: {reply}")


def registered(case: Case, job: str, group: str, gpus: list[int] | None = None) -> Wire:
    w = case.wire()
    w.cooperative = True
    hello(w)
    reply = w.call("register", {"job": job, "group": group, "gpus": gpus, "pids": [os.getpid()]})
    if not reply["ok"]:
        raise FuzzFailure(f"register {job}/{group} refused: {reply}")
    return w


def expect(reply: dict[str, Any], *codes: str) -> dict[str, Any]:
    """``reply`` is an error with one of ``codes`` (or a success when ``codes`` holds "ok")."""
    got = "ok" if reply["ok"] else reply["error"]["code"]
    if got not in codes:
        raise FuzzFailure(f"expected {' or '.join(codes)}, got {short(reply)}")
    return reply


def settle(case: Case, w: Wire, values: list[Any] | None) -> None:
    """End a case: a ping must be answered, or the connection closed with an error, in time.

    ``values``: what was sent as whole frames, in order (None: the bytes were mangled,
    so the daemon's framing is unknown). If the ping is answered, every earlier frame
    must have had its reply too, apart from requests that may be answered later.
    """
    if w.hung_up:
        return
    w.send(frame(pack({"id": case.sentinel, "op": "ping"})))
    deadline = time.monotonic() + REPLY_TIMEOUT
    while True:
        m = w.next_message(deadline)
        if m is None:
            if not w.received or w.received[-1].get("ok") is not False:
                raise FuzzFailure("the daemon closed the connection without an error reply")
            return
        if m.get("id") == case.sentinel:
            break
    if values is None:
        return
    answered = Counter(m.get("id") for m in w.received if "push" not in m)
    owed: Counter[Any] = Counter()
    for value in values:
        if not isinstance(value, dict):
            raise FuzzFailure(f"the frame {short(value)} is not a map, yet the connection stayed open")
        if well_formed_request(value) and value["op"] in DEFERRED_OPS:
            continue
        owed[value["id"] if valid_id(value.get("id")) else None] += 1
    for rid, n in owed.items():
        if answered[rid] < n:
            raise FuzzFailure(f"{n - answered[rid]} frame(s) with id {rid!r} got no reply")


def finish_stream(case: Case, w: Wire, stream: bytes) -> None:
    """After mangled bytes: complete a frame the daemon still waits for, close mid-frame, or let it stall."""
    state, missing = framing_state(stream)
    roll = case.rng.random()
    if state == "pending" and roll < 0.3:
        case.log.append("close mid-frame")
        case.tags.append("close-mid-frame")
        w.close()
        return
    if state == "pending" and roll < 0.4:
        case.log.append("stall mid-frame")
        case.tags.append("stall-mid-frame")
        deadline = time.monotonic() + REPLY_TIMEOUT  # the stall (or handshake) timeout closes it first
        while w.next_message(deadline) is not None:
            pass
        if not w.received or w.received[-1].get("ok") is not False:
            raise FuzzFailure("a stalled connection was closed without an error reply")
        return
    if state == "pending":
        case.log.append(f"pad {missing} zero bytes")
        case.tags.append("completed-with-zeros")
        w.send(b"\x00" * missing, frames=0)  # zeros never complete a map: an error, then a close
    settle(case, w, None)


def framing_state(stream: bytes, max_frame: int = DEFAULT_MAX_FRAME) -> tuple[str, int]:
    """How the daemon's side of ``stream`` ends: ("clean"|"broken", 0) or ("pending", bytes still missing)."""
    pos = 0
    while True:
        left = len(stream) - pos
        if left == 0:
            return "clean", 0
        if left < 4:
            size = int.from_bytes(stream[pos:] + b"\x00" * (4 - left), "big")
            return ("broken", 0) if size > max_frame else ("pending", 4 - left + size)
        size = int.from_bytes(stream[pos : pos + 4], "big")
        if size > max_frame:
            return "broken", 0
        if left - 4 < size:
            return "pending", size - (left - 4)
        try:
            decoded = msgpack.unpackb(stream[pos + 4 : pos + 4 + size], raw=False, strict_map_key=True)
        except Exception:
            return "broken", 0
        if not isinstance(decoded, dict) or nesting(decoded) > MAX_DEPTH:
            return "broken", 0
        pos += 4 + size


def nesting(value: Any) -> int:
    """Levels of maps and lists in ``value``, counted without recursion (there may be a thousand)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, level = stack.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, level)
            stack.extend((child, level + 1) for child in (v.values() if isinstance(v, dict) else v))
    return deepest


def send_stream(case: Case, w: Wire, stream: bytes, frames: int) -> None:
    """All at once, or cut at random points with short pauses (well within the stall timeout)."""
    rng = case.rng
    if len(stream) < 2 or rng.random() < 0.5:
        w.send(stream, frames=frames)
        return
    cuts = sorted(rng.sample(range(1, len(stream)), min(len(stream) - 1, rng.randint(1, 8))))
    case.log.append(f"split at {cuts}")
    case.tags.append("split")
    w.frames += frames
    for a, b in itertools.pairwise([0, *cuts, len(stream)]):
        if not w.send(stream[a:b], frames=0):
            return
        if rng.random() < 0.3:
            time.sleep(rng.random() * 0.003)


# (a) random bytes -------------------------------------------------------------------------------


def case_bytes(case: Case) -> None:
    rng = case.rng
    w = case.wire()
    if rng.random() < 0.8:
        hello(w)
    variants: dict[str, Callable[[], bytes]] = {
        "noise": lambda: rng.randbytes(rng.randint(1, 600)),
        "header+noise": lambda: frame(rng.randbytes(rng.randint(0, 300))),
        "short-header": lambda: rng.randbytes(rng.randint(1, 3)),
        "huge-header": lambda: struct.pack(">I", rng.randint(DEFAULT_MAX_FRAME + 1, 2**32 - 1)) + rng.randbytes(9),
        "zero-length": lambda: frame(b""),
        "bad-utf8": lambda: frame(b"\x83\xa2id\x01\xa2op\xa4p\xffng\xa4args\x80"),
        "int-keys": lambda: frame(pack({1: 2, "id": 3, "op": "ping"})),
        "deep": lambda: frame(pack({"id": 1, "op": "ping", "args": {"x": DEEP}}, rng.choice((1023, 1025, 5000)))),
        "truncated-map": lambda: frame(pack({"id": 1, "op": "ping", "args": {}})[: rng.randint(1, 10)]),
        # ext types Python cannot build: a negative code, a timestamp of the wrong size, the largest timestamp
        "odd-ext": lambda: frame(
            b"\x83\xa2id\x01\xa2op\xa4ping\xa4args\x81\xa1x"
            + rng.choice((b"\xd4\x80\x00", b"\xc7\x03\xff\x00\x00\x00", b"\xd6\xff\xff\xff\xff\xff"))
        ),
        "cut-request": lambda: frame(pack({"id": 1, "op": "acquire", "args": {"timeout": 0}}))[: rng.randint(1, 30)],
        "over-limit": lambda: padded_ping(DEFAULT_MAX_FRAME + 1),
        "at-limit": lambda: padded_ping(DEFAULT_MAX_FRAME),
    }
    variant = rng.choice(sorted(variants))
    case.tags.append(variant)
    stream = variants[variant]()
    case.log.append(f"bytes {short(stream)}")
    send_stream(case, w, stream, frames=1)
    finish_stream(case, w, stream)


# (b) frames holding random msgpack values ----------------------------------------------------------


def case_values(case: Case) -> None:
    rng = case.rng
    w = case.wire()
    helloed = rng.random() < 0.85
    if helloed:
        hello(w)
    if helloed and rng.random() < 0.5:
        w.call("register", {"job": f"fzv{case.index % 16}", "group": f"fzv{case.index % 5}", "pids": [os.getpid()]})
    values: list[Any] = []
    for _ in range(rng.randint(1, 6)):
        roll = rng.random()
        if roll < 0.05:
            value: Any = random_value(rng)  # mostly not a map: the connection must close
        elif roll < 0.6:  # a request shape with random args, so handlers see the values
            value = {"id": w.next_id, "op": rng.choice(OPS), "args": random_map(rng)}
            w.next_id += 1
        else:
            value = {random_key(rng): random_value(rng) for _ in range(rng.randint(0, 6))}
        values.append(harmless_pids(value))
    case.tags.append("maps" if all(isinstance(v, dict) for v in values) else "non-map")
    stream = b"".join(frame(pack(v)) for v in values)
    case.log.extend(f"frame {short(v)}" for v in values)
    send_stream(case, w, stream, frames=len(values))
    settle(case, w, values)


def random_map(rng: random.Random) -> dict[Any, Any]:
    return {random_key(rng): random_value(rng) for _ in range(rng.randint(0, 5))}


# (c) mutated real request sequences ------------------------------------------------------------------


def valid_args(case: Case, op: str) -> dict[str, Any]:
    rng = case.rng
    if op == "hello":
        return {"version": 1, "role": "client", "pid": os.getpid(), "program": "fuzz"}
    if op == "register":
        park = rng.choice(
            (
                None,
                {"method": "sim"},
                {"method": "sim", "tags": ["a"], "level": 2},
                {"method": "offload"},
                {"method": "vllm", "endpoints": ["http://127.0.0.1:9"]},
            )
        )
        gpus = rng.choice((None, [0], [1], [0, 1], [0, 0]))
        job = case.name("m") if rng.random() < 0.2 else f"fzm{rng.randint(0, 15)}"
        return {"job": job, "group": f"fzm{rng.randint(0, 7)}", "gpus": gpus, "pids": [os.getpid()], "park": park}
    if op == "acquire":
        return {"timeout": rng.choice((None, 0, 0.001, 0.05, 0.2))}
    if op == "cancel":
        return {"request": rng.randint(0, 12)}
    if op == "sim_alloc":
        return {"nbytes": rng.choice((1, 4096, 2 * MiB, 3 * MiB)), "gpu": rng.choice((0, 1))}
    if op == "sim_free":
        return {"region": rng.randint(0, 4)}
    if op == "offload_done":
        return {"directive": rng.randint(0, 5), "ok": rng.random() < 0.5, "nbytes": 0, "footprint": {"0": 1}}
    if op == "auth":
        return {"proof": "00" * 32}
    return {}


ARG_NAMES: tuple[str, ...] = ("job", "group", "gpus", "pids", "park", "timeout", "request", "nbytes", "gpu")
ARG_NAMES += ("region", "directive", "ok", "footprint", "error", "version", "role", "proof")
# "arg-*", "huge-*", "deep" and "park-weird" change one argument, "id-*" the id, "op-*" the op
VALUE_MUTATIONS: tuple[str, ...] = ("arg-weird", "arg-weird", "arg-random", "arg-extreme", "arg-drop", "huge-list")
VALUE_MUTATIONS += ("huge-value", "deep", "park-weird", "id-weird", "id-missing", "id-duplicate", "op-weird")
VALUE_MUTATIONS += ("op-huge", "op-other", "args-weird", "extra-keys")


def mutate_value(case: Case, frames: list[dict[str, Any]], i: int) -> tuple[str, int]:
    """Mutate request ``i`` in place; returns the mutation and the nesting depth of a DEEP marker."""
    rng = case.rng
    f = frames[i]
    args = f.get("args") if isinstance(f.get("args"), dict) else None
    key = rng.choice([*(args or {}), *ARG_NAMES]) if args is not None else "args"
    mutation = rng.choice(VALUE_MUTATIONS)
    deep = 0
    if mutation.startswith("arg") or mutation in ("huge-list", "huge-value", "deep", "park-weird"):
        if args is None:
            f["args"] = args = {}
        if mutation == "arg-weird":
            args[key] = rng.choice(WEIRD)
        elif mutation == "arg-random":
            args[key] = random_value(rng)
        elif mutation == "arg-extreme":
            args[key] = rng.choice((random_int(rng), rng.choice(INTERESTING_FLOATS), -(random_int(rng) % 2**63)))
        elif mutation == "arg-drop":
            args.pop(key, None)
        elif mutation == "huge-list":
            n = rng.choice((65, 1025, 5000, 60_000))
            args[key] = rng.choice(([os.getpid()] * n, list(range(n)), ["x"] * n, [None] * n))
        elif mutation == "huge-value":  # small on the wire, four times larger if an error message quoted it whole
            args[key] = rng.choice((b"\0" * 300_000, "\0" * 300_000, [b"\0" * 1000] * 300))
        elif mutation == "deep":
            args[key] = DEEP
            deep = rng.choice((10, 30, 31, 100, 990, 1020))  # the codec admits 32 levels: map, args, 30 lists
        else:
            args["park"] = rng.choice(
                (
                    {"method": rng.choice(WEIRD)},
                    {"method": "vllm"},
                    {"method": "sglang", "endpoints": ["ftp://x", "http://127.0.0.1:9"]},
                    {"method": "sim", "endpoints": "http://127.0.0.1:9"},
                    {"method": "sim", "level": rng.choice(WEIRD)},
                    {"method": "sim", "tags": [rng.choice(WEIRD)] * rng.choice((1, 65))},
                    {"method": "cuda-checkpoint"},
                    rng.choice(WEIRD),
                )
            )
    elif mutation == "id-weird":
        f["id"] = rng.choice(WEIRD)
    elif mutation == "id-missing":
        f.pop("id", None)
    elif mutation == "id-duplicate":
        f["id"] = frames[rng.randrange(len(frames))].get("id", 1)
    elif mutation == "op-weird":
        f["op"] = rng.choice((*WEIRD, *UNKNOWN_OPS))
    elif mutation == "op-huge":
        f["op"] = rng.choice(("\0", "x", "\u00e9")) * rng.choice((65, 300_000))
    elif mutation == "op-other":
        f["op"] = rng.choice(OPS)
    elif mutation == "args-weird":
        f["args"] = rng.choice(WEIRD)
    else:
        for _ in range(rng.randint(1, 4)):
            (args if args is not None and rng.random() < 0.5 else f)[random_key(rng)] = random_value(rng)
    return mutation, deep


def mutate_bytes(case: Case, chunks: list[bytes]) -> tuple[str, bytes]:
    """Mangle the framed requests: flip, cut, re-prefix, insert, drop, duplicate, oversize."""
    rng = case.rng
    i = rng.randrange(len(chunks))
    c = bytearray(chunks[i])
    mutation = rng.choice(("flip", "flip-header", "truncate", "prefix", "insert", "delete", "duplicate", "oversize"))
    if mutation in ("flip", "flip-header"):
        top = 4 if mutation == "flip-header" or len(c) <= 4 else len(c)
        for _ in range(rng.randint(1, 4)):
            c[rng.randrange(4 if top > 4 else 0, top)] ^= 1 << rng.randrange(8)
    elif mutation == "truncate":
        del c[rng.randrange(len(c)) :]
    elif mutation == "prefix":
        size = len(c) - 4 + rng.choice((-3, -1, 1, 2, 100, -(len(c) - 4)))
        c[:4] = struct.pack(">I", max(0, size))
    elif mutation == "insert":
        at = rng.randrange(len(c) + 1)
        c[at:at] = rng.randbytes(rng.randint(1, 8))
    elif mutation == "delete":
        at = rng.randrange(len(c))
        del c[at : at + rng.randint(1, 4)]
    elif mutation == "duplicate":
        c += bytes(c)
    else:  # a frame one byte over the limit, body and all
        c = bytearray(padded_ping(DEFAULT_MAX_FRAME + 1))
    chunks[i] = bytes(c)
    return mutation, b"".join(chunks)


def case_mutated(case: Case) -> None:
    rng = case.rng
    ops = ["hello"] if rng.random() < 0.9 else []
    if rng.random() < 0.8:
        ops.append("register")
    ops += rng.choices((*OPS, "sim_alloc", "acquire", "release", rng.choice(UNKNOWN_OPS)), k=rng.randint(1, 7))
    frames: list[dict[str, Any]] = []
    for n, op in enumerate(ops, start=1):
        frames.append({"id": n if rng.random() < 0.9 else rng.randint(0, 3), "op": op, "args": valid_args(case, op)})
    deep = 0
    for _ in range(rng.choice((1, 1, 2, 3))):
        target = rng.randrange(len(frames)) if rng.random() < 0.8 or len(frames) == 1 else 0
        mutation, d = mutate_value(case, frames, target)
        case.tags.append(f"value:{mutation}")
        deep = deep or d
    chunks = [frame(pack(harmless_pids(f), deep)) for f in frames]
    case.log.extend(f"frame {short(f)}" for f in frames)
    if deep:
        case.log.append(f"DEEP markers are {deep} nested lists")
    if rng.random() < 0.3:
        mutation, stream = mutate_bytes(case, chunks)
        case.tags.append(f"bytes:{mutation}")
        case.log.append(f"mangled ({mutation}) stream {short(stream)}")
        w = case.wire()
        send_stream(case, w, stream, frames=len(frames))
        finish_stream(case, w, stream)
        return
    w = case.wire()
    send_stream(case, w, b"".join(chunks), frames=len(frames))
    if rng.random() < 0.05:
        case.log.append("close without reading")
        case.tags.append("close-without-reading")
        w.close()
        return
    settle(case, w, frames)


# (d) protocol abuse -------------------------------------------------------------------------------


def abuse_before_register(case: Case) -> None:
    w = case.wire()
    hello(w)
    expect(w.call("acquire", {}), "not_registered")
    expect(w.call("release"), "not_registered")
    expect(w.call("cancel", {"request": 1}), "not_registered")
    expect(w.call("sim_alloc", {"nbytes": 4096}), "not_registered")
    expect(w.call("sim_free", {"region": 0}), "not_registered")
    expect(w.call("offload_done", {"directive": 1, "ok": True}), "bad_request", "not_registered")
    expect(w.call("hello", {"version": 1}), "unknown_op", "bad_request")
    settle(case, w, [])


def abuse_release_without_holding(case: Case) -> None:
    w = registered(case, case.name("a"), case.name("g"))
    expect(w.call("release"), "not_holder")
    expect(w.call("release"), "not_holder")
    expect(w.call("register", {"job": case.name("b"), "group": case.name("g")}), "already_registered")
    expect(w.call("acquire", {}), "ok")
    expect(w.call("release"), "ok")
    expect(w.call("release"), "not_holder")
    settle(case, w, [])


def abuse_cancel_others(case: Case) -> None:
    group = case.name("g")
    holder = registered(case, case.name("h"), group)
    expect(holder.call("acquire", {}), "ok")
    waiter = registered(case, case.name("w"), group)
    waiter.next_id = case.rng.randint(2, 50)
    rid = waiter.request("acquire", {})
    if not waiter.quiet(rid):
        raise FuzzFailure("an acquire was answered while another job held the lock")
    same_job = case.rng.random() < 0.5  # the same job's other connection may not cancel it either
    other = registered(case, case.name("w" if same_job else "x"), group)
    for request in (rid, rid + 1, 0, MAX_REQUEST_ID):
        expect(other.call("cancel", {"request": request}), "ok")
    if not waiter.quiet(rid):
        raise FuzzFailure("another connection's cancel ended the acquire")
    expect(holder.call("release"), "ok")
    grant = expect(waiter.reply_to(rid), "ok")
    if grant["result"]["job"] != case.name("w"):
        raise FuzzFailure(f"the grant went to {grant['result']['job']!r}")
    expect(waiter.call("release"), "ok")
    expect(other.call("acquire", {}), "ok")
    for w in (holder, waiter, other):
        settle(case, w, [])


def abuse_free_others_region(case: Case) -> None:
    owner = registered(case, case.name("a"), case.name("g"), [1])
    reply = owner.call("sim_alloc", {"nbytes": 4096, "gpu": 1})
    if not reply["ok"]:  # the GPU may be full of others' memory; nothing to steal then
        expect(reply, "out_of_memory", "not_resident")
        settle(case, owner, [])
        return
    region = reply["result"]["region"]
    thief = registered(case, case.name("b"), case.name("g2"), [1])
    for target in (region, region + 1, 0, 2**64 - 1):
        expect(thief.call("sim_free", {"region": target}), "unknown_region")
    expect(thief.call("sim_free", {"region": -1}), "bad_request")
    expect(owner.call("sim_free", {"region": region}), "ok", "backend_error")  # backend_error: being moved
    settle(case, owner, [])
    settle(case, thief, [])


def abuse_offload_done(case: Case) -> None:
    w = registered(case, case.name("a"), case.name("g"))
    rng = case.rng
    for directive in (0, 1, rng.randint(2, 10**6), MAX_REQUEST_ID, 2**64 - 1):
        args: dict[str, Any] = {
            "directive": directive,
            "ok": rng.random() < 0.5,
            "nbytes": rng.choice((0, -1, 2**64 - 1)),
        }
        args["footprint"] = rng.choice(({}, {"0": 5}, {"9": 1}, {"x": 1}, [1], None))
        expect(w.call("offload_done", args), "bad_request")
    settle(case, w, [])


def abuse_offload_answers(case: Case) -> None:
    """A job parked by offload answers its directive wrongly, from the wrong connection, twice."""
    group = case.name("g")
    owner = case.wire()
    owner.cooperative = True  # until the rival asks for the GPU
    hello(owner)
    register = {"job": case.name("o"), "group": group, "gpus": [1], "park": {"method": "offload"}}
    expect(owner.call("register", {**register, "pids": [os.getpid()]}), "ok")
    expect(owner.call("acquire", {}), "ok")
    expect(owner.call("release"), "ok")
    rival = registered(case, case.name("r"), group, [1])
    owner.cooperative = False
    rid = rival.request("acquire", {})  # the owner is exclusive on GPU 1: it is parked first
    directive = owner.push("offload")["directive"]
    answer = {"directive": directive, "ok": True, "nbytes": 0, "footprint": {}}
    expect(rival.call("offload_done", answer), "bad_request")  # not the rival's directive
    for bogus in (
        {"ok": "yes"},
        {"ok": None},
        {"nbytes": -1},
        {"nbytes": 2**64 - 1, "footprint": {"1": -5}},
        {"footprint": {"0": 1, "1": 1, "2": 1}},
        {"footprint": {"7": 1}},
        {"footprint": {"01x": 1}},
        {"footprint": {b"1": 1}},
        {"footprint": {"1": 1.5}},
        {"footprint": [1]},
        {"directive": directive + 1},
        {"directive": -directive},
    ):
        expect(owner.call("offload_done", {**answer, **bogus}), "bad_request")
    if case.rng.random() < 0.5:
        expect(owner.call("offload_done", answer), "ok")
        expect(owner.call("offload_done", answer), "ok", "bad_request")  # answered already
    else:
        owner.close()  # the park fails: the job is faulted, the rival goes ahead
    expect(rival.reply_to(rid), "ok")
    settle(case, rival, [])
    settle(case, owner, [])


def abuse_alloc_then_vanish(case: Case) -> None:
    """Ask for memory that only fits once others are parked, and go before the answer (or just after)."""
    gpu = case.rng.choice((0, 1))
    w = registered(case, case.name("a"), case.name("g"), [gpu])
    rid = w.request("sim_alloc", {"nbytes": case.rng.choice((8, 24, 40, 58)) * MiB, "gpu": gpu})
    if case.rng.random() < 0.5:
        expect(w.reply_to(rid), "ok", "out_of_memory")
    w.close()
    other = registered(case, case.name("b"), case.name("g2"), [gpu])
    expect(other.call("sim_alloc", {"nbytes": MiB, "gpu": gpu}), "ok", "out_of_memory")
    settle(case, other, [])


def abuse_holder_vanishes(case: Case) -> None:
    group = case.name("g")
    holder = registered(case, case.name("h"), group)
    if case.rng.random() < 0.5:
        holder.call("sim_alloc", {"nbytes": 2 * MiB, "gpu": case.rng.choice((0, 1))})
    expect(holder.call("acquire", {}), "ok")
    waiter = registered(case, case.name("w"), group)
    rid = waiter.request("acquire", {})
    if case.rng.random() < 0.5:
        holder.send(frame(pack({"id": 99, "op": "release"}))[:7], frames=0)  # dies in the middle of a frame
    holder.close()
    expect(waiter.reply_to(rid), "ok")
    settle(case, waiter, [])


def abuse_waiter_vanishes(case: Case) -> None:
    group = case.name("g")
    holder = registered(case, case.name("h"), group)
    expect(holder.call("acquire", {}), "ok")
    ghost = registered(case, case.name("ghost"), group)
    for _ in range(case.rng.choice((1, 3, 300))):
        ghost.request("acquire", {"timeout": case.rng.choice((None, 30.0))})
    ghost.call("ping")
    ghost.close()
    late = registered(case, case.name("late"), group)
    rid = late.request("acquire", {})
    expect(holder.call("release"), "ok")
    grant = expect(late.reply_to(rid), "ok")
    if grant["result"]["job"] != case.name("late"):
        raise FuzzFailure(f"the lock went to {grant['result']['job']!r} after its connection closed")
    status = late.call("status")["result"]
    queue = [q for q in next(g["queue"] for g in status["groups"] if g["group"] == group) if q.get("requests", 1)]
    if queue:
        raise FuzzFailure(f"a closed connection is still queued: {queue}")
    settle(case, late, [])


def abuse_duplicate_ids(case: Case) -> None:
    group = case.name("g")
    holder = registered(case, case.name("h"), group)
    expect(holder.call("acquire", {}), "ok")
    dup = registered(case, case.name("d"), group)
    values: list[dict[str, Any]] = [
        {"id": 5, "op": op, "args": {}} for op in ("acquire", "acquire", "cancel", "acquire", "status")
    ]
    values[2]["args"] = {"request": 5}
    for v in values:
        dup.send_value(v)
    dup.next_id = 100
    dup.call("ping")
    # the second acquire stands for the first; the cancel ends it; the third waits on
    got = sorted("ok" if m["ok"] else m["error"]["code"] for m in dup.stash if m.get("id") == 5)
    if got != ["acquire_cancelled", "ok", "ok"]:
        raise FuzzFailure(f"requests with one id were answered with {got}")
    dup.stash.clear()
    expect(holder.call("release"), "ok")
    grant = expect(dup.reply_to(5), "ok")  # the grant
    if grant["result"].get("job") != case.name("d"):
        raise FuzzFailure(f"expected the grant for request 5, got {short(grant)}")
    third = registered(case, case.name("t"), group)
    rid = third.request("acquire", {})
    expect(dup.call("release"), "ok")
    expect(dup.call("release"), "not_holder")
    expect(third.reply_to(rid), "ok")
    if not dup.quiet(5):
        raise FuzzFailure("a second grant answered request 5")
    settle(case, dup, [])
    settle(case, third, [])


def abuse_acquire_timeouts(case: Case) -> None:
    group = case.name("g")
    holder = registered(case, case.name("h"), group)
    expect(holder.call("acquire", {}), "ok")
    w = registered(case, case.name("w"), group)
    expect(w.call("acquire", {"timeout": 0}), "acquire_timeout")
    expect(w.call("acquire", {"timeout": 0.01}), "acquire_timeout")
    rid = w.request("acquire", {"timeout": 1e300})
    if not w.quiet(rid):
        raise FuzzFailure("an acquire with a huge timeout was answered while the lock was held")
    expect(w.call("cancel", {"request": rid}), "ok")
    expect(w.reply_to(rid), "acquire_cancelled")
    expect(holder.call("release"), "ok")
    expect(w.call("acquire", {"timeout": 2**64 - 1}), "ok")
    settle(case, w, [])


def abuse_same_job_twice(case: Case) -> None:
    job, group = case.name("j"), case.name("g")
    a, b = registered(case, job, group), registered(case, job, group)
    expect(b.call("release"), "not_holder")
    expect(a.call("acquire", {}), "ok")
    expect(b.call("release"), "not_holder")
    expect(b.call("acquire", {}), "ok")  # threads of one job share its hold
    expect(a.call("release"), "ok")
    other = registered(case, case.name("o"), group)
    rid = other.request("acquire", {})
    if not other.quiet(rid):
        raise FuzzFailure("the lock moved while a connection of its job still held it")
    b.close()
    expect(other.reply_to(rid), "ok")
    settle(case, a, [])


def abuse_intruder(case: Case) -> None:
    """A short visit to the bystanders' own group."""
    w = registered(case, case.name("i"), "steady", [0])
    reply = w.call("acquire", {"timeout": 2.0})
    expect(reply, "ok", "acquire_timeout")
    if reply["ok"]:
        expect(w.call("release"), "ok")
    expect(w.call("release"), "not_holder")
    settle(case, w, [])


ABUSES: dict[str, Callable[[Case], None]] = {
    "before-register": abuse_before_register,
    "release-without-holding": abuse_release_without_holding,
    "cancel-others-request": abuse_cancel_others,
    "free-others-region": abuse_free_others_region,
    "offload-done-unknown": abuse_offload_done,
    "offload-answers": abuse_offload_answers,
    "holder-vanishes": abuse_holder_vanishes,
    "alloc-then-vanish": abuse_alloc_then_vanish,
    "waiter-vanishes": abuse_waiter_vanishes,
    "duplicate-ids": abuse_duplicate_ids,
    "acquire-timeouts": abuse_acquire_timeouts,
    "same-job-twice": abuse_same_job_twice,
    "intruder": abuse_intruder,
}


def case_abuse(case: Case) -> None:
    variant = case.rng.choice(sorted(ABUSES))
    case.tags.append(variant)
    ABUSES[variant](case)


KINDS: dict[str, tuple[float, Callable[[Case], None]]] = {
    "bytes": (0.15, case_bytes),
    "values": (0.25, case_values),
    "mutated": (0.42, case_mutated),
    "abuse": (0.18, case_abuse),
}


def run_case(path: str, seed: int, index: int) -> tuple[Case, str | None]:
    rng = random.Random(f"{seed}:{index}")
    case = Case(index, rng, path)
    names = sorted(KINDS)
    case.kind = rng.choices(names, weights=[KINDS[k][0] for k in names])[0]
    failure = None
    try:
        KINDS[case.kind][1](case)
    except FuzzFailure as exc:
        failure = str(exc)
        if "within" in failure:  # a hang: what the daemon says about this case's groups and jobs
            failure += "\n" + json.dumps(case_picture(path, case), default=str)
    except Exception:
        failure = "fuzzer: " + traceback.format_exc(limit=3)
    finally:
        for w in case.wires:
            w.close()
    return case, failure


def case_picture(path: str, case: Case) -> dict[str, Any]:
    prefix = f"fz{case.index}-"
    try:
        status = daemon_status(path, timeout=REPLY_TIMEOUT)
    except Exception as exc:
        return {"status": repr(exc)}
    return {
        "groups": [g for g in status["groups"] if g["group"].startswith(prefix)],
        "jobs": [
            j for j in status["jobs"] if j["job"].startswith(prefix) or j["location"] not in ("resident", "parked")
        ],
        "devices": [{k: d[k] for k in ("index", "used", "jobs")} for d in status["devices"]],
    }


def fuzz_main(argv: list[str]) -> int:
    """``path seed cases [first]``: run the cases and print a JSON report as the last line."""
    path, seed, cases = argv[0], int(argv[1]), int(argv[2])
    first = int(argv[3]) if len(argv) > 3 else 0
    indices = iter(range(first, first + cases))
    lock = threading.Lock()
    kinds: Counter[str] = Counter()
    codes: Counter[str] = Counter()
    frames = connections = 0
    failures: list[dict[str, Any]] = []
    started = time.monotonic()

    def worker() -> None:
        nonlocal frames, connections
        while True:
            with lock:
                index = next(indices, None)
            if index is None:
                return
            case, failure = run_case(path, seed, index)
            with lock:
                kinds[case.kind] += 1
                kinds.update(f"{case.kind}/{tag}" for tag in case.tags)
                frames += sum(w.frames for w in case.wires)
                connections += len(case.wires)
                for w in case.wires:
                    codes.update("ok" if m.get("ok") else m["error"]["code"] for m in w.received if "push" not in m)
                    codes.update(f"push:{m['push']}" for m in w.received if "push" in m)
                if failure is not None:
                    failures.append(
                        {"case": index, "kind": case.kind, "tags": case.tags, "failure": failure, "log": case.log}
                    )

    threads = [threading.Thread(target=worker) for _ in range(WORKERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    report = {
        "seed": seed,
        "cases": cases,
        "frames": frames,
        "connections": connections,
        "seconds": round(time.monotonic() - started, 1),
        "kinds": dict(sorted(kinds.items())),
        "replies": dict(sorted(codes.items())),
        "failures": sorted(failures, key=lambda f: f["case"]),
    }
    print(json.dumps(report), flush=True)
    return 0


FUZZER = "import sys; from tests.integration.test_socket_fuzz import fuzz_main; sys.exit(fuzz_main(sys.argv[1:]))"


# --- the bystanders ----------------------------------------------------------------------------


class Bystander(threading.Thread):
    """A well-behaved job: acquire, check its bytes, write new ones, release; over and over."""

    def __init__(self, socket_path: str, job: str, group: str, gpu: int, stop: threading.Event) -> None:
        super().__init__(name=job, daemon=True)
        self.client = timesliced.Client(job=job, group=group, address=socket_path, gpus=[gpu])
        self.job, self.gpu, self.stop = job, gpu, stop
        self.grants = 0
        self.data_errors = 0
        self.errors: list[str] = []

    def run(self) -> None:
        try:
            with self.client:
                self._loop()
        except Exception as exc:
            self.errors.append(f"{exc.__class__.__name__}: {exc}")

    def _loop(self) -> None:
        region, expected = None, ""
        while not self.stop.is_set():
            with self.client.slice(timeout=60):
                if region is None:
                    region = self.client.sim_alloc(REGION_BYTES, gpu=self.gpu)
                elif region.checksum() != expected:
                    self.data_errors += 1
                if self.grants % 5 == 4:  # now and then a second region comes and goes
                    extra = self.client.sim_alloc(2 * MiB, gpu=self.gpu)
                    extra.fill(b"spare")
                    self.client.sim_free(extra)
                region.fill(f"{self.job}/{self.grants}".encode())
                expected = region.checksum()
            self.grants += 1


class ErrorLog(logging.Handler):
    """Tracebacks logged by the daemon: a task, a cleanup or an effect that failed."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info:
            self.records.append(f"{record.name}: {record.getMessage()} ({record.exc_info[1]!r})")


@pytest.fixture
def error_log() -> Iterator[ErrorLog]:
    handler = ErrorLog()
    logger = logging.getLogger("timesliced")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_fuzzed_socket_hurts_neither_the_daemon_nor_other_clients(daemon: EmbeddedDaemon, error_log: ErrorLog) -> None:
    print(f"socket fuzz: seed {SEED}, {CASES} cases (TIMESLICED_FUZZ_SEED / TIMESLICED_FUZZ_CASES)")
    names = {job for job, _, _ in BYSTANDERS}
    stop = threading.Event()
    bystanders = [Bystander(daemon.socket, job, group, gpu, stop) for job, group, gpu in BYSTANDERS]
    fuzzer = None
    reports, internal = [], []
    for b in bystanders:
        b.start()
    try:
        wait_for(lambda: all(b.grants >= 2 for b in bystanders) or any(b.errors for b in bystanders), timeout=30)
        before = [b.grants for b in bystanders]
        # In batches, each its own process: when one exits, its jobs must go without a trace.
        per_batch = -(-CASES // BATCHES)
        for first in range(0, CASES, per_batch):
            count = str(min(per_batch, CASES - first))
            fuzzer = spawn_python(FUZZER, daemon.socket, str(SEED), count, str(first))
            while fuzzer.poll() is None:  # the daemon answers throughout
                internal.append(daemon_status(daemon.socket, timeout=10)["counters"]["internal_errors"])
                time.sleep(0.5)
            out, err = fuzzer.communicate(timeout=30)
            assert fuzzer.returncode == 0, err
            reports.append(json.loads(out.strip().splitlines()[-1]))
            wait_for(lambda: {j["job"] for j in daemon_status(daemon.socket)["jobs"]} == names, timeout=30)
            assert_no_trace_of_the_fuzzer(daemon, names)
        during = [b.grants - n for b, n in zip(bystanders, before, strict=True)]
        after = [b.grants for b in bystanders]
        wait_for(lambda: all(b.grants >= n + 3 for b, n in zip(bystanders, after, strict=True)), timeout=30)
    finally:
        stop.set()
        if fuzzer is not None and fuzzer.poll() is None:
            fuzzer.kill()
            fuzzer.communicate()
        for b in bystanders:
            b.join(60)

    report = merged(reports)
    print(json.dumps({k: v for k, v in report.items() if k != "failures"}, indent=1))
    failures = report["failures"]
    assert not failures, f"seed {SEED}: {len(failures)} failing cases, the first ones:\n" + json.dumps(
        failures[:5], indent=1
    )
    assert report["frames"] >= 2000
    assert set(internal) == {0}, f"seed {SEED}: internal errors during the fuzz: {internal}"
    assert [b.errors for b in bystanders] == [[], [], []]
    assert [b.data_errors for b in bystanders] == [0, 0, 0]
    assert all(n > 0 for n in during), f"the bystanders stalled during the fuzz: {during}"
    assert error_log.records == []

    with timesliced.Client(job="fresh", group="after-fuzz", address=daemon.socket) as fresh:
        assert fresh.acquire(timeout=10).fence == 1
        region = fresh.sim_alloc(MiB)
        region.fill(b"fresh")
        assert region.read(5) == b"fresh"
        fresh.release()


def assert_no_trace_of_the_fuzzer(daemon: EmbeddedDaemon, names: set[str]) -> None:
    """No connection, waiter, holder, memory or simulated state of a job other than the bystanders'."""
    status = daemon_status(daemon.socket)
    assert status["counters"]["internal_errors"] == 0
    assert status["connections"] == len(BYSTANDERS) + 1  # and this status request's own
    for group in status["groups"]:
        assert {q["job"] for q in group["queue"]} <= names, group
        assert group["holder"] in names | {None}, group
    for device in status["devices"]:
        assert set(device["jobs"]) <= names, device
    sim = daemon.config.resolved_sim_dir()
    assert len(list((sim / "jobs").iterdir())) == len(BYSTANDERS)  # their control files
    # parked copies (those of reclaimed jobs are renamed, then deleted on a worker thread)
    wait_for(lambda: len(list((sim / "parked").iterdir())) <= len(BYSTANDERS))


def merged(reports: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"seed": SEED, "cases": 0, "frames": 0, "connections": 0, "seconds": 0.0}
    counters: dict[str, Counter[str]] = {"kinds": Counter(), "replies": Counter()}
    failures = []
    for r in reports:
        for key in ("cases", "frames", "connections", "seconds"):
            out[key] += r[key]
        for key, counter in counters.items():
            counter.update(r[key])
        failures += r["failures"]
    out["seconds"] = round(out["seconds"], 1)
    return {**out, **{k: dict(sorted(c.items())) for k, c in counters.items()}, "failures": failures}


# --- single inputs the fuzzer found -------------------------------------------------------------


def nested_hello(levels: int) -> bytes:
    """A hello whose version is ``levels`` nested lists: the frame nests ``levels + 2`` deep."""
    return frame(b"\x83\xa2id\x01\xa2op\xa5hello\xa4args\x81\xa7version" + b"\x91" * levels + b"\xc0")


@pytest.mark.parametrize(
    ("levels", "code"),
    [(30, "version_mismatch"), (31, "malformed_message"), (990, "malformed_message"), (1100, "malformed_message")],
)
def test_deeply_nested_values_never_reach_a_handler(daemon: EmbeddedDaemon, raw: Raw, levels: int, code: str) -> None:
    # 990 levels used to raise RecursionError in the hello handler (repr of the version): an internal error
    raw.send_bytes(nested_hello(levels))
    reply = raw.recv()
    assert reply is not None and reply["error"]["code"] == code, reply
    assert raw.closed()
    assert daemon_status(daemon.socket)["counters"]["internal_errors"] == 0


def test_an_overlong_op_is_a_bad_request(raw: Raw) -> None:
    # once echoed by repr() into an unknown_op reply four times its size: over the frame limit, an internal error
    raw.hello()
    reply = raw.call(1, "\0" * 300_000)
    assert reply["error"]["code"] == "bad_request", reply
    assert raw.call(2, "ping")["ok"]


def test_huge_hello_version_is_a_version_mismatch(raw: Raw) -> None:
    reply = raw.call(1, "hello", {"version": b"\0" * 300_000})
    assert reply["error"]["code"] == "version_mismatch", reply


def test_offload_answer_naming_a_huge_gpu_is_a_bad_request(daemon: EmbeddedDaemon) -> None:
    owner, rival = Raw(daemon.socket), Raw(daemon.socket)
    try:
        owner.hello()
        assert owner.call(1, "register", {"job": "o", "group": "g", "gpus": [1], "park": {"method": "offload"}})["ok"]
        assert owner.call(2, "acquire")["ok"] and owner.call(3, "release")["ok"]
        rival.hello()
        assert rival.call(1, "register", {"job": "r", "group": "g", "gpus": [1]})["ok"]
        rival.send({"id": 2, "op": "acquire", "args": {}})  # parks the owner: a directive to answer
        push = owner.recv()
        assert push is not None and push["push"] == "offload", push
        answer = {"directive": push["data"]["directive"], "ok": True, "nbytes": 0, "footprint": {}}
        reply = owner.call(4, "offload_done", {**answer, "footprint": {"\0" * 300_000: 1}})
        assert owner.call(5, "offload_done", answer)["ok"]
        grant = rival.recv()
        assert grant is not None and grant["ok"], grant
        assert reply["error"]["code"] == "bad_request", reply
    finally:
        owner.close()
        rival.close()


def test_requests_before_a_broken_frame_are_answered_however_they_arrive(daemon: EmbeddedDaemon) -> None:
    ping, broken = frame(pack({"id": 7, "op": "ping"})), frame(b"\xc1")
    answered = []
    for chunks in ([ping, broken], [ping + broken]):
        r = Raw(daemon.socket)
        r.hello()
        for chunk in chunks:
            r.send_bytes(chunk)
            time.sleep(0.05)
        got = []
        while (m := r.recv()) is not None:
            got.append(m)
        r.close()
        answered.append([m["id"] for m in got])
    assert answered[0] == [7, None]  # apart: the ping is answered, then the error
    assert answered[1] == [7, None], answered  # together: only the error
