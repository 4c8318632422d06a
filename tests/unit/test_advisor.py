"""The placement advisor (``core/advisor.py``) on hand-made status documents."""

from __future__ import annotations

from typing import Any

import pytest

from timesliced.core.advisor import EXACT_UP_TO, JobLoad, Options, advise, predict

from ..helpers.status_docs import group, phases

MiB = 1 << 20


def doc(jobs: dict[str, tuple[float, float, int]], *, gpus: int = 4, capacity: int = 64 * MiB, **kw: Any) -> Any:
    """A status with ``jobs`` (name -> mean busy s, mean gap s, memory), each alone in a 1-GPU group."""
    return {
        "devices": [{"index": i, "capacity": capacity, "used": 0, "jobs": {}} for i in range(gpus)],
        "groups": [group(f"g-{name}", [i % gpus], **kw) for i, name in enumerate(jobs)],
        "jobs": [
            {
                "job": name,
                "group": f"g-{name}",
                "faulted": None,
                "footprint": {},
                "park": "sim",
                "measured": {},
                "phases": phases(20, busy_s=b, gap_s=g, peak=m),
            }
            for name, (b, g, m) in jobs.items()
        ],
    }


def together(advice: Any) -> list[list[str]]:
    return sorted(sorted(g["jobs"]) for g in advice["suggested"])


def test_complementary_jobs_are_paired_and_a_busy_one_is_left_alone() -> None:
    advice = advise(doc({"rl-a": (0.4, 0.6, 20 * MiB), "sft-b": (0.35, 0.65, 20 * MiB), "busy": (1.0, 0.01, MiB)}))
    assert together(advice) == [["busy"], ["rl-a", "sft-b"]]
    pair = next(g for g in advice["suggested"] if len(g["jobs"]) == 2)
    assert pair["gpus"] == 1 and pair["memory_fits"] and pair["switch_s"] == 0.0
    assert 0.7 < pair["predicted_duty"] <= 1.0 and 1.0 < pair["predicted_slowdown"] <= 1.25
    assert pair["predicted_makespan_s"] == pytest.approx(3600 * pair["predicted_slowdown"])
    assert "rl-a busy 40% and sft-b busy 35%" in pair["reason"] and "switches move nothing" in pair["reason"]
    alone = next(g for g in advice["suggested"] if g["jobs"] == ["busy"])
    assert alone["predicted_slowdown"] == 1.0 and "too little idle time" in alone["reason"]
    assert advice["plan"]["gpus"] == 2 and advice["current"]["gpus"] == 3
    assert advice["message"] is None and advice["exact"]


def test_two_busy_jobs_are_not_put_together() -> None:
    advice = advise(doc({"a": (0.7, 0.3, MiB), "b": (0.6, 0.4, MiB)}))
    assert together(advice) == [["a"], ["b"]]  # 130% load: neither phase fits in the other's gaps


def test_memory_that_does_not_fit_together_costs_a_switch_per_phase() -> None:
    fits = advise(doc({"a": (0.3, 0.7, 30 * MiB), "b": (0.3, 0.7, 30 * MiB)}, median_switch_s=0.1, switches=3))
    apart = advise(doc({"a": (0.3, 0.7, 40 * MiB), "b": (0.3, 0.7, 40 * MiB)}, median_switch_s=0.1, switches=3))
    assert together(fits) == together(apart) == [["a", "b"]]
    (f,), (p,) = fits["suggested"], apart["suggested"]
    assert f["memory_fits"] and not p["memory_fits"] and p["switch_s"] == 0.1 and apart["switch_source"] == "measured"
    assert p["predicted_slowdown"] > f["predicted_slowdown"] and "park and restore" in p["reason"]


def test_a_switch_too_dear_keeps_jobs_apart() -> None:
    advice = advise(doc({"a": (0.3, 0.7, 40 * MiB), "b": (0.3, 0.7, 40 * MiB)}), Options(switch_s=0.5))
    assert together(advice) == [["a"], ["b"]]  # each phase would need 0.5 s of switching: 160% load


