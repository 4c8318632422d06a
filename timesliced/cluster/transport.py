"""Peer transport: authenticated msgpack-over-TCP links between node daemons.

Each node dials every other node once and sends to it only on that outbound
connection; it receives from a peer only on the connection that peer dialed.
So two nodes never race to pick one of two duplicate connections.

Every new connection starts with a challenge-response handshake in both
directions. The accepting side sends a random nonce; the dialer answers with an
proof of the shared token (``wire.proof``) over the nonce and both node ids, and
its own nonce; the accepter's welcome proves the token the same way over that
one. So neither side sends to, or takes from, a node that does not know the
token. The token itself never crosses the wire and is never logged. This authenticates the connection, not each
frame: links are meant for a private network.

Delivery is at most once and in order per link. Frames wait in a bounded
per-peer queue (oldest dropped first) while a link is down or the socket is
pushing back, and leave the queue only when handed to the socket; frames in
flight when a connection breaks are lost, and the layers above resynchronise.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import random
import secrets
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .. import errors
from ..util.compat import timeout
from ..wire import status
from ..wire.codec import FrameDecoder, encode
from ..wire.proof import CHALLENGE_BYTES, Purpose, proof_matches, prove

log = logging.getLogger(__name__)

PEER_PROTOCOL = 3  # 2: proofs made by wire.proof; 3: host readings, moves that leave a job intact, freezing
NONCE_SIZE = CHALLENGE_BYTES
MIN_TOKEN_LENGTH = 16
STALL_BYTES = 8 << 20  # queued for a peer whose socket stopped taking data: past this, drop the connection
WRITE_BATCH = 64 << 10  # a backlog is handed to the socket in writes of about this size
JITTER = 0.2  # reconnect delays vary by this fraction either way, so restarted peers do not dial in lockstep
CLOSE_TIMEOUT = 1.0  # close() waits this long for connections to flush and go before aborting them
BACKLOG = 128


@dataclass(eq=False)
class _Link:
    """Everything this node knows about sending to one peer."""

    peer: str
    address: tuple[str, int]
    queue: collections.deque[bytes] = field(default_factory=collections.deque)
    wire: _Outbound | None = None  # the authenticated outbound connection, while the link is up
    up: bool = False  # as last reported to on_link
    sent: int = 0
    received: int = 0
    dropped: int = 0
    reconnects: int = 0
    ever_up: bool = False
    last_error: str | None = None
    logged_error: str | None = None  # the failure last logged at WARNING; repeats go to DEBUG
    overflowing: bool = False  # an overflow episode is going on (warned once); ends when the queue empties
    blocked_bytes: int = 0  # queued since the socket last pushed back; reset when it takes data again
    task: asyncio.Task[None] | None = None


class PeerTransport:
    """Links from this node to every other node, with ``send`` and an ``on_message`` callback.

    Callbacks (``on_message``, ``on_link``) run on the event loop; an exception
    they raise is logged and changes nothing.
    """

    def __init__(
        self,
        node_id: str,
        peers: dict[str, tuple[str, int]],
        token: str,
        on_message: Callable[[str, dict[str, Any]], None],
        *,
        on_link: Callable[[str, bool], None] | None = None,
        max_frame: int = 1 << 20,
        queue_limit: int = 4096,
        backoff: tuple[float, float] = (0.05, 1.0),
        connect_timeout: float = 2.0,
        handshake_timeout: float = 2.0,
    ) -> None:
        """``peers`` maps every other node's id to the address to dial.

        Raises ``ValueError`` for an empty or NUL-holding node id, ``peers``
        naming this node, a token shorter than 16 characters, or limits and
        delays that are not positive.
        """
        for name in (node_id, *peers):
            if not isinstance(name, str) or not name or "\0" in name:
                raise ValueError(f"node ids must be non-empty strings without NUL, got {name!r}")
        if node_id in peers:
            raise ValueError(f"peers must list the other nodes only, not this node {node_id!r}")
        if len(token) < MIN_TOKEN_LENGTH:
            raise ValueError(f"the peer token must have at least {MIN_TOKEN_LENGTH} characters")
        if max_frame < 1 or queue_limit < 1:
            raise ValueError("max_frame and queue_limit must be positive")
        if not 0 < backoff[0] <= backoff[1]:
            raise ValueError(f"backoff must be (first, maximum) with 0 < first <= maximum, got {backoff!r}")
        if connect_timeout <= 0 or handshake_timeout <= 0:
            raise ValueError("connect_timeout and handshake_timeout must be positive")
        self.node_id = node_id
        self.on_message = on_message
        self.on_link = on_link
        self.max_frame = max_frame
        self.queue_limit = queue_limit
        self.backoff = backoff
        self.connect_timeout = connect_timeout
        self.handshake_timeout = handshake_timeout
        self._token = token.encode()
        self._links = {peer: _Link(peer, (host, port)) for peer, (host, port) in peers.items()}
        self._outbound: set[_Outbound] = set()
        self._inbound: set[_Inbound] = set()
        self._inbound_by_peer: dict[str, _Inbound] = {}
        self._server: asyncio.Server | None = None
        self._listen = ""
        self._closed = False
        self._rng = random.Random()

    # --- public API ----------------------------------------------------------------------

    async def start(self, host: str, port: int) -> tuple[str, int]:
        """Bind the listener (port 0 picks one) and start dialing every peer; returns the bound address.

        Raises ``OSError`` when the address cannot be bound and ``RuntimeError``
        when called twice or after ``close``.
        """
        if self._server is not None or self._closed:
            raise RuntimeError("the peer transport was already started or closed")
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Inbound(self), host=host, port=port, backlog=BACKLOG)
        bound = self._server.sockets[0].getsockname()
        self._listen = f"{bound[0]}:{bound[1]}"
        for link in self._links.values():
            # Owned here and reaped by close(): the transport's API has no run() to hang them on.
            link.task = loop.create_task(self._dial_forever(link), name=f"peer-link {self.node_id}->{link.peer}")
            link.task.add_done_callback(self._dialer_done)
        return bound[0], bound[1]

    def send(self, to: str, message: dict[str, Any]) -> None:
        """Queue ``message`` for peer ``to`` and write it now if its link is up; never blocks.

        Raises ``ValueError`` for a peer that is not configured and
        ``FrameTooLarge`` for a message that does not fit in ``max_frame``.
        """
        link = self._links.get(to)
        if link is None:
            raise ValueError(f"unknown peer {to!r}")
        frame = encode(message, self.max_frame)
        link.queue.append(frame)
        if len(link.queue) > self.queue_limit:
            link.queue.popleft()
            link.dropped += 1
            if not link.overflowing:
                link.overflowing = True
                log.warning("peer %s: more than %d messages queued; dropping the oldest", to, self.queue_limit)
        wire = link.wire
        if wire is None or wire.closing:
            return
        if not wire.paused:
            self._flush(link)
            return
        # The socket pushes back. Bursts are fine, but a peer that takes nothing while
        # this much more piles up has stopped reading: reconnecting tells us whether it lives.
        link.blocked_bytes += len(frame)
        if link.blocked_bytes > STALL_BYTES:
            log.warning("peer %s is not reading: dropping its connection to reconnect", to)
            wire.fail(errors.ConnectionLost("the peer stopped reading"))

    async def close(self) -> None:
        """Stop listening and dialing, close every connection; idempotent.

        Frames already handed to a socket get ``CLOSE_TIMEOUT`` seconds to go
        out; queued ones are discarded. Links that were up report down through
        ``on_link`` like any other loss.
        """
        if self._closed:
            return
        self._closed = True
        if self._server is not None:
            self._server.close()
        dialers = [link.task for link in self._links.values() if link.task is not None]
        for task in dialers:
            task.cancel()
        if dialers:
            # Each dialer closes its own connection on the way out.
            await asyncio.gather(*dialers, return_exceptions=True)
        for inbound in list(self._inbound):
            inbound.abort()  # nothing worth flushing: inbound connections only carry the handshake out
        wires: list[_Outbound | _Inbound] = [*self._outbound, *self._inbound]
        if wires:
            _, pending = await asyncio.wait([w.lost for w in wires], timeout=CLOSE_TIMEOUT)
            if pending:
                for w in wires:
                    w.abort()
                await asyncio.wait(pending, timeout=CLOSE_TIMEOUT)  # connection_lost comes on the next step
        if self._server is not None:
            try:
                async with timeout(CLOSE_TIMEOUT):
                    await self._server.wait_closed()
            except asyncio.TimeoutError:
                log.warning("the peer listener on %s did not close within %.1fs", self._listen, CLOSE_TIMEOUT)

    def connected(self, peer: str) -> bool:
        """Whether the outbound link to ``peer`` is authenticated and up; ``ValueError`` for an unknown peer."""
        link = self._links.get(peer)
        if link is None:
            raise ValueError(f"unknown peer {peer!r}")
        return link.up

    def describe(self) -> status.Peers:
        """The listen address and, per peer, the link's state and counters.

        ``sent`` counts frames handed to the socket, ``received`` messages
        delivered to ``on_message``, ``reconnects`` times the link came back up
        after having been up.
        """
        return {
            "listen": self._listen,
            "peers": {
                link.peer: {
                    "address": f"{link.address[0]}:{link.address[1]}",
                    "connected": link.up,
                    "queued": len(link.queue),
                    "sent": link.sent,
                    "received": link.received,
                    "dropped": link.dropped,
                    "reconnects": link.reconnects,
                    "last_error": link.last_error,
                }
                for link in self._links.values()
            },
        }

    # --- outbound ------------------------------------------------------------------------

    async def _dial_forever(self, link: _Link) -> None:
        delay = self.backoff[0]
        try:
            while True:
                try:
                    wire = await self._connect(link)
                except (OSError, errors.TimeslicedError) as exc:
                    self._attempt_failed(link, _reason(exc))
                else:
                    delay = self.backoff[0]
                    self._link_up(link, wire)
                    await asyncio.shield(wire.lost)  # close() waits on the same future
                await asyncio.sleep(delay * self._rng.uniform(1 - JITTER, 1 + JITTER))
                delay = min(delay * 2, self.backoff[1])
        finally:
            if link.wire is not None:
                link.wire.close()

    async def _connect(self, link: _Link) -> _Outbound:
        """A new connection to ``link``'s peer that has passed the handshake."""
        loop = asyncio.get_running_loop()
        host, port = link.address
        try:
            async with timeout(self.connect_timeout):
                _, wire = await loop.create_connection(lambda: _Outbound(self, link), host, port)
        except asyncio.TimeoutError:
            raise errors.ConnectionLost(f"no connection within {self.connect_timeout:.1f}s") from None
        try:
            async with timeout(self.handshake_timeout):
                await wire.handshake_done
        except asyncio.TimeoutError:
            wire.abort()
            raise errors.ProtocolError(f"no handshake within {self.handshake_timeout:.1f}s") from None
        except BaseException:
            wire.abort()
            raise
        if not wire.welcomed or wire.lost.done():
            wire.abort()
            raise wire.error or errors.ConnectionLost("the connection closed during the handshake")
        return wire

    def _attempt_failed(self, link: _Link, reason: str) -> None:
        link.last_error = reason
        level = logging.DEBUG if reason == link.logged_error else logging.WARNING
        link.logged_error = reason
        log.log(level, "peer %s at %s:%d: %s; retrying", link.peer, *link.address, reason)

    def _link_up(self, link: _Link, wire: _Outbound) -> None:
        link.wire = wire
        link.blocked_bytes = 0
        link.logged_error = None
        if link.ever_up:
            link.reconnects += 1
        link.ever_up = True
        log.info("link to peer %s at %s:%d is up", link.peer, *link.address)
        # Frames queued while the link was down go before anything on_link sends.
        self._flush(link)
        self._report_link(link, True)

    def _wire_lost(self, wire: _Outbound, reason: str) -> None:
        self._outbound.discard(wire)
        link = wire.link
        if link.wire is not wire:
            return  # lost during the handshake: the dialer reports it
        link.wire = None
        link.blocked_bytes = 0
        if not self._closed:
            link.last_error = reason
            log.warning("link to peer %s lost: %s", link.peer, reason)
        self._report_link(link, False)

    def _flush(self, link: _Link) -> None:
        """Hand queued frames to the socket, in order, until it pushes back."""
        wire = link.wire
        queue = link.queue
        while queue and wire is not None and wire.writable:
            batch = [queue.popleft()]
            size = len(batch[0])
            while queue and size < WRITE_BATCH:
                batch.append(queue.popleft())
                size += len(batch[-1])
            wire.write(b"".join(batch))
            link.sent += len(batch)
        if not queue:
            link.overflowing = False

    def _resumed(self, link: _Link) -> None:
        link.blocked_bytes = 0
        self._flush(link)

    def _report_link(self, link: _Link, up: bool) -> None:
        if link.up == up:
            return
        link.up = up
        if self.on_link is None:
            return
        try:
            self.on_link(link.peer, up)
        except Exception:
            log.exception("on_link(%r, %r) failed", link.peer, up)

    def _dialer_done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("a peer dialer stopped", exc_info=task.exception())

    # --- inbound -------------------------------------------------------------------------

    def _refusal(self, message: dict[str, Any], nonce: bytes) -> str | None:
        """Why a hello is refused, or None to accept it."""
        if message.get("t") != "hello":
            return f"expected a hello, got {_shown(message.get('t'))}"
        version = message.get("v")
        if version != PEER_PROTOCOL:
            return f"protocol {_shown(version)} is not supported (this node speaks {PEER_PROTOCOL})"
        node = message.get("node")
        if not isinstance(node, str):
            return f"the hello names no node ({_shown(node)})"
        to = message.get("to")
        if to != self.node_id:
            return f"this is node {self.node_id!r}, not {_shown(to)}"
        theirs = message.get("nonce")
        if not isinstance(theirs, bytes) or len(theirs) != NONCE_SIZE:
            return "the hello holds no valid nonce"
        mac = message.get("mac")
        if not isinstance(mac, bytes) or not proof_matches(
            self._token, Purpose.PEER_HELLO, nonce, mac, node, self.node_id
        ):
            return "authentication failed (is the token the same on both nodes?)"
        if node not in self._links:  # only a holder of the token hears the members
            members = sorted([*self._links, self.node_id])
            shown = ", ".join(members[:8]) + (f" and {len(members) - 8} more" if len(members) > 8 else "")
            return (
                f"node {_shown(node)} is not a member here (members: {shown}); start every daemon with the same "
                "members (with --dns a member's id is its address: keep it across restarts, as on the host network)"
            )
        return None

    def _accepted(self, inbound: _Inbound, peer: str) -> None:
        older = self._inbound_by_peer.get(peer)
        self._inbound_by_peer[peer] = inbound
        if older is not None:
            log.info("peer %s connected again; closing its previous connection", peer)
            older.abort()

    def _deliver(self, peer: str, message: dict[str, Any]) -> None:
        self._links[peer].received += 1
        try:
            self.on_message(peer, message)
        except Exception:
            log.exception("on_message failed for a message from peer %s", peer)

    def _inbound_lost(self, inbound: _Inbound) -> None:
        self._inbound.discard(inbound)
        if inbound.peer is not None and self._inbound_by_peer.get(inbound.peer) is inbound:
            del self._inbound_by_peer[inbound.peer]


