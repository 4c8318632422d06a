"""Refusing a request: ``HttpError``, and the query parameters checked before the source is asked."""

from __future__ import annotations

import math
from collections.abc import Mapping

from aiohttp import web

__all__ = [
    "DEFAULT_EVENTS",
    "DEFAULT_WINDOW_S",
    "MAX_EVENTS",
    "MAX_WINDOW_S",
    "MIN_WINDOW_S",
    "HttpError",
    "int_param",
    "window_param",
]

DEFAULT_WINDOW_S = 600.0
MIN_WINDOW_S = 10.0
MAX_WINDOW_S = 86400.0
DEFAULT_EVENTS = 100
MAX_EVENTS = 1000


class HttpError(Exception):
    """An error answer, rendered as JSON under /api/ and as a page elsewhere."""

    def __init__(self, status: int, code: str, message: str, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = dict(headers or {})


def int_param(request: web.Request, name: str, default: int, lo: int, hi: int) -> int:
    """The query parameter ``name`` as an integer in ``[lo, hi]`` (``default`` when absent).

    Raises ``HttpError`` (400) otherwise.
    """
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        value = int(raw, 10)
    except ValueError:
        value = lo - 1
    if not lo <= value <= hi:
        raise HttpError(400, "bad_request", f"'{name}' must be an integer from {lo} to {hi}")
    return value


def window_param(request: web.Request, name: str, default: float | None) -> float | None:
    """The query parameter ``name`` as a timeline window in seconds (``default`` when absent).

    Raises ``HttpError`` (400) outside ``[MIN_WINDOW_S, MAX_WINDOW_S]``.
    """
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (MIN_WINDOW_S <= value <= MAX_WINDOW_S):
        raise HttpError(
            400, "bad_request", f"'{name}' must be a number of seconds from {MIN_WINDOW_S:g} to {MAX_WINDOW_S:g}"
        )
    return value
