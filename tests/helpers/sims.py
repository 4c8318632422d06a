"""The simulated GPU backends and client regions of one test, and the fixtures that make and close them.

The fixtures (``root``, ``sims``, and the session's sweep of simulated GPU state) are registered for
every test by ``tests/conftest.py``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from timesliced.backends.sim import SimBackend
from timesliced.env import default_sim_dir
from timesliced.sim.layout import RegionInfo, read_ctl
from timesliced.sim.region import SimRegion

PAGE = 64 << 10
REPO = Path(__file__).resolve().parents[2]


class Sims:
    """Backends and client handles of one test, all closed when it ends."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._backends: list[SimBackend] = []
        self._regions: list[SimRegion] = []

    def backend(self, **settings: Any) -> SimBackend:
        """A backend on the test's root; by default 2 GPUs of 32 pages and unlimited bandwidth."""
        settings = {"gpus": 2, "capacity": 32 * PAGE, "page_size": PAGE, "bandwidth": 0, **settings}
        b = SimBackend(self.root, **settings)
        self._backends.append(b)
        return b

    def open(self, info: RegionInfo) -> SimRegion:
        r = SimRegion.open(info)
        self._regions.append(r)
        return r

    def close(self) -> None:
        for r in self._regions:
            r.close()
        for b in self._backends:
            b.close()


@pytest.fixture(scope="session", autouse=True)
def _no_sim_state_left(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Removes, when the session ends, the simulated GPU state of every state dir the tests made.

    A daemon keeps that state (tmpfs, so host memory) when it stops, on purpose; a test's state dir
    goes with the test's temp folder, so what its daemon left would hold memory until a reboot.
    """
    yield
    for folder, _, _ in os.walk(tmp_path_factory.getbasetemp()):
        shutil.rmtree(default_sim_dir(Path(folder)), ignore_errors=True)


@pytest.fixture
def root(tmp_path: Path) -> Iterator[Path]:
    """A fresh sim root on tmpfs where there is one, like production."""
    base = Path("/dev/shm")
    path = base / f"timesliced-test-{uuid.uuid4().hex[:12]}" if base.is_dir() else tmp_path / "sim"
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def sims(root: Path) -> Iterator[Sims]:
    s = Sims(root)
    yield s
    s.close()


def blake(data: bytes | bytearray) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def extents_of(info: RegionInfo) -> tuple[tuple[int, int], ...]:
    _, slot, _ = read_ctl(Path(info.ctl_path))
    return next(r.extents for r in slot.regions if r.region == info.region)
