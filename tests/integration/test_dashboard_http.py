"""The dashboard's HTTP surface over a fake source: pages, JSON API, stream, admin actions, assets.

Each test runs its own event loop (``asyncio.run``) with aiohttp's TestServer / TestClient.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import math
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp import ClientResponse
from aiohttp.test_utils import TestClient, TestServer

from timesliced import errors
from timesliced.dashboard import (
    HUB,
    admin,
    dumps,
    fmt_duration,
    job_color,
    make_app,
    pathseg,
    serve,
)

from ..helpers import status_docs

MiB = 1 << 20
TOKEN = "tok-0123456789abcdef"
NOW = 1_700_000_000.0


@pytest.fixture(autouse=True)
def no_wrong_token_delay(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests try many wrong admin tokens; the delay each costs is tested in tests/unit/test_authz.py."""
    monkeypatch.setattr(admin, "WRONG_TOKEN_DELAY_S", 0.0)


class FakeSource:
    """A DashboardSource that holds its answers and records the admin calls."""

    def __init__(self) -> None:
        self.doc = status_docs.dashboard_status()
        self.spans: list[dict[str, Any]] = [
            {"group": "pool", "job": "rl-math", "kind": "held", "start": NOW - 900, "end": NOW - 700},
            {"group": "pool", "job": "rl-math", "kind": "held", "start": NOW - 300, "end": NOW - 100},
            {"group": "pool", "job": "sft-chat", "kind": "switching", "start": NOW - 100, "end": NOW - 99},
            {"group": "pool", "job": "sft-chat", "kind": "held", "start": NOW - 99, "end": None},
        ]
        self.event_log: list[dict[str, Any]] = [
            {"id": i, "t": NOW - 100 + i, "kind": "granted", "group": "pool", "job": "sft-chat", "detail": f"fence {i}"}
            for i in range(1, 6)
        ]
        self.calls: list[tuple[str, Any]] = []
        self.is_ready = True
        self.fail: dict[str, BaseException] = {}  # method name -> what it raises
        self.release_error: errors.TimeslicedError | None = None

    def _maybe_fail(self, method: str) -> None:
        if method in self.fail:
            raise self.fail[method]

    def add_event(self, kind: str, detail: str = "") -> int:
        event_id = self.event_log[-1]["id"] + 1 if self.event_log else 1
        self.event_log.append({"id": event_id, "t": NOW, "kind": kind, "group": "pool", "job": None, "detail": detail})
        return event_id

    def status(self) -> dict[str, Any]:
        self._maybe_fail("status")
        return copy.deepcopy(self.doc)

    def timeline(self, window_s: float) -> dict[str, Any]:
        self._maybe_fail("timeline")
        self.calls.append(("timeline", window_s))
        return {
            "now": NOW,
            "window_s": window_s,
            "groups": [{"group": "pool", "gpus": [0, 1]}],
            "spans": [dict(s) for s in self.spans if s["end"] is None or s["end"] >= NOW - window_s],
        }

    def events(self, after: int, limit: int) -> list[dict[str, Any]]:
        self._maybe_fail("events")
        return [dict(e) for e in self.event_log if e["id"] > after][:limit]

    def force_release(self, group: str) -> dict[str, Any]:
        self.calls.append(("force_release", group))
        if self.release_error is not None:
            raise self.release_error
        return {"group": group, "released": "sft-chat"}

    def drain(self, group: str, on: bool) -> dict[str, Any]:
        self.calls.append(("drain", (group, on)))
        if group != "pool":
            raise errors.UnknownGroup(f"no group named {group!r}")
        return {"group": group, "draining": on}

    def resume(self, group: str) -> dict[str, Any]:
        self.calls.append(("resume", group))
        if group != "pool":
            raise errors.UnknownGroup(f"no group named {group!r}")
        return {"group": group, "draining": False, "resumed": ["rl-code"], "still_faulted": {}}

    def resume_job(self, job: str) -> dict[str, Any]:
        self.calls.append(("resume_job", job))
        if job == "rl-code":
            return {"job": job, "group": "pool", "location": "resident", "was": "restore failed: out of memory"}
        if job in ("rl-math", "sft-chat"):
            raise errors.BadRequest(f"job {job!r} is not faulted: there is nothing to resume")
        if job == "lost":
            raise errors.JobFaulted("job 'lost' cannot be resumed: its simulated GPU state is faulted")
        raise errors.UnknownJob(f"no job {job!r}")

    def ready(self) -> bool:
        self._maybe_fail("ready")
        return self.is_ready

    def admin_calls(self) -> list[tuple[str, Any]]:
        return [c for c in self.calls if c[0] != "timeline"]


