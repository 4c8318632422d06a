"""JSON as the dashboard writes it: API answers, stream messages and data embedded in pages."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from aiohttp import web
from markupsafe import Markup

__all__ = ["dumps", "json_response", "script_json"]


def dumps(value: Any) -> bytes:
    """Compact JSON; NaN and infinities become null (browsers reject them), unknown types their ``str``."""
    try:
        text = json.dumps(value, separators=(",", ":"), allow_nan=False, default=_json_default)
    except ValueError:
        text = json.dumps(_finite(value), separators=(",", ":"), allow_nan=False, default=_json_default)
    return text.encode()


def _json_default(value: Any) -> Any:
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=str)
    if hasattr(value, "value") and isinstance(value.value, (str, int, float)):  # enums
        return value.value
    return str(value)


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def json_response(value: Any, *, status: int = 200, headers: Mapping[str, str] | None = None) -> web.Response:
    """``value`` as an ``application/json`` answer, encoded by ``dumps``."""
    return web.Response(body=dumps(value), status=status, content_type="application/json", headers=headers)


def script_json(value: Any) -> Markup:
    """``value`` as JSON that is safe inside ``<script type="application/json">`` (no ``</script>`` can end it)."""
    text = dumps(value).decode()
    return Markup(text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026"))
