"""The dashboard in real headless Chromium, over a fake daemon whose picture the test changes.

Each test changes the fake (a job queues, the lock passes on, spans appear) and waits for the
page to show it without a reload.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

try:
    from playwright.sync_api import Page, expect
except ImportError:  # the browser fixture explains; CI wants a failure, not a skip
    if os.environ.get("TIMESLICED_REQUIRE_BROWSER") == "1":
        raise
    pytest.skip("the Python package playwright is not installed", allow_module_level=True)

from timesliced import errors
from timesliced.dashboard import fmt_bytes, fmt_duration, fmt_gbps, fmt_pct, job_color, make_app

from ..helpers import status_docs
from .conftest import Console, ServedApp, screenshot, wait_live

MiB = 1 << 20
TOKEN = "s3cret-admin-token-for-tests"
INTERVAL = 0.2
LIVE_SECTIONS = {
    "/": ["#node-meta", "#nodes-body", "#gpus", "#groups-body", "#jobs-body"],
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


class EvolvingSource:
    """A fake daemon: two GPUs, a group ``pool`` shared by three jobs and a group ``eval`` with one.

    The test calls ``enqueue`` / ``grant`` / ``leave`` to move the lock; ``status()`` and
    ``timeline()`` describe the current state with the real clock (unless ``frozen``). Called
    from the server's thread and the test's, so everything goes under one lock.
    """

    JOBS = {"rl-math": "pool", "sft-chat": "pool", "rl-code": "pool", "eval-harness": "eval"}

    def __init__(self, *, frozen: bool = False) -> None:
        self._lock = threading.Lock()
        self.frozen = frozen
        self.t0 = time.time() - 300
        self.now_fixed = time.time()
        self.holder: dict[str, str | None] = {"pool": "sft-chat", "eval": "eval-harness"}
        self.held_since: dict[str, float] = {"pool": self.t0 + 200, "eval": self.t0 + 100}
        self.queue: dict[str, list[tuple[str, float]]] = {"pool": [("rl-math", self.t0 + 250)], "eval": []}
        self.draining: dict[str, bool] = {"pool": False, "eval": False}
        self.resident = {"sft-chat", "eval-harness", "rl-code"}
        self.switches = 1
        self.fence = {"pool": 2, "eval": 1}
        self.spans: list[dict[str, Any]] = [
            {"group": "pool", "job": "rl-math", "kind": "held", "start": self.t0 + 60, "end": self.t0 + 180},
            {"group": "pool", "job": "sft-chat", "kind": "switching", "start": self.t0 + 180, "end": self.t0 + 200},
            {"group": "pool", "job": "sft-chat", "kind": "held", "start": self.t0 + 200, "end": None},
            {"group": "eval", "job": "eval-harness", "kind": "held", "start": self.t0 + 100, "end": None},
        ]
        self.event_log: list[dict[str, Any]] = []
        self.calls: list[tuple[str, Any]] = []
        self._event("granted", "pool", "sft-chat", "fence 2")

    # --- what the test does -------------------------------------------------------------

    def now(self) -> float:
        return self.now_fixed if self.frozen else time.time()

    def enqueue(self, job: str) -> None:
        with self._lock:
            group = self.JOBS[job]
            self.queue[group].append((job, self.now()))
            self._event("registered", group, job, "acquire queued")

    def grant_next(self, group: str = "pool") -> str:
        """The holder yields; the head of the queue is switched in (a switching span, then a held one)."""
        with self._lock:
            now = self.now()
            old = self.holder[group]
            job, _ = self.queue[group].pop(0)
            for span in self.spans:
                if span["group"] == group and span["end"] is None:
                    span["end"] = now - 0.4
            self.spans.append({"group": group, "job": job, "kind": "switching", "start": now - 0.4, "end": now})
            self.spans.append({"group": group, "job": job, "kind": "held", "start": now, "end": None})
            if old is not None:
                self.resident.discard(old)
                self.queue[group].append((old, now))
            self.resident.add(job)
            self.holder[group] = job
            self.held_since[group] = now
            self.fence[group] += 1
            self.switches += 1
            self._event("switch_finished", group, job, f"from {old}")
            self._event("granted", group, job, f"fence {self.fence[group]}")
            return job

    def leave(self, job: str) -> None:
        with self._lock:
            group = self.JOBS[job]
            self.queue[group] = [(j, t) for j, t in self.queue[group] if j != job]
            self._event("exited", group, job, "")

    # --- the DashboardSource interface ---------------------------------------------------

    def _event(self, kind: str, group: str | None, job: str | None, detail: str) -> None:
        self.event_log.append(
            {"id": len(self.event_log) + 1, "t": self.now(), "kind": kind, "group": group, "job": job, "detail": detail}
        )

    def status(self) -> dict[str, Any]:
        with self._lock:
            return self._status()

    def _status(self) -> dict[str, Any]:
        now = self.now()
        footprint = {"rl-math": 24 * MiB, "sft-chat": 20 * MiB, "rl-code": 8 * MiB, "eval-harness": 12 * MiB}
        devices = []
        for index in (0, 1):
            jobs = {}
            for job, group in self.JOBS.items():
                if index == 0 and group == "eval":
                    continue
                if index == 1 and group == "pool" and job != "rl-code":
                    continue
                jobs[job] = {"bytes": footprint[job], "location": "resident" if job in self.resident else "parked"}
            used = sum(j["bytes"] for j in jobs.values() if j["location"] == "resident")
            devices.append({"index": index, "capacity": 64 * MiB, "used": used, "jobs": jobs})
        groups = []
        for name, gpus in (("pool", [0, 1]), ("eval", [1])):
            holder = self.holder[name]
            groups.append(
                {
                    "group": name,
                    "gpus": gpus,
                    "state": "locked" if holder else "idle",
                    "holder": holder,
                    "held_s": now - self.held_since[name] if holder else None,
                    "fence": self.fence[name],
                    "queue": [
                        {
                            "job": j,
                            "waited_s": now - t,
                            "requests": 1,
                            "preempted": i == 0 and name == "pool",
                            "kept_for_s": 12.0 if i == 1 else None,
                        }
                        for i, (j, t) in enumerate(self.queue[name])
                    ],
                    "max_slice_s": 300.0 if name == "pool" else None,
                    "slice_action": "preempt" if name == "pool" else None,
                    "overdue_s": 4.0 if name == "pool" and holder else None,
                    "preemptions": 2 if name == "pool" else 0,
                    "switching_to": None,
                    "grants": self.fence[name],
                    "switches": self.switches if name == "pool" else 0,
                    "bytes_moved": 96 * MiB if name == "pool" else 0,
                    "median_switch_s": 0.42 if name == "pool" else None,
                    "p95_switch_s": 0.61 if name == "pool" else None,
                    "median_wait_s": 3.5,
                    "lock_duty": 0.87,
                    "draining": self.draining[name],
                    "frozen": None,
                    "deferred": 0,
                }
            )
        jobs = [
            {
                "job": job,
                "group": group,
                "location": "resident" if job in self.resident else "parked",
                "faulted": None,
                "sessions": 1,
                "pids": [4242 + i],
                "footprint": {"0": footprint[job]},
                "slices": 3 + i,
                "restores": 1,
                "snapshots": 1,
                "gpu_seconds": 61.5 + i,
                "bytes_moved": 2 * footprint[job],
                "median_wait_s": 2.25,
                "park": "sim",
                "measured": {},
            }
            for i, (job, group) in enumerate(self.JOBS.items())
        ]
        return {
            "node": "node-a",
            "version": "0.1.0",
            "pid": 4000,
            "backend": "sim",
            "parking": status_docs.parking(),
            "addresses": ["/run/timesliced/timesliced.sock"],
            "uptime_s": now - self.t0,
            "connections": 4,
            "counters": status_docs.counters(accepted=4),
            "devices": devices,
            "groups": groups,
            "jobs": jobs,
            "cluster": status_docs.cluster("node-a"),
            "telemetry": status_docs.telemetry(
                *(
                    status_docs.gpu(
                        i,
                        total=64 * MiB,
                        used=devices[i]["used"] + 2 * MiB,
                        duty_now=0.9 if i == 0 else 0.35,
                        duty_window=0.72 if i == 0 else 0.31,
                        processes={str(4242 + i): devices[i]["used"]},
                    )
                    for i in (0, 1)
                )
            ),
            "moves": {
                "recent": [
                    status_docs.move("rl-math", "snapshot", 24 * MiB, 0.2, now),
                    status_docs.move("rl-math", "restore", 24 * MiB, 0.25, now),
                ],
                "jobs": {"rl-math": status_docs.job_moves(2, 1, 1, 48 * MiB, 0.45)},
            },
        }

    def timeline(self, window_s: float) -> dict[str, Any]:
        with self._lock:
            now = self.now()
            return {
                "now": now,
                "window_s": window_s,
                "groups": [{"group": "pool", "gpus": [0, 1]}, {"group": "eval", "gpus": [1]}],
                "spans": [dict(s) for s in self.spans if s["end"] is None or s["end"] >= now - window_s],
            }

    def events(self, after: int, limit: int) -> list[dict[str, Any]]:
        with self._lock:
            return [dict(e) for e in self.event_log if e["id"] > after][:limit]

    def force_release(self, group: str) -> dict[str, Any]:
        with self._lock:
            self.calls.append(("force_release", group))
            if group not in self.holder:
                raise errors.UnknownGroup(f"no group {group!r}")
            job = self.holder[group]
            if job is None:
                raise errors.NotHolder("nobody holds the group")
            self.holder[group] = None
            for span in self.spans:
                if span["group"] == group and span["end"] is None:
                    span["end"] = self.now()
            self._event("admin", group, job, "force-released")
            return {"group": group, "released": job}

    def drain(self, group: str, on: bool) -> dict[str, Any]:
        with self._lock:
            self.calls.append(("drain", (group, on)))
            self.draining[group] = on
            return {"group": group, "draining": on}

    def ready(self) -> bool:
        return True


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
    assert source.calls[-1] == ("drain", ("pool", False))


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
