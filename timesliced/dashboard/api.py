"""The read-only JSON API, and the probes ``/healthz``, ``/readyz`` and ``/metrics``.

Every answer is ``Cache-Control: no-store``; errors are ``{"error": {"code", "message"}}`` with
400 for bad parameters and 404 for unknown names; collections are arrays, items objects:

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
``GET /api/v1/advice?min_phases=N``  placement advice from the jobs' phases (``timesliced advise --json``'s document)

The admin routes are in ``admin.py``, the live stream in ``stream.py``. ``/metrics`` is the given
callable's answer (404 without one), ``/healthz`` is 200 while serving and ``/readyz`` 200 while the
source is ready (else 503).
"""

from __future__ import annotations

from aiohttp import web

from .. import errors
from ..core.advisor import Options, advise
from .context import SETTINGS, SOURCE
from .encoding import json_response
from .params import DEFAULT_EVENTS, DEFAULT_WINDOW_S, MAX_EVENTS, HttpError, int_param, window_param
from .views import devices_view, group_detail, items, job_detail, node_view

__all__ = [
    "devices",
    "events",
    "group",
    "groups",
    "healthz",
    "job",
    "jobs",
    "metrics",
    "nodes",
    "readyz",
    "status",
    "timeline",
]


async def status(request: web.Request) -> web.Response:
    return json_response(request.app[SOURCE].status())


async def nodes(request: web.Request) -> web.Response:
    return json_response([node_view(request.app[SOURCE].status())])


async def devices(request: web.Request) -> web.Response:
    return json_response(devices_view(request.app[SOURCE].status()))


async def groups(request: web.Request) -> web.Response:
    return json_response(items(request.app[SOURCE].status().get("groups")))


async def group(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    found = group_detail(request.app[SOURCE].status(), name)
    if found is None:
        raise HttpError(404, errors.UnknownGroup.code, f"no group named {name!r}")
    return json_response(found)


async def jobs(request: web.Request) -> web.Response:
    return json_response(items(request.app[SOURCE].status().get("jobs")))


async def job(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    found = job_detail(request.app[SOURCE].status(), name)
    if found is None:
        raise HttpError(404, errors.UnknownJob.code, f"no job named {name!r}")
    return json_response(found)


async def timeline(request: web.Request) -> web.Response:
    window = window_param(request, "window", DEFAULT_WINDOW_S)
    assert window is not None
    return json_response(request.app[SOURCE].timeline(window))


async def events(request: web.Request) -> web.Response:
    after = int_param(request, "after", 0, 0, 2**63 - 1)
    limit = int_param(request, "limit", DEFAULT_EVENTS, 1, MAX_EVENTS)
    return json_response(request.app[SOURCE].events(after, limit))


async def advice(request: web.Request) -> web.Response:
    """What ``timesliced advise --json`` prints, from the source's status (its ``message`` says what is missing)."""
    min_phases = int_param(request, "min_phases", Options.min_phases, 1, 256)
    return json_response(advise(request.app[SOURCE].status(), Options(min_phases=min_phases)))


# --- probes -------------------------------------------------------------------------------


async def healthz(request: web.Request) -> web.Response:
    return web.Response(text="ok\n")


async def readyz(request: web.Request) -> web.Response:
    if request.app[SOURCE].ready():
        return web.Response(text="ready\n")
    return web.Response(status=503, text="not ready\n")


async def metrics(request: web.Request) -> web.Response:
    answer = request.app[SETTINGS].metrics
    if answer is None:
        raise web.HTTPNotFound()
    body, content_type = answer(request.headers.get("Accept"))
    return web.Response(body=body, headers={"Content-Type": content_type})