Body = Callable[[Any, FakeSource], Awaitable[None]]  # (TestClient, source)


def run(body: Body, source: FakeSource | None = None, **options: Any) -> FakeSource:
    """Serve ``make_app(source, **options)`` on a loopback port and run ``body(client, source)``."""
    source = source or FakeSource()
    options.setdefault("admin_token", TOKEN)

    async def main() -> None:
        app = make_app(source, **options)
        async with TestClient(TestServer(app)) as client:
            await body(client, source)

    asyncio.run(main())
    return source


async def get_json(client: Any, path: str, status: int = 200) -> Any:
    response = await client.get(path)
    assert response.status == status, (path, response.status, await response.text())
    assert response.content_type == "application/json"
    assert response.headers["Cache-Control"] == "no-store"
    return await response.json()


async def get_raw(client: Any, raw_path: str) -> tuple[int, bytes]:
    """GET a path byte for byte as written (HTTP clients would normalise ``..`` away): (status, body)."""
    reader, writer = await asyncio.open_connection(client.host, client.port)
    try:
        writer.write(f"GET {raw_path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n".encode())
        await writer.drain()
        reply = await asyncio.wait_for(reader.read(), 5)
    finally:
        writer.close()
        await writer.wait_closed()
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def bearer(token: str = TOKEN) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def read_event(response: ClientResponse, timeout: float = 5.0) -> dict[str, Any]:
    """The next message of an event stream: {"event", "id", "data", "retry"} (data parsed as JSON)."""
    while True:
        raw = await asyncio.wait_for(response.content.readuntil(b"\n\n"), timeout)
        fields: dict[str, Any] = {}
        for line in raw.decode().splitlines():
            name, _, value = line.partition(": ")
            fields[name] = value
        if "event" in fields:
            fields["data"] = json.loads(fields["data"])
            return fields


async def read_until(response: ClientResponse, event: str, timeout: float = 5.0) -> dict[str, Any]:
    while True:
        message = await read_event(response, timeout)
        if message["event"] == event:
            return message


# --- pages --------------------------------------------------------------------------------------


def test_overview_page_shows_node_gpus_groups_jobs_and_events() -> None:
    async def body(client: Any, source: FakeSource) -> None:
        response = await client.get("/")
        assert response.status == 200
        assert response.content_type == "text/html"
        assert response.headers["Cache-Control"] == "no-store"
        assert "script-src 'self'" in response.headers["Content-Security-Policy"]
        assert response.headers["X-Content-Type-Options"] == "nosniff"
        html = await response.text()
        for text in ("node-7", "sim-gpu0", "GPU 1", "93%", "61%", "duty 60 s", "pool", "sft-chat", "rl-code"):
            assert text in html, text
        # the memory bar: sft-chat resident (40 of 64 MiB), 8 MiB used by others, rl-math parked
        assert f'fill="{job_color("sft-chat")}" data-job="sft-chat"' in html
        assert 'x="0.0" width="625.0"' in html
        assert '<rect class="seg seg-other" x="625.0" width="125.0"' in html
        assert "48.0 MiB of 64.0 MiB" in html
        assert '<li class="parked"><a class="job" href="/jobs/rl-math">' in html
        # the groups table: holder, held time, queue in order, fence, lock duty
        row = html[html.index('<tr data-group="pool">') :]
        row = row[: row.index("</tr>")]
        assert "12.5 s" in row and ">7<" in row and "87%" in row and "420 ms" in row
        assert row.index("rl-math") < row.index("rl-code")
        assert '<span class="badge faulted" title="restore failed: out of memory">' in html
        assert 'data-after="5"' in html  # the stream resumes after the newest event shown
        assert html.count('<li data-id="') == 5 and "fence 5" in html

    run(body)


def test_group_page_shows_the_lock_queue_and_switch_figures() -> None:
    async def body(client: Any, source: FakeSource) -> None:
        response = await client.get("/groups/pool")
        assert response.status == 200
        html = await response.text()
        assert '<span class="badge state-locked">locked</span>' in html
        assert "<dt>Held for</dt><dd>12.5 s</dd>" in html
        assert "<dt>Fence</dt><dd>7</dd>" in html
        assert "<dt>Draining</dt><dd>no</dd>" in html
        assert "<dt>Median switch</dt><dd>420 ms</dd>" in html
        assert "<dt>p95 switch</dt><dd>900 ms</dd>" in html
        assert "<dt>Bytes moved</dt><dd>160 MiB</dd>" in html
        assert "<dt>Copy rate</dt><dd>0.73 GB/s</dd>" in html  # (200 + 80) MiB in 0.4 s
        assert "<dt>Median queue wait</dt><dd>2.0 s</dd>" in html
        queue = html[html.index('id="group-queue-body"') :]
        queue = queue[: queue.index("</tbody>")]
        assert queue.index("rl-math") < queue.index("rl-code")
        assert "3.3 s" in queue and "1.5 s" in queue
        assert '<span class="badge preempted">preempted</span>' in queue and "turn kept 12.0 s" in queue
        slice_row = html[html.index("<dt>Maximum slice</dt>") :]
        slice_row = slice_row[: slice_row.index("</dd>")]
        assert f"{fmt_duration(300.0)}, then preempt" in slice_row and "overdue 4.0 s" in slice_row
        assert "(2 preempted)" in slice_row
        assert 'data-action="release"' in html and 'class="actions admin-only"' in html
        assert TOKEN not in html

    run(body)


