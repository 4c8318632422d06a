"""The messages of the timesliced protocol and their validation (pure).

Three kinds of map travel in frames:

- request  ``{"id": int, "op": str, "args": map}``       client -> daemon
- reply    ``{"id": int, "ok": true, "result": any}``     daemon -> client
           ``{"id": int, "ok": false, "error": {"code", "message"[, "details"]}}``
- push     ``{"push": str, "data": map}``                 daemon -> client, unsolicited

Every connection starts with a ``hello`` request carrying the protocol version.
"""

from __future__ import annotations

import math
import reprlib
from dataclasses import dataclass, field
from typing import Any

from ..errors import BadRequest, MalformedMessage, TimeslicedError, from_wire, to_wire

PROTOCOL_VERSION = 1
MAX_PARTY = 256  # characters of a registration's party
MAX_REQUEST_ID = (1 << 63) - 1
MAX_OP_CHARS = 64  # op names are short; a longer one is refused before any error message quotes it
_QUOTE = reprlib.Repr()
_QUOTE.maxstring = _QUOTE.maxother = 60


def quoted(value: Any) -> str:
    """A client's value for an error message: its repr, cut short, so no reply outgrows a frame."""
    return _QUOTE.repr(value)


@dataclass(frozen=True)
class Request:
    id: int
    op: str
    args: dict[str, Any] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        return {"id": self.id, "op": self.op, "args": self.args}


@dataclass(frozen=True)
class Reply:
    id: int
    ok: bool
    result: Any = None
    error: TimeslicedError | None = None

    def to_wire(self) -> dict[str, Any]:
        if self.ok:
            return {"id": self.id, "ok": True, "result": self.result}
        assert self.error is not None
        return {"id": self.id, "ok": False, "error": to_wire(self.error)}


@dataclass(frozen=True)
class Push:
    event: str
    data: dict[str, Any] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        return {"push": self.event, "data": self.data}


def parse_request(msg: dict[str, Any]) -> Request:
    """Validate a map received by the daemon; raises ``BadRequest``."""
    rid = msg.get("id")
    if not isinstance(rid, int) or isinstance(rid, bool) or not 0 <= rid <= MAX_REQUEST_ID:
        raise BadRequest("request 'id' must be a non-negative integer")
    op = msg.get("op")
    if not isinstance(op, str) or not op:
        raise BadRequest("request 'op' must be a non-empty string", id=rid)
    if len(op) > MAX_OP_CHARS:
        raise BadRequest(f"request 'op' is longer than {MAX_OP_CHARS} characters", id=rid)
    args = msg.get("args", {})
    if not isinstance(args, dict):
        raise BadRequest("request 'args' must be a map", id=rid)
    return Request(rid, op, args)


def parse_incoming(msg: dict[str, Any]) -> Reply | Push:
    """Validate a map received by a client; raises ``MalformedMessage``."""
    if "push" in msg:
        event, data = msg["push"], msg.get("data", {})
        if not isinstance(event, str) or not isinstance(data, dict):
            raise MalformedMessage("malformed push from daemon")
        return Push(event, data)
    rid, ok = msg.get("id"), msg.get("ok")
    # bool is an int subclass and True == 1: a reply with id true must not answer request 1
    if not isinstance(rid, int) or isinstance(rid, bool) or not isinstance(ok, bool):
        raise MalformedMessage("malformed reply from daemon")
    if ok:
        return Reply(rid, True, msg.get("result"))
    return Reply(rid, False, error=from_wire(msg.get("error")))


def request_id_of(msg: dict[str, Any]) -> int | None:
    """The id of a (possibly invalid) request, so an error reply can name it."""
    rid = msg.get("id")
    if isinstance(rid, int) and not isinstance(rid, bool) and 0 <= rid <= MAX_REQUEST_ID:
        return rid
    return None


# --- argument helpers: one place that turns wrong types into BadRequest -------------


def arg_str(args: dict[str, Any], name: str, *, max_len: int = 256, default: str | None = None) -> str:
    value = args.get(name, default)
    if not isinstance(value, str) or not value:
        raise BadRequest(f"argument '{name}' must be a non-empty string")
    if len(value) > max_len:
        raise BadRequest(f"argument '{name}' is longer than {max_len} characters")
    return value


def arg_int(args: dict[str, Any], name: str, *, minimum: int = 0, default: int | None = None) -> int:
    value = args.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise BadRequest(f"argument '{name}' must be an integer >= {minimum}")
    return value


MAX_PRIORITY = 1_000_000  # |priority| of a job (``register``)
MAX_GANG = 64  # members of one gang (``acquire``)


