"""Bad input hurts only the connection that sent it; the daemon and others keep working."""

from __future__ import annotations

import os
import socket
import struct
import threading
import time

import pytest

import timesliced
from timesliced import errors
from timesliced.daemon.embedded import EmbeddedDaemon

from ..helpers.daemon import Raw
from ..helpers.processes import run_python, wait_for


@pytest.fixture
def bystander(daemon: EmbeddedDaemon) -> timesliced.Client:
    """A well-behaved client holding the lock through every test."""
    c = timesliced.Client(job="bystander", group="g", address=daemon.socket)
    c.acquire()
    yield c
    c.close()


def assert_bystander_fine(c: timesliced.Client) -> None:
    c.release()
    assert c.acquire().job == "bystander"
    assert c.status()["jobs"]


def test_malformed_msgpack_gets_error_then_close(raw: Raw, bystander: timesliced.Client) -> None:
    raw.hello()
    raw.send_bytes(struct.pack(">I", 3) + b"\xc1\xc1\xc1")  # 0xc1 is never valid msgpack
    reply = raw.recv()
    assert reply is not None and reply["ok"] is False and reply["error"]["code"] == "malformed_message"
    assert raw.closed()
    assert_bystander_fine(bystander)


def test_non_map_frame(raw: Raw, bystander: timesliced.Client) -> None:
    raw.send([1, 2, 3])
    reply = raw.recv()
    assert reply is not None and reply["error"]["code"] == "malformed_message"
    assert raw.closed()
    assert_bystander_fine(bystander)


@pytest.mark.parametrize(
    ("message", "code"),
    [
        ({"id": "x", "op": "ping"}, "bad_request"),
        ({"id": True, "op": "ping"}, "bad_request"),
        ({"id": -1, "op": "ping"}, "bad_request"),
        ({"id": 5}, "bad_request"),
        ({"id": 5, "op": 7}, "bad_request"),
        ({"id": 5, "op": "ping", "args": [1]}, "bad_request"),
        ({"id": 5, "op": "no_such_op"}, "unknown_op"),
        ({"id": 5, "op": "register", "args": {"job": 3, "group": "g"}}, "bad_request"),
        ({"id": 5, "op": "register", "args": {"job": "j", "group": "g", "gpus": "0"}}, "bad_request"),
        ({"id": 5, "op": "register", "args": {"job": "j" * 1000, "group": "g"}}, "bad_request"),
        ({"id": 5, "op": "acquire", "args": {}}, "not_registered"),
        ({"id": 5, "op": "release"}, "not_registered"),
        ({"id": 5, "op": "sim_alloc", "args": {"nbytes": -1}}, "bad_request"),
    ],
)
def test_wrong_types_get_error_reply_and_connection_stays(
    raw: Raw, bystander: timesliced.Client, message: dict[str, object], code: str
) -> None:
    raw.hello()
    raw.send(message)
    reply = raw.recv()
    assert reply is not None and reply["ok"] is False, reply
    assert reply["error"]["code"] == code, reply
    assert isinstance(reply["error"]["message"], str) and reply["error"]["message"]
    assert raw.call(9, "ping")["ok"]  # the same connection still works
    assert_bystander_fine(bystander)


def test_bad_acquire_args_after_register(raw: Raw) -> None:
    raw.hello()
    assert raw.call(1, "register", {"job": "j", "group": "g"})["ok"]
    for bad in ("soon", -1, float("inf"), float("nan"), True, [1]):
        reply = raw.call(2, "acquire", {"timeout": bad})
        assert reply["error"]["code"] == "bad_request", (bad, reply)
    reply = raw.call(3, "sim_alloc", {"nbytes": 1 << 50, "gpu": 0})
    assert reply["error"]["code"] == "out_of_memory"
    assert "free" in reply["error"]["message"]
    assert raw.call(4, "sim_alloc", {"nbytes": 10, "gpu": 9})["error"]["code"] == "unknown_device"


def test_oversized_frame_is_refused_before_its_body(raw: Raw, bystander: timesliced.Client) -> None:
    raw.hello()
    raw.send_bytes(struct.pack(">I", 1 << 30))  # announces 1 GiB; nothing more is sent
    reply = raw.recv()
    assert reply is not None and reply["error"]["code"] == "frame_too_large"
    assert raw.closed()
    assert_bystander_fine(bystander)


@pytest.mark.slow
def test_half_frame_stall_is_closed(raw: Raw, bystander: timesliced.Client) -> None:
    raw.hello()
    raw.send_bytes(struct.pack(">I", 100) + b"\x80")  # 1 of 100 bytes, then silence
    start = time.monotonic()
    reply = raw.recv()
    assert reply is not None and reply["error"]["code"] == "protocol_error"
    assert raw.closed()
    assert time.monotonic() - start >= 0.4  # stall_timeout is 0.5 s in the fixture
    assert_bystander_fine(bystander)


