"""The server-rendered pages and the static files they load.

Pages: ``/`` (overview), ``/groups/NAME``, ``/jobs/NAME``, ``/timeline?window=S``. jinja2 renders
the first paint; ``static/dashboard.js`` then keeps a page current in place from the live stream
(``stream.py``). An unknown group or job is a 404 page.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from .. import errors
from ..version import __version__
from .context import API, ASSETS, HUB, SETTINGS, SOURCE, TEMPLATES
from .encoding import script_json
from .params import DEFAULT_WINDOW_S, HttpError, window_param
from .views import group_detail, job_detail, timeline_delta

__all__ = [
    "PAGE_EVENTS",
    "group_page",
    "job_page",
    "overview_page",
    "render",
    "static",
    "timeline_page",
]

PAGE_EVENTS = 50  # events a page shows


def render(request: web.Request, template: str, **context: Any) -> str:
    """The HTML of ``template`` with ``context`` and what every page shows (version, admin, stream settings)."""
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
    return web.Response(text=render(request, template, **context), content_type="text/html")


def _recent_events(request: web.Request, *, group: str | None = None, job: str | None = None) -> list[dict[str, Any]]:
    hub = request.app[HUB]
    hub.poll_events()
    picked = [
        e
        for e in hub.recent_events()
        if (group is None or e.get("group") == group) and (job is None or e.get("job") == job)
    ]
    return picked[-PAGE_EVENTS:][::-1]


async def overview_page(request: web.Request) -> web.Response:
    status = request.app[SOURCE].status()
    events = _recent_events(request)
    return _page(request, "overview.html", page="overview", title="Overview", status=status, events=events)


async def group_page(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    status = request.app[SOURCE].status()
    group = group_detail(status, name)
    if group is None:
        raise HttpError(404, errors.UnknownGroup.code, f"no group named {name!r}")
    events = _recent_events(request, group=name)
    return _page(
        request, "group.html", page="group", name=name, title=f"Group {name}", status=status, group=group, events=events
    )


async def job_page(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    status = request.app[SOURCE].status()
    job = job_detail(status, name)
    if job is None:
        raise HttpError(404, errors.UnknownJob.code, f"no job named {name!r}")
    events = _recent_events(request, job=name)
    return _page(request, "job.html", page="job", name=name, title=f"Job {name}", status=status, job=job, events=events)


async def timeline_page(request: web.Request) -> web.Response:
    window = window_param(request, "window", DEFAULT_WINDOW_S)
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


async def static(request: web.Request) -> web.StreamResponse:
    # Only the files found at start-up are served: no path ever reaches the filesystem.
    asset = request.app[ASSETS].get(request.match_info["name"])
    if asset is None:
        raise web.HTTPNotFound()
    headers = {"Cache-Control": "no-cache", "ETag": asset.etag}
    if asset.etag in request.headers.get("If-None-Match", ""):
        return web.Response(status=304, headers=headers)
    return web.Response(body=asset.body, headers={**headers, "Content-Type": asset.content_type})