class _Outbound(asyncio.Protocol):
    """A connection this node dialed: answer the challenge, wait for welcome, then only send."""

    def __init__(self, owner: PeerTransport, link: _Link) -> None:
        loop = asyncio.get_running_loop()
        self.owner = owner
        self.link = link
        self.transport: asyncio.Transport | None = None
        self.decoder = FrameDecoder(owner.max_frame)
        self.hello_sent = False
        self.welcomed = False
        self.nonce = secrets.token_bytes(NONCE_SIZE)  # the accepter proves the token over it
        self.paused = False
        self.error: errors.TimeslicedError | None = None
        # Both futures only ever get a result, so none holds an exception nobody retrieves.
        self.handshake_done: asyncio.Future[None] = loop.create_future()
        self.lost: asyncio.Future[None] = loop.create_future()

    @property
    def closing(self) -> bool:
        return self.transport is None or self.transport.is_closing()

    @property
    def writable(self) -> bool:
        return not self.paused and not self.closing

    def write(self, data: bytes) -> None:
        assert self.transport is not None
        self.transport.write(data)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.owner._outbound.add(self)
        _set_nodelay(transport)

    def data_received(self, data: bytes) -> None:
        if self.error is not None:
            return
        try:
            for message in self.decoder.feed(data):
                self._handshake(message)
        except errors.TimeslicedError as exc:
            self.fail(exc)

    def fail(self, error: errors.TimeslicedError) -> None:
        """Drop the connection for ``error`` (what the dialer and ``last_error`` report)."""
        if self.error is None:
            self.error = error
        self._settle()
        self.abort()

    def _handshake(self, message: dict[str, Any]) -> None:
        kind = message.get("t")
        if self.welcomed:
            raise errors.ProtocolError(f"the peer sent {_shown(kind)} on a send-only link")
        if not self.hello_sent:
            if kind != "challenge":
                raise errors.ProtocolError(f"expected a challenge, got {_shown(kind)}")
            if message.get("v") != PEER_PROTOCOL:
                raise errors.VersionMismatch(
                    f"the peer speaks protocol {_shown(message.get('v'))}, this node {PEER_PROTOCOL}"
                )
            nonce = message.get("nonce")
            if not isinstance(nonce, bytes) or len(nonce) != NONCE_SIZE:
                raise errors.ProtocolError("the challenge holds no valid nonce")
            node, to = self.owner.node_id, self.link.peer
            mac = prove(self.owner._token, Purpose.PEER_HELLO, nonce, node, to)
            hello = {"t": "hello", "v": PEER_PROTOCOL, "node": node, "to": to, "mac": mac, "nonce": self.nonce}
            self.write(encode(hello, self.owner.max_frame))
            self.hello_sent = True
        elif kind == "welcome":
            answered = message.get("node")
            if answered != self.link.peer:
                # A misconfigured address: never deliver this peer's messages to another node.
                raise errors.ProtocolError(f"the node there is {_shown(answered)}, not {self.link.peer!r}")
            proof = message.get("mac")
            if not isinstance(proof, bytes) or not proof_matches(
                self.owner._token, Purpose.PEER_WELCOME, self.nonce, proof, answered, self.owner.node_id
            ):
                raise errors.PermissionDenied(f"the node at {self.link.peer!r}'s address does not know the token")
            self.welcomed = True
            self._settle()
        elif kind == "refused":
            raise errors.PermissionDenied(f"refused: {_shown(message.get('reason'), 200)}")
        else:
            raise errors.ProtocolError(f"expected a welcome, got {_shown(kind)}")

    def _settle(self) -> None:
        if not self.handshake_done.done():
            self.handshake_done.set_result(None)

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        if self.link.wire is self:
            self.owner._resumed(self.link)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.error is None:
            self.error = errors.ConnectionLost(_reason(exc) if exc else "the peer closed the connection")
        self._settle()
        if not self.lost.done():
            self.lost.set_result(None)
        self.owner._wire_lost(self, self.error.message)


