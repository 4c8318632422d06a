"""`timesliced bench copy`: figures in the shape the CLI prints; the model line warns when it cannot be met."""

from __future__ import annotations

import mmap
from pathlib import Path
from typing import Any

import pytest

from timesliced.bench import copy
from timesliced.bench.copy import describe_link, format_copy, measure_ceiling, run_copy


def test_bench_copy_reports_the_ceiling_and_each_move_against_its_model() -> None:
    result = run_copy(bandwidths=[1.0], sizes=(1,), reps=1, mib=4)
    assert set(result["ceiling"]) == {
        "warm_gbps",
        "warm_chunked_gbps",
        "fresh_mmap_gbps",
        "fresh_write_gbps",
        "prefaulted_gbps",
    }
    assert all(v > 0 for v in result["ceiling"].values())
    rows = {(r["pool"], r["kind"]): r for r in result["sim"]}  # the before (no pool) and the after
    assert set(rows) == {(pool, kind) for pool in ("off", "on") for kind in ("snapshot", "restore", "swap")}
    for r in rows.values():
        assert r["model_gbps"] == 1.0 and r["mib"] == 1 and r["model_s"] == (1 << 20) / 1e9
        assert r["took_s"] > 0 and r["ratio"] == r["model_s"] / r["took_s"]
    text = format_copy(result)
    assert "copy ceiling on this machine: warm" in text and len(text.splitlines()) == 2 + 6 + 1 + 2
    assert "1.0 GB/s pool off: 1 MiB " in text and "1.0 GB/s pool  on: 1 MiB " in text


def test_bench_copy_runs_one_side_alone() -> None:
    result = run_copy(bandwidths=[1.0], sizes=(1,), reps=1, mib=4, pools=(True,))
    assert {r["pool"] for r in result["sim"]} == {"on"} and len(result["sim"]) == 3


def test_the_link_line_says_when_the_model_outruns_the_machine() -> None:
    assert "faster than this machine copies" in describe_link({"model_gbps": 25.0, "copy_ceiling_gbps": 10.0})
    assert "faster" not in describe_link({"model_gbps": 2.0, "copy_ceiling_gbps": 10.0})
    assert "(unpaced)" in describe_link({"model_gbps": 0.0, "copy_ceiling_gbps": 10.0})


def test_the_ceiling_holds_one_runs_pages_at_a_time_however_many_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each timed copy into a fresh file maps its own file: the runs before must be unmapped by then.

    They were kept to the end, so ``--rounds 60`` held 60 times 256 MiB of tmpfs twice over and the
    kernel killed the bench.
    """
    live: set[int] = set()
    most = 0

    class Counted(mmap.mmap):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            nonlocal most
            live.add(id(self))
            most = max(most, len(live))

        def close(self) -> None:
            live.discard(id(self))
            super().close()

    real_fresh = copy._fresh_file

    def fresh(folder: Path, name: str, size: int) -> int:
        assert not live, "a file made while the last run's pages are still mapped"
        return real_fresh(folder, name, size)

    monkeypatch.setattr(mmap, "mmap", Counted)  # what the bench module calls
    monkeypatch.setattr(copy, "_fresh_file", fresh)
    figures = measure_ceiling(tmp_path, mib=1, reps=5)
    assert figures["fresh_mmap_gbps"] > 0 and figures["prefaulted_gbps"] > 0
    assert most == 1 and not live
    assert list(tmp_path.iterdir()) == []