def test_group_page_without_admin_token_has_no_action_buttons() -> None:
    async def body(client: Any, source: FakeSource) -> None:
        html = await (await client.get("/groups/pool")).text()
        assert 'data-action="release"' not in html and 'id="admin"' not in html

    run(body, admin_token=None)


def test_group_page_shows_draining_and_deferred() -> None:
    source = FakeSource()
    source.doc["groups"][0].update(draining=True, deferred=3)

    async def body(client: Any, source: FakeSource) -> None:
        html = await (await client.get("/groups/pool")).text()
        assert '<span class="badge draining">draining</span>' in html
        assert '<span class="badge deferred">3 deferred</span>' in html
        assert "<dd>yes (3 requests deferred)</dd>" in html

    run(body, source)


def test_job_page_shows_lock_state_memory_processes_and_moves() -> None:
    async def body(client: Any, source: FakeSource) -> None:
        html = await (await client.get("/jobs/rl-math")).text()
        assert '<span class="badge loc-parked">parked</span>' in html
        assert '<span class="badge lock-waiting">waiting #1</span>' in html
        assert "waiting, #1 in the queue, for 3.3 s" in html
        assert "in host memory (parked)" in html
        assert "<dt>Parking method</dt><dd>sim</dd>" in html
        assert "<dt>Snapshots / restores</dt><dd>3 / 2</dd>" in html
        assert "<dt>GPU time held</dt><dd>33.0 s</dd>" in html
        assert '<td>GPU 0</td><td class="num">40.0 MiB</td>' in html
        assert "41.0 MiB" in html  # measured
        assert '<td class="num">5001</td><td>GPU 0: 0 B</td>' in html
        assert "<td>snapshot</td>" in html and "0.84 GB/s" in html
        assert "<dt>Moves</dt><dd>5</dd>" in html
        html = await (await client.get("/jobs/sft-chat")).text()
        assert "holding it for 12.5 s" in html and "cuda-checkpoint" in html
        assert "GPU 0: 40.0 MiB" in html
        html = await (await client.get("/jobs/rl-code")).text()
        assert '<dd class="fault">restore failed: out of memory</dd>' in html
        assert "no processes registered" in html

    run(body)


def test_timeline_page_embeds_the_window() -> None:
    async def body(client: Any, source: FakeSource) -> None:
        html = await (await client.get("/timeline")).text()
        assert '<option value="600" selected>10 min</option>' in html
        data = json.loads(re.search(r'<script id="timeline-data" type="application/json">(.*?)</script>', html)[1])  # type: ignore[index]
        assert data["window_s"] == 600 and data["full"] is True
        assert len(data["spans"]) == 3  # the span that ended 700 s ago is outside
        html = await (await client.get("/timeline?window=1800")).text()
        assert '<option value="1800" selected>30 min</option>' in html
        html = await (await client.get("/timeline?window=45")).text()
        assert '<option value="45" selected>45 s</option>' in html
        for bad in ("5", "90000", "abc", "nan"):
            response = await client.get(f"/timeline?window={bad}")
            assert response.status == 400 and response.content_type == "text/html"

    run(body)


def test_timeline_json_cannot_end_its_script_element() -> None:
    source = FakeSource()
    source.spans.append(
        {"group": "pool", "job": "</script><script>alert(1)</script>", "kind": "held", "start": NOW, "end": None}
    )

    async def body(client: Any, source: FakeSource) -> None:
        html = await (await client.get("/timeline")).text()
        assert "<script>alert(1)" not in html
        data = json.loads(re.search(r'<script id="timeline-data" type="application/json">(.*?)</script>', html)[1])  # type: ignore[index]
        assert data["spans"][-1]["job"] == "</script><script>alert(1)</script>"

    run(body, source)


