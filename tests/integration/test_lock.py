"""The lock end to end: real sockets, a real daemon, each test against both client shells."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import timesliced
from timesliced import errors
from timesliced.daemon.embedded import EmbeddedDaemon

from ..helpers.client_shells import SHELLS, Shell, shell_of
from ..helpers.daemon import TOKEN
from ..helpers.processes import wait_for


@pytest.fixture(params=SHELLS)
def shell(request: pytest.FixtureRequest) -> Iterator[Shell]:
    with shell_of(request.param) as made:
        yield made


def group_status(c: Any, name: str = "g") -> dict[str, Any]:
    return next(g for g in c.status()["groups"] if g["group"] == name)  # type: ignore[no-any-return]


def queue(c: Any) -> list[str]:
    return [w["job"] for w in group_status(c)["queue"]]


def test_acquire_release_and_grant_fields(daemon: EmbeddedDaemon, shell: Shell) -> None:
    with shell.client(daemon.socket, "a") as a:
        assert a.gpus == [0, 1]
        grant = a.acquire()
        assert (grant.group, grant.job, grant.fence, grant.restored) == ("g", "a", 1, False)
        assert grant.waited_s >= 0 and grant.switch_s == 0
        assert group_status(a)["holder"] == "a" and a.lock.holding
        again = a.acquire()  # idempotent while holding
        assert again.fence == 1
        a.release()
        st = group_status(a)
        assert st["holder"] is None and st["state"] == "idle-yielded"  # a's state stays on the GPUs
        assert not a.lock.holding
        with pytest.raises(errors.NotHolder):
            a.release()
        # nobody waited: re-acquire is immediate and moves nothing
        grant = a.acquire()
        assert grant.fence == 2 and not grant.restored


def test_waiter_is_granted_on_release_with_next_fence(daemon: EmbeddedDaemon, shell: Shell) -> None:
    a = shell.client(daemon.socket, "a", connect=True)
    b = shell.client(daemon.socket, "b", connect=True)
    a.acquire()
    got: list[timesliced.Grant] = []
    t = threading.Thread(target=lambda: got.append(b.acquire()))
    t.start()
    wait_for(lambda: queue(a) == ["b"])
    with pytest.raises(errors.NotHolder):
        b.release()  # waiting is not holding
    time.sleep(0.05)
    a.release()
    t.join(5)
    assert got and got[0].job == "b" and got[0].fence == 2 and got[0].waited_s >= 0.05


def test_threads_of_one_client_share_its_hold(daemon: EmbeddedDaemon, shell: Shell) -> None:
    a = shell.client(daemon.socket, "a", connect=True)
    b = shell.client(daemon.socket, "b", connect=True)
    b.acquire()
    grants: list[timesliced.Grant] = []
    threads = [threading.Thread(target=lambda: grants.append(a.acquire(timeout=10))) for _ in range(3)]
    for t in threads:
        t.start()
    wait_for(lambda: queue(b) == ["a"])  # one place in the queue for the job, whatever its threads ask
    b.release()
    for t in threads:
        t.join(10)
    assert [g.fence for g in grants] == [2, 2, 2] and a.lock.holding
    a.release()
    assert group_status(b)["holder"] is None


def test_fifo_order_among_waiters(daemon: EmbeddedDaemon, shell: Shell) -> None:
    holder = shell.client(daemon.socket, "h", connect=True)
    holder.acquire()
    order: list[str] = []
    lock = threading.Lock()
    clients = [shell.client(daemon.socket, f"w{i}", connect=True) for i in range(5)]
    threads = []
    for c in clients:

        def run(c: Any = c) -> None:
            c.acquire()
            with lock:
                order.append(c.job)
            c.release()

        threads.append(threading.Thread(target=run))
        threads[-1].start()
        wait_for(lambda c=c: c.job in queue(holder))
    holder.release()
    for t in threads:
        t.join(10)
    assert order == [f"w{i}" for i in range(5)]


def test_acquire_timeout_leaves_queue_and_is_never_granted(daemon: EmbeddedDaemon, shell: Shell) -> None:
    a = shell.client(daemon.socket, "a", connect=True)
    b = shell.client(daemon.socket, "b", connect=True)
    a.acquire()
    with pytest.raises(errors.AcquireTimeout):
        b.acquire(timeout=0.2)
    assert group_status(a)["queue"] == []
    a.release()
    # b's expired request must not have been granted behind our back
    st = group_status(a)
    assert st["holder"] is None and st["fence"] == 1
    assert b.acquire(timeout=0).fence == 2  # a timeout of 0 asks once: free, so granted


def test_an_interrupted_acquire_leaves_the_queue_at_once(daemon: EmbeddedDaemon, shell: Shell) -> None:
    """``Client``: KeyboardInterrupt; ``AsyncClient``: its task cancelled. No ghost waiter is ever granted."""
    a = shell.client(daemon.socket, "a", connect=True)
    b = shell.client(daemon.socket, "b", connect=True)
    a.acquire()
    shell.interrupt_acquire(b, after=0.3)
    wait_for(lambda: group_status(a)["queue"] == [], timeout=1.0)
    a.release()
    st = group_status(a)
    assert st["holder"] is None and st["fence"] == 1
    with b.slice() as grant:  # b can still use the lock normally
        assert grant.fence == 2 and group_status(a)["holder"] == "b"
    assert group_status(a)["holder"] is None


def test_an_async_acquire_whose_submit_fails_once_made_is_withdrawn(
    daemon: EmbeddedDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``AsyncClient._submit``: an error after the request went to the core (here in starting the supervisor)."""

    async def main() -> None:
        async with (
            timesliced.AsyncClient("a", "g", address=daemon.socket) as a,
            timesliced.AsyncClient("b", "g", address=daemon.socket) as b,
        ):
            await a.acquire()
            await b.ping()

            def broken() -> None:
                raise RuntimeError("the supervisor could not start")

            monkeypatch.setattr(b, "_ensure_supervisor", broken)
            with pytest.raises(RuntimeError):
                await b.acquire()
            monkeypatch.undo()
            queue: list[Any] = ["b"]
            for _ in range(250):
                queue = next(g for g in (await a.status())["groups"] if g["group"] == "g")["queue"]
                if not queue:
                    break
                await asyncio.sleep(0.02)
            assert queue == [], "the failed acquire is still queued at the daemon"
            await a.release()
            assert (await b.acquire(timeout=5)).fence == 2  # no ghost of b's was granted in between
            await b.release()

    asyncio.run(main())


