from __future__ import annotations

import os
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest

from timesliced.config import DaemonConfig
from timesliced.daemon.embedded import EmbeddedDaemon
from timesliced.env import default_sim_dir

MiB = 1 << 20
TOKEN = "shared-token-for-tests-5d1e8c0b"  # what TCP clients of the ``daemon`` fixture prove
REPO = Path(__file__).resolve().parent.parent

# tests/gpu needs a real NVIDIA GPU and runs only when asked for (tests/gpu/check.sh sets this):
# elsewhere it is neither collected nor counted as skipped.
collect_ignore_glob = [] if os.environ.get("TIMESLICED_GPU_TESTS") == "1" else ["gpu", "gpu/*"]


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[EmbeddedDaemon]:
    """A daemon on a background thread: 2 simulated GPUs of 64 MiB, no copy throttling."""
    config = DaemonConfig(
        state_dir=tmp_path / "state",
        backend="sim",
        gpus=2,
        gpu_memory=64 * MiB,
        bandwidth=0,
        stall_timeout=0.5,
        handshake_timeout=1.0,
        pid_poll_interval=0.1,
        listen=("127.0.0.1", 0),
        token=TOKEN,
    )
    embedded = EmbeddedDaemon(config)
    embedded.start()
    try:
        yield embedded
    finally:
        embedded.stop()
        import shutil

        shutil.rmtree(default_sim_dir(config.state_dir), ignore_errors=True)


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


@pytest.fixture
def raw(daemon: EmbeddedDaemon) -> Iterator[Raw]:
    conn = Raw(daemon.socket)
    yield conn
    conn.close()


def run_python(code: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter (a real client process)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout, env=env, check=False
    )


def spawn_python(code: str, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )


def wait_for(predicate: Any, timeout: float = 10.0, interval: float = 0.02) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(interval)