@pytest.mark.slow
def test_request_before_hello_and_wrong_version(daemon: EmbeddedDaemon, bystander: timesliced.Client) -> None:
    early = Raw(daemon.socket)
    reply = early.call(1, "status")
    assert reply["error"]["code"] == "handshake_required"
    assert early.closed()
    old = Raw(daemon.socket)
    reply = old.call(1, "hello", {"version": 99})
    assert reply["error"]["code"] == "version_mismatch"
    assert old.closed()
    silent = Raw(daemon.socket)  # never says hello: closed after handshake_timeout (1 s)
    reply = silent.recv()
    assert reply is not None and reply["error"]["code"] == "protocol_error"
    assert silent.closed()
    for r in (early, old, silent):
        r.close()
    assert_bystander_fine(bystander)


def test_thousands_of_connections_open_and_close(daemon: EmbeddedDaemon, bystander: timesliced.Client) -> None:
    def churn(n: int) -> None:
        for i in range(n):
            s = socket.socket(socket.AF_UNIX)
            s.connect(daemon.socket)
            if i % 3 == 0:
                s.sendall(b"\x00\x00")  # half a header, then gone
            s.close()

    threads = [threading.Thread(target=churn, args=(500,)) for _ in range(4)]
    held = [Raw(daemon.socket) for _ in range(200)]  # and many open at once, through the churn
    try:
        for h in held:
            h.hello()  # first: a slow machine's churn may outlast the handshake's timeout
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for rid, h in enumerate(held, start=1):
            assert h.call(rid, "ping")["ok"]
    finally:
        for h in held:
            h.close()
    assert_bystander_fine(bystander)
    counters = bystander.status()["counters"]
    # All from this one process: past 256 at once it is refused (the daemon accepts a burst of
    # connections before it sees the earlier ones close), and every one is answered either way.
    assert counters["accepted"] + counters["refused"] >= 2200
    wait_for(lambda: len(daemon.daemon.server.connections) <= 2)  # the bystander (and its status call)
    late = Raw(daemon.socket)  # the limit counts open connections only
    late.hello()
    late.close()


def test_request_id_0_is_reserved_for_acquires(raw: Raw, bystander: timesliced.Client) -> None:
    raw.hello()
    assert raw.call(1, "register", {"job": "j", "group": "g"})["ok"]
    reply = raw.call(0, "acquire", {})  # the scheduler's own requests (a preempted job queued again) use 0
    assert reply["error"]["code"] == "bad_request" and "reserved" in reply["error"]["message"]
    assert raw.call(2, "ping")["ok"]
    assert_bystander_fine(bystander)


def test_connection_limit_per_client_process(tmp_path: object) -> None:
    with EmbeddedDaemon(gpus=1, gpu_memory=8 << 20, max_connections_per_client=4) as d:
        held = [Raw(d.socket) for _ in range(4)]
        for h in held:
            h.hello()
        extra = Raw(d.socket)
        reply = extra.recv()
        assert reply is not None and reply["error"]["code"] == "limit_exceeded"
        assert f"process {os.getpid()} already has 4 connections" in reply["error"]["message"]
        assert extra.closed()
        extra.close()
        other = run_python(  # another process is not held back by this one
            "import sys, timesliced; print(timesliced.Client(job='o', group='g', address=sys.argv[1]).status())",
            d.socket,
        )
        assert other.returncode == 0, other.stderr
        for h in held:
            h.close()


def test_connection_limit(tmp_path: object) -> None:
    with EmbeddedDaemon(gpus=1, gpu_memory=8 << 20, max_connections=5) as d:
        held = [Raw(d.socket) for _ in range(5)]
        for h in held:
            h.hello()
        extra = Raw(d.socket)
        reply = extra.recv()
        assert reply is not None and reply["error"]["code"] == "limit_exceeded"
        assert extra.closed()
        extra.close()
        held[0].close()
        time.sleep(0.1)
        again = Raw(d.socket)
        again.hello()
        for h in [*held[1:], again]:
            h.close()


def test_client_that_does_not_read_is_dropped(tmp_path: object) -> None:
    with EmbeddedDaemon(gpus=1, gpu_memory=8 << 20, max_write_buffer=64 << 10) as d:
        greedy = Raw(d.socket)
        greedy.hello()
        greedy.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        body = b"\x83\xa2id\x01\xa2op\xa6status\xa4args\x80"  # {"id":1,"op":"status","args":{}}
        try:
            for _ in range(5000):  # ask for status over and over, never read a reply
                greedy.send_bytes(struct.pack(">I", len(body)) + body)
        except OSError:
            pass  # the daemon already hung up on us
        with timesliced.Client(job="ok", group="g", address=d.socket) as c:
            assert c.acquire().fence == 1
            assert c.status()["counters"]["accepted"] >= 2
        greedy.close()


def test_errors_cross_the_wire_as_typed_exceptions(daemon: EmbeddedDaemon) -> None:
    c = timesliced.Client(job="a", group="g", address=daemon.socket)
    with pytest.raises(errors.NotHolder) as info:
        c.release()
    assert info.value.code == "not_holder" and "does not hold" in info.value.message
    assert isinstance(info.value, timesliced.TimeslicedError)
    c.close()
