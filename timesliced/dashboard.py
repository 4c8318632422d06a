"""The browser dashboard: server-rendered pages, a JSON API, live updates and admin actions.

``make_app(source, admin_token=...)`` builds an aiohttp application over a
``DashboardSource`` (the daemon); ``serve(app, host, port)`` binds it and returns
once it listens. Pages are rendered by jinja2 for the first paint and then kept
current in place by ``static/dashboard.js`` from the Server-Sent Events stream
at ``/api/v1/stream``. Templates and assets ship as the packages
``timesliced.web`` and ``timesliced.static`` (the repository's ``web/`` and
``static/``); nothing is fetched from elsewhere, so the dashboard works on an
air-gapped cluster.

Pages: ``/`` (overview), ``/groups/NAME``, ``/jobs/NAME``, ``/timeline?window=S``.

JSON API (every answer ``Cache-Control: no-store``; errors are
``{"error": {"code", "message"}}`` with 400 for bad parameters and 404 for
unknown names; collections are arrays, items objects):

``GET /api/v1/status``              the status document as the source gives it
``GET /api/v1/nodes``               ``[node]``: the document without its bulky lists, plus ``gpus``
``GET /api/v1/devices``             ``[device]``: each device plus ``telemetry`` (its GPU's, or null)
``GET /api/v1/groups``              ``[group]``
``GET /api/v1/groups/NAME``         the group plus ``members`` (job names) and ``gbps``
``GET /api/v1/jobs``                ``[job]``
``GET /api/v1/jobs/NAME``           the job plus ``lock`` {state, position, waited_s, held_s},
                                    ``residency``, ``processes`` and ``moves`` {summary, recent}
``GET /api/v1/timeline?window=S``   the source's timeline, 10 <= S <= 86400 (default 600)
``GET /api/v1/events?after=ID&limit=N``  ``[event]``, N <= 1000 (default 100)
``GET /api/v1/admin``               ``{"enabled", "authorized"}`` (authorized: null without a token sent)
``POST /api/v1/groups/NAME/release|drain|resume``  the source's answer

The dashboard is read-only. Admin actions (force-release, drain, resume) need
``Authorization: Bearer <admin token>`` (401 without, 403 when wrong or when no
token is configured; 404 unknown group, 409 nobody holds it). Browsers never
attach that header by themselves, and a body must be JSON, so a cross-site form
or link cannot trigger an action. ``/metrics`` is the given callable's answer
(404 without one), ``/healthz`` is 200 while serving and ``/readyz`` 200 while
the source is ready (else 503).

The stream (``GET /api/v1/stream?after=ID&timeline=SECONDS``; at most
``max_streams`` at once, past that 503 with ``Retry-After``; every stream ends
as soon as the app shuts down) sends:

``hello``
    ``{"interval_s", "after", "timeline_window_s"}`` once, first.
``status``
    the whole status document, at once and then every ``sse_interval`` seconds.
``events``
    ``{"events": [...]}``: events newer than the last one sent (or than
    ``after`` / the ``Last-Event-ID`` header; with neither, only events from now
    on), with ``id:`` set to the newest id so that a reconnecting browser
    resumes where it stopped. Omitted when nothing is new.
``timeline``
    only when ``timeline=SECONDS`` was given: ``{"now", "window_s", "groups",
    "spans", "full"}``. The first one is ``full`` (every span in the window);
    later ones carry only the spans still open or ended since the previous one.
    A client keys spans by (group, kind, job, start), replaces what it has, and
    drops spans that ended before ``now - window_s``.
``problem``
    ``{"error": {"code", "message"}}`` when the source failed this tick; the
    stream goes on.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import math
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import quote

import jinja2
from aiohttp import web
from markupsafe import Markup

from . import __version__, errors
from .node.compat import timeout

if TYPE_CHECKING:
    from importlib.abc import Traversable

__all__ = [
    "HUB",
    "SOURCE",
    "DashboardSource",
    "Metrics",
    "StreamHub",
    "dumps",
    "gpu_views",
    "group_detail",
    "job_color",
    "job_detail",
    "make_app",
    "serve",
    "timeline_delta",
]

log = logging.getLogger(__name__)

API = "/api/v1"
DEFAULT_WINDOW_S = 600.0
MIN_WINDOW_S = 10.0
MAX_WINDOW_S = 86400.0
DEFAULT_EVENTS = 100
MAX_EVENTS = 1000
MAX_STREAMS = 64
RECENT_EVENTS = 1000  # events the stream hub keeps for pages and streams
PAGE_EVENTS = 50  # events a page shows
WRITE_TIMEOUT_S = 10.0  # a stream whose client reads nothing for this long is dropped
RETRY_MS = 2000  # the reconnection delay the stream asks browsers for
SPAN_SLACK_S = 1.0  # timeline deltas overlap the previous one by this much

_STATIC_TYPES = {
    ".css": "text/css; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
    ".ico": "image/x-icon",
}
_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)
# What a failing source maps to; any other TimeslicedError is a 500 with its own code.
_ERROR_STATUS: tuple[tuple[type[errors.TimeslicedError], int], ...] = (
    (errors.UnknownGroup, 404),
    (errors.UnknownJob, 404),
    (errors.NotHolder, 409),
    (errors.GroupDraining, 409),
    (errors.BadRequest, 400),
    (errors.PermissionDenied, 403),
    (errors.LimitExceeded, 503),
)


class DashboardSource(Protocol):
    """What the dashboard reads and drives; the daemon implements it. Wall-clock times are epoch seconds."""

    def status(self) -> dict[str, Any]:
        """The status document (node, devices, groups, jobs, telemetry, moves)."""

    def timeline(self, window_s: float) -> dict[str, Any]:
        """``{"now", "window_s", "groups": [{"group", "gpus"}],
        "spans": [{"group", "job", "kind", "start", "end"}]}``; ``end`` is None while a span is open."""

    def events(self, after: int, limit: int) -> list[dict[str, Any]]:
        """Up to ``limit`` events with ``id > after``, oldest first."""

    def force_release(self, group: str) -> dict[str, Any]:
        """Take the lock from its holder. Raises ``UnknownGroup``, ``NotHolder`` (nobody holds it)."""

    def drain(self, group: str, on: bool) -> dict[str, Any]:
        """Stop (``on``) or resume granting the group. Raises ``UnknownGroup``."""

    def ready(self) -> bool:
        """Serving and able to grant."""


Metrics = Callable[[str | None], tuple[bytes, str]]


@dataclass(frozen=True)
class Settings:
    admin_token: str | None
    metrics: Metrics | None
    sse_interval: float
    max_streams: int


@dataclass(frozen=True)
class Asset:
    body: bytes
    content_type: str
    etag: str


SOURCE: web.AppKey[DashboardSource] = web.AppKey("source")
SETTINGS: web.AppKey[Settings] = web.AppKey("settings")
TEMPLATES: web.AppKey[jinja2.Environment] = web.AppKey("templates")
ASSETS: web.AppKey[dict[str, Asset]] = web.AppKey("assets")
HUB: web.AppKey[StreamHub] = web.AppKey("hub")


class HttpError(Exception):
    """An error answer, rendered as JSON under /api/ and as a page elsewhere."""

    def __init__(self, status: int, code: str, message: str, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = dict(headers or {})


# --- the application --------------------------------------------------------------------


def make_app(
    source: DashboardSource,
    *,
    admin_token: str | None,
    metrics: Metrics | None = None,
    sse_interval: float = 1.0,
    max_streams: int = MAX_STREAMS,
) -> web.Application:
    """The dashboard over ``source``.

    ``admin_token`` enables the admin actions (``None`` disables them);
    ``metrics(accept)`` returns ``(body, content_type)`` for ``/metrics``
    (``None``: 404). Raises ``ValueError`` for an empty token, a non-positive
    interval or stream cap, and ``RuntimeError`` when the templates or assets
    are not installed.
    """
    if admin_token is not None and not admin_token:
        raise ValueError("admin_token must be None (actions disabled) or a non-empty string")
    if not (sse_interval > 0 and math.isfinite(sse_interval)):
        raise ValueError("sse_interval must be a positive number of seconds")
    if max_streams < 1:
        raise ValueError("max_streams must be at least 1")
    app = web.Application(middlewares=[_error_middleware])
    app[SOURCE] = source
    app[SETTINGS] = Settings(admin_token, metrics, float(sse_interval), max_streams)
    app[TEMPLATES] = _templates()
    app[ASSETS] = _assets()
    app[HUB] = StreamHub(source, float(sse_interval))
    app.cleanup_ctx.append(_run_hub)
    app.on_shutdown.append(_close_streams)
    app.on_response_prepare.append(_common_headers)
    app.add_routes(
        [
            web.get("/", _overview_page),
            web.get("/groups/{name}", _group_page),
            web.get("/jobs/{name}", _job_page),
            web.get("/timeline", _timeline_page),
            web.get("/static/{name}", _static),
            web.get("/healthz", _healthz),
            web.get("/readyz", _readyz),
            web.get("/metrics", _metrics),
            web.get(f"{API}/status", _api_status),
            web.get(f"{API}/nodes", _api_nodes),
            web.get(f"{API}/devices", _api_devices),
            web.get(f"{API}/groups", _api_groups),
            web.get(f"{API}/groups/{{name}}", _api_group),
            web.get(f"{API}/jobs", _api_jobs),
            web.get(f"{API}/jobs/{{name}}", _api_job),
            web.get(f"{API}/timeline", _api_timeline),
            web.get(f"{API}/events", _api_events),
            web.get(f"{API}/stream", _stream, allow_head=False),
            web.get(f"{API}/admin", _api_admin),
            web.post(f"{API}/groups/{{name}}/release", _admin_release),
            web.post(f"{API}/groups/{{name}}/drain", _admin_drain),
            web.post(f"{API}/groups/{{name}}/resume", _admin_resume),
        ]
    )
    return app


async def serve(
    app: web.Application, host: str = "127.0.0.1", port: int = 0, *, shutdown_timeout: float = 5.0
) -> tuple[web.AppRunner, tuple[str, int]]:
    """Bind ``app`` on ``host:port`` (0 picks a free port) and return ``(runner, (host, port))`` once it listens.

    Stop it with ``await runner.cleanup()``: live streams end at once, other
    requests get ``shutdown_timeout`` seconds. Raises ``OSError`` when the
    address cannot be bound.
    """
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=shutdown_timeout)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    bound = runner.addresses[0]
    return runner, (str(bound[0]), int(bound[1]))


async def _run_hub(app: web.Application) -> AsyncIterator[None]:
    hub = app[HUB]
    task = asyncio.create_task(hub.run(), name="timesliced-dashboard-hub")
    try:
        yield
    finally:
        hub.close()  # run() returns at once when closed; cancel() is only a backstop
        task.cancel()
        await asyncio.wait([task])  # unlike `await task`, this raises only our own cancellation
        if not task.cancelled() and task.exception() is not None:
            log.error("dashboard: the stream hub failed", exc_info=task.exception())


async def _close_streams(app: web.Application) -> None:
    # on_shutdown runs before the server waits for in-flight handlers: ending the
    # streams here is what lets a daemon stop without waiting out shutdown_timeout.
    app[HUB].close()


async def _common_headers(request: web.Request, response: web.StreamResponse) -> None:
    headers = response.headers
    headers.setdefault("Cache-Control", "no-store")
    headers.setdefault("X-Content-Type-Options", "nosniff")
    headers.setdefault("Referrer-Policy", "no-referrer")
    headers.setdefault("X-Frame-Options", "DENY")
    headers.setdefault("Content-Security-Policy", _CSP)


@web.middleware
async def _error_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    try:
        return await handler(request)
    except HttpError as exc:
        return _error_response(request, exc.status, exc.code, exc.message, exc.headers)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status, "http_error")
        message = exc.reason if exc.status != 404 else f"nothing at {request.path}"
        keep = {k: v for k, v in exc.headers.items() if k.lower() in ("allow", "retry-after", "www-authenticate")}
        return _error_response(request, exc.status, code, message, keep)
    except errors.TimeslicedError as exc:
        status = next((s for cls, s in _ERROR_STATUS if isinstance(exc, cls)), 500)
        if status >= 500:
            log.error("dashboard: %s %s: %s: %s", request.method, request.path, exc.code, exc.message)
        return _error_response(request, status, exc.code, exc.message)
    except Exception:
        log.exception("dashboard: %s %s failed", request.method, request.path)
        return _error_response(request, 500, "internal", "internal error; the daemon's log has the details")


def _error_response(
    request: web.Request, status: int, code: str, message: str, headers: Mapping[str, str] | None = None
) -> web.Response:
    if request.path.startswith("/api/"):
        return _json({"error": {"code": code, "message": message}}, status=status, headers=headers)
    try:
        html = _render(request, "error.html", status_code=status, code=code, message=message, title=f"{status}")
    except Exception:
        log.exception("dashboard: rendering the error page failed")
        return web.Response(status=status, text=f"{status}: {message}\n", headers=headers)
    return web.Response(status=status, text=html, content_type="text/html", headers=headers)


# --- JSON --------------------------------------------------------------------------------


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


def _json(value: Any, *, status: int = 200, headers: Mapping[str, str] | None = None) -> web.Response:
    return web.Response(body=dumps(value), status=status, content_type="application/json", headers=headers)


# --- resources ---------------------------------------------------------------------------


def _resource_dir(package: str, folder: str, marker: str) -> Traversable:
    """The installed package ``package``, or in a source checkout the repository's ``folder``."""
    try:
        installed = resources.files(package)
        if installed.joinpath(marker).is_file():
            return installed
    except ModuleNotFoundError:
        pass
    checkout = Path(__file__).resolve().parent.parent / folder
    if checkout.joinpath(marker).is_file():
        return checkout
    raise RuntimeError(f"the dashboard's files are missing: neither {package} nor {checkout} has {marker}")


