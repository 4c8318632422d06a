"""``bench workload``'s pure parts: the scenario (parsing, checks, bound), the mode table, the checkers."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from timesliced.bench import scenario as sc
from timesliced.bench.workload import MODES, Checked, contents, figures, overlaps, placement

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

MiB = 1 << 20
DEFAULT = tomllib.loads(
    (Path(sc.__file__).parent / "scenarios" / "published.toml").read_text()
)  # the packaged file, read as data


def default() -> dict[str, Any]:
    return copy.deepcopy(DEFAULT)


def test_the_default_scenario_loads_from_the_package() -> None:
    s = sc.load()
    assert [(j.name, j.kind, j.workers) for j in s.jobs] == [
        ("rl-a", "rl", ("sampler", "trainer")),
        ("rl-b", "rl", ("sampler", "trainer")),
        ("sft", "sft", ("trainer",)),
    ]
    assert s.workers == 5 and s.seconds_per_minute == 0.5


def test_on_the_trainer_gpu_any_two_states_fit_but_not_all_three() -> None:
    s = sc.load()
    trainer = [s.nbytes(j.trainer_gb) for j in s.jobs]
    assert sum(trainer) > s.gpu_memory
    assert all(a + b <= s.gpu_memory for i, a in enumerate(trainer) for b in trainer[i + 1 :])
    samplers = [s.nbytes(j.sampler_gb) for j in s.jobs if j.kind == "rl"]
    assert sum(samplers) <= s.gpu_memory  # both samplers stay resident


def test_lower_bound_is_the_busiest_gpu_or_the_longest_job() -> None:
    s = sc.load()
    # sampler GPU: 2 jobs x 10 x (6 rollout + 0.5 sync) = 130 min; trainer GPU: 2 x 10 x 3.5 + 40 x 1 = 110;
    # an RL job alone: 10 x 11.5 = 115; the SFT job alone: 40 x 1.2 = 48
    assert s.gpu_work_min() == {"trainer": 110.0, "sampler": 130.0}
    assert s.lower_bound_s() == pytest.approx(130 * 0.5)
    assert s.serial_s() == pytest.approx((115 + 115 + 48) * 0.5)
    data = default()
    data["jobs"][0]["reward_min"] = 30.0  # now one RL job alone (10 x 39.5) is longer than any GPU's work
    longer = sc.parse(data)
    assert longer.lower_bound_s() == pytest.approx(395 * 0.5)


def test_quick_scales_the_clock_and_the_iterations() -> None:
    s = sc.load().quick()
    assert s.seconds_per_minute == 0.06
    assert [j.iterations for j in s.jobs] == [3, 3, 12]
    data = default()
    data["quick"]["iterations"] = 0.01
    assert all(j.iterations == 1 for j in sc.parse(data).quick().jobs)


def test_sizes_are_whole_pages_and_the_bandwidth_follows_both_scales() -> None:
    s = sc.load()
    assert s.nbytes(36) == 18 * MiB and s.nbytes(30) == 16 * MiB and s.nbytes(0.001) == 2 * MiB
    assert s.gpu_memory == 40 * MiB
    # 25 GB/s real; 0.5 MiB per GB and 0.5 s per 60 s: 25 * (0.5 MiB / 1 GB) / (0.5 / 60)
    assert s.sim_bandwidth_gbps == pytest.approx(25 * (0.5 * MiB / 1e9) * 120)


def _set(path: str, value: Any) -> dict[str, Any]:
    data = default()
    *parents, last = path.split(".")
    node: Any = data
    for p in parents:
        node = node[int(p)] if p.isdigit() else node[p]
    if value is DELETE:
        del node[last]
    else:
        node[last] = value
    return data


DELETE = object()


@pytest.mark.parametrize(
    ("path", "value", "named"),
    [
        ("gpus.memory_gb", -1, "gpus.memory_gb"),
        ("gpus.memory_gb", DELETE, "gpus.memory_gb: missing"),
        ("gpus.bandwidth_gbps", "fast", "gpus.bandwidth_gbps"),
        ("scale.seconds_per_minute", 0, "scale.seconds_per_minute"),
        ("scale.speed", 1, "scale.speed: unknown key"),
        ("quick.iterations", 2, "quick.iterations"),
        ("jobs.0.kind", "dpo", "jobs[0].kind"),
        ("jobs.0.name", "a b", "jobs[0].name"),
        ("jobs.0.iterations", 0, "jobs[0] (rl-a).iterations"),
        ("jobs.0.iterations", True, "jobs[0] (rl-a).iterations"),
        ("jobs.1.rollout_min", DELETE, "jobs[1] (rl-b).rollout_min: missing"),
        ("jobs.1.sync_min", float("nan"), "jobs[1] (rl-b).sync_min"),
        ("jobs.2.rollout_min", 1.0, "jobs[2] (sft).rollout_min: unknown key"),
        ("jobs.0.weights_gb", 40.0, "jobs[0] (rl-a).weights_gb"),
        ("jobs.2.trainer_gb", 100.0, "jobs (sft).trainer_gb"),
        ("jobs.1.name", "rl-a", "names must differ"),
        ("extra", {}, "extra: unknown key"),
    ],
)
def test_a_bad_scenario_is_refused_naming_the_key(path: str, value: Any, named: str) -> None:
    with pytest.raises(ValueError, match=r"my\.toml") as err:
        sc.parse(_set(path, value), "my.toml")
    assert named in str(err.value)


def test_a_missing_table_or_file_is_named(tmp_path: Path) -> None:
    data = default()
    del data["scale"]
    with pytest.raises(ValueError, match=r"\[scale\]: missing"):
        sc.parse(data)
    with pytest.raises(ValueError, match="cannot read the scenario"):
        sc.load(tmp_path / "none.toml")
    (tmp_path / "bad.toml").write_text("[gpus\n")
    with pytest.raises(ValueError, match="not valid TOML"):
        sc.load(tmp_path / "bad.toml")


# --- the modes ---------------------------------------------------------------------------------


def test_the_modes_place_workers_as_documented() -> None:
    s = sc.load()
    assert [m for m in MODES if MODES[m].default] == ["dedicated", "serial", "reference", "timesliced"]
    assert MODES["anticipating"].daemon_flags == ("--anticipate", "5") and MODES["anticipating"].declare_memory
    gpus, where = placement(s, MODES["dedicated"])
    assert gpus == 5 and sorted(gpu for _group, gpu in where.values()) == [0, 1, 2, 3, 4]
    assert len({group for group, _gpu in where.values()}) == 5
    gpus, where = placement(s, MODES["timesliced"])
    assert gpus == 2
    assert where == {
        "rl-a-sampler": ("sampler", 1),
        "rl-a-trainer": ("trainer", 0),
        "rl-b-sampler": ("sampler", 1),
        "rl-b-trainer": ("trainer", 0),
        "sft-trainer": ("trainer", 0),
    }
    assert MODES["reference"].daemon_flags == ("--park-every-handoff", "--no-prefetch")
    assert MODES["serial"].serial and not MODES["timesliced"].serial


# --- the checkers can fail ------------------------------------------------------------------------


def span(job: str, gpu: int, start: float, end: float) -> dict[str, Any]:
    return {"job": job, "gpu": gpu, "phase": "train", "start": start, "end": end}


def test_overlaps_counts_two_jobs_on_one_gpu_at_once_only() -> None:
    assert overlaps([span("a", 0, 0, 1), span("b", 0, 1, 2), span("b", 1, 0.5, 1.5)]) == 0
    assert overlaps([span("a", 0, 0, 1), span("a", 0, 0.5, 2)]) == 0  # one job's two sessions
    assert overlaps([span("a", 0, 0, 1), span("b", 0, 0.9, 2)]) == 1
    assert overlaps([span("a", 0, 0, 10), span("c", 0, 5, 6), span("b", 0, 1, 2)]) == 2


class FakeRegion:
    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.data = bytearray(nbytes)

    def write(self, data: bytes) -> None:
        self.data[: len(data)] = data

    def readinto(self, buf: bytearray) -> int:
        buf[:] = self.data
        return len(buf)


def test_checked_regions_find_one_stale_or_changed_byte() -> None:
    r = FakeRegion(3 * MiB + 5)
    c = Checked(r, "job/weights")
    c.write(1)
    assert c.intact()
    assert bytes(r.data) == contents("job/weights", 1, r.nbytes) != contents("job/weights", 2, r.nbytes)
    r.data[2 * MiB] ^= 1
    assert not c.intact()
    c.write(2)
    r.write(contents("job/weights", 1, r.nbytes))  # a restore of the previous version
    assert not c.intact()


def test_figures_from_worker_records() -> None:
    s = sc.load()
    where = {"a-trainer": ("trainer", 0), "a-sampler": ("sampler", 1)}
    records = [
        {
            "started": 100.0,
            "finished": 110.0,
            "spans": [span("a-trainer", 0, 101, 106), span("a-trainer", 0, 104, 107), span("a-sampler", 1, 100, 102)],
            "grants": [
                {"waited_s": 1.0, "switch_s": 0.2, "restored": True},
                {"waited_s": 0.0, "switch_s": 0.0, "restored": False},
                {"waited_s": 3.0, "switch_s": 0.4, "restored": True},
            ],
            "data_errors": 1,
            "error_notes": ["x"],
        }
    ]
    status = {
        "groups": [
            {"group": "trainer", "switches": 3, "bytes_moved": 10, "lock_duty": 0.5},
            {"group": "sampler", "switches": 1, "bytes_moved": 5, "lock_duty": 0.25},
        ]
    }
    f = figures(records, 2, where, status, s)
    assert f["makespan_s"] == 10.0 and f["gpu_hours"] == pytest.approx(20 / 3600)
    assert f["duty"] == {"0": pytest.approx(0.6), "1": pytest.approx(0.2)}  # the union of spans per GPU
    assert f["daemon_duty"] == {"0": 0.5, "1": 0.25}
    assert (f["switches"], f["bytes_moved"], f["data_errors"], f["overlaps"]) == (4, 15, 1, 0)
    assert f["median_switch_s"] == pytest.approx(0.3) and f["median_wait_s"] == 1.0
    assert f["timeline"][0]["start"] == 1.0


@pytest.mark.parametrize(
    "where, says",
    [
        ("missing/workload.png", "the folder .*missing does not exist; create it"),
        (".", "is a folder: give a file name"),
    ],
)
def test_a_plot_path_that_cannot_take_the_png_is_refused_before_the_run(tmp_path: Path, where: str, says: str) -> None:
    """It was found only once the minutes of the run were over, and the figures went with the traceback."""
    from timesliced.cli import main

    def never(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the run started")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("timesliced.bench.workload.run_workload", never)
        with pytest.raises(SystemExit, match=f"bench workload: --plot .*{says}"):
            main(["bench", "workload", "--quick", "--plot", str(tmp_path / where)])


def test_a_plot_that_fails_to_write_still_prints_every_figure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from timesliced.bench import workload_plot
    from timesliced.cli import main

    report = {"lower_bound_s": 1.0, "modes": {}}
    monkeypatch.setattr("timesliced.bench.workload.run_workload", lambda *a, **k: report)
    monkeypatch.setattr("timesliced.bench.workload.failed", lambda r: False)

    def full(report: dict[str, Any], path: Path) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(workload_plot, "plot", full)
    assert main(["bench", "workload", "--quick", "--json", "--plot", str(tmp_path / "w.png")]) == 1
    out, err = capsys.readouterr()
    assert json.loads(out) == report and "the plot could not be written" in err and "No space left" in err
