"""The browser dashboard: server-rendered pages, a JSON API, live updates and admin actions.

``make_app(source, admin_token=...)`` builds an aiohttp application over a
``DashboardSource`` (the daemon); ``serve(app, host, port)`` binds it and returns
once it listens. Pages are rendered by jinja2 for the first paint and then kept
current in place by ``static/dashboard.js`` from the Server-Sent Events stream
at ``/api/v1/stream``.

The modules, each with the part of the surface it serves:

- ``app``: ``make_app``, ``serve``, the headers and error answers common to every route.
- ``context``: ``DashboardSource``, the settings and the typed app keys.
- ``resources``: templates (``timesliced.web``) and assets (``timesliced.static``).
- ``formatting``, ``views``: pure helpers and views of the status document (mirrored in ``dashboard.js``).
- ``encoding``, ``params``: JSON out; query parameters in, ``HttpError`` when they are wrong.
- ``pages``: ``/``, ``/groups/NAME``, ``/jobs/NAME``, ``/timeline``, ``/static/NAME``.
- ``api``: the read-only ``/api/v1/...`` routes, ``/healthz``, ``/readyz``, ``/metrics``.
- ``admin``: force-release, drain and resume, behind the admin token.
- ``stream``: the SSE protocol and the hub that feeds every stream.
"""

from __future__ import annotations

from .app import make_app, serve
from .context import API as API
from .context import ASSETS as ASSETS
from .context import HUB, SOURCE, DashboardSource, Metrics
from .context import SETTINGS as SETTINGS
from .context import TEMPLATES as TEMPLATES
from .context import Settings as Settings
from .encoding import dumps
from .encoding import script_json as script_json
from .formatting import clock as clock
from .formatting import fixed as fixed
from .formatting import fmt_bytes as fmt_bytes
from .formatting import fmt_duration as fmt_duration
from .formatting import fmt_gbps as fmt_gbps
from .formatting import fmt_num as fmt_num
from .formatting import fmt_pct as fmt_pct
from .formatting import job_color
from .formatting import pathseg as pathseg
from .formatting import window_label as window_label
from .pages import PAGE_EVENTS as PAGE_EVENTS
from .params import DEFAULT_EVENTS as DEFAULT_EVENTS
from .params import DEFAULT_WINDOW_S as DEFAULT_WINDOW_S
from .params import MAX_EVENTS as MAX_EVENTS
from .params import MAX_WINDOW_S as MAX_WINDOW_S
from .params import MIN_WINDOW_S as MIN_WINDOW_S
from .params import HttpError as HttpError
from .resources import Asset as Asset
from .stream import MAX_STREAMS as MAX_STREAMS
from .stream import RECENT_EVENTS as RECENT_EVENTS
from .stream import RETRY_MS as RETRY_MS
from .stream import WRITE_TIMEOUT_S as WRITE_TIMEOUT_S
from .stream import Frame as Frame
from .stream import StreamHub
from .views import SPAN_SLACK_S as SPAN_SLACK_S
from .views import gpu_views, group_detail, job_detail, timeline_delta

# The same public list as before the split; the other names above stay importable from here too.
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