def _templates() -> jinja2.Environment:
    root = _resource_dir("timesliced.web", "web", "base.html")
    sources = {e.name: e.read_text(encoding="utf-8") for e in root.iterdir() if e.name.endswith(".html")}
    env = jinja2.Environment(
        loader=jinja2.DictLoader(sources),
        autoescape=True,
        trim_blocks=True,
        lstrip_blocks=True,
        auto_reload=False,
    )
    env.filters["pathseg"] = pathseg
    env.globals.update(
        fmt_bytes=fmt_bytes,
        fmt_duration=fmt_duration,
        fmt_pct=fmt_pct,
        fmt_gbps=fmt_gbps,
        fmt_num=fmt_num,
        fixed=fixed,
        job_color=job_color,
        gpu_views=gpu_views,
        group_detail=group_detail,
        job_detail=job_detail,
        is_number=_is_number,
        clock=clock,
        window_label=window_label,
    )
    return env


def _assets() -> dict[str, Asset]:
    root = _resource_dir("timesliced.static", "static", "dashboard.js")
    out: dict[str, Asset] = {}
    for entry in root.iterdir():
        content_type = _STATIC_TYPES.get(Path(entry.name).suffix)
        if content_type is None or not entry.is_file():
            continue
        body = entry.read_bytes()
        out[entry.name] = Asset(body, content_type, '"' + hashlib.sha256(body).hexdigest()[:20] + '"')
    return out


