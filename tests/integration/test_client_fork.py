"""A ``Client`` made before ``fork()`` is its parent's: in the child its calls raise ``ConnectionLost`` at
once, and neither they nor ``close()`` write on the parent's connection (a child's ``release()`` would
release the parent's lock at the daemon, while the parent believes it holds it).
"""

from __future__ import annotations

import os
import time
import warnings
from pathlib import Path
from typing import Any

import pytest

import timesliced
from timesliced import errors
from timesliced.config import DaemonConfig

from ..helpers.daemon import serving

pytestmark = pytest.mark.slow


def in_child(client: timesliced.Client) -> str:
    """What the client does in a forked child: ``release()``'s outcome, then its ``close()``."""
    read, write = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # a fork of a process with threads (3.12+)
        pid = os.fork()
    if pid == 0:  # the child
        outcome = "released"
        started = time.monotonic()
        try:
            client.release()
        except errors.ConnectionLost as exc:
            outcome = f"{exc.message} ({time.monotonic() - started:.1f}s)"
        except BaseException as exc:
            outcome = repr(exc)
        try:
            client.close()
        except BaseException as exc:
            outcome += f"; close raised {exc!r}"
        os.write(write, outcome.encode())
        os._exit(0)
    os.close(write)
    chunks = []
    while chunk := os.read(read, 4096):
        chunks.append(chunk)
    os.close(read)
    os.waitpid(pid, 0)
    return b"".join(chunks).decode()


def holder(status: dict[str, Any]) -> Any:
    (group,) = status["groups"].values() if isinstance(status["groups"], dict) else status["groups"]
    return group.get("holder")


def test_a_forked_child_cannot_release_or_close_its_parents_connection(tmp_path: Path) -> None:
    with serving(DaemonConfig(state_dir=tmp_path / "state", backend="sim", gpus=1)) as daemon:
        client = timesliced.Client("a", "g", address=daemon.socket, request_timeout=5.0)
        other = timesliced.Client("b", "g", address=daemon.socket)
        try:
            client.acquire()
            outcome = in_child(client)
            assert "make a new client in this process" in outcome and "(0.0s)" in outcome, outcome
            assert holder(other.status()) == "a", "the child's release or close acted for the parent"
            assert client.lock.holding
            client.release()  # the parent's connection still works
            assert holder(other.status()) is None
        finally:
            other.close()
            client.close()
