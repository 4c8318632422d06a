"""The built wheel carries the dashboard: every page and asset is served from an installed copy."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from timesliced.version import __version__

from ..helpers.processes import REPO

pytestmark = pytest.mark.slow  # the quick loop (-m "not slow") leaves these out

SERVE_EVERYTHING = """
import json, sys, urllib.request
import timesliced
from timesliced.daemon.embedded import EmbeddedDaemon
assert timesliced.__file__.startswith(sys.argv[1]), timesliced.__file__  # the installed copy, not the source
with EmbeddedDaemon(gpus=1, web=("127.0.0.1", 0)) as d:
    with timesliced.Client(job="a", group="g", address=d.socket) as c:
        c.acquire()
        out = {}
        for path in sys.argv[2:]:
            with urllib.request.urlopen(d.web_url + path, timeout=10) as r:
                out[path] = [r.status, r.headers.get("Content-Type"), len(r.read())]
print(json.dumps(out))
"""


def test_the_wheel_serves_every_page_and_asset(tmp_path: Path) -> None:
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(REPO)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = tmp_path.glob("timesliced-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        z.extractall(tmp_path / "site")
        (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        version = next(line for line in z.read(metadata).decode().splitlines() if line.startswith("Version: "))
    assert version == f"Version: {__version__}", "the wheel's version comes from timesliced/version.py"
    templates = {p.name for p in (REPO / "web").glob("*.html")}
    assets = {p.name for p in (REPO / "static").iterdir() if p.suffix in {".js", ".css", ".svg"}}
    assert templates and assets
    assert {f"timesliced/web/{t}" for t in templates} <= names
    assert {f"timesliced/static/{a}" for a in assets} <= names

    site = tmp_path / "site"
    pages = ["", "groups/g", "jobs/a", "timeline", "api/v1/status", "metrics", *(f"static/{a}" for a in assets)]
    served = subprocess.run(
        [sys.executable, "-c", SERVE_EVERYTHING, str(site), *pages],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,  # not the repository: only the extracted wheel is importable as timesliced
        env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
    )
    assert served.returncode == 0, served.stderr
    results = json.loads(served.stdout)
    assert {path: r[0] for path, r in results.items()} == dict.fromkeys(pages, 200)
    assert all(r[2] > 0 for r in results.values())