def test_unknown_group_and_job_pages_are_404_pages() -> None:
    async def body(client: Any, source: FakeSource) -> None:
        for path, text in (
            ("/groups/nope", "no group named"),
            ("/jobs/nope", "no job named"),
            ("/nothing", "nothing at"),
        ):
            response = await client.get(path)
            assert response.status == 404, path
            assert response.content_type == "text/html"
            html = await response.text()
            assert text in html and "Back to the overview" in html
        html = await (await client.get("/groups/%3Cimg%20src=x%3E")).text()
        assert "<img src=x>" not in html and "&lt;img src=x&gt;" in html

    run(body)


def test_names_with_odd_characters_link_and_resolve() -> None:
    source = FakeSource()
    source.doc["jobs"][0]["job"] = "team/a b?"
    source.doc["groups"][0]["queue"][0]["job"] = "team/a b?"

    async def body(client: Any, source: FakeSource) -> None:
        html = await (await client.get("/")).text()
        assert f'href="/jobs/{pathseg("team/a b?")}"' in html and "team%2Fa%20b%3F" in html
        response = await client.get("/jobs/team%2Fa%20b%3F")
        assert response.status == 200
        job = await get_json(client, "/api/v1/jobs/team%2Fa%20b%3F")
        assert job["job"] == "team/a b?"

    run(body, source)


# --- the JSON API ----------------------------------------------------------------------------


def test_api_shapes() -> None:
    async def body(client: Any, source: FakeSource) -> None:
        assert await get_json(client, "/api/v1/status") == status_docs.dashboard_status()
        nodes = await get_json(client, "/api/v1/nodes")
        assert len(nodes) == 1 and nodes[0]["node"] == "node-7" and nodes[0]["gpus"] == 2
        assert "groups" not in nodes[0] and nodes[0]["backend"] == "sim"
        devices = await get_json(client, "/api/v1/devices")
        assert [d["index"] for d in devices] == [0, 1]
        assert devices[0]["jobs"]["sft-chat"]["location"] == "resident"
        assert devices[0]["telemetry"]["name"] == "sim-gpu0"
        groups = await get_json(client, "/api/v1/groups")
        assert [g["group"] for g in groups] == ["pool"]
        group = await get_json(client, "/api/v1/groups/pool")
        assert group["holder"] == "sft-chat" and [w["job"] for w in group["queue"]] == ["rl-math", "rl-code"]
        assert group["members"] == ["rl-math", "sft-chat", "rl-code"]
        assert group["gbps"] == pytest.approx(280 * MiB / 0.4 / 1e9)
        jobs = await get_json(client, "/api/v1/jobs")
        assert [j["job"] for j in jobs] == ["rl-math", "sft-chat", "rl-code"]
        job = await get_json(client, "/api/v1/jobs/rl-math")
        assert job["lock"] == {"state": "waiting", "position": 1, "waited_s": 3.25, "held_s": None}
        assert job["residency"] == [{"gpu": 0, "bytes": 40 * MiB, "location": "parked"}]
        assert job["processes"] == [{"pid": 5001, "gpus": {"0": 0}}]
        assert [m["kind"] for m in job["moves"]["recent"]] == ["snapshot"]
        assert job["moves"]["summary"]["count"] == 5
        job = await get_json(client, "/api/v1/jobs/sft-chat")
        assert job["lock"]["state"] == "holding" and job["lock"]["held_s"] == 12.5
        timeline = await get_json(client, "/api/v1/timeline")
        assert timeline["window_s"] == 600 and timeline["now"] == NOW and len(timeline["spans"]) == 3
        timeline = await get_json(client, "/api/v1/timeline?window=86400")
        assert len(timeline["spans"]) == 4
        events = await get_json(client, "/api/v1/events")
        assert [e["id"] for e in events] == [1, 2, 3, 4, 5] and events[0]["kind"] == "granted"
        events = await get_json(client, "/api/v1/events?after=2&limit=2")
        assert [e["id"] for e in events] == [3, 4]
        assert await get_json(client, "/api/v1/events?after=99") == []

    run(body)


def test_api_advice_is_the_advisors_document_and_says_what_history_is_missing() -> None:
    async def body(client: Any, source: FakeSource) -> None:
        advice = await get_json(client, "/api/v1/advice")
        assert set(advice) >= {"current", "suggested", "missing", "message", "min_phases"}
        assert advice["min_phases"] == 5 and advice["message"] and advice["suggested"] == []
        assert {m["job"] for m in advice["missing"]} == {"rl-math", "sft-chat", "rl-code"}  # no phases yet
        assert (await get_json(client, "/api/v1/advice?min_phases=2"))["min_phases"] == 2

    run(body)


