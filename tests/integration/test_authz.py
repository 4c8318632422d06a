"""Every forbidden action against a real daemon: refused with a typed error, and nothing changes.

Each test takes a picture of the daemon (groups, holders, fences, queues, jobs, memory) before
the forbidden action and checks it is the same after. The peers' side (a wrong peer token)
is tested in tests/unit/test_peer_transport.py (``test_a_wrong_token_is_refused_and_never_logged``,
``test_an_accepter_that_does_not_know_the_token_gets_nothing``).

Registering another user's or a non-descendant process is refused to non-root peers only. As
root, the test lends a connection to uid 1000: a child process started as that user connects
(so SO_PEERCRED names it) and passes the socket back over SCM_RIGHTS; the test then speaks
for it. That child needs a Python interpreter uid 1000 may run (stdlib only); without one the
test is skipped, and ``checked_pids`` is still covered by tests/unit/test_authz.py.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import timesliced
from timesliced import errors
from timesliced.client.sync import daemon_status
from timesliced.daemon.embedded import EmbeddedDaemon
from timesliced.env import PEER_TOKEN_ENV, TOKEN_ENV, TOKEN_FILE_ENV
from timesliced.wire.proof import Purpose, prove

from ..helpers.daemon import TOKEN, Raw
from ..helpers.processes import wait_for

WRONG = "not-the-shared-token-9f8e7d6c"
OTHER_USER = 1000


def client_proof(token: str, challenge: str) -> str:
    return prove(token, Purpose.CLIENT, bytes.fromhex(challenge)).hex()


@pytest.fixture(autouse=True)
def no_token_in_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (TOKEN_ENV, TOKEN_FILE_ENV, PEER_TOKEN_ENV):
        monkeypatch.delenv(name, raising=False)


def picture(d: EmbeddedDaemon) -> dict[str, Any]:
    """What a forbidden action must not change (read over the Unix socket)."""
    st = daemon_status(d.socket)
    return {
        "groups": [(g["group"], g["holder"], g["fence"], [w["job"] for w in g["queue"]]) for g in st["groups"]],
        "jobs": sorted((j["job"], j["location"], tuple(j["pids"]), str(j["footprint"])) for j in st["jobs"]),
        "devices": [(dev["index"], dev["used"]) for dev in st["devices"]],
    }


def counters(d: EmbeddedDaemon) -> dict[str, int]:
    return dict(daemon_status(d.socket)["counters"])


def tcp_address(d: EmbeddedDaemon) -> str:
    assert d.daemon is not None and d.daemon.tcp_address is not None
    host, port = d.daemon.tcp_address
    return f"{host}:{port}"


class TcpRaw(Raw):
    """``Raw`` over the daemon's TCP listener."""

    def __init__(self, d: EmbeddedDaemon) -> None:
        assert d.daemon is not None and d.daemon.tcp_address is not None
        self.sock = socket.create_connection(d.daemon.tcp_address, timeout=5)
        self.buf = b""

    def challenge(self) -> str:
        reply = self.call(0, "hello", {"version": 1, "role": "client"})
        assert reply["ok"], reply
        challenge = reply["result"]["challenge"]
        assert isinstance(challenge, str) and len(challenge) == 64
        return challenge


class SocketRaw(Raw):
    """``Raw`` over a socket connected elsewhere (by another process)."""

    def __init__(self, sock: socket.socket) -> None:
        sock.settimeout(5)
        self.sock = sock
        self.buf = b""


def refused(reply: dict[str, Any], code: str, match: str) -> str:
    assert reply["ok"] is False, reply
    assert reply["error"]["code"] == code, reply
    assert match in reply["error"]["message"], reply
    return str(reply["error"]["message"])


# --- TCP clients and the shared token ---------------------------------------------------


def test_a_tcp_client_without_the_token_is_refused_before_it_sends_anything(daemon: EmbeddedDaemon) -> None:
    before, failures = picture(daemon), counters(daemon)["auth_failures"]
    with pytest.raises(errors.PermissionDenied, match=r"shared token over TCP: pass token= or set \$TIMESLICED_TOKEN"):
        timesliced.Client(job="intruder", group="g", address=tcp_address(daemon)).connect()

    async def attempt() -> None:
        with pytest.raises(errors.PermissionDenied, match="shared token"):
            await timesliced.AsyncClient(job="intruder", group="g", address=tcp_address(daemon)).connect()

    asyncio.run(attempt())
    with pytest.raises(errors.PermissionDenied, match="shared token"):
        daemon_status(tcp_address(daemon))
    assert picture(daemon) == before
    assert counters(daemon)["auth_failures"] == failures  # the clients sent no guess at all


