"""Clients in other PID namespaces (containers, Kubernetes job pods beside the daemon's pod).

A client claims PIDs as its own namespace numbers them; the daemon must translate them where it
sees the client's namespace (nested below its own: the daemon in the host's namespace) and must
not take them for its own where it cannot (the kernel then reports the peer's PID as 0).

The namespaces come from ``unshare --user --map-root-user --pid --fork`` (util-linux), which needs
unprivileged user namespaces; where they cannot be made these tests skip, or fail when
``TIMESLICED_REQUIRE_PIDNS=1`` (CI sets it).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import timesliced
from timesliced import errors
from timesliced.daemon.authz import checked_pids
from timesliced.daemon.embedded import EmbeddedDaemon
from timesliced.daemon.server import Peer
from timesliced.util.processes import descendants, namespace_pids, pids_as_seen_inside

UNSHARE = ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--mount-proc"]


def namespaces_problem() -> str | None:
    if shutil.which("unshare") is None:
        return "unshare (util-linux) is not on the PATH"
    done = subprocess.run([*UNSHARE, "true"], capture_output=True, text=True, timeout=30, check=False)
    if done.returncode != 0:
        return f"cannot make a PID namespace: {done.stderr.strip()}"
    return None


@pytest.fixture(scope="module", autouse=True)
def namespaces() -> None:
    problem = namespaces_problem()
    if problem is not None:
        if os.environ.get("TIMESLICED_REQUIRE_PIDNS") == "1":
            pytest.fail(f"TIMESLICED_REQUIRE_PIDNS=1 but {problem}", pytrace=False)
        pytest.skip(problem)


@pytest.fixture
def contained() -> Iterator[tuple[int, dict[int, int]]]:
    """A shell in a new PID namespace with a sleeping child: (the shell's PID here, {PID inside: PID here})."""
    with subprocess.Popen(
        [*UNSHARE, "sh", "-c", "sleep 60 & echo $$ $!; wait"], stdout=subprocess.PIPE, text=True, cwd="/"
    ) as outside:
        yield from _contained(outside)


def _contained(outside: subprocess.Popen[str]) -> Iterator[tuple[int, dict[int, int]]]:
    try:
        assert outside.stdout is not None
        shell_inside, sleep_inside = (int(n) for n in outside.stdout.readline().split())
        # The line is written after the fork: both processes exist, as unshare's descendants.
        (shell,) = [p for p in descendants([outside.pid]) if (namespace_pids(p) or ())[-1:] == (shell_inside,)]
        inside = pids_as_seen_inside(shell)
        assert set(inside) == {shell_inside, sleep_inside}
        yield shell, inside
    finally:
        outside.kill()
        outside.wait()


def test_a_process_in_a_nested_namespace_is_numbered_in_both(contained: tuple[int, dict[int, int]]) -> None:
    shell, _ = contained
    chain = namespace_pids(shell)
    assert chain is not None and len(chain) == 2 and chain[0] == shell and chain[1] == 1
    assert namespace_pids(os.getpid()) == (os.getpid(),)  # the tests run in the namespace of their /proc


def test_the_pids_a_contained_client_claims_are_translated_to_the_daemons(
    contained: tuple[int, dict[int, int]],
) -> None:
    shell, inside = contained
    peer = Peer("unix", pid=shell, uid=os.getuid())
    # The shell is PID 1 in its namespace and its child 2; here they are other numbers. Taken as
    # this namespace's, 2 would be kthreadd (or refused as another user's).
    assert checked_pids([1, 2], peer) == {inside[1], inside[2]} and inside[2] != 2
    assert checked_pids([], peer) == {shell}


def test_a_contained_client_may_claim_only_its_own_tree(contained: tuple[int, dict[int, int]]) -> None:
    shell, inside = contained
    missing = max(inside) + 1000
    for uid in (os.getuid(), 0):  # root in a container is no one's root here
        with pytest.raises(errors.PermissionDenied, match="its own process tree"):
            checked_pids([1, missing], Peer("unix", pid=shell, uid=uid))
    with pytest.raises(errors.BadRequest, match="not a process id"):
        checked_pids([0], Peer("unix", pid=shell, uid=os.getuid()))


def test_a_client_the_daemon_cannot_see_is_followed_by_its_connection_alone() -> None:
    # SO_PEERCRED gives 0 for a process of a namespace the reader cannot see: what it claims
    # are another namespace's numbers, never this one's.
    assert checked_pids([1, os.getpid()], Peer("unix", pid=0, uid=0)) == set()


@pytest.mark.slow
def test_a_client_in_a_container_registers_with_a_daemon_outside() -> None:
    """End to end: the real client, PID 1 of its namespace, registers; the daemon records its PID here."""
    script = (
        "import os, sys, timesliced\n"
        "with timesliced.Client(job='contained', group='g', address=sys.argv[1]) as c:\n"
        "    c.acquire()\n"
        "    print(os.getpid(), [j['pids'] for j in c.status()['jobs']], flush=True)\n"
        "    sys.stdin.readline()\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(timesliced.__file__).parents[1])}
    with (
        EmbeddedDaemon(gpus=1, gpu_memory=16 << 20, bandwidth=0) as daemon,
        subprocess.Popen(
            [*UNSHARE, sys.executable, "-c", script, daemon.socket],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        ) as client,
    ):
        run_contained_client(client)


def run_contained_client(client: subprocess.Popen[str]) -> None:
    """Reads the client's PID and the daemon's record of it, then lets it finish."""
    try:
        assert client.stdout is not None and client.stdin is not None
        line = client.stdout.readline()
        assert line, client.communicate(timeout=30)[1]
        own, pids = line.split(" ", 1)
        (here,) = [p for p in descendants([client.pid]) if (namespace_pids(p) or ())[-1:] == (int(own),)]
        assert own == "1" and pids.strip() == f"[[{here}]]"
        client.stdin.write("\n")
        client.stdin.flush()
        assert client.wait(timeout=30) == 0
    finally:
        client.kill()
