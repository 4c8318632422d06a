"""descendants() over real processes: a child that starts a grandchild."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests.helpers.processes import wait_for
from timesliced.util.processes import descendants, pid_alive

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs procfs")

# The child renames itself (a command name with ") (" in it must not confuse the
# /proc parser), starts a sleeping grandchild, prints its pid and waits on stdin
# without reaping it.
CHILD = """
import subprocess, sys
with open("/proc/self/comm", "w") as f:
    f.write("odd) (name")
grand = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
print(grand.pid, flush=True)
sys.stdin.read()
"""


@pytest.fixture
def tree() -> Iterator[tuple[subprocess.Popen[str], int]]:
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    grandchild = int(child.stdout.readline())
    try:
        yield child, grandchild
    finally:
        for pid in (grandchild, child.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pipe in (child.stdin, child.stdout):
            if pipe is not None:
                pipe.close()
        child.wait(timeout=30)


def test_descendants_finds_children_and_grandchildren(tree: tuple[subprocess.Popen[str], int]) -> None:
    child, grandchild = tree
    assert descendants([child.pid]) == {grandchild}
    assert {child.pid, grandchild} <= descendants([os.getpid()])
    assert os.getpid() not in descendants([os.getpid()])
    # A root that descends from another root is a root, not a descendant.
    both = descendants([os.getpid(), child.pid])
    assert grandchild in both and child.pid not in both


def test_dead_descendants_vanish(tree: tuple[subprocess.Popen[str], int]) -> None:
    child, grandchild = tree
    os.kill(grandchild, signal.SIGKILL)  # a zombie until the child reaps it, which it never does
    wait_for(lambda: not pid_alive(grandchild))
    assert descendants([child.pid]) == set()

    assert child.stdin is not None
    child.stdin.close()  # the child exits; we reap it
    child.wait(timeout=30)
    assert descendants([child.pid]) == set()
    assert child.pid not in descendants([os.getpid()])


def test_unknown_roots_have_no_descendants() -> None:
    assert descendants([]) == set()
    assert descendants([2**22 + 12345]) == set()