def test_api_unknown_names_and_routes_are_404_json() -> None:
    async def body(client: Any, source: FakeSource) -> None:
        error = await get_json(client, "/api/v1/groups/nope", 404)
        assert error["error"]["code"] == "unknown_group" and "nope" in error["error"]["message"]
        error = await get_json(client, "/api/v1/jobs/nope", 404)
        assert error["error"]["code"] == "unknown_job"
        error = await get_json(client, "/api/v1/nothing", 404)
        assert error["error"]["code"] == "not_found"
        response = await client.post("/api/v1/status")
        assert response.status == 405 and (await response.json())["error"]["code"] == "method_not_allowed"
        assert "GET" in response.headers["Allow"]

    run(body)


@pytest.mark.parametrize(
    "query",
    [
        "timeline?window=5",
        "timeline?window=86401",
        "timeline?window=abc",
        "timeline?window=nan",
        "timeline?window=inf",
        "timeline?window=",
        "events?after=-1",
        "events?after=x",
        "events?after=1.5",
        "events?limit=0",
        "events?limit=1001",
        "events?limit=ten",
        "advice?min_phases=0",
        "advice?min_phases=x",
        "stream?after=-3",
        "stream?timeline=1",
    ],
)
def test_api_bad_parameters_are_400_json(query: str) -> None:
    async def body(client: Any, source: FakeSource) -> None:
        error = await get_json(client, f"/api/v1/{query}", 400)
        assert error["error"]["code"] == "bad_request" and error["error"]["message"]

    run(body)


def test_api_limits_are_inclusive() -> None:
    async def body(client: Any, source: FakeSource) -> None:
        await get_json(client, "/api/v1/timeline?window=10")
        await get_json(client, "/api/v1/timeline?window=86400")
        await get_json(client, "/api/v1/events?limit=1000")
        await get_json(client, "/api/v1/events?limit=1")

    run(body)


def test_non_finite_numbers_become_null() -> None:
    source = FakeSource()
    source.doc["groups"][0]["lock_duty"] = math.nan
    source.doc["groups"][0]["held_s"] = math.inf

    async def body(client: Any, source: FakeSource) -> None:
        response = await client.get("/api/v1/groups/pool")
        text = await response.text()
        assert "NaN" not in text and "Infinity" not in text
        group = json.loads(text)
        assert group["lock_duty"] is None and group["held_s"] is None
        assert (await client.get("/groups/pool")).status == 200

    run(body, source)
    assert dumps({"a": [1.5, math.nan, {2: -math.inf}]}) == b'{"a":[1.5,null,{"2":null}]}'
    assert dumps({"s": {3, 1}}) == b'{"s":[1,3]}'


# --- admin actions ------------------------------------------------------------------------


ACTIONS = [
    ("release", ("force_release", "pool")),
    ("drain", ("drain", ("pool", True))),
    ("resume", ("resume", "pool")),
]


def test_admin_actions_are_disabled_without_a_configured_token() -> None:
    async def body(client: Any, source: FakeSource) -> None:
        for action, _ in ACTIONS:
            for headers in ({}, bearer()):
                response = await client.post(f"/api/v1/groups/pool/{action}", headers=headers)
                assert response.status == 403
                error = (await response.json())["error"]
                assert error["code"] == "admin_disabled" and "without an admin token" in error["message"]
        assert await get_json(client, "/api/v1/admin") == {"enabled": False, "authorized": None}
        assert source.admin_calls() == []

    run(body, admin_token=None)


def test_admin_actions_need_the_right_bearer_token() -> None:
    async def body(client: Any, source: FakeSource) -> None:
        for action, _ in ACTIONS:
            response = await client.post(f"/api/v1/groups/pool/{action}")
            assert response.status == 401
            assert response.headers["WWW-Authenticate"].startswith("Bearer")
            assert (await response.json())["error"]["code"] == "unauthorized"
            for header in (
                f"Bearer {TOKEN}x",
                "Bearer tok",
                f"Basic {TOKEN}",
                "Bearer",
                TOKEN,
                f"Bearer  {TOKEN[:-1]}",
            ):
                response = await client.post(f"/api/v1/groups/pool/{action}", headers={"Authorization": header})
                assert response.status == 403, header
                error = (await response.json())["error"]
                assert error["code"] == "permission_denied" and TOKEN not in error["message"]
        assert source.admin_calls() == []
        for action, call in ACTIONS:
            response = await client.post(f"/api/v1/groups/pool/{action}", headers=bearer())
            assert response.status == 200, await response.text()
            reply = await response.json()
            assert source.admin_calls()[-1] == call
            assert (
                reply
                == {
                    "release": {"group": "pool", "released": "sft-chat"},
                    "drain": {"group": "pool", "draining": True},
                    "resume": {"group": "pool", "draining": False, "resumed": ["rl-code"], "still_faulted": {}},
                }[action]
            )
        assert len(source.admin_calls()) == 3
        assert await get_json(client, "/api/v1/admin") == {"enabled": True, "authorized": None}
        assert (await (await client.get("/api/v1/admin", headers=bearer())).json())["authorized"] is True
        assert (await (await client.get("/api/v1/admin", headers=bearer("no"))).json())["authorized"] is False

    run(body)


