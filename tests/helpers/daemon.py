"""Test daemons: one embedded for a block (``serving``), the ``daemon`` fixture's token, a raw connection."""

from __future__ import annotations

import shutil
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import msgpack

if TYPE_CHECKING:
    from timesliced.config import DaemonConfig
    from timesliced.daemon.embedded import EmbeddedDaemon

TOKEN = "shared-token-for-tests-5d1e8c0b"  # what TCP clients of the ``daemon`` fixture prove


@contextmanager
def serving(config: DaemonConfig) -> Iterator[EmbeddedDaemon]:
    """A daemon embedded in this process for the block; its simulated GPU's files go with it."""
    from timesliced.daemon.embedded import EmbeddedDaemon

    embedded = EmbeddedDaemon(config)
    embedded.start()
    try:
        yield embedded
    finally:
        embedded.stop()
        shutil.rmtree(config.resolved_sim_dir(), ignore_errors=True)


class Raw:
    """A hand-driven protocol connection for bad-input tests."""

    def __init__(self, path: str) -> None:
        from timesliced.client.protocol import Address
        from timesliced.client.sync import open_socket

        self.sock = open_socket(Address("unix", path=path), 5)
        self.buf = b""

    def send_bytes(self, data: bytes) -> None:
        self.sock.sendall(data)

    def send(self, message: Any) -> None:
        body = msgpack.packb(message, use_bin_type=True)
        self.sock.sendall(struct.pack(">I", len(body)) + body)

    def recv(self) -> dict[str, Any] | None:
        """The next message, or None when the daemon closed the connection."""
        while True:
            if len(self.buf) >= 4:
                (n,) = struct.unpack(">I", self.buf[:4])
                if len(self.buf) >= 4 + n:
                    body, self.buf = self.buf[4 : 4 + n], self.buf[4 + n :]
                    return msgpack.unpackb(body)  # type: ignore[no-any-return]
            try:
                data = self.sock.recv(65536)
            except ConnectionResetError:
                return None
            if not data:
                return None
            self.buf += data

    def call(self, rid: int, op: str, args: dict[str, Any] | None = None) -> dict[str, Any]:
        self.send({"id": rid, "op": op, "args": args or {}})
        reply = self.recv()
        assert reply is not None, f"connection closed instead of answering {op}"
        return reply

    def hello(self) -> None:
        reply = self.call(0, "hello", {"version": 1, "role": "client"})
        assert reply["ok"], reply

    def closed(self) -> bool:
        return self.recv() is None

    def close(self) -> None:
        self.sock.close()
