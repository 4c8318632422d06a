"""The Grafana dashboard (``packaging/grafana/timesliced.json``) asks only for what the daemon exports.

Every metric and label name in its PromQL is checked against a real daemon's ``/metrics`` scrape,
taken after a switch so that the histograms, the move counters and the per-job series exist, and
against the collector's own families without a daemon. The checker is shown to catch a misspelled
metric, a misspelled label and a label the daemon's series do not carry.
"""

from __future__ import annotations

import copy
import json
import re
import threading
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

import timesliced
from timesliced.daemon.embedded import EmbeddedDaemon
from timesliced.metrics import Metrics

from ..helpers.promql import dashboard_queries, legend_labels, parse, problems, used_metrics

DASHBOARD = Path(__file__).resolve().parents[2] / "packaging" / "grafana" / "timesliced.json"
METRICS_PAGE = Path(__file__).resolve().parents[2] / "docs" / "guide" / "metrics.md"
MiB = 1 << 20

# What the issue asks the dashboard to show, as the metrics that carry it.
REQUIRED = {
    "queue depth": "timesliced_group_queue_depth",
    "waits": "timesliced_acquire_wait_seconds_bucket",
    "switch durations": "timesliced_switch_duration_seconds_bucket",
    "GB/s": "timesliced_move_bytes_total",
    "GPU duty": "timesliced_gpu_duty_ratio",
    "GPU memory": "timesliced_gpu_memory_used_bytes",
    "per-job GPU-seconds": "timesliced_job_gpu_seconds_total",
}


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())  # type: ignore[no-any-return]


def scraped(text: str) -> dict[str, set[str]]:
    """Sample name -> the label names its samples carry, from an exposition."""
    names: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            names.setdefault(sample.name, set()).update(sample.labels)
    return names


def collector_names() -> dict[str, set[str]]:
    """The sample names the daemon's registry can export, from its families alone (no labels known)."""
    metrics = Metrics(dict, node="n")
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "info": ("_info",)}
    names: dict[str, set[str]] = {}
    for family in [*metrics.collector.describe(), *metrics.registry.collect()]:
        for suffix in suffixes.get(family.type, ("",)):
            names.setdefault(family.name + suffix, set())
    return names


@pytest.fixture(scope="module")
def exported() -> dict[str, set[str]]:
    """A real daemon's scrape after b's grant parked a and a's next grant restored it."""
    with (
        EmbeddedDaemon(gpus=1, gpu_memory=64 * MiB, bandwidth=0, web=("127.0.0.1", 0), park_every_handoff=True) as d,
        timesliced.Client(job="a", group="g", address=d.socket) as a,
        timesliced.Client(job="b", group="g", address=d.socket) as b,
    ):
        a.acquire(timeout=10)
        a.sim_alloc(8 * MiB)
        a.release()
        b.acquire(timeout=10)  # parks a
        b.sim_alloc(8 * MiB)
        got: list[Any] = []
        waiter = threading.Thread(target=lambda: got.append(a.acquire(timeout=10)))
        waiter.start()
        b.release()  # a's grant parks b and restores a
        waiter.join(15)
        assert got and got[0].restored, "the handoff did not move state; the scrape would lack the move series"
        assert d.web_url is not None
        with urllib.request.urlopen(d.web_url.rstrip("/") + "/metrics", timeout=10) as response:
            text = response.read().decode()
        a.release()
    return scraped(text)


@pytest.mark.slow
def test_every_metric_and_label_of_the_dashboard_is_in_a_real_scrape(exported: dict[str, set[str]]) -> None:
    assert problems(dashboard(), exported) == []


@pytest.mark.slow
def test_the_scrape_has_what_the_issue_asks_to_show(exported: dict[str, set[str]]) -> None:
    assert set(REQUIRED.values()) <= exported.keys()


def test_every_metric_of_the_dashboard_is_one_the_collector_exports() -> None:
    assert problems(dashboard(), collector_names(), labels=False) == []


def test_the_dashboard_shows_what_the_issue_asks_for() -> None:
    used = used_metrics(dashboard())
    assert {what: name for what, name in REQUIRED.items() if name not in used} == {}


def test_a_misspelled_metric_is_caught() -> None:
    broken = copy.deepcopy(dashboard())
    target = broken["panels"][1]["targets"][0]
    assert "timesliced_group_queue_depth" in target["expr"]
    target["expr"] = target["expr"].replace("timesliced_group_queue_depth", "timesliced_group_queue_dept")
    assert problems(broken, collector_names(), labels=False) == [
        "panel 'Queue depth' target A: timesliced_group_queue_dept is not a metric the daemon exports"
    ]