def test_admin_errors_map_to_http_statuses() -> None:
    source = FakeSource()

    async def body(client: Any, source: FakeSource) -> None:
        for error, status in (
            (errors.UnknownGroup("no group named 'x'"), 404),
            (errors.NotHolder("nobody holds 'pool'"), 409),
            (errors.BadRequest("bad group name"), 400),
            (errors.BackendError("snapshot failed"), 500),
        ):
            source.release_error = error
            response = await client.post("/api/v1/groups/pool/release", headers=bearer())
            assert response.status == status
            assert (await response.json())["error"] == {"code": error.code, "message": error.message}
        response = await client.post("/api/v1/groups/other/drain", headers=bearer())
        assert response.status == 404 and (await response.json())["error"]["code"] == "unknown_group"

    run(body, source)


def test_resuming_a_faulted_job_needs_the_token_and_says_why_it_cannot() -> None:
    async def body(client: Any, source: FakeSource) -> None:
        response = await client.post("/api/v1/jobs/rl-code/resume")
        assert response.status == 401 and source.admin_calls() == []
        response = await client.post("/api/v1/jobs/rl-code/resume", headers=bearer())
        assert response.status == 200
        assert (await response.json()) == {
            "job": "rl-code",
            "group": "pool",
            "location": "resident",
            "was": "restore failed: out of memory",
        }
        for job, status, code in (
            ("rl-math", 400, "bad_request"),  # not faulted
            ("lost", 409, "job_faulted"),  # its state is gone: it cannot be resumed
            ("nobody", 404, "unknown_job"),
        ):
            response = await client.post(f"/api/v1/jobs/{job}/resume", headers=bearer())
            assert response.status == status, job
            assert (await response.json())["error"]["code"] == code
        assert [c for c in source.admin_calls()] == [
            ("resume_job", "rl-code"),
            ("resume_job", "rl-math"),
            ("resume_job", "lost"),
            ("resume_job", "nobody"),
        ]

    run(body)


def test_admin_posts_refuse_form_bodies() -> None:
    async def body(client: Any, source: FakeSource) -> None:
        url = "/api/v1/groups/pool/release"
        # what a cross-site form can send: no Authorization header at all
        response = await client.post(url, data={"a": "b"})
        assert response.status == 401
        # even with the token, only JSON bodies
        for data, content_type in (("a=b", "application/x-www-form-urlencoded"), ("hi", "text/plain")):
            response = await client.post(url, data=data, headers={**bearer(), "Content-Type": content_type})
            assert response.status == 415, content_type
        response = await client.post(url, data="{nope", headers={**bearer(), "Content-Type": "application/json"})
        assert response.status == 400
        response = await client.post(url, data="[1]", headers={**bearer(), "Content-Type": "application/json"})
        assert response.status == 400
        assert source.admin_calls() == []
        response = await client.post(url, json={}, headers=bearer())
        assert response.status == 200 and source.admin_calls() == [("force_release", "pool")]
        response = await client.get(url, headers=bearer())
        assert response.status == 405

    run(body)


def test_the_token_is_never_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)

    async def body(client: Any, source: FakeSource) -> None:
        await client.post("/api/v1/groups/pool/release", headers=bearer())
        await client.post("/api/v1/groups/pool/release", headers=bearer(TOKEN + "wrong"))
        source.release_error = errors.BackendError("snapshot failed")
        await client.post("/api/v1/groups/pool/release", headers=bearer())

    run(body)
    assert any("admin release" in r.getMessage() for r in caplog.records)
    assert all(TOKEN not in r.getMessage() for r in caplog.records)


# --- live updates -------------------------------------------------------------------------


