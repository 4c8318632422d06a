"""The fault-injection proxy that partition tests put between daemons."""

from __future__ import annotations

import os
import socket
import socketserver
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from tests.fakes.proxy import FaultProxy, ProxyMesh
from tests.helpers.processes import REPO, wait_for

SILENCE = 0.3  # how long a black-holed client waits to be sure that no reply comes


class EchoServer(socketserver.ThreadingTCPServer):
    """Echoes every byte back; closes its side at end of stream; counts the connections it accepted."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), EchoHandler)
        self.accepted = 0
        self.finished = 0  # connections that saw end of stream or a reset

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.server_address[:2]
        return (str(host), int(port))


class EchoHandler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        assert isinstance(self.server, EchoServer)
        self.server.accepted += 1
        try:
            while data := self.request.recv(65536):
                self.request.sendall(data)
        except OSError:  # reset by the proxy
            pass
        self.server.finished += 1


@pytest.fixture
def echo() -> Iterator[EchoServer]:
    server = EchoServer()
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join(5)


@pytest.fixture
def proxy(echo: EchoServer) -> Iterator[FaultProxy]:
    with FaultProxy(echo.address) as p:
        yield p


def dial(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=2)


def echoes(sock: socket.socket, payload: bytes = b"ping") -> bool:
    sock.sendall(payload)
    got = b""
    while len(got) < len(payload):
        chunk = sock.recv(65536)
        if not chunk:
            break
        got += chunk
    return got == payload


def silent(sock: socket.socket, payload: bytes | None = b"ping") -> bool:
    """True when ``payload`` gets no reply at all, and the connection stays open, for ``SILENCE`` seconds."""
    if payload is not None:
        sock.sendall(payload)
    sock.settimeout(SILENCE)
    try:
        sock.recv(1)
    except TimeoutError:
        return True
    finally:
        sock.settimeout(2)
    return False


def closed(sock: socket.socket) -> bool:
    """True when the other end closed or reset the connection (within the socket's timeout)."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def dial_closed(port: int) -> bool:
    """True when a new connection to ``port`` is closed or reset at once (the reset may even beat connect)."""
    try:
        sock = dial(port)
    except ConnectionResetError:
        return True
    with sock:
        return closed(sock)


# --- FaultProxy --------------------------------------------------------------------------------


def test_forwards_both_ways(proxy: FaultProxy, echo: EchoServer) -> None:
    assert proxy.port != 0 and proxy.mode is None
    with dial(proxy.port) as a, dial(proxy.port) as b:
        assert echoes(a, b"hello")
        big = os.urandom(4 << 20)  # more than any socket buffer: exercises back-pressure
        sender = threading.Thread(target=b.sendall, args=(big,))
        sender.start()
        got = bytearray()
        while len(got) < len(big):
            got += b.recv(1 << 20)
        sender.join(5)
        assert bytes(got) == big
        assert proxy.connections == 2
    wait_for(lambda: proxy.connections == 0, timeout=2)
    assert echo.accepted == 2


def test_passes_a_half_close_on(proxy: FaultProxy) -> None:
    with dial(proxy.port) as sock:
        sock.sendall(b"last words")
        sock.shutdown(socket.SHUT_WR)
        # the echo server sees end of stream only through the proxy, answers, then closes
        assert sock.recv(100) == b"last words"
        assert sock.recv(100) == b""


@pytest.mark.slow
def test_blackhole_drops_bytes_both_ways(proxy: FaultProxy, echo: EchoServer) -> None:
    with dial(proxy.port) as old:
        assert echoes(old)
        proxy.cut()
        assert proxy.mode == "blackhole"
        assert silent(old), "a black-holed connection answered or closed"
        # a new connection is accepted but never reaches the target
        with dial(proxy.port) as new:
            assert silent(new)
            assert proxy.connections == 2
            assert echo.accepted == 1
            # end of stream crosses a blackhole in neither direction
            old.shutdown(socket.SHUT_WR)
            new.shutdown(socket.SHUT_WR)
            assert silent(old, None)
            assert silent(new, None)
            assert echo.finished == 0


def test_heal_resets_blackholed_connections_and_forwards_new_ones(proxy: FaultProxy) -> None:
    with dial(proxy.port) as old:
        assert echoes(old)
        proxy.cut("blackhole")
        with dial(proxy.port) as during:
            assert silent(old)
            proxy.heal()
            assert proxy.mode is None
            # their streams lost bytes: they must not resume
            assert closed(old)
            assert closed(during)
    with dial(proxy.port) as new:
        assert echoes(new)
    wait_for(lambda: proxy.connections == 0, timeout=2)


def test_reset_closes_connections_now_and_on_accept(proxy: FaultProxy, echo: EchoServer) -> None:
    with dial(proxy.port) as old:
        assert echoes(old)
        proxy.cut("reset")
        assert proxy.mode == "reset"
        assert closed(old)
        assert proxy.connections == 0
        assert dial_closed(proxy.port)
        assert echo.accepted == 1
    proxy.heal()
    with dial(proxy.port) as healed:
        assert echoes(healed)


def test_reset_after_blackhole_closes_at_once(proxy: FaultProxy) -> None:
    with dial(proxy.port) as old:
        proxy.cut("blackhole")
        assert silent(old)
        proxy.cut("reset")
        assert closed(old)


def test_unreachable_target_closes_the_client() -> None:
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]  # bound but not listening: connections are refused
        with FaultProxy(("127.0.0.1", port)) as proxy:
            assert dial_closed(proxy.port)


