"""``timesliced bench scale`` at small sizes: what it checks and the shape of its figures (never its speed)."""

from __future__ import annotations

import json

import pytest

from timesliced.bench import scale
from timesliced.cli import main
from timesliced.cluster.messages import Grant, GrantInfo


def test_json_shape_and_every_check_passes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "scale", "--jobs", "4", "40", "--events", "400", "--check", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert set(r) == {
        "nodes",
        "gpus_per_node",
        "per_event_us",
        "per_event_ratio",
        "rebuild_ms",
        "runs",
        "checked_invariants",
        "ok",
    }
    assert r["ok"] and r["checked_invariants"]
    assert set(r["per_event_us"]) == set(r["rebuild_ms"]) == set(r["runs"]) == {"4", "40"}
    assert all(v > 0 for v in [*r["per_event_us"].values(), *r["rebuild_ms"].values(), r["per_event_ratio"]])
    for jobs, run in r["runs"].items():
        assert run["groups"] == int(jobs) // 2
        assert run["events"] >= 400
        assert run["problems"] == [] and run["rebuild_problems"] == []
        # jobs took turns, and every handoff switched (a park and a restore)
        assert run["grants"] > int(jobs) and run["moves"] > run["grants"]


def _run() -> scale._Run:
    job = scale._Job("job-0", "group-0", slot=0, conn=1, gpu=0)
    return scale._Run({"job-0": job}, {(0, 1): job})


def _grant(fence: int) -> Grant:
    return Grant((1, 1), ((1, 7),), GrantInfo("group-0", "job-0", fence, 0.0, 0.0, False, 1))


def test_the_checks_can_fail() -> None:
    run = _run()
    scale._on_message(run, 0, _grant(3))
    assert run.problems == [] and run.holders == {"group-0": "job-0"}
    scale._on_message(run, 0, _grant(4))  # granted again while held
    assert run.problems == ["job-0 granted group-0 while job-0 holds it"]
    run.holders.clear()
    scale._on_message(run, 0, _grant(4))  # a fence that did not increase
    assert run.problems[1:] == ["group-0: fence 4 after 4"]


def test_a_broken_core_is_reported_not_hidden(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_: object) -> None:
        raise ValueError("refused")

    monkeypatch.setattr(scale.Orchestrator, "handle", refuse)
    r = scale.run_scale((2,), events=10)
    assert not r["ok"]
    assert r["runs"]["2"]["problems"][0] == "Register refused: refused"


@pytest.mark.parametrize(("sizes", "events"), [((), 100), ((1,), 100), ((2,), 9)])
def test_refuses_sizes_it_cannot_run(sizes: tuple[int, ...], events: int) -> None:
    with pytest.raises(ValueError):
        scale.run_scale(sizes, events=events)