def arg_party(args: dict[str, Any]) -> str:
    """``register``'s ``party``: who the session acts for (a process, or processes that work as one); "": none said."""
    value = args.get("party", "")
    if not isinstance(value, str) or len(value) > MAX_PARTY:
        raise BadRequest(
            f"argument 'party' must be a string of at most {MAX_PARTY} characters "
            "(the client names its process by default)"
        )
    return value


def arg_priority(args: dict[str, Any]) -> int:
    """``register``'s ``priority``: an integer (default 0), higher first under the ``priority`` policy."""
    value = args.get("priority", 0)
    if not isinstance(value, int) or isinstance(value, bool) or not -MAX_PRIORITY <= value <= MAX_PRIORITY:
        raise BadRequest(f"argument 'priority' must be an integer from -{MAX_PRIORITY} to {MAX_PRIORITY} (default 0)")
    return value


def arg_weight(args: dict[str, Any]) -> float:
    """``register``'s ``weight``: a positive finite number (default 1), the job's share under ``fair``."""
    value = args.get("weight", 1.0)
    number = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan
    if not 0 < number < math.inf:
        raise BadRequest("argument 'weight' must be a finite number > 0 (default 1): the job's share of its group")
    return number


def arg_gang(args: dict[str, Any]) -> tuple[str | None, int]:
    """``acquire``'s ``gang`` (an id every member gives) and ``members`` (how many), both or neither."""
    gang, members = args.get("gang"), args.get("members")
    if gang is None and members is None:
        return None, 0
    if not isinstance(gang, str) or not 0 < len(gang) <= 256:
        raise BadRequest("argument 'gang' must be a string of 1 to 256 characters, the same for every member")
    if not isinstance(members, int) or isinstance(members, bool) or not 1 <= members <= MAX_GANG:
        raise BadRequest(f"argument 'members' must be the gang's size, an integer from 1 to {MAX_GANG}")
    return gang, members


def arg_opt_float(args: dict[str, Any], name: str) -> float | None:
    value = args.get(name)
    if value is None:
        return None
    number = math.nan
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:  # an int beyond every float is not a finite number either
            number = math.inf
    if not number >= 0 or number == math.inf:
        raise BadRequest(f"argument '{name}' must be a finite number >= 0 or null")
    return number


def arg_int_list(args: dict[str, Any], name: str, *, max_len: int = 1024) -> list[int] | None:
    value = args.get(name)
    if value is None:
        return None
    if (
        not isinstance(value, list)
        or len(value) > max_len
        or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)
    ):
        raise BadRequest(f"argument '{name}' must be a list of at most {max_len} non-negative integers")
    return list(value)


EVERY_GPU = "*"  # the key of a ``memory`` declaration that stands for each of the job's GPUs
MAX_DECLARED = 1 << 50  # bytes; past any GPU's memory, so a wrong figure is refused with the GPU's size


def arg_memory(args: dict[str, Any], name: str = "memory") -> tuple[dict[int, int] | None, int | None]:
    """A ``register``'s device memory declaration: ``{"*": bytes}`` (each of its GPUs) and/or
    ``{"<gpu>": bytes, ...}``; returns (per GPU, for each GPU), both None when absent.

    Raises ``BadRequest`` for anything else (bytes must be integers >= 1).
    """
    value = args.get(name)
    if value is None:
        return None, None
    if not isinstance(value, dict) or not value or len(value) > 64:
        raise BadRequest(f"argument '{name}' must map GPU numbers (or {EVERY_GPU!r} for each GPU) to bytes")
    per_gpu: dict[int, int] = {}
    each: int | None = None
    for key, n in value.items():
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_DECLARED:
            raise BadRequest(f"argument '{name}': {key!r} must map to a number of bytes >= 1, not {n!r}")
        if key == EVERY_GPU:
            each = n
        elif isinstance(key, str) and key.isdecimal() and key.isascii() and len(key) <= 6:
            per_gpu[int(key)] = n
        else:
            raise BadRequest(
                f"argument '{name}': {key!r} is no GPU number; use the node's GPU numbers or {EVERY_GPU!r}"
            )
    return per_gpu or None, each


def arg_str_list(args: dict[str, Any], name: str, *, max_len: int = 64, max_chars: int = 1024) -> list[str]:
    """A list of non-empty strings; absent or null is the empty list."""
    value = args.get(name)
    if value is None:
        return []
    if (
        not isinstance(value, list)
        or len(value) > max_len
        or not all(isinstance(v, str) and 0 < len(v) <= max_chars for v in value)
    ):
        raise BadRequest(f"argument '{name}' must be a list of at most {max_len} non-empty strings")
    return list(value)