def test_cut_rejects_an_unknown_mode(proxy: FaultProxy) -> None:
    with pytest.raises(ValueError, match="unknown cut mode 'drop'"):
        proxy.cut("drop")
    assert proxy.mode is None


def test_start_reports_a_port_in_use(echo: EchoServer) -> None:
    proxy = FaultProxy(echo.address, port=echo.address[1])
    with pytest.raises(OSError):
        proxy.start()
    proxy.stop()


def test_stop_is_idempotent_and_ends_the_thread(echo: EchoServer) -> None:
    proxy = FaultProxy(echo.address).start()
    thread = proxy._thread
    assert thread is not None and thread.is_alive()
    sock = dial(proxy.port)
    with sock:
        assert echoes(sock)
        proxy.stop()
        assert not thread.is_alive()
        assert closed(sock)
    proxy.stop()
    with pytest.raises(ConnectionRefusedError):
        dial(proxy.port).close()
    # controls after stop do nothing and do not hang
    proxy.cut()
    proxy.heal()
    assert proxy.connections == 0


def test_main_forwards_until_killed(echo: EchoServer) -> None:
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.fakes.proxy", "0", f"{echo.address[0]}:{echo.address[1]}"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        assert child.stdout is not None
        line = child.stdout.readline()
        assert line.startswith("listening on 127.0.0.1:"), line
        with dial(int(line.rsplit(":", 1)[1])) as sock:
            assert echoes(sock)
    finally:
        child.terminate()
        returncode = child.wait(5)
        assert child.stdout is not None
        child.stdout.close()
    assert returncode == 0  # it stopped cleanly on SIGTERM


# --- ProxyMesh ---------------------------------------------------------------------------------


@pytest.fixture
def servers() -> Iterator[dict[str, EchoServer]]:
    made = {node: EchoServer() for node in "abc"}
    threads = [threading.Thread(target=s.serve_forever, args=(0.05,), daemon=True) for s in made.values()]
    for thread in threads:
        thread.start()
    yield made
    for server in made.values():
        server.shutdown()
        server.server_close()
    for thread in threads:
        thread.join(5)


@pytest.fixture
def mesh(servers: dict[str, EchoServer]) -> Iterator[ProxyMesh]:
    with ProxyMesh({node: s.address for node, s in servers.items()}) as m:
        yield m


