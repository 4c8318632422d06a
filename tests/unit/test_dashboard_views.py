"""The dashboard's pure parts: formatting, colours, timeline deltas, and settings make_app refuses."""

from __future__ import annotations

import re
from typing import Any

import pytest

from timesliced.dashboard import fmt_bytes, fmt_duration, job_color, make_app, timeline_delta

MiB = 1 << 20


def test_make_app_refuses_bad_settings() -> None:
    source: Any = object()  # never read while the app is built
    with pytest.raises(ValueError, match="admin_token"):
        make_app(source, admin_token="")
    with pytest.raises(ValueError, match="sse_interval"):
        make_app(source, admin_token=None, sse_interval=0)
    with pytest.raises(ValueError, match="max_streams"):
        make_app(source, admin_token=None, max_streams=0)


def test_job_colours_are_stable_and_differ() -> None:
    assert job_color("sft-chat") == job_color("sft-chat")
    assert re.fullmatch(r"hsl\(\d{1,3}, 62%, (40|48|56)%\)", job_color("rl-math"))
    assert len({job_color(f"job-{i}") for i in range(20)}) > 15
    assert job_color("") == "hsl(61, 62%, 48%)"  # FNV-1a offset basis: pinned, the browser computes the same


def test_formatting() -> None:
    assert [fmt_bytes(n) for n in (None, 0, 1023, 1024, 10 * MiB, 1536 * MiB, 3 << 40)] == [
        "—",
        "0 B",
        "1023 B",
        "1.00 KiB",
        "10.0 MiB",
        "1.50 GiB",
        "3.00 TiB",
    ]
    assert [fmt_duration(s) for s in (None, 0.0004, 0.0123, 0.5, 12.25, 61, 7322)] == [
        "—",
        "0.4 ms",
        "12 ms",
        "500 ms",
        "12.3 s",
        "1 min 01 s",
        "2 h 02 min",
    ]


def test_timeline_delta_keeps_open_and_recently_ended_spans() -> None:
    timeline = {
        "now": 1000.0,
        "window_s": 3600.0,
        "groups": [{"group": "g", "gpus": [0]}],
        "spans": [
            {"group": "g", "job": "a", "kind": "held", "start": 100.0, "end": 200.0},
            {"group": "g", "job": "b", "kind": "held", "start": 800.0, "end": 995.0},
            {"group": "g", "job": "c", "kind": "switching", "start": 995.0, "end": 996.0},
            {"group": "g", "job": "c", "kind": "held", "start": 996.0, "end": None},
        ],
    }
    full = timeline_delta(timeline, 600.0, None)
    assert full["full"] is True and [s["job"] for s in full["spans"]] == ["b", "c", "c"]
    delta = timeline_delta(timeline, 600.0, 998.0)
    assert delta["full"] is False and [(s["job"], s["kind"]) for s in delta["spans"]] == [("c", "held")]
    delta = timeline_delta(timeline, 600.0, 996.5)  # within the slack: the switch span comes again
    assert [(s["job"], s["kind"]) for s in delta["spans"]] == [("c", "switching"), ("c", "held")]
