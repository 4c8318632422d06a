"""The lock end to end: real sockets, a real daemon, sync and async clients."""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
import time
from pathlib import Path

import pytest

import timesliced
from timesliced import errors
from timesliced.daemon.embedded import EmbeddedDaemon

from ..helpers.daemon import TOKEN
from ..helpers.processes import wait_for


def client(daemon: EmbeddedDaemon, job: str, group: str = "g", **kw: object) -> timesliced.Client:
    c = timesliced.Client(job=job, group=group, address=daemon.socket, **kw)  # type: ignore[arg-type]
    c.connect()
    return c


def group_status(c: timesliced.Client, name: str = "g") -> dict[str, object]:
    return next(g for g in c.status()["groups"] if g["group"] == name)


def test_acquire_release_and_grant_fields(daemon: EmbeddedDaemon) -> None:
    with client(daemon, "a") as a:
        assert a.gpus == [0, 1]
        grant = a.acquire()
        assert (grant.group, grant.job, grant.fence, grant.restored) == ("g", "a", 1, False)
        assert grant.waited_s >= 0 and grant.switch_s == 0
        assert group_status(a)["holder"] == "a"
        again = a.acquire()  # idempotent while holding
        assert again.fence == 1
        a.release()
        st = group_status(a)
        assert st["holder"] is None and st["state"] == "idle-yielded"  # a's state stays on the GPUs
        with pytest.raises(errors.NotHolder):
            a.release()
        # nobody waited: re-acquire is immediate and moves nothing
        grant = a.acquire()
        assert grant.fence == 2 and not grant.restored


def test_waiter_is_granted_on_release_with_next_fence(daemon: EmbeddedDaemon) -> None:
    with client(daemon, "a") as a, client(daemon, "b") as b:
        a.acquire()
        got: list[timesliced.Grant] = []
        t = threading.Thread(target=lambda: got.append(b.acquire()))
        t.start()
        wait_for(lambda: [w["job"] for w in group_status(a)["queue"]] == ["b"])  # type: ignore[index]
        with pytest.raises(errors.NotHolder):
            b.release()  # waiting is not holding
        time.sleep(0.05)
        a.release()
        t.join(5)
        assert got and got[0].job == "b" and got[0].fence == 2 and got[0].waited_s >= 0.05


def test_fifo_order_among_waiters(daemon: EmbeddedDaemon) -> None:
    holder = client(daemon, "h")
    holder.acquire()
    order: list[str] = []
    lock = threading.Lock()
    clients = [client(daemon, f"w{i}") for i in range(5)]
    threads = []
    for c in clients:

        def run(c: timesliced.Client = c) -> None:
            c.acquire()
            with lock:
                order.append(c.job)
            c.release()

        threads.append(threading.Thread(target=run))
        threads[-1].start()
        wait_for(lambda c=c: c.job in [w["job"] for w in group_status(holder)["queue"]])  # type: ignore[index]
    holder.release()
    for t in threads:
        t.join(10)
    assert order == [f"w{i}" for i in range(5)]
    for c in [holder, *clients]:
        c.close()


def test_acquire_timeout_leaves_queue_and_is_never_granted(daemon: EmbeddedDaemon) -> None:
    with client(daemon, "a") as a, client(daemon, "b") as b:
        a.acquire()
        with pytest.raises(errors.AcquireTimeout):
            b.acquire(timeout=0.2)
        assert group_status(a)["queue"] == []
        a.release()
        # b's expired request must not have been granted behind our back
        st = group_status(a)
        assert st["holder"] is None and st["fence"] == 1


def test_cancelled_async_acquire_leaves_queue_at_once(daemon: EmbeddedDaemon) -> None:
    async def scenario() -> None:
        async with (
            timesliced.AsyncClient(job="a", group="g", address=daemon.socket) as a,
            timesliced.AsyncClient(job="b", group="g", address=daemon.socket) as b,
        ):
            await a.acquire()
            task = asyncio.ensure_future(b.acquire())
            await asyncio.sleep(0.1)
            assert [w["job"] for w in _group(await a.status())["queue"]] == ["b"]
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            for _ in range(100):
                if not _group(await a.status())["queue"]:
                    break
                await asyncio.sleep(0.01)
            assert _group(await a.status())["queue"] == []
            await a.release()
            st = _group(await a.status())
            assert st["holder"] is None and st["fence"] == 1
            async with b.aslice() as grant:  # b can still use the lock normally
                assert grant.fence == 2

    asyncio.run(scenario())


