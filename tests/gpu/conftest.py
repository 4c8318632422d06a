"""Every test here needs a real NVIDIA GPU: marked ``gpu``, and skipped with the reason where there is none.

The directory is collected only with ``TIMESLICED_GPU_TESTS=1`` (see
``tests/conftest.py``); ``check.sh`` sets it.
"""

from __future__ import annotations

import functools
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from . import check

# CUDA numbers GPUs fastest first unless told otherwise, NVML by PCI bus: make GPU 0 the same
# GPU for both before anything in this process initialises the driver.
os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")

HERE = Path(__file__).resolve().parent


@functools.cache
def _preflight() -> tuple[dict[str, Any] | None, str]:
    """(what GPU 0 is, "") or (None, why this machine cannot run the GPU tests)."""
    try:
        return check.preflight(), ""
    except check.PreflightError as exc:
        return None, str(exc)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    mine = [item for item in items if HERE in Path(item.path).resolve().parents]
    if not mine:
        return
    if threading.current_thread() is threading.main_thread():
        # A timeout's SIGTERM ends the run like Ctrl-C, so the daemons and jobs a test started are stopped.
        signal.signal(signal.SIGTERM, check.as_interrupt)
    _, why = _preflight()
    for item in mine:
        item.add_marker(pytest.mark.gpu)
        if why:
            item.add_marker(pytest.mark.skip(reason=f"needs a usable NVIDIA GPU: {why}"))


@pytest.fixture(scope="session")
def gpu() -> dict[str, Any]:
    """What the preflight found about GPU 0 (name, memory, driver, checkpoint API verdict)."""
    info, why = _preflight()
    if info is None:
        pytest.skip(f"needs a usable NVIDIA GPU: {why}")
    return info


@pytest.fixture
def nvml() -> Iterator[Any]:
    """An open NVML session."""
    from timesliced.nvml import Nvml

    session = Nvml.open()
    if not session.available:
        pytest.skip(f"needs NVML: {session.reason}")
    try:
        yield session
    finally:
        session.close()
