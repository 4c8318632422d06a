"""The client server: accepts connections and turns bytes into requests.

Each connection is isolated: a malformed or oversized frame, a stalled
half-frame, a client that stops reading or a handler that blows up closes
(or answers) that one connection and touches nothing else.

A TCP connection must also prove the deployment's shared token before any
request other than its hello is served (``wire.proof``); Unix-socket connections
are vouched for by the kernel.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import secrets
import socket
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from .. import errors
from ..wire.codec import FrameDecoder, encode
from ..wire.messages import PROTOCOL_VERSION, Push, Reply, parse_request, quoted, request_id_of
from ..wire.proof import CHALLENGE_BYTES, Purpose, proof_matches
from ..wire.status import Counters

log = logging.getLogger(__name__)

UNIX_PATH_MAX = 107  # sockaddr_un's sun_path is 108 bytes on Linux, the last one the terminating NUL
BACKLOG = 1024  # bursts of clients starting together (a whole job's ranks) must not see EAGAIN


@dataclass
class Peer:
    """Who is on the other end, as the kernel reports it."""

    transport: str  # "unix" | "tcp"
    pid: int | None = None
    uid: int | None = None
    address: str = ""

    @property
    def client(self) -> str:
        """Who counts as one client for the connection limit: a process, or a remote host.

        A process in a PID namespace the daemon cannot see (a job pod beside the daemon's) has no PID
        here (the kernel says 0): each such connection counts alone, so that one pod's connections never
        use up the others'; ``max_connections`` still bounds them all.
        """
        if self.transport == "unix":
            if not self.pid:
                return f"a process of another PID namespace (connection {id(self):x})"
            return f"process {self.pid}"
        return f"host {self.address.rpartition(':')[0] or '?'}"


@dataclass
class Connection:
    id: int
    peer: Peer
    transport: asyncio.WriteTransport
    max_frame: int
    max_write_buffer: int
    hello: dict[str, Any] | None = None
    challenge: str | None = None  # set by a TCP hello; None again once the client proved the token
    closed: bool = False
    heard_at: float = 0.0  # event-loop time of the last bytes from the client (its lease runs from here)

    @property
    def ready(self) -> bool:
        """Said hello and, over TCP, proved the token: its requests are served."""
        return self.hello is not None and self.challenge is None

    def send(self, message: dict[str, Any]) -> None:
        """Queue one frame; never blocks. A client that does not read is dropped."""
        if self.closed:
            return
        try:
            frame = encode(message, self.max_frame)
        except errors.FrameTooLarge as exc:
            log.error("connection %d: reply too large, sending an error instead: %s", self.id, exc)
            if "id" not in message:
                return
            frame = encode(Reply(message["id"], False, error=errors.InternalError(str(exc))).to_wire())
        self.transport.write(frame)
        if self.transport.get_write_buffer_size() > self.max_write_buffer:
            log.warning("connection %d: client is not reading its replies; closing it", self.id)
            self.transport.abort()
            self.closed = True

    def reply(self, request_id: int, result: Any) -> None:
        self.send(Reply(request_id, True, result).to_wire())

    def fail(self, request_id: int | None, error: errors.TimeslicedError) -> None:
        self.send({"id": request_id, "ok": False, "error": errors.to_wire(error)})

    def push(self, event: str, data: dict[str, Any]) -> None:
        self.send(Push(event, data).to_wire())

    def close(self) -> None:
        """Close after the queued frames (an error reply, say) are sent."""
        if not self.closed:
            self.closed = True
            self.transport.close()


class Handler(Protocol):
    """What the server needs from the daemon."""

    def handle_request(self, conn: Connection, request_id: int, op: str, args: dict[str, Any]) -> Any: ...
    def close_connection(self, conn: Connection) -> None: ...


DEFERRED = object()  # a handler returns this when the reply comes later (acquire, alloc)


class ClientServer:
    """Unix-socket (and optional TCP) listener feeding requests to a ``Handler``."""

    def __init__(
        self,
        handler: Handler,
        *,
        max_frame: int,
        max_connections: int,
        handshake_timeout: float,
        stall_timeout: float,
        max_write_buffer: int,
        node: str,
        backend: str,
        token: str | None = None,
        lease: float = 0.0,
        max_per_client: int = 256,
    ) -> None:
        """``token``: what TCP clients must prove (``start_tcp`` refuses to listen without one)."""
        self.handler = handler
        self.max_frame = max_frame
        self.max_connections = max_connections
        self.handshake_timeout = handshake_timeout
        self.stall_timeout = stall_timeout
        self.max_write_buffer = max_write_buffer
        self.node = node
        self.backend = backend
        self._token = token
        self.lease = lease  # a connection silent this long is closed (0: never); clients heartbeat
        self.max_per_client = max_per_client  # connections from one process (Unix socket) or one host (TCP)
        self._per_client: dict[str, int] = {}
        self.connections: dict[int, Connection] = {}
        self.counters: Counters = {
            "accepted": 0,
            "refused": 0,
            "protocol_errors": 0,
            "internal_errors": 0,
            "auth_failures": 0,
            "leases_expired": 0,
        }
        self._ids = itertools.count(1)
        self._servers: list[asyncio.Server] = []
        self._closing = False
        self.addresses: list[str] = []

    async def start_unix(self, path: Path) -> None:
        """Bind the Unix socket (replacing a stale one) and start accepting."""
        if len(os.fsencode(path)) > UNIX_PATH_MAX:
            raise errors.TimeslicedError(
                f"the socket path {path} is {len(os.fsencode(path))} bytes, longer than the {UNIX_PATH_MAX} a Unix "
                "socket's address holds: give a shorter --socket or --state-dir"
            )
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        if path.exists() or path.is_symlink():
            if await _socket_answers(path):
                raise errors.TimeslicedError(f"another daemon is already serving {path}")
            path.unlink()
        loop = asyncio.get_running_loop()
        server = await loop.create_unix_server(lambda: _Wire(self, "unix"), path=str(path), backlog=BACKLOG)
        os.chmod(path, 0o660)  # the owner and its group; see docs/guide/security.md
        self._servers.append(server)
        self.addresses.append(str(path))

    async def start_tcp(self, host: str, port: int) -> tuple[str, int]:
        """Bind a TCP listener (port 0 picks one); returns the bound address.

        Raises ``ValueError`` without a token: TCP clients are known by the token alone.
        """
        if not self._token:
            raise ValueError("serving clients over TCP needs the shared token (--token-file or $TIMESLICED_TOKEN)")
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: _Wire(self, "tcp"), host=host, port=port, backlog=BACKLOG)
        self._servers.append(server)
        bound = server.sockets[0].getsockname()
        self.addresses.append(f"{bound[0]}:{bound[1]}")
        return bound[0], bound[1]

    async def close(self) -> None:
        self._closing = True
        for server in self._servers:
            server.close()
        conns = list(self.connections.values())
        for conn in conns:
            conn.close()
        await asyncio.sleep(0)  # a closed transport lets its socket go on the loop's next pass
        for conn in conns:
            # One whose client reads nothing holds its last frames, and its socket, until they are
            # written: the daemon is going, so they go now (a transport already gone ignores this).
            conn.transport.abort()
        await asyncio.sleep(0)
        for server in self._servers:
            await server.wait_closed()

    def expire_leases(self, now: float) -> list[Connection]:
        """Close every introduced connection silent for longer than the lease; returns them."""
        if not self.lease:
            return []
        quiet = [c for c in self.connections.values() if c.ready and now - c.heard_at > self.lease]
        for conn in quiet:
            self.counters["leases_expired"] += 1
            log.warning(
                "connection %d (pid %s): silent for %.1fs, past its lease of %gs; closing it",
                conn.id,
                conn.peer.pid,
                now - conn.heard_at,
                self.lease,
            )
            conn.fail(None, errors.ConnectionLost(f"no heartbeat within the lease of {self.lease:g}s"))
            conn.close()
        return quiet

    def accept(self, transport: asyncio.Transport, kind: str) -> Connection | None:
        if self._closing:  # accepted by the kernel as the daemon stopped: nothing will serve it
            transport.abort()
            return None
        peer = Peer(kind)
        sock = transport.get_extra_info("socket")
        if kind == "unix" and sock is not None and hasattr(socket, "SO_PEERCRED"):
            creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            peer.pid, peer.uid, _gid = struct.unpack("3i", creds)
        elif kind == "tcp":
            address = transport.get_extra_info("peername")
            peer.address = f"{address[0]}:{address[1]}" if address else ""
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = Connection(next(self._ids), peer, transport, self.max_frame, self.max_write_buffer)
        conn.heard_at = asyncio.get_running_loop().time()
        client = peer.client
        refusal = None
        if len(self.connections) >= self.max_connections:
            refusal = f"the daemon already serves {self.max_connections} connections"
        elif self._per_client.get(client, 0) >= self.max_per_client:
            refusal = f"{client} already has {self.max_per_client} connections to this daemon"
        if refusal is not None:
            self.counters["refused"] += 1
            conn.fail(None, errors.LimitExceeded(refusal))
            conn.close()
            return None
        self.counters["accepted"] += 1
        self.connections[conn.id] = conn
        self._per_client[client] = self._per_client.get(client, 0) + 1
        return conn

    def lost(self, conn: Connection) -> None:
        conn.closed = True
        if self.connections.pop(conn.id, None) is not None:
            left = self._per_client[conn.peer.client] - 1
            if left:
                self._per_client[conn.peer.client] = left
            else:
                del self._per_client[conn.peer.client]
        if conn.ready:
            try:
                self.handler.close_connection(conn)
            except Exception:
                log.exception("connection %d: cleanup failed", conn.id)

    def received(self, conn: Connection, decoder: FrameDecoder, data: bytes) -> None:
        conn.heard_at = asyncio.get_running_loop().time()
        messages, error = decoder.feed_until_error(data)
        for message in messages:  # the requests before a broken frame are answered first
            self._dispatch(conn, message)
            if conn.closed:
                return
        if error is not None:
            self.counters["protocol_errors"] += 1
            conn.fail(None, error)  # the stream cannot be resynchronised: answer, then close
            conn.close()

    def _dispatch(self, conn: Connection, message: dict[str, Any]) -> None:
        rid = request_id_of(message)
        try:
            request = parse_request(message)
            if conn.hello is None:
                if request.op != "hello":
                    raise errors.HandshakeRequired("the first request must be 'hello'")
                conn.reply(request.id, self._hello(conn, request.args))
                return
            if request.op == "auth" or conn.challenge is not None:
                conn.reply(request.id, self._auth(conn, request.op, request.args))
                return
            result = self.handler.handle_request(conn, request.id, request.op, request.args)
            if result is not DEFERRED:
                conn.reply(request.id, result)
        except errors.TimeslicedError as exc:
            if isinstance(exc, errors.ProtocolError):
                self.counters["protocol_errors"] += 1
            conn.fail(rid, exc)
            refused = (errors.HandshakeRequired, errors.VersionMismatch, errors.PermissionDenied)
            if isinstance(exc, refused) and not conn.ready:  # refused before it may ask anything: nothing to add
                conn.close()
        except Exception as exc:
            self.counters["internal_errors"] += 1
            log.exception("connection %d: request %r failed", conn.id, message.get("op"))
            conn.fail(rid, errors.InternalError(f"{exc.__class__.__name__}: {exc}"))

    def _hello(self, conn: Connection, args: dict[str, Any]) -> dict[str, Any]:
        version = args.get("version")
        if version != PROTOCOL_VERSION:
            raise errors.VersionMismatch(f"daemon speaks protocol {PROTOCOL_VERSION}, client sent {quoted(version)}")
        if args.get("role", "client") != "client":
            raise errors.BadRequest("this listener serves clients only")
        conn.hello = args
        reply = {"version": PROTOCOL_VERSION, "node": self.node, "backend": self.backend, "session": conn.id}
        if self.lease:
            reply["lease_s"] = self.lease
        if conn.peer.transport == "tcp":
            conn.challenge = reply["challenge"] = secrets.token_hex(CHALLENGE_BYTES)
        return reply

    def _auth(self, conn: Connection, op: str, args: dict[str, Any]) -> dict[str, Any]:
        """Check a TCP client's proof of the token; raises ``PermissionDenied`` (then the connection closes)."""
        if conn.challenge is None:
            raise errors.BadRequest("this connection is not asked to authenticate")
        if op != "auth":
            self.counters["auth_failures"] += 1
            raise errors.PermissionDenied(f"authenticate first: {op!r} needs the shared token over TCP")
        assert self._token is not None  # no TCP listener without one
        if not proof_matches(self._token, Purpose.CLIENT, bytes.fromhex(conn.challenge), args.get("proof")):
            self.counters["auth_failures"] += 1
            log.warning("connection %d from %s: wrong token proof; closing", conn.id, conn.peer.address)
            raise errors.PermissionDenied("wrong token proof: this daemon's clients over TCP need its shared token")
        conn.challenge = None
        return {}


class _Wire(asyncio.Protocol):
    """One connection's transport callbacks: bytes in, frames out, timers.

    Requests are handled right in ``data_received``, so a reply (or a grant
    for another connection) is written within the same loop iteration.
    """

    def __init__(self, server: ClientServer, kind: str) -> None:
        self.server = server
        self.kind = kind
        self.conn: Connection | None = None
        self.decoder = FrameDecoder(server.max_frame)
        self.timer: asyncio.TimerHandle | None = None
        self.timer_for = ""  # what the armed timer waits for the client to do

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.conn = self.server.accept(transport, self.kind)
        if self.conn is not None:
            self._arm(self.server.handshake_timeout, "say hello")

    def data_received(self, data: bytes) -> None:
        conn = self.conn
        if conn is None or conn.closed:
            return
        self.server.received(conn, self.decoder, data)
        # Waiting for a grant can take hours, so an idle connection may stay
        # silent; but a new connection must introduce itself, and a frame that
        # has started must finish.
        if conn.closed:
            self._disarm()
        elif not conn.ready:
            pass  # the handshake timer keeps running until hello (and, over TCP, the token proof)
        elif self.decoder.pending:
            if self.timer is None or self.timer_for != "finish its frame":
                self._arm(self.server.stall_timeout, "finish its frame")
        else:
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self.conn is not None:
            self.server.lost(self.conn)

    def _arm(self, delay: float, what: str) -> None:
        self._disarm()
        self.timer_for = what
        self.timer = asyncio.get_running_loop().call_later(delay, self._expired, delay, what)

    def _disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _expired(self, delay: float, what: str) -> None:
        self.timer = None
        conn = self.conn
        if conn is None or conn.closed:
            return
        log.info("connection %d: did not %s within %.1fs; closing", conn.id, what, delay)
        conn.fail(None, errors.ProtocolError(f"timed out waiting for the client to {what}"))
        conn.close()


async def _socket_answers(path: Path) -> bool:
    try:
        _, writer = await asyncio.wait_for(asyncio.open_unix_connection(str(path)), 1.0)
    except (OSError, asyncio.TimeoutError):
        return False
    writer.close()
    return True