def test_stream_sends_status_events_and_timeline_then_ends_at_shutdown() -> None:
    async def main() -> None:
        source = FakeSource()
        server = TestServer(make_app(source, admin_token=TOKEN, sse_interval=0.05))
        async with TestClient(server) as client:
            response = await client.get("/api/v1/stream?after=3&timeline=600")
            assert response.status == 200
            assert response.headers["Content-Type"] == "text/event-stream"
            assert response.headers["Cache-Control"] == "no-store"
            hello = await read_event(response)
            assert hello["event"] == "hello"
            assert hello["data"] == {"interval_s": 0.05, "after": 3, "timeline_window_s": 600.0}
            status = await read_event(response)
            assert status["event"] == "status" and status["data"] == status_docs.dashboard_status()
            timeline = await read_event(response)
            assert timeline["event"] == "timeline" and timeline["data"]["full"] is True
            assert len(timeline["data"]["spans"]) == 3
            events = await read_event(response)
            assert events["event"] == "events" and events["id"] == "5"
            assert [e["id"] for e in events["data"]["events"]] == [4, 5]
            # later ticks: status every interval, new events, timeline deltas
            source.doc["groups"][0]["holder"] = "rl-math"
            status = await read_until(response, "status")
            assert status["data"]["groups"][0]["holder"] == "rl-math"
            source.add_event("released", "by the holder")
            events = await read_until(response, "events")
            assert events["id"] == "6" and [e["kind"] for e in events["data"]["events"]] == ["released"]
            delta = await read_until(response, "timeline")
            assert delta["data"]["full"] is False
            assert [s["end"] for s in delta["data"]["spans"]] == [None]  # only the open span
            assert server.app is not None and server.app[HUB].streams == 1
            # shutting down ends the stream at once (the runner would otherwise wait 60 s)
            closing = asyncio.create_task(server.close())
            rest = await asyncio.wait_for(response.content.read(), 5)
            assert response.content.at_eof()
            await asyncio.wait_for(closing, 5)
            assert b"event: status" in rest or rest == b"" or rest.startswith(b"event")

    asyncio.run(main())


def test_stream_resumes_from_last_event_id_and_starts_at_the_newest_without_it() -> None:
    async def body(client: Any, source: FakeSource) -> None:
        response = await client.get("/api/v1/stream?after=1", headers={"Last-Event-ID": "4"})
        hello = await read_event(response)
        assert hello["data"]["after"] == 4 and hello["data"]["timeline_window_s"] is None
        events = await read_until(response, "events")
        assert [e["id"] for e in events["data"]["events"]] == [5]
        response.close()
        response = await client.get("/api/v1/stream")
        hello = await read_event(response)
        assert hello["data"]["after"] == 5  # no backlog: the page already shows the recent events
        source.add_event("admin", "drained")
        events = await read_until(response, "events")
        assert [e["id"] for e in events["data"]["events"]] == [6]
        response.close()

    run(body, sse_interval=0.05)


def test_stream_reports_source_failures_and_goes_on() -> None:
    async def body(client: Any, source: FakeSource) -> None:
        response = await client.get("/api/v1/stream")
        await read_until(response, "status")
        source.fail["status"] = RuntimeError("boom")
        problem = await read_until(response, "problem")
        assert problem["data"]["error"]["code"] == "internal" and "boom" not in problem["data"]["error"]["message"]
        del source.fail["status"]
        await read_until(response, "status")
        response.close()
        # a stream that starts while the source fails says so, then carries on
        source.fail["status"] = errors.BackendError("telemetry went away")
        response = await client.get("/api/v1/stream?timeline=60")
        assert (await read_event(response))["event"] == "hello"
        problem = await read_event(response)
        assert problem["event"] == "problem"
        assert problem["data"]["error"] == {"code": "backend_error", "message": "telemetry went away"}
        del source.fail["status"]
        await read_until(response, "status")
        timeline = await read_until(response, "timeline")
        assert timeline["data"]["full"] is True  # it never had the first one
        response.close()

    run(body, sse_interval=0.05)


def test_stream_count_is_capped_and_released_by_disconnects() -> None:
    async def main() -> None:
        source = FakeSource()
        app = make_app(source, admin_token=None, sse_interval=0.05, max_streams=2)
        async with TestClient(TestServer(app)) as client:
            first = await client.get("/api/v1/stream")
            second = await client.get("/api/v1/stream")
            await read_event(first)
            await read_event(second)
            third = await client.get("/api/v1/stream")
            assert third.status == 503 and third.headers["Retry-After"]
            assert (await third.json())["error"]["code"] == "limit_exceeded"
            assert (await client.get("/api/v1/status")).status == 200  # the rest keeps serving
            first.close()
            for _ in range(200):  # the server notices at its next write
                if app[HUB].streams < 2:
                    break
                await asyncio.sleep(0.02)
            assert app[HUB].streams == 1
            again = await client.get("/api/v1/stream")
            assert again.status == 200 and (await read_event(again))["event"] == "hello"
            again.close()
            second.close()

    asyncio.run(main())