def test_holder_connection_drop_hands_lock_on(daemon: EmbeddedDaemon, shell: Shell) -> None:
    a = shell.client(daemon.socket, "a", connect=True)
    b = shell.client(daemon.socket, "b", connect=True)
    a.acquire()
    got: list[timesliced.Grant] = []
    t = threading.Thread(target=lambda: got.append(b.acquire()))
    t.start()
    wait_for(lambda: bool(group_status(b)["queue"]))
    a.close()  # connection gone: a loses the lock
    t.join(5)
    assert got and got[0].job == "b"


def test_slice_releases_on_exception(daemon: EmbeddedDaemon, shell: Shell) -> None:
    with shell.client(daemon.socket, "a") as a:
        with pytest.raises(RuntimeError), a.slice():
            assert group_status(a)["holder"] == "a"
            raise RuntimeError("boom")
        assert group_status(a)["holder"] is None and not a.lock.holding
        with a.slice(timeout=5) as grant:
            assert grant.fence == 2
        assert group_status(a)["holder"] is None


def test_sync_decorator(daemon: EmbeddedDaemon) -> None:
    with timesliced.Client(job="a", group="g", address=daemon.socket) as a:

        @a.on_accelerators()
        def step(x: int) -> object:
            return group_status(a)["holder"], x

        assert step(3) == ("a", 3)
        assert group_status(a)["holder"] is None


def test_async_decorator_and_slice(daemon: EmbeddedDaemon) -> None:
    async def scenario() -> None:
        async with timesliced.AsyncClient(job="a", group="g", address=daemon.socket) as a:

            @a.on_accelerators()
            async def step() -> object:
                return _group(await a.status())["holder"]

            assert await step() == "a"
            assert _group(await a.status())["holder"] is None
            with pytest.raises(asyncio.CancelledError):
                async with a.aslice():  # a slice whose block is cancelled still gives the lock back
                    raise asyncio.CancelledError
            assert _group(await a.status())["holder"] is None and not a.lock.holding

    asyncio.run(scenario())


def test_an_async_client_works_without_async_with(daemon: EmbeddedDaemon) -> None:
    async def scenario() -> None:
        c = timesliced.AsyncClient(job="a", group="g", address=daemon.socket)
        assert (await c.acquire()).fence == 1  # connects on first use
        await c.release()
        await c.close()
        await c.connect()  # and again after a close
        assert (await c.acquire()).fence == 2
        await c.close()

    asyncio.run(scenario())


def _group(status: dict[str, Any], name: str = "g") -> dict[str, Any]:
    return next(g for g in status["groups"] if g["group"] == name)  # type: ignore[no-any-return]


