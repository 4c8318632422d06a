"""A ``Client`` driven by hand, without a daemon or a socket: its core brought to ``ready`` on a fake wire.

The test plays the daemon: ``OfflineClient.feed`` hands the core bytes as ``Client._receive`` does (under
the client's lock, then ``_flush``) and returns the outputs left for ``_dispatch``, so a test can dispatch
them late, as a thread preempted between the two would. What the client sends lands in ``Wire``.
"""

from __future__ import annotations

import time
from typing import Any

import timesliced
from timesliced.client.directives import directive_worker
from timesliced.wire.codec import FrameDecoder, encode
from timesliced.wire.messages import Push, Reply


class Wire:
    """Stands in for the client's socket: records what is sent, and whether it was shut down."""

    def __init__(self) -> None:
        self.sent = bytearray()
        self.shut = False
        self.fail: BaseException | None = None  # raised by the next sendall

    def sendall(self, data: bytes) -> None:
        if self.fail is not None:
            error, self.fail = self.fail, None
            raise error
        self.sent += data

    def shutdown(self, how: int) -> None:
        self.shut = True

    def close(self) -> None:
        pass

    def requests(self) -> list[dict[str, Any]]:
        """The requests sent since the last look."""
        data, self.sent = bytes(self.sent), bytearray()
        return FrameDecoder().feed(data)


class OfflineClient:
    """A ``Client`` whose connections the test makes, reads and ends by hand."""

    def __init__(self, **options: Any) -> None:
        self.client = timesliced.Client("a", "g", address="/nonexistent/timesliced.sock", **options)
        # The test is the reader thread: none is started, and its directive worker is made here.
        self.client._driving = True
        self.client._directives = directive_worker("a")
        self.wire = Wire()
        self.conn = 0

    def connect(self) -> int:
        """A new connection through its handshake to ``ready``; returns its number."""
        client, core, now = self.client, self.client._core, time.monotonic()
        with client._lock:
            if not core.wants_connection:
                core.wait_ready(now)
            core.start_attempt(now)
            self.conn = core.connection_made(now)
            client._sock, client._sock_conn = self.wire, self.conn  # type: ignore[assignment]
            client._flush()
        (hello,) = self.wire.requests()
        self.answer(hello["id"], {"version": 1, "session": 7})
        (register,) = self.wire.requests()
        self.answer(register["id"], {"session": 7, "gpus": [0]})
        self.client._dispatch(self.answer_later)
        return self.conn

    def feed(self, message: dict[str, Any]) -> list[Any]:
        """``_receive``'s work for bytes holding ``message``; returns what is left for ``_dispatch``."""
        client = self.client
        with client._lock:
            client._core.receive_data(self.conn, encode(message), time.monotonic())
            return client._flush()

    def push(self, event: str, data: dict[str, Any]) -> list[Any]:
        return self.feed(Push(event, data).to_wire())

    def answer(self, rid: int, result: Any) -> None:
        self.answer_later = self.feed(Reply(rid, True, result, None).to_wire())

    def end(self, reason: str = "the daemon closed the connection") -> None:
        """What ``_receive`` does when the socket's end is read (by any thread)."""
        client = self.client
        with client._lock:
            client._core.connection_lost(self.conn, time.monotonic(), reason)
            client._rooms.lost(reason, self.conn)
            client._sock = None
            later = client._flush()
        client._dispatch(later)

    def close(self) -> None:
        self.client._rooms.lost("test over")
        self.client.close()