def test_serve_binds_a_free_port_and_stops_promptly_with_a_stream_open() -> None:
    async def main() -> None:
        source = FakeSource()
        runner, (host, port) = await serve(make_app(source, admin_token=None), "127.0.0.1", 0, shutdown_timeout=60)
        assert host == "127.0.0.1" and port > 0
        from aiohttp import ClientSession

        async with ClientSession() as session:
            async with session.get(f"http://{host}:{port}/healthz") as response:
                assert response.status == 200
            async with session.get(f"http://{host}:{port}/api/v1/stream") as stream:
                await read_event(stream)
                started = time.monotonic()
                await asyncio.wait_for(runner.cleanup(), 10)
                assert time.monotonic() - started < 10  # not the 60 s shutdown timeout
                await asyncio.wait_for(stream.content.read(), 5)

    asyncio.run(main())


# --- metrics, probes, assets, failures -------------------------------------------------------


def test_metrics_passthrough_and_404_without() -> None:
    seen: list[str | None] = []

    def metrics(accept: str | None) -> tuple[bytes, str]:
        seen.append(accept)
        return b"# HELP x y\nx 1\n", "text/plain; version=0.0.4; charset=utf-8"

    async def body(client: Any, source: FakeSource) -> None:
        response = await client.get("/metrics", headers={"Accept": "application/openmetrics-text"})
        assert response.status == 200
        assert response.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
        assert await response.read() == b"# HELP x y\nx 1\n"

    run(body, metrics=metrics)
    assert seen == ["application/openmetrics-text"]

    async def without(client: Any, source: FakeSource) -> None:
        assert (await client.get("/metrics")).status == 404

    run(without)


def test_healthz_and_readyz() -> None:
    async def body(client: Any, source: FakeSource) -> None:
        response = await client.get("/healthz")
        assert response.status == 200 and await response.text() == "ok\n"
        assert (await client.get("/readyz")).status == 200
        source.is_ready = False
        response = await client.get("/readyz")
        assert response.status == 503
        assert (await client.get("/healthz")).status == 200

    run(body)


def test_static_assets_have_their_content_types_and_etags() -> None:
    async def body(client: Any, source: FakeSource) -> None:
        for name, content_type in (
            ("dashboard.css", "text/css"),
            ("dashboard.js", "text/javascript"),
            ("favicon.svg", "image/svg+xml"),
        ):
            response = await client.get(f"/static/{name}")
            assert response.status == 200 and response.content_type == content_type, name
            assert response.headers["X-Content-Type-Options"] == "nosniff"
            etag = response.headers["ETag"]
            again = await client.get(f"/static/{name}", headers={"If-None-Match": etag})
            assert again.status == 304
        js = await (await client.get("/static/dashboard.js")).text()
        assert "http://" not in js and "https://" not in js  # nothing is fetched from elsewhere

    run(body)


@pytest.mark.parametrize(
    "path",
    [
        "/static/../timesliced/dashboard/app.py",
        "/static/%2e%2e/timesliced/dashboard/app.py",
        "/static/..%2ftimesliced%2fdashboard%2fapp.py",
        "/static/%2e%2e%2ftimesliced%2fdashboard%2fapp.py",
        "/static/%2e%2e%2f%2e%2e%2f%2e%2e%2fetc%2fpasswd",
        "/static/..%5c..%5ctimesliced%5cdashboard%5capp.py",
        "/static//etc/passwd",
        "/static/%2fetc%2fpasswd",
        "/static/README.md",
        "/static/__init__.py",
        "/static/",
        "/static/dashboard.js%00.py",
        "/static/DASHBOARD.JS",
    ],
)
def test_static_paths_outside_the_known_files_are_404(path: str) -> None:
    async def body(client: Any, source: FakeSource) -> None:
        status, body = await get_raw(client, path)
        assert status == 404, path
        assert b"def make_app" not in body and b"root:" not in body

    run(body)


def test_a_raising_source_gives_500_and_the_next_request_works(caplog: pytest.LogCaptureFixture) -> None:
    async def body(client: Any, source: FakeSource) -> None:
        source.fail["status"] = RuntimeError("kaput")
        error = await get_json(client, "/api/v1/status", 500)
        assert error["error"]["code"] == "internal" and "kaput" not in error["error"]["message"]
        response = await client.get("/")
        assert response.status == 500 and response.content_type == "text/html"
        source.fail["timeline"] = errors.BackendError("telemetry went away")
        error = await get_json(client, "/api/v1/timeline", 500)
        assert error["error"] == {"code": "backend_error", "message": "telemetry went away"}
        source.fail["ready"] = RuntimeError("no")
        assert (await client.get("/readyz")).status == 500
        source.fail.clear()
        assert (await get_json(client, "/api/v1/status"))["node"] == "node-7"
        assert (await client.get("/")).status == 200

    run(body)
    assert any("kaput" in (r.exc_text or "") or r.exc_info for r in caplog.records if r.levelno >= logging.ERROR)


# --- pure helpers -----------------------------------------------------------------------------