def test_a_job_too_big_for_a_gpu_is_said_so() -> None:
    advice = advise(doc({"big": (0.3, 0.7, 80 * MiB), "b": (0.3, 0.7, MiB)}))
    big = next(g for g in advice["suggested"] if "big" in g["jobs"])
    assert big["jobs"] == ["big"] and "does not fit by itself" in big["reason"]


def test_whole_process_jobs_always_pay_a_switch() -> None:
    a, b = (JobLoad(n, "g", 1, 0.2, 0.8, MiB, exclusive=(n == "a")) for n in "ab")
    assert not predict([a, b], 1, 0.1, 64 * MiB).fits
    assert predict([a, b], 1, 0.1, 64 * MiB).switch_s == 0.1


def test_jobs_of_different_gpu_counts_are_not_grouped() -> None:
    d = doc({"one": (0.2, 0.8, MiB), "two": (0.2, 0.8, MiB)})
    d["groups"][1]["gpus"] = [1, 2]
    assert together(advise(d)) == [["one"], ["two"]]


def test_the_answer_is_deterministic() -> None:
    jobs = {f"j{i}": (0.1 + 0.03 * (i % 4), 0.9, MiB) for i in range(8)}
    first = advise(doc(jobs, gpus=8))
    again = advise(doc(dict(reversed(list(jobs.items()))), gpus=8))
    assert together(first) == together(again) and first["plan"] == again["plan"]


def test_many_jobs_are_placed_greedily_and_still_share() -> None:
    jobs = {f"j{i:02d}": (0.1, 0.9, MiB) for i in range(EXACT_UP_TO + 2)}
    advice = advise(doc(jobs, gpus=12))
    assert not advice["exact"]
    assert all(g["load"] <= 1.0 for g in advice["suggested"]) and len(advice["suggested"]) < len(jobs)
    assert sorted(j for g in advice["suggested"] for j in g["jobs"]) == sorted(jobs)


def test_when_the_gpus_are_too_few_the_least_slow_grouping_on_them_is_suggested() -> None:
    advice = advise(doc({"a": (0.7, 0.3, MiB), "b": (0.6, 0.4, MiB), "c": (0.5, 0.5, MiB)}, gpus=2))
    assert advice["plan"]["gpus"] == 2 and len(advice["suggested"]) == 2
    assert "over-full" in next(g["reason"] for g in advice["suggested"] if len(g["jobs"]) == 2)


def test_too_little_history_says_what_is_missing_and_what_to_do() -> None:
    d = doc({"a": (0.3, 0.7, MiB), "b": (0.3, 0.7, MiB)})
    d["jobs"][0]["phases"] = phases(2, busy_s=0.3, gap_s=0.7)
    d["jobs"][1]["phases"] = phases(0)
    advice = advise(d)
    assert advice["suggested"] == [] and advice["missing"] == [
        {"job": "a", "phases": 2, "gaps": 1},
        {"job": "b", "phases": 0, "gaps": 0},
    ]
    assert advice["message"] is not None and "job a has 2 phases" in advice["message"]
    assert "run the jobs longer" in advice["message"]
    assert advise(d, Options(min_phases=1))["missing"] == [{"job": "b", "phases": 0, "gaps": 0}]


def test_a_follower_status_is_told_to_ask_the_leader() -> None:
    d = doc({"a": (0.3, 0.7, MiB)})
    del d["jobs"][0]["phases"]
    message = advise(d)["message"]
    assert message is not None and "leader" in message


def test_options_out_of_range_are_refused() -> None:
    with pytest.raises(ValueError):
        advise(doc({}), Options(max_slowdown=0.5))
    with pytest.raises(ValueError):
        advise(doc({}), Options(switch_s=-1.0))


def test_the_current_grouping_is_predicted_too() -> None:
    d = doc({"a": (0.7, 0.3, MiB), "b": (0.6, 0.4, MiB)})
    d["groups"] = [group("pool", [0])]
    for j in d["jobs"]:
        j["group"] = "pool"
    advice = advise(d)
    (current,) = advice["current"]["groups"]
    assert current["group"] == "pool" and current["jobs"] == ["a", "b"] and current["predicted_slowdown"] > 1.29
    assert together(advice) == [["a"], ["b"]] and "GPU time" in advice["summary"]
