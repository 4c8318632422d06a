"""The fake checkpoint driver: its stand-in enums are the bindings' own, and it needs no cuda-python."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.fakes.cuda_driver import StandInCUprocessState, StandInCUresult

from ..helpers.processes import REPO

# Python as if cuda-python were not installed: with None in sys.modules, every import of cuda fails.
WITHOUT_CUDA = "import sys\nsys.modules['cuda'] = None\n"

DRIVE_A_PROCESS = """
import tests.fakes.cuda_driver as fake

assert not fake.HAVE_CUDA_PYTHON and fake.CUresult is fake.StandInCUresult
memory = fake.FakeGpuMemory({0: 100})
driver = fake.FakeCheckpointDriver(memory)
driver.add_process(7, {0: 60})
assert driver.lock(7, 1000) == fake.CUresult.CUDA_ERROR_NOT_INITIALIZED
assert driver.init() == 0
results = [driver.lock(7, 1000), driver.checkpoint(7), driver.checkpoint(7)]
assert results == [0, 0, fake.CUresult.CUDA_ERROR_ILLEGAL_STATE], results
assert driver.state(7) == fake.CHECKPOINTED and memory.free_bytes(0) == 100
assert [driver.restore(7), driver.unlock(7)] == [0, 0] and driver.state(7) == fake.RUNNING
print("ok")
"""

# Every test module that imports the fake, or that needs cuda-python's own types.
USERS = (
    "tests/unit/test_cuda_checkpoint.py",
    "tests/unit/test_cuda_checkpoint_footprints.py",
    "tests/unit/test_cuda_bindings.py",
    "tests/unit/test_parking.py",
    "tests/integration/test_cuda_driver_fake.py",
    "tests/unit/test_offload_client.py",
    "tests/integration/test_cuda_checkpoint_daemon.py",
)


def python(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


def test_the_stand_ins_are_the_bindings_numbers() -> None:
    cu = pytest.importorskip(
        "cuda.bindings.driver", reason="cuda-python is not installed: there are no bindings to compare with"
    )
    for member in StandInCUresult:
        assert int(getattr(cu.CUresult, member.name)) == member.value, member
    assert {m.name: m.value for m in StandInCUprocessState} == {m.name: int(m) for m in cu.CUprocessState}


def test_the_fake_drives_processes_without_cuda_python() -> None:
    done = python(WITHOUT_CUDA + DRIVE_A_PROCESS)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


@pytest.mark.slow
def test_its_users_are_collected_without_cuda_python() -> None:
    run_pytest = WITHOUT_CUDA + "import pytest\nraise SystemExit(pytest.main(sys.argv[1:]))\n"
    done = python(run_pytest, "--collect-only", "-q", "-rs", "-p", "no:cacheprovider", *USERS)
    assert done.returncode == 0, done.stdout + done.stderr
    # Only the module that checks the seam against the bindings' own types skips, and says why.
    assert "cuda-python is not installed: these tests check the seam" in done.stdout
    assert "tests/integration/test_cuda_checkpoint_daemon.py::" in done.stdout
    assert "tests/unit/test_cuda_checkpoint_footprints.py::" in done.stdout
    assert "tests/unit/test_cuda_bindings.py::" in done.stdout
