"""The sim backend's swap: a park and a restore streamed at once, the restore taking the pages the park frees."""

from __future__ import annotations

import asyncio
import errno
import os
import random
import shutil
from pathlib import Path
from typing import Any

import pytest

from timesliced import errors
from timesliced.backends import sim
from timesliced.backends.base import MoveResult, SwapResult
from timesliced.backends.sim import SimBackend
from timesliced.sim import layout
from timesliced.sim.layout import RegionInfo, job_key
from timesliced.sim.region import SimRegion
from timesliced.util.compat import timeout

from ..helpers.sims import PAGE, Sims

# A chunk that is not a whole number of pages, so that hand-overs lag the bytes written.
CHUNK = 3 * PAGE + 4096


@pytest.fixture(autouse=True, params=["helper", "inline"])
def small_chunks(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> None:
    """Small chunks, the park's copied in the swap's helper thread (as large ones are) or inline (small ones)."""
    monkeypatch.setattr(sim, "_CHUNK", CHUNK)
    monkeypatch.setattr(sim, "_HELPER_MIN", 0 if request.param == "helper" else CHUNK + 1)


def fill(sims: Sims, info: RegionInfo, seed: int) -> bytes:
    data = random.Random(seed).randbytes(info.nbytes)
    sims.open(info).write(data)
    return data


def full_gpu(sims: Sims, **settings: Any) -> tuple[SimBackend, dict[str, list[tuple[RegionInfo, bytes]]]]:
    """gpu 0 (32 pages) holds "a" (20 pages, resident); "b" (24 pages there, 3 on gpu 1) is parked.

    ``b`` cannot come back before ``a`` leaves: only 12 pages of gpu 0 are free.
    """
    return parked_b_resident_a(sims, ((0, 16 * PAGE - 5), (1, 3 * PAGE), (0, 8 * PAGE)), **settings)


def parked_b_resident_a(
    sims: Sims, b_regions: tuple[tuple[int, int], ...], **settings: Any
) -> tuple[SimBackend, dict[str, list[tuple[RegionInfo, bytes]]]]:
    """Job "b"'s ``(gpu, nbytes)`` regions filled and parked, then "a"'s two regions of gpu 0 (20 pages), resident."""
    b = sims.backend(**settings)
    jobs: dict[str, list[tuple[RegionInfo, bytes]]] = {"a": [], "b": []}
    for gpu, nbytes in b_regions:
        info = b.alloc("b", gpu, nbytes)
        jobs["b"].append((info, fill(sims, info, info.region)))
    asyncio.run(b.snapshot("b"))
    for nbytes in (12 * PAGE + 7, 8 * PAGE):
        info = b.alloc("a", 0, nbytes)
        jobs["a"].append((info, fill(sims, info, 100 + info.region)))
    return b, jobs


def holds(job: list[tuple[RegionInfo, bytes]]) -> bool:
    """The job's regions read back the bytes written into them (open afresh: the pages may have moved)."""
    for info, data in job:
        with SimRegion.open(info) as region:
            if region.read() != data:
                return False
    return True


def test_swap_streams_a_job_into_the_room_another_frees(sims: Sims) -> None:
    b, jobs = full_gpu(sims)
    with pytest.raises(errors.RestoreRefused):  # alone, the incoming job does not fit
        asyncio.run(b.restore("b"))

    result = asyncio.run(b.swap("a", "b"))
    assert isinstance(result.park, MoveResult) and isinstance(result.restore, MoveResult)
    assert result.park.nbytes == 20 * PAGE + 7 and result.restore.nbytes == 27 * PAGE - 5
    assert result.to_host_gbps is not None and result.to_device_gbps is not None
    assert b.job_state("a") == "parked" and b.job_state("b") == "resident" and holds(jobs["b"])
    assert b.free_bytes(0) == 8 * PAGE and b.free_bytes(1) == 29 * PAGE
    assert len(list((b.root / "parked" / job_key("b")).iterdir())) == 3  # its files, the pool's now, kept there

    back = asyncio.run(b.swap("b", "a"))  # and the other way
    assert isinstance(back.park, MoveResult) and isinstance(back.restore, MoveResult)
    assert b.job_state("a") == "resident" and b.job_state("b") == "parked" and holds(jobs["a"])


def test_a_paced_swap_never_ends_before_the_model_says(sims: Sims) -> None:
    bandwidth = 64 * (1 << 20)
    b, jobs = full_gpu(sims, bandwidth=bandwidth)
    b._tails["swap"].lead = sim._TAIL_MAX_S  # as if commits had taken long: the schedule runs 1 ms early
    for out, in_ in (("a", "b"), ("b", "a")) * 2:
        result = asyncio.run(b.swap(out, in_))
        assert isinstance(result.park, MoveResult) and isinstance(result.restore, MoveResult)
        assert result.park.seconds >= result.park.nbytes / bandwidth
        assert result.restore.seconds >= result.restore.nbytes / bandwidth
        assert holds(jobs[in_])
    assert 0 < b._tails["swap"].lead <= sim._TAIL_MAX_S


def test_swap_that_cannot_fit_moves_nothing(sims: Sims) -> None:
    b, jobs = full_gpu(sims)
    big = b.alloc("c", 1, 30 * PAGE)  # gpu 1 is now too full for b's 3 pages there
    with pytest.raises(errors.RestoreRefused, match="both jobs stay where they are") as caught:
        asyncio.run(b.swap("a", "b"))
    assert errors.state_intact(caught.value)
    assert b.job_state("a") == "resident" and b.job_state("b") == "parked" and holds(jobs["a"])
    b.free("c", big.region)
    assert isinstance(asyncio.run(b.swap("a", "b")).restore, MoveResult) and holds(jobs["b"])


def test_swap_of_jobs_not_in_place_moves_each_half_alone(sims: Sims) -> None:
    b, jobs = full_gpu(sims)
    with pytest.raises(ValueError, match="two jobs"):
        asyncio.run(b.swap("a", "a"))
    asyncio.run(b.snapshot("a"))
    result = asyncio.run(b.swap("a", "b"))  # "a" is parked already: only the restore moves
    assert result.park == MoveResult(0, 0.0) and isinstance(result.restore, MoveResult)
    assert holds(jobs["b"])
    result = asyncio.run(b.swap("b", "nobody"))
    assert isinstance(result.park, MoveResult) and result.park.nbytes and result.restore == MoveResult(0, 0.0)


def test_swap_with_a_damaged_incoming_copy_still_parks_the_outgoing_job(sims: Sims) -> None:
    b, jobs = full_gpu(sims)
    victim = b.root / "parked" / job_key("b") / f"{jobs['b'][2][0].region}.bin"
    os.truncate(victim, PAGE)
    result = asyncio.run(b.swap("a", "b"))
    assert isinstance(result.park, MoveResult) and b.job_state("a") == "parked"
    assert isinstance(result.restore, errors.BackendError) and not errors.state_intact(result.restore)
    assert b.job_state("b") == "parked" and b.free_bytes(0) == 32 * PAGE and b.free_bytes(1) == 32 * PAGE
    assert isinstance(asyncio.run(b.swap("b", "a")).restore, MoveResult) and holds(jobs["a"])


def test_swap_whose_park_finds_no_room_moves_nothing(sims: Sims, monkeypatch: pytest.MonkeyPatch) -> None:
    b, jobs = full_gpu(sims)

    def disk_full(*args: object) -> None:
        raise OSError(28, os.strerror(28))

    monkeypatch.setattr(sim, "_fallocate", disk_full)
    with pytest.raises(errors.InsufficientHostMemory):
        asyncio.run(b.swap("a", "b"))
    assert b.job_state("a") == "resident" and b.job_state("b") == "parked" and holds(jobs["a"])


def test_a_cancelled_swap_leaves_each_job_whole(sims: Sims) -> None:
    # 20 pages of 64 KiB take about 0.26 s each way at 5 MB/s: cut it at a tenth of that
    b, jobs = full_gpu(sims, bandwidth=5e6)

    async def cut() -> None:
        with pytest.raises(TimeoutError):
            async with timeout(0.1):
                await b.swap("a", "b")
        await b.restore("nobody")  # let the worker thread wind up

    asyncio.run(cut())
    for _ in range(200):  # the worker ends the swap (rolls the park forward) in its thread
        if b.job_state("a") != "resident" or b._jobs["a"].move is None:
            break
        asyncio.run(asyncio.sleep(0.01))
    b.bandwidth = 0
    assert b.job_state("b") == "parked"
    assert b.job_state("a") in ("resident", "parked")
    asyncio.run(b.restore("a"))
    assert holds(jobs["a"])
    asyncio.run(b.swap("a", "b"))
    assert holds(jobs["b"])


def crash_roots(b: SimBackend, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, *, write_late: bool) -> list[Path]:
    """Copy the whole sim root (what a killed daemon leaves on the tmpfs) at every step and every commit of a swap.

    ``write_late`` breaks the park's ordering on purpose: each chunk reaches its host file only after the
    next control-file commit (the one that hands its pages over, or says ``PARKED``), as if the commit
    came before the copy.
    """
    crashes: list[Path] = []
    late: list[tuple[Path, bytes, int]] = []

    def crash_copy() -> None:
        dest = tmp_path / f"crash-{len(crashes)}"
        shutil.copytree(b.root, dest)
        crashes.append(dest)

    sleep_until, commit = sim._Swap._sleep_until, layout.CtlWriter.commit

    def at_step(self: sim._Swap, due: float) -> None:
        crash_copy()
        sleep_until(self, due)

    def at_commit(self: layout.CtlWriter, slot: layout.SlotData) -> None:
        crash_copy()
        commit(self, slot)
        crash_copy()
        while late:
            path, data, pos = late.pop(0)
            fd = os.open(path, os.O_WRONLY)  # the park may have closed its own descriptor by now
            os.pwrite(fd, data, pos)
            os.close(fd)

    def written_late(self: sim._ParkFile, src: memoryview, address: int, pos: int) -> None:
        late.append((self.path, bytes(src), pos))

    monkeypatch.setattr(sim._Swap, "_sleep_until", at_step)
    monkeypatch.setattr(layout.CtlWriter, "commit", at_commit)
    if write_late:
        monkeypatch.setattr(sim._ParkFile, "write", written_late)
    asyncio.run(b.swap("a", "b"))
    monkeypatch.undo()
    return crashes


def damaged(root: Path, jobs: dict[str, list[tuple[RegionInfo, bytes]]]) -> str | None:
    """What start-up on a crashed root got wrong (a job in no whole state, or bytes lost), or None."""
    data = {job: {info.region: d for info, d in regions} for job, regions in jobs.items()}
    adopted = SimBackend(root, gpus=2, capacity=32 * PAGE, page_size=PAGE, bandwidth=0)
    try:
        states = {job: adopted.job_state(job) for job in jobs}
        if sorted(states.values()) not in (["parked", "resident"], ["parked", "parked"]):
            return f"{root.name}: {states}"
        for job, other in (("a", "b"), ("b", "a")):  # each in turn on the device: every byte is back
            asyncio.run(adopted.snapshot(other))
            asyncio.run(adopted.restore(job))
            if not holds([(info, data[job][info.region]) for info in adopted.regions(job)]):
                return f"{root.name}: job {job} lost bytes"
    finally:
        adopted.close()
    return None


def test_a_daemon_killed_at_any_instant_of_a_swap_leaves_each_job_whole(
    sims: Sims, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    b, jobs = full_gpu(sims)
    crashes = crash_roots(b, monkeypatch, tmp_path, write_late=False)
    assert len(crashes) > 20  # many instants: chunks of both directions and their hand-overs
    handed_over = 0
    for root in crashes:
        _, slot, _ = layout.read_ctl(root / "jobs" / f"{job_key('a')}.ctl")
        pages = sum(n for r in slot.regions for _, n in r.extents)
        handed_over += slot.state == layout.PARKING and 0 < pages < 20
        assert damaged(root, jobs) is None
    assert handed_over > 3  # copies caught the park part-way handed over: start-up finished those parks


def test_the_crash_check_catches_a_park_that_commits_before_it_copies(
    sims: Sims, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The check above, against a park whose control file says its pages' bytes are on the host before they are.

    The parked files carry no mark of being whole: only the order of copy and commit keeps a killed
    daemon's parks whole, so a check that did not see it broken would prove nothing.
    """
    b, jobs = full_gpu(sims)
    crashes = crash_roots(b, monkeypatch, tmp_path, write_late=True)
    found = [d for root in crashes if (d := damaged(root, jobs))]
    assert found and all(d.endswith("job a lost bytes") for d in found), found


class CommitFaults:
    """Fails one job's control-file commits with EBADF (a descriptor gone bad): its ``at``-th (1: the first), or on.

    ``seen`` counts the job's commits, failed or not; ``clear()`` lets them land again.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch, job: str, *, at: int, once: bool) -> None:
        self.seen = self.failed = 0
        self.cleared = False
        commit, name = layout.CtlWriter.commit, f"{job_key(job)}.ctl"

        def at_commit(writer: layout.CtlWriter, slot: layout.SlotData) -> None:
            if writer.path.name == name and not self.cleared:
                self.seen += 1
                if self.seen == at or (self.seen > at and not once):
                    self.failed += 1
                    raise OSError(errno.EBADF, os.strerror(errno.EBADF))
            commit(writer, slot)

        monkeypatch.setattr(layout.CtlWriter, "commit", at_commit)

    def clear(self) -> None:
        self.cleared = True


def listed_pages_stay_theirs(b: SimBackend) -> str | None:
    """What breaks the rule start-up relies on: no page a control file lists is free, or listed by two files."""
    owner: dict[tuple[int, int], str] = {}
    for path in sorted((b.root / "jobs").glob("*.ctl")):
        _, slot, _ = layout.read_ctl(path)
        for r in slot.regions:
            for first, count in r.extents:
                for page in range(first, first + count):
                    if (r.gpu, page) in owner:
                        return f"gpu {r.gpu} page {page} is listed by {owner[r.gpu, page]} and {path.name}"
                    owner[r.gpu, page] = path.name
    for gpu, allocator in enumerate(b._allocators):
        for first, count in allocator.free_runs():
            for page in range(first, first + count):
                if (gpu, page) in owner:
                    return f"gpu {gpu} page {page} is free, yet {owner[gpu, page]} lists it"
    return None


def each_comes_back(b: SimBackend, jobs: dict[str, list[tuple[RegionInfo, bytes]]]) -> str | None:
    """Each job in turn on the device, every byte back (the regions opened afresh); what went wrong, or None."""
    data = {job: {info.region: d for info, d in regions} for job, regions in jobs.items()}
    for job, other in (("a", "b"), ("b", "a")):
        asyncio.run(b.snapshot(other))
        asyncio.run(b.restore(job))
        if not holds([(info, data[job][info.region]) for info in b.regions(job)]):
            return f"job {job} lost bytes"
    return None


def swap_with_commit_faults(root: Path, job: str, *, at: int, once: bool) -> tuple[str, int]:
    """A swap of "a" out for "b" in whose ``job``'s ``at``-th control-file commit fails (and those after, unless
    ``once``); what went wrong (or "") and how many commits ``job`` made.

    Whatever fails, each job must end whole where the swap's result and ``verify`` say, never faulted;
    the pages the control files list must stay their job's; and a daemon started on the root afterwards
    must find each job where this one had it, whole.
    """
    sims = Sims(root)
    try:
        with pytest.MonkeyPatch.context() as mp:
            b, jobs = full_gpu(sims)
            faults = CommitFaults(mp, job, at=at, once=once)
            try:
                result = asyncio.run(b.swap("a", "b"))
            except errors.ParkRefused as exc:  # failed as it started: nothing moved
                park: MoveResult | Exception = exc
                restore: MoveResult | Exception = exc
            else:
                park, restore = result.park, result.restore
            for name, outcome, moved in (("a", park, "parked"), ("b", restore, "resident")):
                if isinstance(outcome, Exception) and not errors.state_intact(outcome):
                    return f"job {name} faulted: {outcome}", faults.seen
                where = moved if isinstance(outcome, MoveResult) else {"a": "resident", "b": "parked"}[name]
                if (b.job_state(name), b.verify(name)) != (where, where):
                    return f"job {name} is {b.job_state(name)}/{b.verify(name)}, not {where}", faults.seen
            if broken := listed_pages_stay_theirs(b):
                return broken, faults.seen
            states = {name: b.job_state(name) for name in jobs}
            b.close()  # as a daemon stops: no commit, the files stay as the faults left them
            faults.clear()  # the next daemon opens the files afresh
            adopted = sims.backend()
            if (found := {name: adopted.job_state(name) for name in jobs}) != states:
                return f"start-up found {found}, not {states}", faults.seen
            return each_comes_back(adopted, jobs) or "", faults.seen
    finally:
        sims.close()


@pytest.mark.parametrize("once", [True, False], ids=["once", "from-then-on"])
@pytest.mark.parametrize("job", ["a", "b"])
def test_a_swap_whose_control_file_commits_fail_leaves_each_job_whole_and_unfaulted(
    root: Path, job: str, once: bool
) -> None:
    """Every commit of a swap in turn fails (an EBADF or EIO from tmpfs): the outgoing job's, or the incoming job's.

    The outgoing job's last commit failing once, say, used to fault it with "list index out of range",
    its bytes whole: the park, stepping on after the error, read past its region's last chunk.
    """
    _, commits = swap_with_commit_faults(root / "count", job, at=0, once=True)  # at 0: none fails
    assert commits == (8 if job == "a" else 1)  # "a": PARKING, 6 hand-overs and PARKED; "b": RESIDENT
    wrong = {at: swap_with_commit_faults(root / f"at-{at}", job, at=at, once=once)[0] for at in range(1, commits + 1)}
    assert not {at: why for at, why in wrong.items() if why}, f"commits of job {job} failing"


def test_a_park_whose_last_commits_fail_holds_the_pages_its_control_file_lists(
    sims: Sims, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From the park's last commit on, the outgoing job's control file takes no write.

    The job is parked, whole; its file still says ``PARKING`` with the last pages it had, which start-up
    would copy into the parked file: they stay the job's until a write lands. Its restore, whose commit
    fails too, is refused with the job still parked; once the file takes writes, the restore lands and
    the pages are free again.
    """
    b, jobs = full_gpu(sims)
    faults = CommitFaults(monkeypatch, "a", at=8, once=False)  # 8: the park's last commit, PARKED
    result = asyncio.run(b.swap("a", "b"))
    assert faults.failed == 2  # the commit, and the one more try
    assert isinstance(result.park, MoveResult) and isinstance(result.restore, MoveResult)
    assert b.job_state("a") == b.verify("a") == "parked" and holds(jobs["b"])
    _, slot, _ = layout.read_ctl(b.root / "jobs" / f"{job_key('a')}.ctl")
    listed = sum(n for r in slot.regions for _, n in r.extents)
    assert slot.state == layout.PARKING and listed == 2  # the last chunk's pages: 2 of region 1's 8
    assert b.free_bytes(0) == (8 - listed) * PAGE and listed_pages_stay_theirs(b) is None

    asyncio.run(b.snapshot("b"))
    with pytest.raises(errors.RestoreRefused, match="stays parked, whole") as refused:
        asyncio.run(b.restore("a"))
    assert errors.state_intact(refused.value) and b.job_state("a") == b.verify("a") == "parked"
    assert b.free_bytes(0) == (32 - listed) * PAGE and listed_pages_stay_theirs(b) is None

    faults.clear()
    asyncio.run(b.restore("a"))
    assert holds(jobs["a"]) and b.free_bytes(0) == 11 * PAGE  # its 21 pages only: the held ones went back
    assert listed_pages_stay_theirs(b) is None


def test_the_listed_pages_check_catches_a_park_that_lets_them_go(sims: Sims, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above, against a park that gives back the pages its unwritten control file still lists."""
    b, _ = full_gpu(sims)
    park_holding = sim._Swap._park_holding

    def lets_go(self: sim._Swap, exc: errors.BackendError) -> None:
        park_holding(self, exc)
        for record in self.a.held:
            self.sim._release_pages(record, keep=True)
        self.a.held = []

    monkeypatch.setattr(sim._Swap, "_park_holding", lets_go)
    CommitFaults(monkeypatch, "a", at=8, once=False)
    asyncio.run(b.swap("a", "b"))
    assert "is free, yet" in (listed_pages_stay_theirs(b) or "")


def test_a_park_write_that_fails_once_after_a_hand_over_is_written_again(
    sims: Sims, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The park goes on from the chunk that failed (an EIO), not the one after it, which would land at its place."""
    b, jobs = full_gpu(sims)
    write, calls = sim._ParkFile.write, []

    def fails_once(self: sim._ParkFile, src: memoryview, address: int, pos: int) -> None:
        calls.append(pos)
        if len(calls) == 3:  # two chunks written and handed over
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        write(self, src, address, pos)

    monkeypatch.setattr(sim._ParkFile, "write", fails_once)
    result = asyncio.run(b.swap("a", "b"))
    assert calls[2] == calls[3]  # the failed chunk, again
    assert isinstance(result.park, MoveResult) and b.verify("a") == "parked"
    assert isinstance(result.restore, errors.RestoreRefused) and b.verify("b") == "parked"  # stopped, whole
    assert each_comes_back(b, jobs) is None


class WriteFaults:
    """Fails the writes of parked copies (``_ParkFile.write``) with EIO: the ``at``-th (1: the first) and the
    ``times - 1`` after it (``times`` None: every one from then on).

    ``seen`` counts the writes, failed or not; ``clear()`` lets them land again.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, at: int, times: int | None) -> None:
        self.seen = self.failed = 0
        self.cleared = False
        write = sim._ParkFile.write

        def at_write(f: sim._ParkFile, src: memoryview, address: int, pos: int) -> None:
            self.seen += 1
            if not self.cleared and self.seen >= at and (times is None or self.failed < times):
                self.failed += 1
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            write(f, src, address, pos)

        monkeypatch.setattr(sim._ParkFile, "write", at_write)

    def clear(self) -> None:
        self.cleared = True


def small_in(sims: Sims) -> tuple[SimBackend, dict[str, list[tuple[RegionInfo, bytes]]]]:
    """Job "a" (21 pages of gpu 0, resident) and "b" (3 pages there and 2 on gpu 1, parked), which free pages
    take: a swap of "a" out for "b" in restores "b" whole in its first two steps, "a"'s park going on.
    """
    return parked_b_resident_a(sims, ((0, 3 * PAGE - 5), (1, 2 * PAGE)))


def listed(b: SimBackend, job: str) -> tuple[int, int]:
    """The state the job's control file says, and how many device pages it lists."""
    _, slot, _ = layout.read_ctl(b.root / "jobs" / f"{job_key(job)}.ctl")
    return slot.state, sum(n for r in slot.regions for _, n in r.extents)


def park_left_unfinished(
    sims: Sims, monkeypatch: pytest.MonkeyPatch, *, times: int | None
) -> tuple[SimBackend, dict[str, list[tuple[RegionInfo, bytes]]], WriteFaults, int]:
    """A swap of "a" out for "b" in whose park's third write fails (two chunks handed over), and so does its
    completion; checks that "a" is parked, not faulted, holding the pages its control file lists, and "b"
    restored whole. Returns the backend, the jobs, the faults and the pages "a" holds.
    """
    b, jobs = small_in(sims)
    faults = WriteFaults(monkeypatch, at=3, times=times)
    result = asyncio.run(b.swap("a", "b"))
    assert faults.failed == 2  # the chunk, and the completion's try at it
    assert isinstance(result.park, MoveResult), result.park  # parked, as the scheduler must hear it
    assert result.park.nbytes == 20 * PAGE + 7  # what the parked files take on the host
    assert isinstance(result.restore, MoveResult) and b.job_state("b") == "resident" and holds(jobs["b"])
    assert b.job_state("a") == b.verify("a") == "parked"
    state, held = listed(b, "a")
    assert state == layout.PARKING and held == 21 - 6  # two chunks' 6 pages handed over; start-up finishes it
    assert b.free_bytes(0) == (32 - 3 - held) * PAGE and b.free_bytes(1) == 30 * PAGE
    assert listed_pages_stay_theirs(b) is None
    assert b.held() == {"a": {"bytes": held * PAGE, "unfinished": True}}  # as status and the metrics show it
    return b, jobs, faults, held


def test_a_park_whose_completion_fails_after_a_hand_over_is_completed_at_the_next_restore(
    sims: Sims, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A park write fails (EIO) after pages were handed over, and so does its completion: the job used to be
    faulted, its bytes whole (the host files and the pages its control file lists). It is parked; its next
    restore completes the parked copy first, with the fault gone, and brings every byte back.
    """
    b, jobs, _, _ = park_left_unfinished(sims, monkeypatch, times=2)
    asyncio.run(b.restore("a"))
    assert b.job_state("a") == "resident" and holds(jobs["a"]) and holds(jobs["b"])
    assert listed(b, "a") == (layout.RESIDENT, 21) and b.free_bytes(0) == (32 - 3 - 21) * PAGE
    assert listed_pages_stay_theirs(b) is None
    assert each_comes_back(b, jobs) is None


def test_a_park_left_unfinished_is_refused_its_restore_while_its_writes_fail(
    sims: Sims, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writes fail from then on: the restore, which must complete the parked copy first, is refused with the
    job parked, whole, still holding its pages; once writes land, the restore brings every byte back."""
    b, jobs, faults, held = park_left_unfinished(sims, monkeypatch, times=None)
    for _ in range(2):
        with pytest.raises(errors.RestoreRefused, match="stays parked, whole") as refused:
            asyncio.run(b.restore("a"))
        assert errors.state_intact(refused.value)
        assert b.job_state("a") == b.verify("a") == "parked" and listed(b, "a") == (layout.PARKING, held)
        assert b.free_bytes(0) == (32 - 3 - held) * PAGE and listed_pages_stay_theirs(b) is None
    with pytest.raises(errors.BackendError, match="restore it"):  # a free would commit the unfinished park
        b.free("a", jobs["a"][0][0].region)

    faults.clear()
    result = asyncio.run(b.swap("b", "a"))  # a streamed restore cannot complete it: the halves go in turn
    assert isinstance(result.park, MoveResult) and isinstance(result.restore, MoveResult)
    assert holds(jobs["a"]) and b.free_bytes(0) == (32 - 21) * PAGE and b.free_bytes(1) == 32 * PAGE
    assert listed_pages_stay_theirs(b) is None
    assert each_comes_back(b, jobs) is None


def test_a_daemon_started_on_a_park_left_unfinished_finishes_it(sims: Sims, monkeypatch: pytest.MonkeyPatch) -> None:
    b, jobs, faults, _ = park_left_unfinished(sims, monkeypatch, times=None)
    b.close()  # as a daemon stops: its files stay as the faults left them
    faults.clear()
    adopted = sims.backend()
    assert adopted.recovered_jobs()["a"][0] == "parked" and listed(adopted, "a") == (layout.PARKED, 0)
    assert adopted.free_bytes(0) == (32 - 3) * PAGE  # the pages it held are free: the park is complete
    asyncio.run(adopted.restore("a"))
    assert holds(jobs["a"]) and holds(jobs["b"]) and listed_pages_stay_theirs(adopted) is None


def test_a_daemon_started_while_the_writes_still_fail_keeps_the_park_unfinished_and_whole(
    sims: Sims, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Start-up's copy of the listed pages fails too: the job stays parked, holding them (it was faulted, and
    its pages zeroed with the free ones), through any number of restarts, until a restore can complete it.
    """
    b, jobs, faults, held = park_left_unfinished(sims, monkeypatch, times=None)
    b.close()
    for _ in range(2):  # a restart, and one more, with the file system still failing
        adopted = sims.backend()
        assert adopted.recovered_jobs()["a"][0] == "parked" and adopted.verify("a") == "parked"
        assert listed(adopted, "a") == (layout.PARKING, held)  # nothing committed: the file says what is so
        assert adopted.free_bytes(0) == (32 - 3 - held) * PAGE and listed_pages_stay_theirs(adopted) is None
        with pytest.raises(errors.RestoreRefused, match="stays parked, whole"):
            asyncio.run(adopted.restore("a"))
        adopted.close()
    faults.clear()
    adopted = sims.backend()
    asyncio.run(adopted.restore("a"))
    assert holds(jobs["a"]) and holds(jobs["b"]) and listed_pages_stay_theirs(adopted) is None
    assert adopted.free_bytes(0) == (32 - 3 - 21) * PAGE


@pytest.mark.parametrize("healthy", [True, False])
def test_another_restore_completes_a_park_left_unfinished_to_take_its_pages(
    sims: Sims, monkeypatch: pytest.MonkeyPatch, healthy: bool
) -> None:
    """The scheduler counts the held pages as free ("a" is parked): a restore that needs them completes the
    park first, when the file system takes writes again, rather than being refused until "a" comes back.
    """
    b, jobs, faults, held = park_left_unfinished(sims, monkeypatch, times=None)
    faults.clear()  # "c"'s own park lands
    c = b.alloc("c", 0, 14 * PAGE)
    data = fill(sims, c, 7)
    asyncio.run(b.snapshot("c"))
    faults.cleared = healthy  # and then the file system is well again, or not
    b.alloc("d", 0, PAGE)  # 13 pages free, and "a" holds 15: "c" fits only in what "a" holds
    if healthy:
        asyncio.run(b.restore("c"))
        assert sims.open(c).read() == data and listed(b, "a") == (layout.PARKED, 0)
        assert b.free_bytes(0) == (32 - 3 - 1 - 14) * PAGE
        asyncio.run(b.reclaim("c"))
    else:
        with pytest.raises(errors.RestoreRefused):
            asyncio.run(b.restore("c"))
        assert listed(b, "a") == (layout.PARKING, held) and b.job_state("c") == "parked"
        faults.clear()
    asyncio.run(b.reclaim("d"))
    asyncio.run(b.restore("a"))
    assert holds(jobs["a"]) and holds(jobs["b"]) and listed_pages_stay_theirs(b) is None


def test_a_reclaimed_park_left_unfinished_frees_the_pages_it_held(sims: Sims, monkeypatch: pytest.MonkeyPatch) -> None:
    b, jobs, _, _ = park_left_unfinished(sims, monkeypatch, times=None)
    asyncio.run(b.reclaim("a"))
    assert b.job_state("a") == "unknown" and b.free_bytes(0) == (32 - 3) * PAGE and holds(jobs["b"])
    assert listed_pages_stay_theirs(b) is None and not (b.root / "parked" / job_key("a")).exists()


@pytest.mark.parametrize("move", ["restore", "swap"])
@pytest.mark.parametrize("healthy", [True, False])
def test_another_restore_lands_the_commit_a_park_could_not_to_take_its_pages(
    sims: Sims, monkeypatch: pytest.MonkeyPatch, healthy: bool, move: str
) -> None:
    """Only the park's last commit failed: "a" is parked, whole, holding the 2 pages its file still lists. A
    restore that needs them (alone, or in a swap) lands that commit first, once the file takes writes, rather
    than being refused until "a" comes back; while it does not, the restore is refused and "a" still holds them.
    """
    b, jobs = full_gpu(sims)
    faults = CommitFaults(monkeypatch, "a", at=8, once=False)  # 8: the park's last commit, PARKED
    asyncio.run(b.swap("a", "b"))
    assert listed(b, "a") == (layout.PARKING, 2) and b.job_state("a") == "parked"
    assert b.held() == {"a": {"bytes": 2 * PAGE, "unfinished": False}}
    asyncio.run(b.snapshot("b"))  # 30 pages free, 2 held by "a"
    c = b.alloc("c", 0, 30 * PAGE)
    data = fill(sims, c, 7)
    asyncio.run(b.snapshot("c"))
    b.alloc("d", 0, PAGE)  # 29 pages free: "c" fits only with the 2 "a" holds
    if move == "swap":
        b.alloc("e", 0, PAGE)  # and swapped in for "d": 28 free, and the 1 "d" frees
    bring_in = (lambda: b.restore("c")) if move == "restore" else (lambda: b.swap("d", "c"))
    faults.cleared = healthy
    if healthy:
        result = asyncio.run(bring_in())
        assert not isinstance(result, SwapResult) or isinstance(result.restore, MoveResult), result
        assert sims.open(c).read() == data and listed(b, "a") == (layout.PARKED, 0) and b.held() == {}
        assert b.job_state("c") == "resident" and listed_pages_stay_theirs(b) is None
        asyncio.run(b.reclaim("c"))
    else:
        tried = faults.failed
        if move == "restore":
            with pytest.raises(errors.RestoreRefused, match=r"parked jobs hold more \('a' 128\.0 KiB\) until"):
                asyncio.run(bring_in())  # 128 KiB: the 2 pages of 64 KiB
        else:
            with pytest.raises(errors.RestoreRefused, match="both jobs stay where they are"):
                asyncio.run(bring_in())
        assert faults.failed > tried  # the commit was tried, and failed again
        assert listed(b, "a") == (layout.PARKING, 2) and b.job_state("c") == "parked"
        faults.clear()
    for other in ("d", "e"):
        asyncio.run(b.reclaim(other))
    asyncio.run(b.restore("a"))
    assert holds(jobs["a"]) and listed_pages_stay_theirs(b) is None


@pytest.mark.parametrize("move", ["restore", "swap"])
def test_a_restore_lands_the_commit_its_own_park_could_not_to_take_back_its_pages(
    sims: Sims, monkeypatch: pytest.MonkeyPatch, move: str
) -> None:
    """Only "a"'s park's last commit failed, and it holds 2 pages; the file takes writes again, and "a" fits only
    with those pages: its restore, or a swap that brings it in, lands that commit first rather than being refused.
    """
    b, jobs = full_gpu(sims)
    faults = CommitFaults(monkeypatch, "a", at=8, once=False)
    asyncio.run(b.swap("a", "b"))
    assert b.held() == {"a": {"bytes": 2 * PAGE, "unfinished": False}}
    faults.clear()
    if move == "restore":
        asyncio.run(b.snapshot("b"))
        b.alloc("d", 0, 11 * PAGE)  # 19 pages free: "a" needs 21, of which it holds 2
        asyncio.run(b.restore("a"))
    else:
        asyncio.run(b.snapshot("b"))
        d = b.alloc("d", 0, 9 * PAGE)
        b.alloc("e", 0, 11 * PAGE)  # 10 pages free, and "d"'s 9: "a" needs 21, of which it holds 2
        result = asyncio.run(b.swap("d", "a"))
        assert isinstance(result.restore, MoveResult), result.restore
        assert b.job_state("d") == "parked" and b.regions("d")[0].nbytes == d.nbytes
    assert b.job_state("a") == "resident" and holds(jobs["a"]) and b.held() == {}
    assert listed_pages_stay_theirs(b) is None
