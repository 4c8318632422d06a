"""Length-prefixed msgpack framing (pure, no I/O).

A frame is a 4-byte big-endian length followed by that many bytes holding one
msgpack map, nested at most ``MAX_DEPTH`` levels. ``FrameDecoder`` takes bytes
as they arrive from a socket and returns whole messages; it never buffers more
than one maximum-size frame.
"""

from __future__ import annotations

import struct
from typing import Any

import msgpack  # type: ignore[import-untyped]  # msgpack ships no type information

from ..errors import FrameTooLarge, MalformedMessage
from ..util.parse import exact_size

HEADER = struct.Struct(">I")
DEFAULT_MAX_FRAME = 1 << 20  # 1 MiB: requests are small; regions travel as metadata only
# The deepest message of the protocol (a status reply) nests 6 levels. msgpack itself decodes
# up to 1024, deep enough that a repr() or any other recursive walk of such a value raises
# RecursionError wherever it happens (an error message, a log line, a comparison).
MAX_DEPTH = 32


def encode(message: dict[str, Any], max_frame: int = DEFAULT_MAX_FRAME) -> bytes:
    """One frame holding ``message``; raises ``FrameTooLarge`` past ``max_frame``."""
    body: bytes = msgpack.packb(message, use_bin_type=True)
    if len(body) > max_frame:
        raise FrameTooLarge(f"frame of {exact_size(len(body))} exceeds the limit of {exact_size(max_frame)}")
    return HEADER.pack(len(body)) + body


def decode_body(body: bytes) -> dict[str, Any]:
    """The map held by one frame body; raises ``MalformedMessage``.

    The map and everything in it nest at most ``MAX_DEPTH`` levels of maps and lists.
    """
    try:
        obj = msgpack.unpackb(body, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise MalformedMessage(f"frame is not valid msgpack: {exc.__class__.__name__}") from None
    if not isinstance(obj, dict):
        raise MalformedMessage(f"frame holds a {type(obj).__name__}, expected a map")
    if _deeper_than(obj, MAX_DEPTH):
        raise MalformedMessage(f"frame nests maps and lists deeper than {MAX_DEPTH} levels")
    return obj


def _deeper_than(obj: dict[str, Any], limit: int) -> bool:
    """Whether maps and lists nest more than ``limit`` levels in ``obj`` (a map: level 1).

    Iterative, so that it cannot hit the recursion limit itself. Keys need no look:
    ``strict_map_key`` admits only strings and bytes.
    """
    stack: list[tuple[Any, int]] = [(obj, 1)]
    while stack:
        container, level = stack.pop()
        for child in container.values() if isinstance(container, dict) else container:
            if isinstance(child, (dict, list)):
                if level == limit:
                    return True
                stack.append((child, level + 1))
    return False


class FrameDecoder:
    """Splits a byte stream into messages.

    After an error the stream cannot be resynchronised, so the decoder stays
    broken and the caller must close the connection (after sending an error).
    """

    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        self.max_frame = max_frame
        self._buf = bytearray()
        self._broken = False

    @property
    def pending(self) -> int:
        """Bytes received that do not yet form a whole frame."""
        return len(self._buf)

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        """Add ``data``; return every message it completes.

        Raises ``FrameTooLarge`` as soon as a header announces an oversized
        frame (before its body arrives) and ``MalformedMessage`` for a body
        that is not a msgpack map.
        """
        messages, error = self.feed_until_error(data)
        if error is not None:
            raise error
        return messages

    def feed_until_error(self, data: bytes) -> tuple[list[dict[str, Any]], FrameTooLarge | MalformedMessage | None]:
        """Like ``feed``, but the messages before a broken frame come back with its error.

        A server answers those requests, then the error, however the bytes were split.
        """
        if self._broken:
            return [], MalformedMessage("stream already failed to decode")
        self._buf += data
        out: list[dict[str, Any]] = []
        while len(self._buf) >= HEADER.size:
            (size,) = HEADER.unpack_from(self._buf)
            if size > self.max_frame:
                self._broken = True
                limit = exact_size(self.max_frame)
                return out, FrameTooLarge(f"frame of {exact_size(size)} exceeds the limit of {limit}")
            end = HEADER.size + size
            if len(self._buf) < end:
                break
            body = bytes(self._buf[HEADER.size : end])
            del self._buf[:end]
            try:
                out.append(decode_body(body))
            except MalformedMessage as exc:
                self._broken = True
                return out, exc
        return out, None
