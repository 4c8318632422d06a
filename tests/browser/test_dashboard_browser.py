"""The dashboard in real headless Chromium, over a fake daemon whose picture the test changes.

Each test changes the fake (a job queues, the lock passes on, spans appear) and waits for the
page to show it without a reload.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from typing import Any

import pytest

try:
    from playwright.sync_api import Page, expect
except ImportError:  # the browser fixture explains; CI wants a failure, not a skip
    if os.environ.get("TIMESLICED_REQUIRE_BROWSER") == "1":
        raise
    pytest.skip("the Python package playwright is not installed", allow_module_level=True)

from timesliced.dashboard import fmt_bytes, fmt_duration, fmt_gbps, fmt_pct, job_color, make_app

from ..helpers.browser import Console, ServedApp, screenshot, wait_live
from ..helpers.evolving_source import EvolvingSource

pytestmark = pytest.mark.slow  # the quick loop (-m "not slow") leaves these out

MiB = 1 << 20
TOKEN = "s3cret-admin-token-for-tests"
INTERVAL = 0.2
LIVE_SECTIONS = {
    "/": ["#node-meta", "#nodes-body", "#gpus", "#groups-body", "#jobs-body", "#host-body", "#host-reading"],
    "/groups/pool": ["#group-head", "#group-summary", "#group-stats", "#group-queue-body", "#group-members-body"],
    "/jobs/rl-math": [
        "#job-head",
        "#job-summary",
        "#job-moves-summary",
        "#job-state-body",
        "#job-processes-body",
        "#job-moves-body",
    ],
}


@pytest.fixture
def source() -> EvolvingSource:
    return EvolvingSource()


@pytest.fixture
def served(source: EvolvingSource) -> Iterator[ServedApp]:
    with ServedApp(lambda: make_app(source, admin_token=TOKEN, sse_interval=INTERVAL)) as app:
        yield app


# --- tests -----------------------------------------------------------------------------------


def test_overview_shows_nodes_gpus_groups_and_jobs(served: ServedApp, browser_page: Page) -> None:
    page = browser_page
    page.goto(served.url + "/")
    wait_live(page)
    expect(page.locator("#nodes-body")).to_contain_text("node-a")
    expect(page.locator("#gpus article.gpu")).to_have_count(2)
    gpu0 = page.locator('#gpus article[data-gpu="0"]')
    expect(gpu0).to_contain_text("sim-gpu0")
    expect(gpu0).to_contain_text("90%")  # duty now
    expect(gpu0.locator('rect.seg[data-job="sft-chat"]')).to_have_count(1)
    expect(gpu0.locator("rect.seg-other")).to_have_count(1)
    expect(gpu0.locator("li.parked")).to_contain_text("rl-math")
    assert gpu0.locator('rect.seg[data-job="sft-chat"]').get_attribute("fill") == job_color("sft-chat")
    pool = page.locator('#groups-body tr[data-group="pool"]')
    expect(pool.locator("td.holder")).to_have_text("sft-chat")
    expect(pool.locator("td.queue")).to_contain_text("rl-math")
    expect(page.locator('#groups-body tr[data-group="eval"]')).to_contain_text("eval-harness")
    expect(page.locator("#jobs-body tr")).to_have_count(4)
    expect(page.locator("#events-list li").first).to_contain_text("granted")
    screenshot(page, "dashboard-overview")


def test_holder_and_queue_update_in_place(served: ServedApp, source: EvolvingSource, browser_page: Page) -> None:
    page = browser_page
    page.goto(served.url + "/groups/pool")
    wait_live(page)
    page.evaluate("window.__notReloaded = true")
    queue = page.locator("#group-queue-body tr[data-job]")
    expect(queue).to_have_count(1)

    source.enqueue("rl-code")  # the queue grows
    expect(queue).to_have_count(2)
    expect(queue.nth(1)).to_contain_text("rl-code")

    source.grant_next()  # sft-chat yields, rl-math is switched in, sft-chat queues again
    expect(page.locator("#group-summary dd.holder")).to_have_text("rl-math")
    expect(queue).to_have_count(2)
    expect(queue.nth(0)).to_contain_text("rl-code")
    expect(queue.nth(1)).to_contain_text("sft-chat")
    expect(page.locator("#group-summary")).to_contain_text("3")  # the fence grew
    expect(page.locator("#events-list li").first).to_contain_text("granted")

    source.leave("sft-chat")  # the queue shrinks
    expect(queue).to_have_count(1)
    assert page.evaluate("window.__notReloaded") is True
    screenshot(page, "dashboard-group")


def test_timeline_gains_spans_live(served: ServedApp, source: EvolvingSource, browser_page: Page) -> None:
    page = browser_page
    page.goto(served.url + "/timeline")
    wait_live(page)
    pool = page.locator('#timeline-svg g.lane[data-group="pool"]')
    expect(pool.locator("rect.span.held")).to_have_count(2)
    expect(pool.locator("rect.span.switching")).to_have_count(1)
    expect(pool.locator("rect.idle")).to_have_count(1)
    held = pool.locator('rect.span.held[data-job="sft-chat"]')
    assert held.get_attribute("fill") == job_color("sft-chat")

    source.grant_next()  # a switch span and a new held span appear
    expect(pool.locator("rect.span.held")).to_have_count(3)
    expect(pool.locator("rect.span.switching")).to_have_count(2)
    expect(pool.locator('rect.span.held[data-job="rl-math"]')).to_have_count(2)
    expect(page.locator("#timeline-legend")).to_contain_text("rl-math")

    page.select_option("#window", "60")  # a shorter window, in place: rl-math's first slice leaves it
    expect(pool.locator('rect.span.held[data-job="rl-math"]')).to_have_count(1)
    expect(pool.locator("rect.span.held")).to_have_count(2)
    assert "window=60" in page.url
    page.select_option("#window", "600")
    expect(pool.locator("rect.span.held")).to_have_count(3)
    screenshot(page, "dashboard-timeline")


def test_disconnected_banner_when_the_server_goes(served: ServedApp, browser_page: Page, console: Console) -> None:
    console.allow(r"net::ERR_CONNECTION_REFUSED \(http://[^)]*/api/v1/stream")  # the browser retrying the stream
    page = browser_page
    page.goto(served.url + "/")
    wait_live(page)
    expect(page.locator("#conn-banner")).to_be_hidden()
    served.stop()
    expect(page.locator("#conn-banner")).to_be_visible()
    expect(page.locator("#live")).to_have_attribute("data-state", "offline")
    screenshot(page, "dashboard-disconnected")


def test_admin_actions_need_the_token(served: ServedApp, source: EvolvingSource, browser_page: Page) -> None:
    page = browser_page
    page.goto(served.url + "/groups/pool")
    wait_live(page)
    release = page.locator('#group-actions button[data-action="release"]')
    expect(release).to_be_hidden()

    page.locator("#admin summary").click()
    page.locator("#admin-token").fill("not-the-token")
    page.locator("#admin-unlock").click()
    expect(page.locator("#admin-msg")).to_have_text("That token was not accepted.")
    expect(release).to_be_hidden()
    assert page.locator("#admin-token").input_value() == ""

    page.locator("#admin-token").fill(TOKEN)
    page.locator("#admin-token").press("Enter")
    expect(release).to_be_visible()
    assert TOKEN not in page.content()
    expect(page.locator('#group-actions button[data-action="resume"]')).to_be_disabled()  # not draining
    screenshot(page, "dashboard-group-admin")

    release.click()
    expect(release).to_have_text("Confirm force release")
    assert source.calls == []  # one click only arms it
    release.click()
    expect(page.locator("#action-msg")).to_have_text("Force-released pool.")
    assert source.calls == [("force_release", "pool")]
    expect(page.locator("#group-summary dd.holder")).to_have_text("—")
    expect(release).to_be_disabled()  # nobody holds the lock now

    page.locator('#group-actions button[data-action="drain"]').click()
    expect(page.locator("#group-head")).to_contain_text("draining")
    assert source.calls[-1] == ("drain", ("pool", True))

    page.reload()  # the token stays for this tab's session
    wait_live(page)
    expect(page.locator('#group-actions button[data-action="resume"]')).to_be_enabled()
    page.locator('#group-actions button[data-action="resume"]').click()
    expect(page.locator("#group-head")).not_to_contain_text("draining")
    assert source.calls[-1] == ("resume", "pool")


def test_a_faulted_job_is_resumed_from_its_page(served: ServedApp, source: EvolvingSource, browser_page: Page) -> None:
    page = browser_page
    page.goto(served.url + "/jobs/rl-code")
    wait_live(page)
    page.locator("#admin summary").click()
    page.locator("#admin-token").fill(TOKEN)
    page.locator("#admin-token").press("Enter")
    resume = page.locator('#job-actions button[data-action="resume"]')
    expect(resume).to_be_disabled()  # nothing to resume
    source.faulted["rl-code"] = "snapshot failed: timed out after 600 s"
    expect(page.locator("#job-head")).to_contain_text("faulted")
    expect(page.locator("#job-summary")).to_contain_text("snapshot failed: timed out after 600 s")
    expect(resume).to_be_enabled()
    resume.click()
    expect(page.locator("#action-msg")).to_have_text("Resumed rl-code.")
    assert source.calls[-1] == ("resume_job", "rl-code")
    expect(page.locator("#job-head")).not_to_contain_text("faulted")
    expect(resume).to_be_disabled()


def test_the_overview_shows_the_host_budget_and_what_each_job_has_parked(
    served: ServedApp, source: EvolvingSource, browser_page: Page
) -> None:
    page = browser_page
    page.goto(served.url + "/")
    wait_live(page)
    row = page.locator("#host-body tr[data-slot='0']")
    expect(row).to_contain_text("node-a")
    expect(row).to_contain_text(fmt_bytes(512 * MiB))  # the budget
    expect(row).to_contain_text("tmpfs:/dev/shm: 24.0 MiB of 256 MiB")
    expect(page.locator("#host-reading")).to_contain_text("cgroup /system.slice/timesliced.service")
    expect(page.locator('#jobs-body tr[data-job="rl-math"] td').nth(8)).to_have_text(fmt_bytes(24 * MiB))
    expect(page.locator('#jobs-body tr[data-job="eval-harness"]')).to_contain_text("park refused")
    source.grant_next()  # rl-math comes back: its parked state is gone from host memory
    expect(page.locator('#jobs-body tr[data-job="rl-math"] td').nth(8)).to_have_text(fmt_bytes(0))


def _normalise(html: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r">\s+|\s+<", lambda m: m.group(0).strip(), html)).strip()


def test_first_paint_matches_the_live_render(browser_page: Page) -> None:
    """The jinja2 first paint and the browser's re-render from the stream produce the same markup."""
    frozen = EvolvingSource(frozen=True)
    page = browser_page
    with ServedApp(lambda: make_app(frozen, admin_token=None, sse_interval=INTERVAL)) as served:
        for path, sections in LIVE_SECTIONS.items():
            first_paint = page.request.get(served.url + path).text()
            page.goto(served.url + path)
            wait_live(page)
            server = page.evaluate(
                """([html, ids]) => {
                    const doc = new DOMParser().parseFromString(html, "text/html");
                    return ids.map((id) => doc.querySelector(id).innerHTML);
                }""",
                [first_paint, sections],
            )
            browser = page.evaluate("ids => ids.map((id) => document.querySelector(id).innerHTML)", sections)
            for section, a, b in zip(sections, server, browser, strict=True):
                assert _normalise(a) == _normalise(b), f"{path} {section} differs between jinja2 and dashboard.js"
        expect(page.locator("#admin")).to_have_count(0)  # no token configured: no admin control at all

        names = ["rl-math", "sft-chat", "évaluation", "作业-7", "a/b c"]
        assert page.evaluate("ns => ns.map((n) => window.timesliced.jobColor(n))", names) == [
            job_color(n) for n in names
        ]
        numbers: list[Any] = [0, 1, 1023, 1024, 1536, 10 * MiB + 5, 123456789012, 0.0004, 0.0123, 0.5, 59.96, 61, 7322]
        numbers += [None, float("nan")]
        js = page.evaluate(
            """ns => ns.map((n) => { const t = window.timesliced;
                   return [t.fmtBytes(n), t.fmtDuration(n), t.fmtPct(n), t.fmtGbps(n)]; })""",
            [n if n == n else None for n in numbers],
        )
        py = [[fmt_bytes(n), fmt_duration(n), fmt_pct(n), fmt_gbps(n)] for n in numbers]
        assert js == py
