"""The application: ``make_app`` wires the routes, the stream hub and the answers common to every
route (security headers, errors as JSON under ``/api/`` and as pages elsewhere); ``serve`` binds it."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping

from aiohttp import web

from .. import errors
from . import admin, api, pages
from .context import API, ASSETS, HUB, SETTINGS, SOURCE, TEMPLATES, DashboardSource, Metrics, Settings
from .encoding import json_response
from .params import HttpError
from .resources import load_assets, load_templates
from .stream import MAX_STREAMS, StreamHub, serve_stream

__all__ = ["make_app", "serve"]

log = logging.getLogger(__package__)  # the whole dashboard logs under one name

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
    (errors.JobFaulted, 409),  # a job that cannot be resumed (its state is lost, or it exited)
    (errors.BadRequest, 400),
    (errors.PermissionDenied, 403),
    (errors.LimitExceeded, 503),
)


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
    app[TEMPLATES] = load_templates()
    app[ASSETS] = load_assets()
    app[HUB] = StreamHub(source, float(sse_interval))
    app[admin.GUESSES] = asyncio.Lock()
    app.cleanup_ctx.append(_run_hub)
    app.on_shutdown.append(_close_streams)
    app.on_response_prepare.append(_common_headers)
    app.add_routes(
        [
            web.get("/", pages.overview_page),
            web.get("/groups/{name}", pages.group_page),
            web.get("/jobs/{name}", pages.job_page),
            web.get("/timeline", pages.timeline_page),
            web.get("/static/{name}", pages.static),
            web.get("/healthz", api.healthz),
            web.get("/readyz", api.readyz),
            web.get("/metrics", api.metrics),
            web.get(f"{API}/status", api.status),
            web.get(f"{API}/nodes", api.nodes),
            web.get(f"{API}/devices", api.devices),
            web.get(f"{API}/groups", api.groups),
            web.get(f"{API}/groups/{{name}}", api.group),
            web.get(f"{API}/jobs", api.jobs),
            web.get(f"{API}/jobs/{{name}}", api.job),
            web.get(f"{API}/timeline", api.timeline),
            web.get(f"{API}/events", api.events),
            web.get(f"{API}/advice", api.advice),
            web.get(f"{API}/stream", serve_stream, allow_head=False),
            web.get(f"{API}/admin", admin.state),
            web.post(f"{API}/groups/{{name}}/release", admin.release),
            web.post(f"{API}/groups/{{name}}/drain", admin.drain),
            web.post(f"{API}/groups/{{name}}/resume", admin.resume),
            web.post(f"{API}/jobs/{{name}}/resume", admin.resume_job),
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
        return json_response({"error": {"code": code, "message": message}}, status=status, headers=headers)
    try:
        html = pages.render(request, "error.html", status_code=status, code=code, message=message, title=f"{status}")
    except Exception:
        log.exception("dashboard: rendering the error page failed")
        return web.Response(status=status, text=f"{status}: {message}\n", headers=headers)
    return web.Response(status=status, text=html, content_type="text/html", headers=headers)
