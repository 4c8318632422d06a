"""The dashboard's files: jinja2 templates and static assets, read once when the app is built.

They ship as the packages ``timesliced.web`` and ``timesliced.static`` (the repository's ``web/``
and ``static/``); a source checkout without them installed reads the repository's folders. Nothing
is fetched from elsewhere, so the dashboard works on an air-gapped cluster, and nothing is read
from disk after start-up.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import jinja2

from .formatting import (
    clock,
    fixed,
    fmt_bytes,
    fmt_duration,
    fmt_gbps,
    fmt_num,
    fmt_pct,
    is_number,
    job_color,
    pathseg,
    window_label,
)
from .views import gpu_views, group_detail, job_detail

if TYPE_CHECKING:
    from importlib.abc import Traversable

__all__ = ["Asset", "load_assets", "load_templates"]

_STATIC_TYPES = {
    ".css": "text/css; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
    ".ico": "image/x-icon",
}


@dataclass(frozen=True)
class Asset:
    body: bytes
    content_type: str
    etag: str


def _resource_dir(package: str, folder: str, marker: str) -> Traversable:
    """In a source checkout the repository's ``folder``, else the installed package ``package``.

    The checkout comes first: the templates and the script must be those of the code that runs,
    and an editable install elsewhere (another checkout's) would map ``package`` to its own folder.
    """
    checkout = Path(__file__).resolve().parents[2] / folder  # this file is timesliced/dashboard/resources.py
    if checkout.joinpath(marker).is_file():
        return checkout
    try:
        installed = resources.files(package)
        if installed.joinpath(marker).is_file():
            return installed
    except ModuleNotFoundError:
        pass
    raise RuntimeError(f"the dashboard's files are missing: neither {checkout} nor {package} has {marker}")


def load_templates() -> jinja2.Environment:
    """The page templates, with the formatting helpers and views they call. Raises ``RuntimeError`` when missing."""
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
        is_number=is_number,
        clock=clock,
        window_label=window_label,
    )
    return env


def load_assets() -> dict[str, Asset]:
    """The static files by name, each with its content type and ETag. Raises ``RuntimeError`` when missing."""
    root = _resource_dir("timesliced.static", "static", "dashboard.js")
    out: dict[str, Asset] = {}
    for entry in root.iterdir():
        content_type = _STATIC_TYPES.get(Path(entry.name).suffix)
        if content_type is None or not entry.is_file():
            continue
        body = entry.read_bytes()
        out[entry.name] = Asset(body, content_type, '"' + hashlib.sha256(body).hexdigest()[:20] + '"')
    return out