# --- formatting (static/dashboard.js has the same functions: keep them in step) -----------


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def fixed(value: float, digits: int) -> str:
    """``value`` with ``digits`` decimals, halves rounded up, exactly as the browser code does it."""
    scale = 10**digits
    return f"{math.floor(value * scale + 0.5) / scale:.{digits}f}"


def fmt_bytes(n: Any) -> str:
    if not _is_number(n):
        return "—"
    if abs(n) < 1024:
        return f"{int(n)} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):  # noqa: B007 - the unit the loop stops at is the answer
        value /= 1024
        if abs(value) < 1024:
            break
    digits = 2 if abs(value) < 10 else 1 if abs(value) < 100 else 0
    return f"{fixed(value, digits)} {unit}"


def fmt_duration(s: Any) -> str:
    if not _is_number(s):
        return "—"
    if s < 1:
        ms = s * 1000
        return f"{fixed(ms, 1 if ms < 10 else 0)} ms"
    if s < 60:
        return f"{fixed(s, 1)} s"
    if s < 3600:
        return f"{math.floor(s / 60)} min {math.floor(s % 60):02d} s"
    return f"{math.floor(s / 3600)} h {math.floor(s % 3600 / 60):02d} min"


def fmt_pct(x: Any) -> str:
    return f"{fixed(x * 100, 0)}%" if _is_number(x) else "—"