def test_mesh_peers_arg(mesh: ProxyMesh, servers: dict[str, EchoServer]) -> None:
    assert len(mesh.proxies) == 6
    real = {node: s.address[1] for node, s in servers.items()}
    ab, ac = mesh.address("a", "b")[1], mesh.address("a", "c")[1]
    assert len({ab, ac, *real.values()}) == 5
    assert mesh.peers_arg("a") == f"a=127.0.0.1:{real['a']},b=127.0.0.1:{ab},c=127.0.0.1:{ac}"
    ba, bc = mesh.address("b", "a")[1], mesh.address("b", "c")[1]
    assert mesh.peers_arg("b") == f"a=127.0.0.1:{ba},b=127.0.0.1:{real['b']},c=127.0.0.1:{bc}"
    assert mesh.address("c", "c") == servers["c"].address
    with pytest.raises(ValueError, match="no link 'a' -> 'x'"):
        mesh.address("a", "x")


def test_mesh_proxies_reach_their_target(mesh: ProxyMesh, servers: dict[str, EchoServer]) -> None:
    for (src, dst), _ in mesh.proxies.items():
        before = servers[dst].accepted
        with dial(mesh.address(src, dst)[1]) as sock:
            assert echoes(sock, f"{src}->{dst}".encode())
        assert servers[dst].accepted == before + 1


def test_mesh_isolate_cuts_exactly_the_links_of_a_node(mesh: ProxyMesh) -> None:
    mesh.isolate("b")
    assert mesh.cut_links() == {("a", "b"), ("b", "a"), ("b", "c"), ("c", "b")}  # 2 * (3 - 1)
    socks = {pair: dial(mesh.address(*pair)[1]) for pair in mesh.proxies}
    try:
        # wait for all the cut links in parallel, so that the test stays short
        replies: dict[tuple[str, str], bool] = {}
        threads = [
            threading.Thread(target=lambda p=pair, s=sock: replies.__setitem__(p, not silent(s)))
            for pair, sock in socks.items()
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(5)
        assert {pair for pair, answered in replies.items() if answered} == {("a", "c"), ("c", "a")}
    finally:
        for sock in socks.values():
            sock.close()
    mesh.heal_all()
    assert mesh.cut_links() == set()
    for pair in mesh.proxies:
        with dial(mesh.address(*pair)[1]) as sock:
            assert echoes(sock)


def test_mesh_isolate_with_reset(mesh: ProxyMesh) -> None:
    with dial(mesh.address("c", "a")[1]) as ca, dial(mesh.address("b", "c")[1]) as bc:
        assert echoes(ca) and echoes(bc)
        mesh.isolate("a", mode="reset")
        assert closed(ca)
        assert echoes(bc)
    assert {mesh.proxy(*pair).mode for pair in mesh.cut_links()} == {"reset"}
    with pytest.raises(ValueError, match="unknown node 'x'"):
        mesh.isolate("x")


def test_mesh_cut_partition_and_heal_one_link(mesh: ProxyMesh) -> None:
    mesh.cut("a", "b")
    assert mesh.cut_links() == {("a", "b")}
    mesh.heal("a", "b")
    mesh.partition({"a"}, {"b", "c"})
    assert mesh.cut_links() == {("a", "b"), ("a", "c"), ("b", "a"), ("c", "a")}
    mesh.heal_all()
    mesh.partition(["a"], ["b"])  # c stays connected to both sides
    assert mesh.cut_links() == {("a", "b"), ("b", "a")}
    with pytest.raises(ValueError, match="on two sides"):
        mesh.partition(["a"], ["a", "b"])


def test_mesh_stop_is_idempotent(servers: dict[str, EchoServer]) -> None:
    mesh = ProxyMesh({node: s.address for node, s in servers.items()}).start()
    threads = [p._thread for p in mesh.proxies.values()]
    mesh.stop()
    mesh.stop()
    assert all(t is not None and not t.is_alive() for t in threads)
