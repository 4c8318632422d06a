"""`timesliced bench copy`: figures in the shape the CLI prints; the model line warns when it cannot be met."""

from __future__ import annotations

import ctypes
import mmap
import threading
from pathlib import Path
from typing import Any

import pytest

from timesliced.bench import copy
from timesliced.bench.copy import describe_link, format_copy, measure_ceiling, row_ceiling, run_copy


def test_bench_copy_reports_the_ceiling_and_each_move_against_its_model() -> None:
    result = run_copy(bandwidths=[1.0], sizes=(1,), reps=1, mib=4)
    assert set(result["ceiling"]) == {
        "warm_gbps",
        "warm_chunked_gbps",
        "warm_duplex_gbps",
        "fresh_mmap_gbps",
        "fresh_write_gbps",
        "mapped_read_gbps",
        "prefaulted_gbps",
    }
    assert all(v > 0 for v in result["ceiling"].values())
    rows = {(r["pool"], r["kind"]): r for r in result["sim"]}  # the before (no pool) and the after
    assert set(rows) == {(pool, kind) for pool in ("off", "on") for kind in ("snapshot", "restore", "swap")}
    for r in rows.values():
        assert r["model_gbps"] == 1.0 and r["mib"] == 1 and r["model_s"] == (1 << 20) / 1e9
        assert r["took_s"] > 0 and r["ratio"] == r["model_s"] / r["took_s"]
        assert r["ceiling_gbps"] == row_ceiling(result["ceiling"], r["kind"], 1 << 20, pool=r["pool"] == "on")
    text = format_copy(result)
    assert "copy ceiling on this machine: warm" in text and len(text.splitlines()) == 2 + 6 + 1 + 4
    for pool in ("off", " on"):
        for kind in ("lone", "swap"):
            assert f"1.0 GB/s pool {pool} {kind}: 1 MiB " in text


def test_the_summary_marks_a_model_above_the_ceiling_of_its_kind() -> None:
    """A swap makes two copies at once, so its ceiling is the duplex one: a model between the two marks swaps only."""

    def row(kind: str, ceiling: float) -> dict[str, Any]:
        return {
            "model_gbps": 5.0, "pool": "on", "mib": 1, "kind": kind, "model_s": 2e-4, "took_s": 4e-4,
            "achieved_gbps": 2.6, "ratio": 0.5, "ceiling_gbps": ceiling,
        }  # fmt: skip

    ceiling = {
        "warm_gbps": 10.0, "warm_chunked_gbps": 6.0, "warm_duplex_gbps": 4.0, "fresh_mmap_gbps": 1.0,
        "fresh_write_gbps": 2.0, "mapped_read_gbps": 3.0, "prefaulted_gbps": 9.0,
    }  # fmt: skip
    text = format_copy({"ceiling": ceiling, "sim": [row("snapshot", 6.0), row("restore", 6.0), row("swap", 4.0)]})
    assert "5.0 GB/s pool  on lone: 1 MiB 0.50\n" in text + "\n"
    assert "5.0 GB/s pool  on swap: 1 MiB 0.50*" in text
    assert "4.00 GB/s each for two at once" in text


def test_each_move_is_judged_against_the_most_this_machine_lets_it_follow() -> None:
    c = {"warm_chunked_gbps": 6.0, "warm_duplex_gbps": 4.0, "fresh_write_gbps": 1.5, "mapped_read_gbps": 2.0}
    MiB = 1 << 20
    assert row_ceiling(c, "snapshot", MiB, pool=True) == row_ceiling(c, "restore", 1024 * MiB, pool=True) == 6.0
    assert row_ceiling(c, "swap", 16 * MiB, pool=True) == row_ceiling(c, "swap", 1024 * MiB, pool=True) == 4.0
    # under 2 MiB its two copies go one after the other
    assert row_ceiling(c, "swap", MiB, pool=True) == pytest.approx(3.0)
    # without the pool a park writes new tmpfs pages, and a restore maps its parked file afresh
    assert row_ceiling(c, "snapshot", MiB, pool=False) == row_ceiling(c, "swap", 16 * MiB, pool=False) == 1.5
    assert row_ceiling(c, "restore", MiB, pool=False) == 2.0
    assert row_ceiling(c, "swap", MiB, pool=False) == pytest.approx(1 / (1 / 1.5 + 1 / 2.0))


def test_the_duplex_ceiling_copies_in_two_threads_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each run copies both buffers whole, one in this thread and one in another, with the call that frees the GIL."""
    real = ctypes.memmove
    copied: dict[threading.Thread, int] = {}  # the threads themselves: an ident may be reused
    lock = threading.Lock()

    def memmove(dst: int, src: int, n: int) -> int:
        with lock:
            me = threading.current_thread()
            copied[me] = copied.get(me, 0) + n
        return int(real(dst, src, n))

    monkeypatch.setattr(ctypes, "memmove", memmove)
    assert copy.duplex_ceiling(2, 3, chunk=1 << 19) > 0
    assert copied.pop(threading.current_thread()) == 3 * (2 << 20)
    assert list(copied.values()) == [2 << 20] * 3  # one helper per run, each copying its buffer whole


def test_bench_copy_runs_one_side_alone() -> None:
    result = run_copy(bandwidths=[1.0], sizes=(1,), reps=1, mib=4, pools=(True,))
    assert {r["pool"] for r in result["sim"]} == {"on"} and len(result["sim"]) == 3


def test_the_link_line_says_when_the_model_outruns_the_machine() -> None:
    def line(model: float) -> str:
        return describe_link({"model_gbps": model, "copy_ceiling_gbps": 10.0, "duplex_ceiling_gbps": 6.0})

    assert "faster than this machine copies: switches" in line(25.0)
    assert "faster than this machine makes two copies at once: swaps" in line(8.0)
    assert "faster" not in line(2.0) and "6.0 GB/s each for two at once" in line(2.0)
    assert "(unpaced)" in line(0.0)


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
    assert figures["fresh_mmap_gbps"] > 0 and figures["mapped_read_gbps"] > 0 and figures["prefaulted_gbps"] > 0
    assert most == 1 and not live
    assert list(tmp_path.iterdir()) == []