def fmt_gbps(x: Any) -> str:
    return f"{fixed(x, 2)} GB/s" if _is_number(x) else "—"


def fmt_num(x: Any) -> str:
    return str(x) if _is_number(x) else "—"


def job_color(name: Any) -> str:
    """The colour of ``name`` everywhere (FNV-1a of its UTF-8 bytes to a hue and a lightness)."""
    h = 0x811C9DC5
    for byte in str(name).encode("utf-8"):
        h = ((h ^ byte) * 0x01000193) & 0xFFFFFFFF
    return f"hsl({h % 360}, 62%, {40 + (h >> 12) % 3 * 8}%)"


def pathseg(name: Any) -> str:
    """``name`` quoted as one URL path segment, as the browser's ``encodeURIComponent`` does."""
    return quote(str(name), safe="!~*'()")


def clock(t: Any) -> str:
    """``HH:MM:SS`` (UTC) of an epoch time; the browser rewrites it in its own time zone."""
    return time.strftime("%H:%M:%S", time.gmtime(t)) if _is_number(t) else "—"


def window_label(seconds: float) -> str:
    if seconds >= 3600 and seconds % 3600 == 0:
        return f"{seconds / 3600:g} h"
    if seconds >= 60 and seconds % 60 == 0:
        return f"{seconds / 60:g} min"
    return f"{seconds:g} s"