def test_registration_errors(daemon: EmbeddedDaemon, shell: Shell) -> None:
    with shell.client(daemon.socket, "a", gpus=[0]):
        with pytest.raises(errors.GroupMismatch):
            shell.client(daemon.socket, "b", gpus=[1], connect=True)  # group g is GPU 0 only
        with pytest.raises(errors.UnknownDevice):
            shell.client(daemon.socket, "c", group="other", gpus=[7], connect=True)
        with pytest.raises(errors.GroupMismatch):
            shell.client(daemon.socket, "a", group="elsewhere", connect=True)


def test_tcp_clients(daemon: EmbeddedDaemon, shell: Shell) -> None:
    assert daemon.daemon is not None and daemon.daemon.tcp_address is not None
    host, port = daemon.daemon.tcp_address
    with shell.client(f"{host}:{port}", "remote", token=TOKEN) as c:
        assert c.acquire().fence == 1
        c.release()


def test_unreachable_daemon_is_connection_lost_at_once(tmp_path: Path, shell: Shell) -> None:
    started = time.monotonic()
    with pytest.raises(errors.ConnectionLost, match="cannot reach the timesliced daemon at /nonexistent"):
        shell.client("/nonexistent/timesliced.sock", "a").connect()  # reconnect=60, but nothing is there
    with pytest.raises(errors.ConnectionLost, match="cannot reach"):
        shell.client("/nonexistent/timesliced.sock", "a").acquire(timeout=30)
    assert time.monotonic() - started < 2


def test_daemon_stop_fails_waiters_with_connection_lost(shell: Shell) -> None:
    embedded = EmbeddedDaemon(gpus=1, gpu_memory=8 << 20)
    embedded.start()
    a = shell.client(embedded.socket, "a", reconnect=0, connect=True)  # clients that do not wait for a restart
    b = shell.client(embedded.socket, "b", reconnect=0, connect=True)
    a.acquire()
    errs: list[BaseException] = []

    def wait() -> None:
        try:
            b.acquire()
        except BaseException as exc:
            errs.append(exc)

    t = threading.Thread(target=wait)
    t.start()
    wait_for(lambda: queue(a) == ["b"])
    embedded.stop()
    t.join(5)
    assert errs and isinstance(errs[0], errors.ConnectionLost)
    with pytest.raises(errors.ConnectionLost):
        a.release()


@pytest.mark.parametrize(
    ("pid", "error", "match"),
    [
        (2**40, errors.BadRequest, "not a process id"),
        ((1 << 22) - 1, errors.BadRequest, "no process"),
        (0, errors.BadRequest, "not a process id"),
    ],
)
def test_register_refuses_pids_that_are_not_processes(
    daemon: EmbeddedDaemon, shell: Shell, pid: int, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        shell.client(daemon.socket, "x", pids=[pid], connect=True)
    with shell.client(daemon.socket, "y") as y:  # the daemon is unharmed
        assert y.acquire().job == "y"


def test_pids_of_another_user_are_refused() -> None:
    from timesliced.daemon.authz import checked_pids
    from timesliced.daemon.server import Peer

    me = os.getpid()
    assert checked_pids([me], Peer("unix", pid=me, uid=os.getuid())) == {me}
    stranger = Peer("unix", pid=me, uid=os.getuid() + 4242)
    with subprocess.Popen(["sleep", "30"]) as child:  # a process of ours, so another user's to the stranger
        try:
            with pytest.raises(errors.PermissionDenied, match="another user"):
                checked_pids([child.pid], stranger)
            assert checked_pids([me, child.pid], Peer("unix", pid=me, uid=0)) == {me, child.pid}  # root: any process
        finally:
            child.kill()
    with pytest.raises(errors.BadRequest, match="not a process id"):
        checked_pids([1], Peer("unix", pid=me, uid=0))  # init is always alive: a job with it would never end
    assert checked_pids([me], Peer("tcp")) == set()  # over TCP, PIDs would be another machine's


def test_a_second_daemon_leaves_the_first_ones_socket_alone(daemon: EmbeddedDaemon, tmp_path: Path) -> None:
    from timesliced.config import DaemonConfig
    from timesliced.env import default_sim_dir

    config = DaemonConfig(state_dir=tmp_path / "other", socket_path=daemon.config.resolved_socket(), backend="sim")
    try:
        with pytest.raises(errors.TimeslicedError, match="already serving"):
            EmbeddedDaemon(config).start()
    finally:
        shutil.rmtree(default_sim_dir(config.state_dir), ignore_errors=True)
    with timesliced.Client(job="still-here", group="g", address=daemon.socket) as c:
        assert c.acquire().job == "still-here"
