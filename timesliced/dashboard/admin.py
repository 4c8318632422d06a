"""The admin actions: force-release, drain and resume a group, resume a faulted job, behind the admin token.

``GET /api/v1/admin``                              ``{"enabled", "authorized"}`` (authorized: null without a token sent)
``POST /api/v1/groups/NAME/release|drain|resume``  the source's answer (resume also clears its jobs' faults)
``POST /api/v1/jobs/NAME/resume``                  the source's answer: the job's fault is cleared

The rest of the dashboard is read-only. An action needs ``Authorization: Bearer <admin token>``
(401 without, 403 when wrong or when no token is configured; 404 unknown group or job, 409 nobody
holds it, or the job cannot be resumed). Browsers never attach that header by themselves, and a
body must be JSON, so a cross-site form or link cannot trigger an action. The token is compared
in constant time and never logged. Wrong tokens are answered one at a time, each after
``WRONG_TOKEN_DELAY_S``: guessing gets no faster with more connections, and other requests are
never held up.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging

from aiohttp import web

from .. import errors
from .context import API, SETTINGS, SOURCE
from .encoding import json_response
from .params import HttpError

__all__ = ["GUESSES", "WRONG_TOKEN_DELAY_S", "drain", "release", "resume", "resume_job", "state"]

log = logging.getLogger(__package__)  # the whole dashboard logs under one name

WRONG_TOKEN_DELAY_S = 0.5
GUESSES: web.AppKey[asyncio.Lock] = web.AppKey("admin_guesses")  # held while a wrong token waits out its delay


async def _check_token(request: web.Request) -> None:
    """Raise unless the request carries the admin token (compared in constant time); a wrong one costs a delay."""
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
        async with request.app[GUESSES]:
            await asyncio.sleep(WRONG_TOKEN_DELAY_S)
        raise HttpError(403, errors.PermissionDenied.code, "the admin token is not valid")


async def _admin_request(request: web.Request) -> str:
    """Authorise an admin POST and return its group name. A body, if any, must be JSON (forms cannot send it)."""
    await _check_token(request)
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
    what = "job" if request.path.startswith(f"{API}/jobs/") else "group"
    log.warning("dashboard: admin %s on %s %r from %s", request.path.rsplit("/", 1)[-1], what, name, request.remote)
    return name


async def release(request: web.Request) -> web.Response:
    name = await _admin_request(request)
    return json_response(request.app[SOURCE].force_release(name))


async def drain(request: web.Request) -> web.Response:
    name = await _admin_request(request)
    return json_response(request.app[SOURCE].drain(name, True))


async def resume(request: web.Request) -> web.Response:
    name = await _admin_request(request)
    return json_response(request.app[SOURCE].resume(name))


async def resume_job(request: web.Request) -> web.Response:
    name = await _admin_request(request)
    return json_response(request.app[SOURCE].resume_job(name))


async def state(request: web.Request) -> web.Response:
    """Whether admin actions are enabled, and (given an Authorization header) whether its token is valid."""
    enabled = request.app[SETTINGS].admin_token is not None
    authorized: bool | None = None
    if enabled and request.headers.get("Authorization"):
        try:
            await _check_token(request)
            authorized = True
        except HttpError:
            authorized = False
    return json_response({"enabled": enabled, "authorized": authorized})
