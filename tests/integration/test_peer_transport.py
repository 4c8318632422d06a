"""The peer transport over real loopback sockets: handshake, delivery, queues, reconnects."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from timesliced.cluster.transport import NONCE_SIZE, PEER_PROTOCOL, PeerTransport
from timesliced.errors import FrameTooLarge
from timesliced.wire.codec import HEADER, decode_body, encode
from timesliced.wire.proof import Purpose, prove

TOKEN = "peer-token-4f9c2a7d81e6"
OTHER_TOKEN = "peer-token-0b3e5d9a2c47"
HOST = "127.0.0.1"
Address = tuple[str, int]


def free_port() -> int:
    """A loopback port that was free a moment ago (peers must know each other's address up front)."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        port: int = s.getsockname()[1]
        return port


class Node:
    """A ``PeerTransport`` that records what it receives and how its links change."""

    def __init__(self, net: Net, node_id: str, peers: dict[str, Address], **options: Any) -> None:
        self.id = node_id
        self.inbox: list[tuple[str, dict[str, Any]]] = []
        self.links: list[tuple[str, bool]] = []
        self.fail_on: object = None  # on_message raises for a message whose "n" is this
        options.setdefault("backoff", (0.01, 0.1))
        token = options.pop("token", TOKEN)
        self.t = PeerTransport(node_id, peers, token, self._received, on_link=self._link, **options)
        net.closers.append(self.t.close)

    def _received(self, sender: str, message: dict[str, Any]) -> None:
        self.inbox.append((sender, message))
        if message.get("n") == self.fail_on:
            raise RuntimeError("on_message blew up")

    def _link(self, peer: str, up: bool) -> None:
        self.links.append((peer, up))

    def got(self, sender: str) -> list[Any]:
        return [m.get("n") for s, m in self.inbox if s == sender]

    def peer(self, peer: str) -> dict[str, Any]:
        info: dict[str, Any] = self.t.describe()["peers"][peer]
        return info


class Net:
    """Loopback addresses reserved per node id, and everything to close at the end of a test."""

    def __init__(self) -> None:
        self.addresses: dict[str, Address] = {}
        self.closers: list[Callable[[], Awaitable[None]]] = []

    def address(self, node_id: str) -> Address:
        if node_id not in self.addresses:
            self.addresses[node_id] = (HOST, free_port())
        return self.addresses[node_id]

    def node(self, node_id: str, peers: list[str], **options: Any) -> Node:
        return Node(self, node_id, {p: self.address(p) for p in peers}, **options)

    async def start(self, *nodes: Node) -> None:
        for n in nodes:
            assert await n.t.start(*self.address(n.id)) == self.address(n.id)

    async def mesh(self, *ids: str, **options: Any) -> list[Node]:
        nodes = [self.node(i, [p for p in ids if p != i], **options) for i in ids]
        await self.start(*nodes)
        for n in nodes:
            for p in ids:
                if p != n.id:
                    await eventually(lambda n=n, p=p: n.t.connected(p), f"{n.id} -> {p} up")
        return nodes

    def track(self, writer: asyncio.StreamWriter) -> asyncio.StreamWriter:
        async def close() -> None:
            writer.close()
            try:
                await writer.wait_closed()
            except OSError:
                pass

        self.closers.append(close)
        return writer

    async def close(self) -> None:
        for close in reversed(self.closers):
            await close()


def run(body: Callable[[Net], Awaitable[None]]) -> None:
    async def main() -> None:
        net = Net()
        try:
            await body(net)
        finally:
            await net.close()

    asyncio.run(main())


async def eventually(predicate: Callable[[], Any], what: str = "condition", timeout: float = 3.0) -> None:
    """Poll ``predicate`` until it holds; generous, since machines are noisy."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def read_frame(reader: asyncio.StreamReader) -> dict[str, Any]:
    (size,) = HEADER.unpack(await reader.readexactly(HEADER.size))
    return decode_body(await reader.readexactly(size))


async def at_eof(reader: asyncio.StreamReader) -> bool:
    """Whether the other end closes the connection (soon), skipping whatever it still sends."""

    async def drain() -> None:
        while await reader.read(1 << 16):
            pass

    try:
        await asyncio.wait_for(drain(), 3.0)
    except asyncio.TimeoutError:
        return False
    except ConnectionResetError:
        pass
    return True


def mac(token: str, nonce: bytes, node: str, to: str) -> bytes:
    """Written out here rather than imported, so the test pins the documented handshake (wire.proof)."""
    names = b"".join(len(n).to_bytes(2, "big") + n for n in (node.encode(), to.encode()))
    return hmac.new(token.encode(), b"timesliced peer hello v2\0" + nonce + names, hashlib.sha256).digest()


async def dial(
    net: Net, address: Address, node: str, to: str, token: str = TOKEN
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, dict[str, Any]]:
    """A hand-made dialer: answer the challenge as ``node``; returns the accepter's reply."""
    reader, writer = await asyncio.open_connection(*address)
    net.track(writer)
    challenge = await read_frame(reader)
    assert challenge["t"] == "challenge" and challenge["v"] == PEER_PROTOCOL
    assert isinstance(challenge["nonce"], bytes) and len(challenge["nonce"]) == NONCE_SIZE
    hello = {
        "t": "hello",
        "v": PEER_PROTOCOL,
        "node": node,
        "to": to,
        "mac": mac(token, challenge["nonce"], node, to),
        "nonce": os.urandom(NONCE_SIZE),
    }
    writer.write(encode(hello))
    return reader, writer, await read_frame(reader)


class Accepter:
    """A hand-made accepting node: challenges, welcomes as ``answer_as``, then never reads again."""

    def __init__(self, net: Net, answer_as: str, token: str = TOKEN) -> None:
        self.net = net
        self.answer_as = answer_as
        self.token = token
        self.hellos: list[dict[str, Any]] = []
        self.readers: list[asyncio.StreamReader] = []
        self.release = asyncio.Event()
        self.serving: set[asyncio.Task[Any]] = set()

    async def start(self) -> Address:
        server = await asyncio.start_server(self._serve, HOST, 0)

        async def close() -> None:
            self.release.set()
            server.close()
            await server.wait_closed()
            await asyncio.gather(*self.serving)

        self.net.closers.append(close)
        host, port = server.sockets[0].getsockname()[:2]
        return host, port

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.serving.add(task)
        try:
            writer.write(encode({"t": "challenge", "v": PEER_PROTOCOL, "nonce": os.urandom(NONCE_SIZE)}))
            hello = await read_frame(reader)
            self.hellos.append(hello)
            proof = prove(self.token, Purpose.PEER_WELCOME, hello["nonce"], self.answer_as, hello["node"])
            writer.write(encode({"t": "welcome", "node": self.answer_as, "mac": proof}))
            self.readers.append(reader)
            await self.release.wait()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the dialer hung up mid-handshake (its close() in the end, say)
        finally:
            writer.close()


# --- delivery ----------------------------------------------------------------------------


def test_three_nodes_exchange_messages_both_ways_in_order() -> None:
    async def body(net: Net) -> None:
        nodes = await net.mesh("a", "b", "c")
        for n in range(100):
            for src in nodes:
                for dst in nodes:
                    if dst is not src:
                        src.t.send(dst.id, {"n": n, "from": src.id})
        for dst in nodes:
            for src in nodes:
                if src is not dst:
                    await eventually(lambda d=dst, s=src: len(d.got(s.id)) == 100, f"{src.id} -> {dst.id}")
                    assert dst.got(src.id) == list(range(100))
                    assert all(m["from"] == s for s, m in dst.inbox)
        a = nodes[0]
        assert a.peer("b")["sent"] == 100 and a.peer("b")["received"] == 100
        assert a.peer("b")["connected"] is True and a.peer("b")["queued"] == 0
        assert a.t.describe()["listen"] == "{}:{}".format(*net.address("a"))
        assert sorted(a.links) == [("b", True), ("c", True)]

    run(body)


def test_messages_sent_while_the_peer_is_down_arrive_in_order_once_it_starts() -> None:
    async def body(net: Net) -> None:
        a, b = net.node("a", ["b"]), net.node("b", ["a"])
        await net.start(a)
        for n in range(50):
            a.t.send("b", {"n": n})
        await asyncio.sleep(0.2)  # a few failed dials
        assert not a.t.connected("b")
        assert a.peer("b")["queued"] == 50 and a.peer("b")["last_error"]
        await net.start(b)
        await eventually(lambda: len(b.got("a")) == 50, "the queued messages")
        assert b.got("a") == list(range(50))
        assert a.peer("b")["queued"] == 0 and a.peer("b")["dropped"] == 0

    run(body)


def test_queue_overflow_drops_the_oldest_and_counts_it(caplog: pytest.LogCaptureFixture) -> None:
    async def body(net: Net) -> None:
        a, b = net.node("a", ["b"], queue_limit=10), net.node("b", ["a"])
        await net.start(a)
        for n in range(25):
            a.t.send("b", {"n": n})
        assert a.peer("b")["queued"] == 10 and a.peer("b")["dropped"] == 15
        overflow = [r for r in caplog.records if "dropping the oldest" in r.getMessage()]
        assert len(overflow) == 1 and overflow[0].levelno == logging.WARNING  # once per episode
        await net.start(b)
        await eventually(lambda: len(b.got("a")) == 10, "the newest ten")
        assert b.got("a") == list(range(15, 25))

    run(body)


def test_on_message_raising_does_not_break_the_link(caplog: pytest.LogCaptureFixture) -> None:
    async def body(net: Net) -> None:
        a, b = await net.mesh("a", "b")
        b.fail_on = 1
        for n in range(3):
            a.t.send("b", {"n": n})
        await eventually(lambda: len(b.got("a")) == 3, "all three")
        assert b.got("a") == [0, 1, 2]
        assert any("on_message failed" in r.getMessage() and r.exc_info for r in caplog.records)
        assert a.links == [("b", True)] and a.peer("b")["reconnects"] == 0

    run(body)


def test_send_to_an_unknown_peer_or_too_large_a_message_raises() -> None:
    async def body(net: Net) -> None:
        a = net.node("a", ["b"], max_frame=1024)
        with pytest.raises(ValueError, match="unknown peer"):
            a.t.send("z", {"n": 1})
        with pytest.raises(ValueError, match="unknown peer"):
            a.t.send("a", {"n": 1})
        with pytest.raises(ValueError, match="unknown peer"):
            a.t.connected("z")
        with pytest.raises(FrameTooLarge):
            a.t.send("b", {"blob": b"x" * 2048})
        assert a.peer("b")["queued"] == 0

    run(body)


@pytest.mark.parametrize(
    ("node_id", "peers", "token", "match"),
    [
        ("a", {"b": (HOST, 1)}, "short", "at least 16"),
        ("a", {"a": (HOST, 1)}, TOKEN, "not this node"),
        ("", {"b": (HOST, 1)}, TOKEN, "non-empty"),
        ("a", {"b\0": (HOST, 1)}, TOKEN, "without NUL"),
    ],
    ids=["short token", "self among peers", "empty id", "NUL in an id"],
)
def test_bad_configuration_raises(node_id: str, peers: dict[str, Address], token: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        PeerTransport(node_id, peers, token, lambda sender, message: None)


# --- the handshake -----------------------------------------------------------------------


def test_a_wrong_token_is_refused_and_never_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)

    async def body(net: Net) -> None:
        a, b = net.node("a", ["b"]), net.node("b", ["a"], token=OTHER_TOKEN)
        await net.start(a, b)
        a.t.send("b", {"n": 1})
        b.t.send("a", {"n": 2})
        await eventually(lambda: "authentication failed" in (a.peer("b")["last_error"] or ""), "a refused")
        await eventually(lambda: "authentication failed" in (b.peer("a")["last_error"] or ""), "b refused")
        assert a.inbox == b.inbox == []
        assert not a.t.connected("b") and not b.t.connected("a") and a.links == b.links == []
        assert a.peer("b")["queued"] == 1  # kept for when the token is fixed

    run(body)
    refusals = [r for r in caplog.records if r.levelno == logging.WARNING and "authentication failed" in r.getMessage()]
    assert refusals
    for secret in (TOKEN, OTHER_TOKEN):
        assert secret not in caplog.text
        assert all(secret not in r.getMessage() for r in caplog.records)


def test_an_unknown_node_is_refused(caplog: pytest.LogCaptureFixture) -> None:
    async def body(net: Net) -> None:
        b, c = net.node("b", ["a"]), net.node("c", ["b"])
        await net.start(b, c)
        c.t.send("b", {"n": 1})
        refusal = "node 'c' is not a member here (members: a, b); start every daemon with the same members"
        await eventually(lambda: refusal in (c.peer("b")["last_error"] or ""), "the refusal")
        assert b.inbox == [] and not c.t.connected("b")

    run(body)
    assert any(
        r.levelno == logging.WARNING and "node 'c' is not a member here" in r.getMessage() for r in caplog.records
    )


def test_only_a_holder_of_the_token_hears_the_members() -> None:
    """The membership check comes after the token's: a stranger on the peer port learns nothing of the cluster."""

    async def body(net: Net) -> None:
        b = net.node("b", ["a"])
        await net.start(b)
        _, _, stranger = await dial(net, net.address("b"), "intruder", "b", token=OTHER_TOKEN)
        assert stranger == {"t": "refused", "reason": "authentication failed (is the token the same on both nodes?)"}
        _, _, member = await dial(net, net.address("b"), "intruder", "b")
        assert member["t"] == "refused" and "not a member here (members: a, b)" in member["reason"]

    run(body)


def test_dialing_an_address_where_another_node_answers_is_refused() -> None:
    async def body(net: Net) -> None:
        c = net.node("c", ["a"])
        a = Node(net, "a", {"b": net.address("c")})  # b's address wrongly points at c
        await net.start(a, c)
        a.t.send("b", {"n": 1})
        await eventually(lambda: "this is node 'c', not 'b'" in (a.peer("b")["last_error"] or ""), "the refusal")
        assert c.inbox == [] and not a.t.connected("b")

    run(body)


def test_a_welcome_from_another_node_is_not_trusted() -> None:
    async def body(net: Net) -> None:
        accepter = Accepter(net, answer_as="mallory")
        a = Node(net, "a", {"b": await accepter.start()})
        a.t.send("b", {"n": 1})
        await net.start(a)
        await eventually(lambda: "'mallory', not 'b'" in (a.peer("b")["last_error"] or ""), "the rejection")
        assert not a.t.connected("b") and a.links == []
        hello = accepter.hellos[0]
        assert (hello["node"], hello["to"], len(hello["mac"])) == ("a", "b", 32)
        assert await at_eof(accepter.readers[0])  # a hung up without sending its message
        assert a.peer("b")["queued"] == 1 and a.peer("b")["sent"] == 0

    run(body)


def test_an_accepter_that_does_not_know_the_token_gets_nothing() -> None:
    async def body(net: Net) -> None:
        accepter = Accepter(net, answer_as="b", token="an impostor's guess at it")
        a = Node(net, "a", {"b": await accepter.start()})
        a.t.send("b", {"n": 1})
        await net.start(a)
        await eventually(lambda: "does not know the token" in (a.peer("b")["last_error"] or ""), "the rejection")
        assert not a.t.connected("b") and a.links == []
        assert await at_eof(accepter.readers[0])  # a hung up without sending its message
        assert a.peer("b")["queued"] == 1 and a.peer("b")["sent"] == 0

    run(body)


def test_a_silent_connection_is_closed_after_the_handshake_timeout() -> None:
    async def body(net: Net) -> None:
        b = net.node("b", ["a"], handshake_timeout=0.2)
        await net.start(b)
        reader, writer = await asyncio.open_connection(*net.address("b"))
        net.track(writer)
        assert (await read_frame(reader))["t"] == "challenge"
        refused = await read_frame(reader)
        assert refused["t"] == "refused" and "no hello" in refused["reason"]
        assert await at_eof(reader)

    run(body)


def test_a_second_connection_from_a_peer_replaces_the_first() -> None:
    async def body(net: Net) -> None:
        b = net.node("b", ["a"])
        await net.start(b)
        first, _, welcome = await dial(net, net.address("b"), "a", "b")
        assert welcome["t"] == "welcome" and welcome["node"] == "b" and len(welcome["mac"]) == 32
        _, writer, welcome = await dial(net, net.address("b"), "a", "b")
        assert welcome["t"] == "welcome"
        assert await at_eof(first)
        writer.write(encode({"n": 7}))
        await eventually(lambda: b.got("a") == [7], "the message on the new connection")

    run(body)


# --- failures ----------------------------------------------------------------------------


def test_garbage_and_oversized_frames_close_only_their_connection(caplog: pytest.LogCaptureFixture) -> None:
    async def body(net: Net) -> None:
        a, b = net.node("a", ["b"]), net.node("b", ["a", "c"])  # c is played by hand below
        await net.start(a, b)
        await eventually(lambda: a.t.connected("b") and b.t.connected("a"), "a <-> b")

        # Before the handshake: a body that is not msgpack, then a header past max_frame.
        for junk in (HEADER.pack(3) + b"\xc1\xc1\xc1", HEADER.pack((1 << 20) + 1)):
            reader, writer = await asyncio.open_connection(*net.address("b"))
            net.track(writer)
            assert (await read_frame(reader))["t"] == "challenge"
            writer.write(junk)
            assert await at_eof(reader)

        # After it: an authenticated peer's connection is closed, its earlier message kept.
        for n, junk in enumerate((HEADER.pack(1) + b"\x01", HEADER.pack((1 << 20) + 1))):
            reader, writer, welcome = await dial(net, net.address("b"), "c", "b")
            assert welcome["t"] == "welcome"
            writer.write(encode({"n": n}))
            await eventually(lambda n=n: b.got("c") == list(range(n + 1)), "c's message")
            writer.write(junk)
            assert await at_eof(reader)
        assert b.got("c") == [0, 1]
        assert any("closing the connection from peer c" in r.getMessage() for r in caplog.records)

        a.t.send("b", {"n": 42})
        b.t.send("a", {"n": 43})
        await eventually(lambda: b.got("a") == [42] and a.got("b") == [43], "a <-> b still working")
        assert a.links == [("b", True)] and b.links[0] == ("a", True) and ("a", False) not in b.links

    run(body)


def test_a_peer_restart_reconnects_and_reports_the_link_down_then_up() -> None:
    async def body(net: Net) -> None:
        a, b = await net.mesh("a", "b")
        a.t.send("b", {"n": 0})
        await eventually(lambda: b.got("a") == [0], "the first message")
        await b.t.close()
        await eventually(lambda: a.links == [("b", True), ("b", False)], "a sees b go")
        assert not a.t.connected("b")
        for n in range(1, 20):
            a.t.send("b", {"n": n})
        restarted = net.node("b", ["a"])
        await net.start(restarted)
        await eventually(lambda: restarted.got("a") == list(range(1, 20)), "the messages sent while b was away")
        assert a.links == [("b", True), ("b", False), ("b", True)]
        assert a.peer("b")["reconnects"] == 1
        restarted.t.send("a", {"n": 99})
        await eventually(lambda: a.got("b") == [99], "b -> a again")

    run(body)


@pytest.mark.slow
def test_a_peer_that_stops_reading_is_dropped_and_redialed(caplog: pytest.LogCaptureFixture) -> None:
    async def body(net: Net) -> None:
        accepter = Accepter(net, answer_as="b")  # welcomes, then never reads
        a = Node(net, "a", {"b": await accepter.start()}, queue_limit=64, max_frame=2 << 20)
        await net.start(a)
        await eventually(lambda: a.t.connected("b"), "the link")
        blob = b"x" * (1 << 20)
        for n in range(200):  # sockets absorb a few MiB; the transport drops the link past 8 MiB more
            if ("b", False) in a.links:
                break
            a.t.send("b", {"n": n, "blob": blob})
            await asyncio.sleep(0.002)
        assert a.links[:2] == [("b", True), ("b", False)]
        assert any("not reading" in r.getMessage() for r in caplog.records)
        await eventually(lambda: len(accepter.hellos) >= 2, "a dials again")

    run(body)


def test_close_is_idempotent_and_leaves_no_tasks() -> None:
    async def body(net: Net) -> None:
        a, b = await net.mesh("a", "b")
        a.t.send("b", {"n": 1})
        await eventually(lambda: b.got("a") == [1], "a message")
        for _ in range(2):
            await a.t.close()
            await b.t.close()
        assert asyncio.all_tasks() == {asyncio.current_task()}
        assert a.links == [("b", True), ("b", False)] and not a.t.connected("b")
        a.t.send("b", {"n": 2})  # queued, never sent; not an error
        with pytest.raises(RuntimeError):
            await a.t.start(HOST, 0)
        closed_early = net.node("c", ["a"])
        await closed_early.t.close()  # never started
        await closed_early.t.close()

    run(body)