def script_json(value: Any) -> Markup:
    """``value`` as JSON that is safe inside ``<script type="application/json">`` (no ``</script>`` can end it)."""
    text = dumps(value).decode()
    return Markup(text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026"))


# --- views of the status document (the browser code derives the same) ---------------------


def _items(value: Any) -> list[dict[str, Any]]:
    return [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []


def _obj(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _num(value: Any) -> float | None:
    return value if _is_number(value) else None


def _find(items: Any, key: str, name: str) -> dict[str, Any] | None:
    return next((item for item in _items(items) if item.get(key) == name), None)


def gpu_views(status: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Per GPU: index, name, duty, memory total/used and the bar's segments (jobs on the device, then other use)."""
    tele = {g.get("index"): g for g in _items(_obj(status.get("telemetry")).get("gpus"))}
    devices = _items(status.get("devices"))
    known = {d.get("index") for d in devices}
    indexes = [d.get("index") for d in devices] + [i for i in tele if i not in known]
    views = []
    for index in indexes:
        device = next((d for d in devices if d.get("index") == index), {})
        t = tele.get(index, {})
        total = _num(t.get("memory_total"))
        if total is None:
            total = _num(device.get("capacity"))
        total = total if total is not None and total > 0 else 0
        jobs = {str(job): info for job, info in _obj(device.get("jobs")).items() if isinstance(info, dict)}
        on_device: list[tuple[str, float, Any]] = sorted(
            (job, nbytes, info.get("location"))
            for job, info in jobs.items()
            if info.get("location") != "parked" and (nbytes := _num(info.get("bytes"))) is not None
        )
        jobs_bytes = sum(nbytes for _, nbytes, _ in on_device)
        memory_used = _num(t.get("memory_used"))
        other = memory_used - jobs_bytes if memory_used is not None and memory_used > jobs_bytes else 0
        segments = []
        x = 0.0
        for job, nbytes, location in on_device + ([("", other, "other")] if other > 0 else []):
            width = nbytes / total * 1000 if total else 0.0
            segments.append(
                {"job": job, "bytes": nbytes, "location": location, "x": fixed(x, 1), "width": fixed(width, 1)}
            )
            x += width
        views.append(
            {
                "index": index,
                "name": t.get("name") or f"GPU {index}",
                "duty_now": t.get("duty_now"),
                "duty_window": t.get("duty_window"),
                "window_s": t.get("window_s"),
                "total": total,
                "used": jobs_bytes + other,
                "segments": segments,
                "parked": sorted(job for job, info in jobs.items() if info.get("location") == "parked"),
            }
        )
    return views


def group_detail(status: Mapping[str, Any], name: str) -> dict[str, Any] | None:
    """The group named ``name`` plus ``members`` (its jobs) and ``gbps`` (bytes over seconds of their moves)."""
    group = _find(status.get("groups"), "group", name)
    if group is None:
        return None
    members = [j["job"] for j in _items(status.get("jobs")) if j.get("group") == name and "job" in j]
    per_job = _obj(_obj(status.get("moves")).get("jobs"))
    total_bytes = total_seconds = 0.0
    for job in members:
        m = _obj(per_job.get(job))
        nbytes, seconds = _num(m.get("nbytes")), _num(m.get("seconds"))
        if nbytes is not None and seconds is not None:
            total_bytes += nbytes
            total_seconds += seconds
    gbps = total_bytes / total_seconds / 1e9 if total_seconds > 0 else None
    return {**group, "members": members, "gbps": gbps}


def job_detail(status: Mapping[str, Any], name: str) -> dict[str, Any] | None:
    """The job named ``name`` plus ``lock`` (its place in its group), ``residency``, ``processes`` and ``moves``."""
    job = _find(status.get("jobs"), "job", name)
    if job is None:
        return None
    lock: dict[str, Any] = {"state": "idle", "position": None, "waited_s": None, "held_s": None}
    group = _find(status.get("groups"), "group", str(job.get("group")))
    if group is not None:
        queue = _items(group.get("queue"))
        position = next((i for i, w in enumerate(queue) if w.get("job") == name), None)
        if group.get("holder") == name:
            lock.update(state="holding", held_s=group.get("held_s"))
        elif group.get("switching_to") == name:
            lock.update(state="switching")
        elif position is not None:
            lock.update(state="waiting", position=position + 1, waited_s=queue[position].get("waited_s"))
    residency = []
    for device in _items(status.get("devices")):
        info = _obj(device.get("jobs")).get(name)
        if isinstance(info, dict):
            residency.append({"gpu": device.get("index"), "bytes": info.get("bytes"), "location": info.get("location")})
    gpus = _items(_obj(status.get("telemetry")).get("gpus"))
    processes = []
    for pid in job.get("pids") or []:
        found = {}
        for gpu in gpus:
            procs = _obj(gpu.get("processes"))
            nbytes = _num(procs.get(str(pid), procs.get(pid)))  # str keys once through JSON, int ones before
            if nbytes is not None:
                found[str(gpu.get("index"))] = nbytes
        processes.append({"pid": pid, "gpus": found})
    moves = _obj(status.get("moves"))
    recent = [m for m in _items(moves.get("recent")) if m.get("job") == name][-20:]
    return {
        **job,
        "lock": lock,
        "residency": residency,
        "processes": processes,
        "moves": {"summary": _obj(moves.get("jobs")).get(name), "recent": recent},
    }


def _node_view(status: Mapping[str, Any]) -> dict[str, Any]:
    bulky = ("devices", "groups", "jobs", "telemetry", "moves")
    node = {k: v for k, v in status.items() if k not in bulky}
    node["gpus"] = len(_items(status.get("devices")))
    return node


def _devices_view(status: Mapping[str, Any]) -> list[dict[str, Any]]:
    tele = {g.get("index"): g for g in _items(_obj(status.get("telemetry")).get("gpus"))}
    return [{**d, "telemetry": tele.get(d.get("index"))} for d in _items(status.get("devices"))]


def timeline_delta(timeline: Mapping[str, Any], window_s: float, since: float | None) -> dict[str, Any]:
    """The part of ``timeline`` a stream sends: spans in the last ``window_s``; with ``since``, only
    those still open or ended after ``since`` (less a little slack, since duplicates are harmless)."""
    now = _num(timeline.get("now")) or 0.0
    # The source may show less than asked (a daemon younger than the window): keep its window.
    window_s = min(window_s, _num(timeline.get("window_s")) or window_s)
    start = now - window_s
    spans = []
    for span in _items(timeline.get("spans")):
        end = span.get("end")
        if end is not None and not (_is_number(end) and end >= start):
            continue
        if since is not None and end is not None and end < since - SPAN_SLACK_S:
            continue
        spans.append(span)
    return {
        "now": now,
        "window_s": window_s,
        "groups": timeline.get("groups", []),
        "spans": spans,
        "full": since is None,
    }


# --- parameters --------------------------------------------------------------------------


def _int_param(request: web.Request, name: str, default: int, lo: int, hi: int) -> int:
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


def _window_param(request: web.Request, name: str, default: float | None) -> float | None:
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


# --- pages -------------------------------------------------------------------------------


def _render(request: web.Request, template: str, **context: Any) -> str:
    settings = request.app[SETTINGS]
    context.setdefault("status", {})
    base = {
        "events_after": request.app[HUB].newest_event,
        "version": __version__,
        "admin_enabled": settings.admin_token is not None,
        "interval_s": settings.sse_interval,
        "api": API,
    }
    return request.app[TEMPLATES].get_template(template).render({**base, **context})


def _page(request: web.Request, template: str, **context: Any) -> web.Response:
    return web.Response(text=_render(request, template, **context), content_type="text/html")


def _recent_events(request: web.Request, *, group: str | None = None, job: str | None = None) -> list[dict[str, Any]]:
    hub = request.app[HUB]
    hub.poll_events()
    picked = [
        e
        for e in hub.recent_events()
        if (group is None or e.get("group") == group) and (job is None or e.get("job") == job)
    ]
    return picked[-PAGE_EVENTS:][::-1]


async def _overview_page(request: web.Request) -> web.Response:
    status = request.app[SOURCE].status()
    events = _recent_events(request)
    return _page(request, "overview.html", page="overview", title="Overview", status=status, events=events)


async def _group_page(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    status = request.app[SOURCE].status()
    group = group_detail(status, name)
    if group is None:
        raise HttpError(404, errors.UnknownGroup.code, f"no group named {name!r}")
    events = _recent_events(request, group=name)
    return _page(
        request, "group.html", page="group", name=name, title=f"Group {name}", status=status, group=group, events=events
    )


async def _job_page(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    status = request.app[SOURCE].status()
    job = job_detail(status, name)
    if job is None:
        raise HttpError(404, errors.UnknownJob.code, f"no job named {name!r}")
    events = _recent_events(request, job=name)
    return _page(request, "job.html", page="job", name=name, title=f"Job {name}", status=status, job=job, events=events)


async def _timeline_page(request: web.Request) -> web.Response:
    window = _window_param(request, "window", DEFAULT_WINDOW_S)
    assert window is not None
    source = request.app[SOURCE]
    status = source.status()
    timeline = timeline_delta(source.timeline(window), window, None)
    request.app[HUB].poll_events()  # so that the page's stream starts at the newest event
    choices = sorted({60.0, 300.0, 600.0, 1800.0, 3600.0, 3 * 3600.0, 12 * 3600.0, 86400.0, window})
    return _page(
        request,
        "timeline.html",
        page="timeline",
        title="Timeline",
        status=status,
        window_s=window,
        choices=choices,
        timeline_json=script_json(timeline),
    )


async def _static(request: web.Request) -> web.StreamResponse:
    # Only the files found at start-up are served: no path ever reaches the filesystem.
    asset = request.app[ASSETS].get(request.match_info["name"])
    if asset is None:
        raise web.HTTPNotFound()
    headers = {"Cache-Control": "no-cache", "ETag": asset.etag}
    if asset.etag in request.headers.get("If-None-Match", ""):
        return web.Response(status=304, headers=headers)
    return web.Response(body=asset.body, headers={**headers, "Content-Type": asset.content_type})


async def _healthz(request: web.Request) -> web.Response:
    return web.Response(text="ok\n")


async def _readyz(request: web.Request) -> web.Response:
    if request.app[SOURCE].ready():
        return web.Response(text="ready\n")
    return web.Response(status=503, text="not ready\n")


async def _metrics(request: web.Request) -> web.Response:
    metrics = request.app[SETTINGS].metrics
    if metrics is None:
        raise web.HTTPNotFound()
    body, content_type = metrics(request.headers.get("Accept"))
    return web.Response(body=body, headers={"Content-Type": content_type})


# --- the JSON API -------------------------------------------------------------------------


async def _api_status(request: web.Request) -> web.Response:
    return _json(request.app[SOURCE].status())


async def _api_nodes(request: web.Request) -> web.Response:
    return _json([_node_view(request.app[SOURCE].status())])


async def _api_devices(request: web.Request) -> web.Response:
    return _json(_devices_view(request.app[SOURCE].status()))


async def _api_groups(request: web.Request) -> web.Response:
    return _json(_items(request.app[SOURCE].status().get("groups")))


async def _api_group(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    group = group_detail(request.app[SOURCE].status(), name)
    if group is None:
        raise HttpError(404, errors.UnknownGroup.code, f"no group named {name!r}")
    return _json(group)


async def _api_jobs(request: web.Request) -> web.Response:
    return _json(_items(request.app[SOURCE].status().get("jobs")))


async def _api_job(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    job = job_detail(request.app[SOURCE].status(), name)
    if job is None:
        raise HttpError(404, errors.UnknownJob.code, f"no job named {name!r}")
    return _json(job)


async def _api_timeline(request: web.Request) -> web.Response:
    window = _window_param(request, "window", DEFAULT_WINDOW_S)
    assert window is not None
    return _json(request.app[SOURCE].timeline(window))


async def _api_events(request: web.Request) -> web.Response:
    after = _int_param(request, "after", 0, 0, 2**63 - 1)
    limit = _int_param(request, "limit", DEFAULT_EVENTS, 1, MAX_EVENTS)
    return _json(request.app[SOURCE].events(after, limit))


# --- admin actions ------------------------------------------------------------------------


def _check_token(request: web.Request) -> None:
    """Raise unless the request carries the admin token (compared in constant time)."""
    token = request.app[SETTINGS].admin_token
    if token is None:
        raise HttpError(
            403, "admin_disabled", "admin actions are disabled: the daemon was started without an admin token"
        )
    header = request.headers.get("Authorization")
    if not header:
        raise HttpError(
            401,
            "unauthorized",
            "admin actions need the header 'Authorization: Bearer <admin token>'",
            {"WWW-Authenticate": 'Bearer realm="timesliced"'},
        )
    scheme, _, given = header.strip().partition(" ")
    ok = hmac.compare_digest(given.strip().encode("utf-8", "replace"), token.encode("utf-8", "replace"))
    if scheme.lower() != "bearer" or not ok:
        raise HttpError(403, errors.PermissionDenied.code, "the admin token is not valid")


async def _admin_request(request: web.Request) -> str:
    """Authorise an admin POST and return its group name. A body, if any, must be JSON (forms cannot send it)."""
    _check_token(request)
    if request.body_exists:
        if request.content_type != "application/json":
            raise HttpError(415, "unsupported_media_type", "send no body or a JSON body (application/json)")
        try:
            body = json.loads(await request.read() or b"{}")
        except ValueError:
            body = None
        if not isinstance(body, dict):
            raise HttpError(400, "bad_request", "the body must be a JSON object")
    name = request.match_info["name"]
    log.warning("dashboard: admin %s on group %r from %s", request.path.rsplit("/", 1)[-1], name, request.remote)
    return name


async def _admin_release(request: web.Request) -> web.Response:
    name = await _admin_request(request)
    return _json(request.app[SOURCE].force_release(name))


async def _admin_drain(request: web.Request) -> web.Response:
    name = await _admin_request(request)
    return _json(request.app[SOURCE].drain(name, True))


async def _admin_resume(request: web.Request) -> web.Response:
    name = await _admin_request(request)
    return _json(request.app[SOURCE].drain(name, False))


async def _api_admin(request: web.Request) -> web.Response:
    """Whether admin actions are enabled, and (given an Authorization header) whether its token is valid."""
    enabled = request.app[SETTINGS].admin_token is not None
    authorized: bool | None = None
    if enabled and request.headers.get("Authorization"):
        try:
            _check_token(request)
            authorized = True
        except HttpError:
            authorized = False
    return _json({"enabled": enabled, "authorized": authorized})


# --- live updates --------------------------------------------------------------------------


@dataclass(frozen=True)
class Frame:
    """What every stream sends for one tick (the status encoded once for all of them)."""

    seq: int
    status: bytes | None
    problem: bytes | None
    timeline: dict[str, Any] | None
    newest_event: int


class StreamHub:
    """One producer for all live streams: every ``interval`` seconds, while any stream is open, it reads
    the source once (status, new events, the timeline for the widest window asked for) and wakes them."""

    def __init__(self, source: DashboardSource, interval: float) -> None:
        self._source = source
        self.interval = interval
        self.streams = 0
        self.closed = False
        self._windows: Counter[float] = Counter()
        self._closing = asyncio.Event()
        self._changed = asyncio.Event()
        self.frame = Frame(0, None, None, None, 0)
        self._events: deque[dict[str, Any]] = deque(maxlen=RECENT_EVENTS)
        self._cursor = 0
        self._failing = False

    # events

    def poll_events(self) -> None:
        """Take the source's new events into the ring (a few pages at most per call)."""
        for _ in range(20):
            batch = self._source.events(self._cursor, MAX_EVENTS)
            for event in batch:
                if _is_number(event.get("id")) and event["id"] > self._cursor:
                    self._events.append(event)
                    self._cursor = event["id"]
            if len(batch) < MAX_EVENTS:
                return

    def recent_events(self) -> list[dict[str, Any]]:
        return list(self._events)

    @property
    def newest_event(self) -> int:
        return self._cursor

    def events_after(self, after: int) -> list[dict[str, Any]]:
        """Events newer than ``after``: from the ring when it reaches back that far, else from the source."""
        if self._events and after >= self._events[0]["id"] - 1:
            return [e for e in self._events if e["id"] > after][:MAX_EVENTS]
        return self._source.events(after, MAX_EVENTS)

    # streams

    def attach(self, window: float | None) -> None:
        self.streams += 1
        if window is not None:
            self._windows[window] += 1

    def detach(self, window: float | None) -> None:
        self.streams -= 1
        if window is not None:
            self._windows[window] -= 1
            if self._windows[window] <= 0:
                del self._windows[window]

    def close(self) -> None:
        """End every stream (at shutdown); new ones are refused."""
        self.closed = True
        self._closing.set()
        self._changed.set()

    async def next_frame(self, seq: int) -> Frame | None:
        """The first frame after ``seq``, or None once the hub is closed."""
        while not self.closed and self.frame.seq <= seq:
            await self._changed.wait()
        return None if self.closed else self.frame

    async def run(self) -> None:
        """Publish a frame every interval while streams are open; ends when the hub is closed."""
        while not self.closed:
            try:
                await asyncio.wait_for(self._closing.wait(), self.interval)
            except asyncio.TimeoutError:
                pass
            if self.streams and not self.closed:
                self.publish()

    def publish(self) -> None:
        status = problem = None
        timeline = None
        try:
            status = dumps(self._source.status())
            self.poll_events()
            if self._windows:
                timeline = self._source.timeline(max(self._windows))
            if self._failing:
                log.info("dashboard: the status source answers again")
                self._failing = False
        except Exception as exc:
            if not self._failing:
                log.exception("dashboard: reading the status source failed")
                self._failing = True
            problem = dumps({"error": _error_body(exc)})
            status = None
        self.frame = Frame(self.frame.seq + 1, status, problem, timeline, self._cursor)
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()


def _error_body(exc: Exception) -> dict[str, str]:
    if isinstance(exc, errors.TimeslicedError):
        return {"code": exc.code, "message": exc.message}
    return {"code": "internal", "message": "the daemon could not produce its status; its log has the details"}


def _sse(event: str, data: bytes, event_id: int | None = None) -> bytes:
    head = f"event: {event}\n" + (f"id: {event_id}\n" if event_id is not None else "")
    return head.encode() + b"data: " + data + b"\n\n"


async def _stream(request: web.Request) -> web.StreamResponse:
    hub = request.app[HUB]
    settings = request.app[SETTINGS]
    window = _window_param(request, "timeline", None)
    after: int | None = None
    try:  # a reconnecting browser says where it stopped; that wins over the page's ?after=
        after = max(0, int(request.headers.get("Last-Event-ID", ""), 10))
    except ValueError:
        if "after" in request.query:
            after = _int_param(request, "after", 0, 0, 2**63 - 1)
    if hub.closed:
        raise HttpError(503, "shutting_down", "the dashboard is shutting down", {"Retry-After": "5"})
    if hub.streams >= settings.max_streams:
        raise HttpError(
            503,
            errors.LimitExceeded.code,
            f"too many live streams ({settings.max_streams}); try again later",
            {"Retry-After": "5"},
        )
    hub.attach(window)
    try:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-store", "X-Accel-Buffering": "no"}
        )
        await response.prepare(request)
        try:
            await _feed_stream(request, response, hub, window, after)
        except (ConnectionError, TimeoutError, asyncio.TimeoutError):
            pass  # the client went away or stopped reading: only its own stream ends
        except Exception:
            log.exception("dashboard: a live stream failed")
        return response
    finally:
        hub.detach(window)


async def _feed_stream(
    request: web.Request, response: web.StreamResponse, hub: StreamHub, window: float | None, after: int | None
) -> None:
    source = request.app[SOURCE]

    async def send(chunk: bytes) -> None:
        async with timeout(WRITE_TIMEOUT_S):
            await response.write(chunk)

    # The first messages come straight from the source, so a page is current at once; if the
    # source fails, the stream says so and goes on (the next tick may succeed).
    seq = hub.frame.seq
    since: float | None = None
    problem: Exception | None = None
    if after is None:
        try:
            hub.poll_events()
        except Exception as exc:
            problem = exc
    cursor = after if after is not None else hub.newest_event
    hello = {"interval_s": hub.interval, "after": cursor, "timeline_window_s": window}
    await send(f"retry: {RETRY_MS}\n\n".encode() + _sse("hello", dumps(hello)))
    if problem is None:
        try:
            first = [_sse("status", dumps(source.status()))]
            if window is not None:
                timeline = timeline_delta(source.timeline(window), window, None)
                since = timeline["now"]
                first.append(_sse("timeline", dumps(timeline)))
            events = hub.events_after(cursor)
        except Exception as exc:
            problem = exc
        else:
            await send(b"".join(first))
            cursor = await _send_events(send, cursor, events)
    if problem is not None:
        if not isinstance(problem, errors.TimeslicedError):
            log.error("dashboard: reading the status source for a new stream failed", exc_info=problem)
        await send(_sse("problem", dumps({"error": _error_body(problem)})))
    while True:
        frame = await hub.next_frame(seq)
        if frame is None or request.transport is None or request.transport.is_closing():
            return
        seq = frame.seq
        if frame.status is not None:
            await send(_sse("status", frame.status))
        else:
            await send(_sse("problem", frame.problem or b"{}"))
        if frame.newest_event > cursor:
            cursor = await _send_events(send, cursor, hub.events_after(cursor))
        if window is not None and frame.timeline is not None:
            delta = timeline_delta(frame.timeline, window, since)
            since = delta["now"]
            await send(_sse("timeline", dumps(delta)))


async def _send_events(send: Callable[[bytes], Awaitable[None]], cursor: int, events: list[dict[str, Any]]) -> int:
    if events:
        cursor = max([cursor, *(e["id"] for e in events if _is_number(e.get("id")))])
        await send(_sse("events", dumps({"events": events}), cursor))
    return cursor
