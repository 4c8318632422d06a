"""Fixtures every test may ask for: a daemon on a thread (``daemon``) and a raw connection to it (``raw``).

What tests share besides fixtures lives in ``tests/helpers``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from timesliced.config import DaemonConfig
from timesliced.daemon.embedded import EmbeddedDaemon

from .helpers.daemon import TOKEN, Raw, serving

pytest_plugins = ["tests.helpers.sims"]  # the simulated GPU fixtures: root, sims

MiB = 1 << 20

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
    with serving(config) as embedded:
        yield embedded


@pytest.fixture
def raw(daemon: EmbeddedDaemon) -> Iterator[Raw]:
    conn = Raw(daemon.socket)
    yield conn
    conn.close()