class _Inbound(asyncio.Protocol):
    """A connection a peer dialed: challenge it, then only receive."""

    def __init__(self, owner: PeerTransport) -> None:
        self.owner = owner
        self.transport: asyncio.Transport | None = None
        self.decoder = FrameDecoder(owner.max_frame)
        self.nonce = secrets.token_bytes(NONCE_SIZE)
        self.peer: str | None = None  # the authenticated sender
        self.address = "?"
        self.closed = False
        self.timer: asyncio.TimerHandle | None = None
        self.lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def abort(self) -> None:
        self.closed = True
        self._disarm()
        if self.transport is not None:
            self.transport.abort()

    def _refuse(self, reason: str) -> None:
        log.warning("refused a peer connection from %s: %s", self.address, reason)
        self._send({"t": "refused", "reason": reason})
        self.closed = True
        self._disarm()
        if self.transport is not None:
            self.transport.close()  # after the refusal is written

    def _disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _send(self, message: dict[str, Any]) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(encode(message, self.owner.max_frame))

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        peername = transport.get_extra_info("peername")
        if peername:
            self.address = f"{peername[0]}:{peername[1]}"
        if self.owner._closed:
            self.abort()
            return
        self.owner._inbound.add(self)
        _set_nodelay(transport)
        self._send({"t": "challenge", "v": PEER_PROTOCOL, "nonce": self.nonce})
        loop = asyncio.get_running_loop()
        self.timer = loop.call_later(self.owner.handshake_timeout, self._handshake_expired)

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        try:
            messages = self.decoder.feed(data)
        except errors.ProtocolError as exc:
            who = f"peer {self.peer}" if self.peer is not None else "an unauthenticated peer"
            log.warning("closing the connection from %s at %s: %s", who, self.address, exc.message)
            self.abort()
            return
        for message in messages:
            if self.closed:
                return  # replaced, refused or closed by a callback: the rest is not delivered
            if self.peer is not None:
                self.owner._deliver(self.peer, message)
                continue
            reason = self.owner._refusal(message, self.nonce)
            if reason is not None:
                self._refuse(reason)
                return
            self.peer = message["node"]
            self._disarm()
            proof = prove(self.owner._token, Purpose.PEER_WELCOME, message["nonce"], self.owner.node_id, self.peer)
            self._send({"t": "welcome", "node": self.owner.node_id, "mac": proof})
            self.owner._accepted(self, message["node"])

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._disarm()
        self.owner._inbound_lost(self)
        if not self.lost.done():
            self.lost.set_result(None)

    def _handshake_expired(self) -> None:
        self.timer = None
        if not self.closed:
            self._refuse(f"no hello within {self.owner.handshake_timeout:.1f}s")


def _set_nodelay(transport: asyncio.Transport) -> None:
    # A lock handoff is one small frame: Nagle's delay would be most of its latency.
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _reason(exc: BaseException) -> str:
    if isinstance(exc, errors.TimeslicedError):
        return exc.message
    return str(exc) or exc.__class__.__name__


def _shown(value: Any, limit: int = 80) -> str:
    """A remote-supplied value, safe and short enough for a log line."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