def test_a_wrong_token_is_refused_and_counted(daemon: EmbeddedDaemon, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    before, failures = picture(daemon), counters(daemon)["auth_failures"]
    with pytest.raises(errors.PermissionDenied, match="wrong token proof"):
        timesliced.Client(job="intruder", group="g", address=tcp_address(daemon), token=WRONG).connect()

    async def attempt() -> None:
        with pytest.raises(errors.PermissionDenied, match="wrong token proof"):
            await timesliced.AsyncClient(job="intruder", group="g", address=tcp_address(daemon), token=WRONG).connect()

    asyncio.run(attempt())
    with pytest.raises(errors.PermissionDenied, match="wrong token proof"):
        daemon_status(tcp_address(daemon), token=WRONG)
    assert picture(daemon) == before
    assert counters(daemon)["auth_failures"] == failures + 3
    assert "wrong token proof" in caplog.text
    assert TOKEN not in caplog.text and WRONG not in caplog.text


@pytest.mark.parametrize(
    ("op", "args"),
    [
        ("register", {"job": "intruder", "group": "g"}),
        ("status", {}),
        ("ping", {}),
        ("acquire", {}),
        ("sim_free", {"region": 1}),
        ("offload_done", {"directive": 1, "ok": True}),
        ("hello", {"version": 1, "role": "client"}),
    ],
)
def test_requests_before_the_token_proof_are_refused_and_the_connection_closed(
    daemon: EmbeddedDaemon, op: str, args: dict[str, Any]
) -> None:
    with timesliced.Client(job="holder", group="g", address=daemon.socket) as holder:
        holder.acquire()
        before, failures = picture(daemon), counters(daemon)["auth_failures"]
        raw = TcpRaw(daemon)
        raw.challenge()
        refused(raw.call(1, op, args), "permission_denied", f"authenticate first: {op!r} needs the shared token")
        assert raw.closed()
        raw.close()
        assert picture(daemon) == before
        assert counters(daemon)["auth_failures"] == failures + 1


def test_a_proof_is_good_for_its_own_connection_only(daemon: EmbeddedDaemon) -> None:
    before = picture(daemon)
    first, second = TcpRaw(daemon), TcpRaw(daemon)
    challenge = first.challenge()
    assert second.challenge() != challenge  # fresh per connection
    refused(second.call(1, "auth", {"proof": client_proof(TOKEN, challenge)}), "permission_denied", "wrong token")
    assert second.closed()
    assert first.call(1, "auth", {"proof": client_proof(TOKEN, challenge)}) == {"id": 1, "ok": True, "result": {}}
    assert first.call(2, "ping")["ok"]
    refused(first.call(3, "auth", {"proof": "x"}), "bad_request", "not asked to authenticate")
    assert first.call(4, "ping")["ok"]  # a needless auth is a bad request, not a reason to hang up
    for r in (first, second):
        r.close()
    assert picture(daemon) == before


def test_the_token_opens_tcp_and_the_unix_socket_needs_none(
    daemon: EmbeddedDaemon, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with timesliced.Client(job="remote", group="g", address=tcp_address(daemon), token=TOKEN) as c:
        assert c.acquire().fence == 1
        c.release()
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    assert daemon_status(tcp_address(daemon))["node"] == daemon.config.node

    async def with_env() -> None:
        async with timesliced.AsyncClient(job="remote", group="g", address=tcp_address(daemon)) as c:
            assert (await c.acquire()).fence == 2
            await c.release()

    asyncio.run(with_env())
    monkeypatch.delenv(TOKEN_ENV)
    (tmp_path / "token").write_text(TOKEN + "\n")
    monkeypatch.setenv(TOKEN_FILE_ENV, str(tmp_path / "token"))
    with timesliced.Client(job="remote", group="g", address=tcp_address(daemon)) as c:
        assert c.acquire().fence == 3
    raw = Raw(daemon.socket)
    reply = raw.call(0, "hello", {"version": 1, "role": "client"})
    assert reply["ok"] and "challenge" not in reply["result"]
    refused(raw.call(1, "auth", {"proof": "x"}), "bad_request", "not asked to authenticate")
    assert raw.call(2, "ping")["ok"]
    raw.close()


@pytest.mark.slow
def test_an_unproven_tcp_connection_is_closed_after_the_handshake_timeout(daemon: EmbeddedDaemon) -> None:
    raw = TcpRaw(daemon)
    raw.challenge()  # then silence: handshake_timeout is 1 s in the fixture
    reply = raw.recv()
    assert reply is not None and reply["error"]["code"] == "protocol_error"
    assert raw.closed()
    raw.close()


def test_no_tcp_listener_without_a_token() -> None:
    with pytest.raises(ValueError, match="serving clients over TCP needs the shared token"):
        EmbeddedDaemon(gpus=1, listen=("127.0.0.1", 0)).start()


def test_the_token_is_in_no_status_repr_or_log(daemon: EmbeddedDaemon, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    with timesliced.Client(job="remote", group="g", address=tcp_address(daemon), token=TOKEN) as c:
        c.acquire()
        assert TOKEN not in str(c.status()) and TOKEN not in repr(c)
    assert TOKEN not in repr(daemon.config)
    assert TOKEN not in caplog.text


# --- the Unix socket: files and process trees --------------------------------------------


def test_the_socket_is_0660_and_the_state_dir_0700(daemon: EmbeddedDaemon) -> None:
    assert stat.S_IMODE(os.stat(daemon.socket).st_mode) == 0o660
    assert stat.S_ISSOCK(os.stat(daemon.socket).st_mode)
    assert stat.S_IMODE(os.stat(daemon.config.state_dir).st_mode) == 0o700


CHILD = """
import socket, subprocess, sys
path, fd = sys.argv[1], int(sys.argv[2])
conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
conn.connect(path)
grandchild = subprocess.Popen(["sleep", "60"])
with socket.socket(fileno=fd) as chan:
    socket.send_fds(chan, [str(grandchild.pid).encode()], [conn.fileno()])
    chan.recv(1)
grandchild.kill()
grandchild.wait()
"""


def _python_for(uid: int) -> str | None:
    """An interpreter that ``uid`` may run (ours may sit under a directory closed to it)."""
    for candidate in dict.fromkeys([sys.executable, os.path.realpath(sys.executable), "/usr/bin/python3"]):
        try:
            ok = subprocess.run(
                [candidate, "-I", "-c", "pass"], user=uid, group=uid, extra_groups=[], cwd="/", timeout=30, check=False
            )
        except OSError:
            continue
        if ok.returncode == 0:
            return candidate
    return None


class Lent:
    """A connection to the daemon made by a process of another user, and that process's child."""

    def __init__(self, path: str, uid: int, python: str) -> None:
        ours, theirs = socket.socketpair()
        self.chan = ours
        self.proc = subprocess.Popen(
            [python, "-I", "-c", CHILD, path, str(theirs.fileno())],
            user=uid,
            group=uid,
            extra_groups=[],
            pass_fds=[theirs.fileno()],
            cwd="/",
            env={"PATH": "/usr/bin:/bin"},
        )
        theirs.close()
        ours.settimeout(30)
        message, fds, _, _ = socket.recv_fds(ours, 64, 1)
        self.pid = self.proc.pid
        self.child = int(message)
        self.raw = SocketRaw(socket.socket(fileno=fds[0]))

    def close(self) -> None:
        self.raw.close()
        self.chan.close()  # the process kills its child and exits
        self.proc.wait(timeout=30)


@pytest.fixture
def shared_daemon() -> Iterator[EmbeddedDaemon]:
    """A daemon whose socket uid 1000 may use (the test runs as root)."""
    where = Path(tempfile.mkdtemp(prefix="timesliced-authz-"))
    where.chmod(0o711)
    d = EmbeddedDaemon(gpus=1, gpu_memory=8 << 20, socket_path=where / "ts.sock")
    d.start()
    try:
        os.chown(d.socket, OTHER_USER, -1)  # the socket is 0660: its owner may connect
        yield d
    finally:
        d.stop()
        shutil.rmtree(where, ignore_errors=True)


def test_a_client_registers_only_its_own_process_tree(request: pytest.FixtureRequest) -> None:
    """As root, a connection lent by another user is checked; otherwise our own connection is."""
    if os.geteuid() == 0:
        _lent_connection_registers_only_its_tree(request.getfixturevalue("shared_daemon"))
    else:
        _own_connection_registers_only_its_tree(request.getfixturevalue("daemon"))


def _lent_connection_registers_only_its_tree(shared_daemon: EmbeddedDaemon) -> None:
    python = _python_for(OTHER_USER)
    if python is None:
        pytest.skip(f"no Python interpreter that uid {OTHER_USER} may run")
    d = shared_daemon
    stranger = subprocess.Popen(["sleep", "60"], user=OTHER_USER, group=OTHER_USER, extra_groups=[], cwd="/")
    lent = Lent(d.socket, OTHER_USER, python)
    try:
        raw = lent.raw
        raw.hello()
        before = picture(d)
        register = {"job": "j", "group": "g"}
        reply = raw.call(1, "register", {**register, "pids": [lent.pid, stranger.pid]})
        refused(reply, "permission_denied", f"process {stranger.pid} is not a descendant of the connecting process")
        refused(raw.call(2, "register", {**register, "pids": [os.getpid()]}), "permission_denied", "another user")
        assert picture(d) == before
        reply = raw.call(3, "register", {**register, "pids": [lent.pid, lent.child]})  # its own tree: fine
        assert reply["ok"], reply
        (job,) = daemon_status(d.socket)["jobs"]
        assert job["job"] == "j" and sorted(job["pids"]) == sorted([lent.pid, lent.child])
    finally:
        stranger.kill()
        stranger.wait(timeout=30)
        lent.close()


def _own_connection_registers_only_its_tree(daemon: EmbeddedDaemon) -> None:
    child = subprocess.Popen(["sleep", "60"])
    # An orphan of ours: its parent shell has exited, so it no longer descends from us.
    out = subprocess.run(["sh", "-c", "sleep 60 >/dev/null 2>&1 & echo $!"], capture_output=True, text=True, check=True)
    orphan = int(out.stdout)
    raw = Raw(daemon.socket)
    try:
        raw.hello()
        before = picture(daemon)
        register = {"job": "j", "group": "g"}
        reply = raw.call(1, "register", {**register, "pids": [os.getpid(), orphan]})
        refused(reply, "permission_denied", f"process {orphan} is not a descendant of the connecting process")
        assert picture(daemon) == before
        assert raw.call(2, "register", {**register, "pids": [os.getpid(), child.pid]})["ok"]
    finally:
        raw.close()
        for pid in (orphan, child.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        child.wait(timeout=30)


# --- the lock, memory and directives of others ---------------------------------------------


def test_a_job_that_does_not_hold_the_lock_cannot_release_it(daemon: EmbeddedDaemon) -> None:
    with (
        timesliced.Client(job="a", group="g", address=daemon.socket) as a,
        timesliced.Client(job="b", group="g", address=daemon.socket) as b,
    ):
        a.acquire()
        before = picture(daemon)
        with pytest.raises(errors.NotHolder, match=r"job 'b' does not hold group 'g' \(job 'a' does\)"):
            b.release()
        assert picture(daemon) == before


def test_another_session_of_the_holding_job_cannot_release_it(daemon: EmbeddedDaemon) -> None:
    with (
        timesliced.Client(job="a", group="g", address=daemon.socket) as a1,
        timesliced.Client(job="a", group="g", address=daemon.socket) as a2,
    ):
        a1.acquire()
        before = picture(daemon)
        with pytest.raises(errors.NotHolder, match="this connection does not hold group 'g': job 'a' holds it through"):
            a2.release()
        assert picture(daemon) == before
        a1.release()  # the holder still can


def test_a_connection_cannot_cancel_another_connections_acquire(daemon: EmbeddedDaemon) -> None:
    with timesliced.Client(job="a", group="g", address=daemon.socket) as a:
        a.acquire()
        waiter, intruder = Raw(daemon.socket), Raw(daemon.socket)
        try:
            for r, job in ((waiter, "b"), (intruder, "c")):
                r.hello()
                assert r.call(1, "register", {"job": job, "group": "g"})["ok"]
            waiter.send({"id": 7, "op": "acquire", "args": {}})
            wait_for(lambda: picture(daemon)["groups"][0][3] == ["b"])
            before = picture(daemon)
            # Requests are known by (connection, id): another connection's id names nothing of its own.
            assert intruder.call(7, "cancel", {"request": 7}) == {"id": 7, "ok": True, "result": {"cancelled": False}}
            stranger = Raw(daemon.socket)
            stranger.hello()
            refused(stranger.call(8, "cancel", {"request": 7}), "not_registered", "register a job")
            stranger.close()
            assert picture(daemon) == before
            a.release()
            reply = waiter.recv()
            assert reply is not None and reply["id"] == 7 and reply["ok"] and reply["result"]["job"] == "b"
        finally:
            waiter.close()
            intruder.close()


def test_a_job_cannot_free_another_jobs_region(daemon: EmbeddedDaemon) -> None:
    with (
        timesliced.Client(job="a", group="g", gpus=[0], address=daemon.socket) as a,
        timesliced.Client(job="b", group="other", gpus=[1], address=daemon.socket) as b,
    ):
        a.acquire()
        region = a.sim_alloc(1 << 20)
        region.write(b"mine")
        before = picture(daemon)
        with pytest.raises(errors.UnknownRegion, match=f"job 'b' has no region {region.region}"):
            b.sim_free(region.region)
        assert picture(daemon) == before
        assert region.read(4) == b"mine"
        a.sim_free(region)


class _NoCopies:
    """An offload executor with nothing to move."""

    def park(self, tags: Any = (), *, verify: bool | None = None) -> dict[str, Any]:
        return {"nbytes": 0, "seconds": 0.0}

    def unpark(self, tags: Any = (), *, verify: bool | None = None) -> dict[str, Any]:
        return {"nbytes": 0, "seconds": 0.0}


def test_a_connection_cannot_answer_another_connections_offload_directive(daemon: EmbeddedDaemon) -> None:
    offload = {"method": "offload", "endpoints": [], "tags": [], "level": 1}
    target, intruder = Raw(daemon.socket), Raw(daemon.socket)
    try:
        target.hello()
        assert target.call(1, "register", {"job": "r", "group": "g", "gpus": [0], "park": offload})["ok"]
        intruder.hello()
        assert intruder.call(1, "register", {"job": "x", "group": "h", "gpus": [1]})["ok"]
        a = timesliced.Client(
            job="a", group="g", gpus=[0], address=daemon.socket, park="offload", offloader=_NoCopies()
        )
        with a:
            got: list[timesliced.Grant] = []
            t = threading.Thread(target=lambda: got.append(a.acquire(timeout=20)))
            t.start()
            push = target.recv()  # r must be parked before a may have the GPUs
            assert push is not None and push.get("push") == "offload", push
            directive = push["data"]["directive"]
            before = picture(daemon)
            answer = {"directive": directive, "ok": True, "nbytes": 0, "footprint": {}}
            message = f"no offload directive {directive} is waiting on this connection"
            refused(intruder.call(2, "offload_done", answer), "bad_request", message)
            refused(intruder.call(3, "offload_done", {**answer, "ok": False, "error": "x"}), "bad_request", message)
            assert picture(daemon) == before and not got  # the switch still waits for r's own answer
            assert target.call(2, "offload_done", answer)["ok"]
            t.join(20)
            assert got and got[0].job == "a"
    finally:
        target.close()
        intruder.close()


# --- the dashboard's admin actions -----------------------------------------------------------


def _post(d: EmbeddedDaemon, path: str, token: str | None = None) -> tuple[int, str]:
    assert d.web_url is not None
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    request = urllib.request.Request(d.web_url.rstrip("/") + path, method="POST", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        body = e.read().decode()
        e.close()
        return e.code, body


@pytest.mark.slow
def test_admin_actions_without_or_with_a_wrong_token_change_nothing() -> None:
    admin_token = "the-admin-token-1a2b3c4d5e"
    for configured in (admin_token, None):  # None: no admin token, the dashboard is read-only
        with EmbeddedDaemon(gpus=1, gpu_memory=8 << 20, web=("127.0.0.1", 0), admin_token=configured) as d:
            a = timesliced.Client(job="a", group="g", address=d.socket)
            with a:
                a.acquire()
                before = picture(d)
                for action in ("release", "drain", "resume"):
                    path = f"/api/v1/groups/g/{action}"
                    if configured is None:
                        status, body = _post(d, path, token=admin_token)
                        assert status == 403 and '"admin_disabled"' in body
                        continue
                    status, body = _post(d, path)
                    assert status == 401 and '"unauthorized"' in body
                    status, body = _post(d, path, token=WRONG)
                    assert status == 403 and '"permission_denied"' in body and "not valid" in body
                    assert admin_token not in body
                assert picture(d) == before
