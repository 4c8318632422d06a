"""The node journal: two checksummed slots written in place; a torn write leaves the other whole."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from timesliced.daemon.journal import SLOTS, Journal


def picture(fence: int, jobs: int = 2) -> dict[str, Any]:
    return {
        "jobs": [
            {"job": f"j{i}", "group": "g", "exclusive": False, "span": [0], "location": "parked"} for i in range(jobs)
        ],
        "turns": {"j0": -1},
        "fences": {"g": [1, fence]},
        "park": {},
    }


def test_what_was_saved_last_is_loaded(tmp_path: Path) -> None:
    j = Journal(tmp_path)
    assert j.load() is None
    assert j.save(picture(1)) and j.save(picture(2)) and j.save(picture(3))
    assert not j.save(picture(3))  # unchanged: not written again
    assert j.writes == 3
    j.close()
    again = Journal(tmp_path)
    assert again.load() == picture(3)
    again.save(picture(4))  # goes on numbering where the last run stopped
    again.close()
    assert Journal(tmp_path).load() == picture(4)


def records(root: Path, jobs: int) -> tuple[Journal, bytes]:
    """A journal with pictures 1 and 2 saved, and the exact record its third write would put in its slot."""
    scratch = root / "scratch"
    scratch.mkdir()
    other = Journal(scratch)
    for fence in (1, 2, 3):
        other.save(picture(fence, jobs))
    other.close()
    third = (scratch / SLOTS[1]).read_bytes().split(b"\n")[0] + b"\n"
    j = Journal(root)
    j.save(picture(1, jobs))
    j.save(picture(2, jobs))
    j.close()
    return j, third


@settings(max_examples=60, deadline=None)
@given(cut=st.floats(0.0, 1.0, exclude_max=True), jobs=st.sampled_from([1, 9]))
def test_a_write_cut_short_leaves_the_previous_one(tmp_path_factory: Any, cut: float, jobs: int) -> None:
    root = tmp_path_factory.mktemp("journal")
    _, third = records(root, jobs)
    # The third write goes to slot 1 (over the first record, which may be longer or shorter) and dies part way.
    fd = os.open(root / SLOTS[1], os.O_WRONLY)
    os.pwrite(fd, third[: int(len(third) * cut)], 0)
    os.close(fd)
    # Where the part not written already held the same bytes, the write is in fact whole.
    whole = (root / SLOTS[1]).read_bytes().startswith(third)
    assert Journal(root).load() == picture(3 if whole else 2, jobs)


def test_a_whole_write_is_the_newest(tmp_path: Path) -> None:
    _, third = records(tmp_path, 9)
    fd = os.open(tmp_path / SLOTS[1], os.O_WRONLY)
    os.pwrite(fd, third, 0)
    os.close(fd)
    assert Journal(tmp_path).load() == picture(3, 9)


def test_nothing_usable_is_no_journal(tmp_path: Path) -> None:
    for name in SLOTS:
        (tmp_path / name).write_bytes(b"0000beef {not json}\n")
    assert Journal(tmp_path).load() is None
    (tmp_path / SLOTS[0]).write_bytes(b"")
    assert Journal(tmp_path).load() is None