def _group(status: dict[str, object], name: str = "g") -> dict[str, object]:
    return next(g for g in status["groups"] if g["group"] == name)  # type: ignore[attr-defined, index]


def test_holder_connection_drop_hands_lock_on(daemon: EmbeddedDaemon) -> None:
    a = client(daemon, "a")
    b = client(daemon, "b")
    a.acquire()
    got: list[timesliced.Grant] = []
    t = threading.Thread(target=lambda: got.append(b.acquire()))
    t.start()
    wait_for(lambda: bool(group_status(b)["queue"]))
    a.close()  # connection gone: a loses the lock
    t.join(5)
    assert got and got[0].job == "b"
    b.close()


def test_slice_releases_on_exception_and_decorator(daemon: EmbeddedDaemon) -> None:
    with client(daemon, "a") as a:
        with pytest.raises(RuntimeError), a.slice():
            assert group_status(a)["holder"] == "a"
            raise RuntimeError("boom")
        assert group_status(a)["holder"] is None

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

    asyncio.run(scenario())


def test_registration_errors(daemon: EmbeddedDaemon) -> None:
    with client(daemon, "a", gpus=[0]):
        with pytest.raises(errors.GroupMismatch):
            client(daemon, "b", gpus=[1])  # group g is GPU 0 only
        with pytest.raises(errors.UnknownDevice):
            client(daemon, "c", group="other", gpus=[7])
        with pytest.raises(errors.GroupMismatch):
            client(daemon, "a", group="elsewhere")


def test_tcp_clients(daemon: EmbeddedDaemon) -> None:
    assert daemon.daemon is not None and daemon.daemon.tcp_address is not None
    host, port = daemon.daemon.tcp_address
    with timesliced.Client(job="remote", group="g", address=f"{host}:{port}", token=TOKEN) as c:
        assert c.acquire().fence == 1
        c.release()


def test_unreachable_daemon_is_connection_lost(tmp_path: object) -> None:
    with pytest.raises(errors.ConnectionLost):
        timesliced.Client(job="a", group="g", address="/nonexistent/timesliced.sock").connect()


def test_daemon_stop_fails_waiters_with_connection_lost(tmp_path: object) -> None:
    embedded = EmbeddedDaemon(gpus=1, gpu_memory=8 << 20)
    embedded.start()
    a = client(embedded, "a", reconnect=0)  # clients that do not wait for a restarted daemon
    b = client(embedded, "b", reconnect=0)
    a.acquire()
    errs: list[BaseException] = []

    def wait() -> None:
        try:
            b.acquire()
        except BaseException as exc:
            errs.append(exc)

    t = threading.Thread(target=wait)
    t.start()
    time.sleep(0.1)
    embedded.stop()
    t.join(5)
    assert errs and isinstance(errs[0], errors.ConnectionLost)
    with pytest.raises(errors.ConnectionLost):
        a.release()
    a.close()
    b.close()


@pytest.mark.parametrize(
    ("pid", "error", "match"),
    [
        (2**40, errors.BadRequest, "not a process id"),
        ((1 << 22) - 1, errors.BadRequest, "no process"),
        (0, errors.BadRequest, "not a process id"),
    ],
)
def test_register_refuses_pids_that_are_not_processes(
    daemon: EmbeddedDaemon, pid: int, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        client(daemon, "x", pids=[pid])
    with client(daemon, "y") as y:  # the daemon is unharmed
        assert y.acquire().job == "y"


def test_pids_of_another_user_are_refused() -> None:
    from timesliced.daemon.authz import checked_pids
    from timesliced.daemon.server import Peer

    me = os.getpid()
    assert checked_pids([me], Peer("unix", pid=me, uid=os.getuid())) == {me}
    stranger = Peer("unix", pid=me, uid=os.getuid() + 4242)
    parent = os.getppid()
    with pytest.raises(errors.PermissionDenied, match="another user"):
        checked_pids([parent], stranger)
    assert checked_pids([me, parent], Peer("unix", pid=me, uid=0)) == {me, parent}  # root may name any process
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
    with client(daemon, "still-here") as c:
        assert c.acquire().job == "still-here"