def test_a_label_the_series_lack_is_caught() -> None:
    exported = {"timesliced_group_queue_depth": {"group"}, "timesliced_info": {"node", "version", "backend"}}
    misspelled = 'sum by (gruop) (timesliced_group_queue_depth{job="x"})'
    board = {
        "panels": [
            {"title": "p", "targets": [{"refId": "A", "expr": misspelled}]},
            {"title": "q", "targets": [{"refId": "A", "expr": "timesliced_info", "legendFormat": "{{gpu}}"}]},
        ]
    }
    assert problems(board, exported) == [
        "panel 'p' target A: label 'gruop' is on none of timesliced_group_queue_depth",
        "panel 'q' target A: label 'gpu' is on none of timesliced_info",
    ]


def test_a_series_job_label_reaches_prometheus_as_exported_job() -> None:
    """Without honor_labels the target's job wins: a panel must group by exported_job."""
    exported = {"timesliced_job_gpu_seconds_total": {"job", "group"}}

    def board(label: str) -> dict[str, Any]:
        expr = f"sum by ({label}) (rate(timesliced_job_gpu_seconds_total[5m]))"
        return {"panels": [{"title": "p", "targets": [{"refId": "A", "expr": expr}]}]}

    assert problems(board("exported_job"), exported) == []
    assert problems(board("exported_group"), exported) == [
        "panel 'p' target A: label 'exported_group' is on none of timesliced_job_gpu_seconds_total"
    ]


@pytest.mark.parametrize(
    ("expr", "metrics", "matched", "grouped"),
    [
        ("up", ["up"], set(), set()),
        ('rate(a_total{x="1", y=~"$v"}[$__rate_interval])', ["a_total"], {"x", "y"}, set()),
        (
            "histogram_quantile(0.95, sum by (le, g) (rate(h_bucket[5m])))",
            ["h_bucket"],
            set(),
            {"le", "g"},
        ),
        ("sum(a) by (k) / on (k) group_left (m) b offset 1h", ["a", "b"], set(), {"k", "m"}),
        ("a > bool 1e9 and b unless c", ["a", "b", "c"], set(), set()),
        ('sort_desc(max(x{l="a,b}"}) == 1)', ["x"], {"l"}, set()),
    ],
)
def test_the_tokenizer_tells_names_from_the_words_around_them(
    expr: str, metrics: list[str], matched: set[str], grouped: set[str]
) -> None:
    query = parse(expr)
    assert (query.metrics, query.matched, query.grouped) == (metrics, matched, grouped)


def test_an_unreadable_expression_is_refused() -> None:
    with pytest.raises(ValueError, match="unclosed"):
        parse("rate(x[5m)")
    with pytest.raises(ValueError, match="cannot read"):
        parse("x @@ y")
    assert legend_labels("{{ a }} on {{b}}") == {"a", "b"}


def test_the_metrics_page_documents_every_family_and_no_other() -> None:
    """docs/guide/metrics.md has a table row for each family the daemon exports, and names no other."""
    families = {family.name for family in Metrics(dict, node="n").registry.collect()}
    families = {"timesliced_info" if name == "timesliced" else name for name in families}
    text = METRICS_PAGE.read_text()
    rows = set(re.findall(r"^\| `(timesliced_[a-z_]+)` \|", text, re.M))
    named = {n for n in re.findall(r"\b(timesliced_[a-z_]+)", text)}
    exposed = set(collector_names())
    assert (sorted(families - rows), sorted(rows - families)) == ([], [])
    assert sorted(n for n in named if n not in families and n not in exposed) == []


def test_the_dashboard_is_well_formed() -> None:
    """What Grafana needs to lay it out: unique ids, rows of 24 columns without overlaps, one data source."""
    board = dashboard()
    panels = board["panels"]
    ids = [p["id"] for p in panels]
    assert len(set(ids)) == len(ids)
    cells: set[tuple[int, int]] = set()
    for p in panels:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"panel {p['title']!r} overlaps another"
        cells |= mine
        refs = [t["refId"] for t in p.get("targets", [])]
        assert len(set(refs)) == len(refs), p["title"]
        for source in [p.get("datasource"), *(t.get("datasource") for t in p.get("targets", []))]:
            assert source in (None, {"type": "prometheus", "uid": "${datasource}"}), p["title"]
        if p["type"] != "row":
            assert p["targets"] and p["description"], p["title"]
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    used = {name for _, expr, _, _ in dashboard_queries(board) for name in re.findall(r"\$(\w+)", expr)}
    assert used - {"__rate_interval", "__range"} <= variables.keys()
