"""The dashboard of a real daemon running the demo workload, in headless Chromium.

Three job processes take turns on two simulated GPUs while the pages stay
open: the holder, the queue and the timeline must change without a reload.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterator

import pytest

try:
    from playwright.sync_api import Page, expect
except ImportError:  # the browser fixture explains; CI wants a failure, not a skip
    if os.environ.get("TIMESLICED_REQUIRE_BROWSER") == "1":
        raise
    pytest.skip("the Python package playwright is not installed", allow_module_level=True)

from timesliced.bench import demo
from timesliced.daemon.embedded import EmbeddedDaemon

from ..helpers.browser import screenshot, wait_live

pytestmark = pytest.mark.slow  # the quick loop (-m "not slow") leaves these out

SCALE = 0.6  # every phase of the demo jobs, shortened


@pytest.fixture
def running_demo() -> Iterator[EmbeddedDaemon]:
    with EmbeddedDaemon(gpus=demo.GPUS, gpu_memory=demo.GPU_MEMORY, web=("127.0.0.1", 0)) as d:
        # Far more iterations than the test watches for: the jobs still take turns whatever a slow
        # machine's page loads take (the fixture stops them when the test ends).
        workload = [dataclasses.replace(spec, iterations=spec.iterations * 10) for spec in demo.WORKLOAD]
        procs = [demo._spawn(spec, d.socket, SCALE, "") for spec in workload]
        try:
            yield d
        finally:
            for p in procs:
                p.kill()
                p.communicate()


def seen_over(page: Page, selector: str, seconds: float) -> list[str]:
    """The distinct texts of ``selector`` seen while watching the page for ``seconds``."""
    seen: list[str] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        text = page.locator(selector).first.inner_text().strip()
        if text and (not seen or seen[-1] != text):
            seen.append(text)
        page.wait_for_timeout(100)
    return seen


def test_the_demo_lives_on_the_dashboard(running_demo: EmbeddedDaemon, browser_page: Page) -> None:
    page = browser_page
    loads: list[str] = []
    page.on("load", lambda: loads.append(page.url))
    url = running_demo.web_url
    assert url is not None

    page.goto(url)
    wait_live(page)
    expect(page.locator("#groups-body")).to_contain_text(demo.GROUP, timeout=20_000)
    expect(page.locator("#gpus")).to_contain_text("GPU 1")
    screenshot(page, "demo-overview")

    page.goto(f"{url}groups/{demo.GROUP}")
    wait_live(page)
    holders = seen_over(page, "#group-summary dd.holder", 8.0)
    assert len({h for h in holders if h != "—"}) >= 2, holders  # the lock went round without a reload
    expect(page.locator("#group-queue-body tr[data-job]").first).to_be_visible(timeout=15_000)  # someone waits
    updates = int(page.locator("body").get_attribute("data-updates") or 0)
    assert updates >= 5
    screenshot(page, "demo-group")

    page.goto(f"{url}timeline")
    wait_live(page)
    lane = page.locator(f'#timeline-svg g.lane[data-group="{demo.GROUP}"]')
    before = lane.locator("rect.span.held").count()
    expect(lane.locator("rect.span.held")).not_to_have_count(before, timeout=15_000)  # new slices appear live
    expect(lane.locator("rect.span.switching").first).to_be_attached()
    screenshot(page, "demo-timeline")
    assert len(loads) == 3  # one per page opened: everything else came over the stream
