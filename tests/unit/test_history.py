"""The group history behind the dashboard's timeline and event log."""

from __future__ import annotations

from timesliced.core.history import GroupView, History


def view(holder: str | None = None, switching_to: str | None = None, name: str = "g") -> GroupView:
    return GroupView(name, (0, 1), holder, switching_to)


def test_holders_and_switches_become_spans_and_events() -> None:
    h = History()
    h.observe([view()], 0.0)
    h.observe([view("a")], 1.0)
    h.observe([view("a")], 2.0)  # nothing changed: nothing recorded
    h.observe([view(None, "b")], 3.0)
    h.observe([view("b")], 3.5)
    spans = [(s.job, s.kind, s.start, s.end) for s in h.spans]
    assert spans == [("a", "held", 1.0, 3.0), ("b", "switching", 3.0, 3.5), ("b", "held", 3.5, None)]
    kinds = [(e.kind, e.job) for e in h.events]
    assert kinds == [
        ("granted", "a"),
        ("released", "a"),
        ("switch_started", "b"),
        ("switch_finished", "b"),
        ("granted", "b"),
    ]
    assert [e.id for e in h.events] == [1, 2, 3, 4, 5]
    assert h.events[1].detail == "2.000s"


def test_a_direct_handover_closes_one_span_and_opens_the_next() -> None:
    h = History()
    h.observe([view("a")], 0.0)
    h.observe([view("b")], 1.0)
    assert [(s.job, s.end) for s in h.spans] == [("a", 1.0), ("b", None)]


def test_queries_and_bounds() -> None:
    h = History(horizon=10.0, max_spans=3, max_events=4)
    for i in range(6):
        h.observe([view(f"j{i}")], float(i))
    assert len(h.spans) == 3 and len(h.events) == 4
    assert [s.job for s in h.spans_since(3.5)] == ["j3", "j4", "j5"]
    assert [e.id for e in h.events_after(h.events[1].id, 1)] == [h.events[2].id]
    h.record("admin", 7.0, group="g", detail="drained")
    assert h.events[-1].to_dict() == {
        "id": 12,
        "t": 7.0,
        "kind": "admin",
        "group": "g",
        "job": None,
        "detail": "drained",
    }
    h.observe([view("j5")], 100.0)  # everything closed long ago falls out; the open span stays
    assert [s.job for s in h.spans] == ["j5"]


def test_groups_are_remembered_with_their_gpus() -> None:
    h = History()
    h.observe([view(name="x"), view(name="y")], 0.0)
    assert h.groups == {"x": (0, 1), "y": (0, 1)}
