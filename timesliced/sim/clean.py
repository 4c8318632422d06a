"""``timesliced sim clean``: remove the simulated GPU's state that a daemon left behind.

The simulated GPU keeps its device memory and parked copies in files on tmpfs (``/dev/shm``, one
directory per state dir, ``env.default_sim_dir``): an arena per GPU, a control file per job and
the parked regions. They are kept on purpose when a daemon stops with jobs' state in them, cleanly
or not: the next daemon started with the same state dir takes them up, so jobs that come back find
their state (and the simulated state that no job of its journal owns is reclaimed then). A daemon
that stops with none removes them itself, with ``clean`` (keeping the directory and its lock).
What is left where no daemon will start again holds host memory until the node reboots; this
removes it.

It refuses while a daemon holds the directory: the daemon's lock on ``daemon.lock`` (an ``flock``
that dies with its process) is taken here too for as long as the files are removed, so a daemon
starting meanwhile refuses to start on them rather than adopt half of them.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from .. import errors
from ..env import default_sim_dir, default_state_dir
from ..util.parse import human_size
from .layout import LOCK_NAME, POOL_NAME, RESIDENT, job_key, read_ctl

ARENA_SUFFIX = ".arena"
KNOWN_DIRS = ("jobs", "parked", POOL_NAME)


@dataclass(frozen=True)
class Cleaned:
    """What ``clean`` found and removed."""

    root: Path
    existed: bool
    nbytes: int = 0  # the memory the files held (their allocated blocks: arenas are sparse)
    jobs: int = 0  # control files: jobs whose state was there
    parked: int = 0  # parked regions
    kept: tuple[str, ...] = ()  # entries that are not the simulated GPU's, left alone


def clean(root: Path, *, keep_root: bool = False) -> Cleaned:
    """Remove the simulated GPU's files under ``root``; raises ``BackendError`` while a daemon uses it.

    Only what the simulated GPU writes is removed (``gpu<N>.arena``, ``jobs/``, ``parked/``, ``pool/``
    and the lock); anything else is left in place and named in ``kept``, and the directory then stays.
    ``keep_root``: the directory and its lock stay (a daemon may be opening the lock as it goes: one
    that took the old file's lock and another the new one's would both run on the root).
    """
    if not root.is_dir():
        return Cleaned(root, existed=False)
    try:
        return _clean(root, keep_root)
    except OSError as exc:  # another user's files, or a daemon starting meanwhile (a directory not empty)
        raise errors.BackendError(
            f"cannot clean the simulated GPU state at {root}: {exc}; run it as the user whose daemon left it, "
            "with no daemon starting there, then run `timesliced sim clean` again"
        ) from None


def _parked_regions(root: Path) -> int:
    """The parked copies of regions under ``root``: the files in the parked folders of jobs not resident.

    A resident job's folder holds only files of the daemon's pool of warm buffers (what its restores
    left there for its next park), no state.
    """
    if not (root / "parked").is_dir():
        return 0
    resident = set()
    for path in (root / "jobs").glob("*.ctl") if (root / "jobs").is_dir() else ():
        try:
            header, slot, _ = read_ctl(path)
        except (OSError, ValueError):
            continue  # unreadable: its files count as parked
        if slot.state == RESIDENT and header.gen % 2 == 0:
            resident.add(job_key(header.job))
    return sum(1 for f in (root / "parked").glob("*/*.bin") if f.parent.name not in resident)


def _clean(root: Path, keep_root: bool) -> Cleaned:
    lock = root / LOCK_NAME
    try:
        fd = os.open(lock, os.O_RDWR)
    except FileNotFoundError:
        fd = None  # no daemon ever started here, or one removed it: nothing can hold it
    try:
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise errors.BackendError(
                    f"the simulated GPU at {root} is in use by a running daemon; stop that daemon first "
                    "(its state is kept for its next start), then run `timesliced sim clean` again"
                ) from None
        jobs = len(list((root / "jobs").glob("*.ctl"))) if (root / "jobs").is_dir() else 0
        parked = _parked_regions(root)
        nbytes, kept = 0, []
        for entry in sorted(root.iterdir()):
            if entry.name == LOCK_NAME:
                continue  # last: it is what keeps a starting daemon off
            ours = (entry.is_dir() and entry.name in KNOWN_DIRS) or (
                entry.is_file() and entry.name.startswith("gpu") and entry.name.endswith(ARENA_SUFFIX)
            )
            if not ours:
                kept.append(entry.name)
                continue
            nbytes += _allocated(entry)
            if entry.is_dir():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        if not kept and not keep_root:
            lock.unlink(missing_ok=True)
            root.rmdir()
        return Cleaned(root, True, nbytes, jobs, parked, tuple(kept))
    finally:
        if fd is not None:
            os.close(fd)


def _allocated(path: Path) -> int:
    """The bytes ``path`` takes in memory (tmpfs) or on disk: allocated blocks, not apparent size."""
    if path.is_file():
        return path.stat().st_blocks * 512  # st_blocks counts 512-byte units (stat(2))
    return sum(p.stat().st_blocks * 512 for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def add_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``timesliced sim clean``'s parser, on the command line's subcommands."""
    sim = sub.add_parser("sim", help="the simulated GPU's files")
    sim_sub = sim.add_subparsers(dest="sim", metavar="ACTION", required=True)
    p = sim_sub.add_parser(
        "clean",
        help="remove the simulated GPU state a stopped (or killed) daemon left on tmpfs",
        description=(
            "Remove the simulated GPU's arenas, control files and parked copies that a daemon left behind "
            "(the next daemon on the same state dir would take them up instead). Refuses while a daemon uses them."
        ),
    )
    p.add_argument(
        "--state-dir", type=Path, default=None, help=f"the daemon's state directory (default {default_state_dir()})"
    )
    p.add_argument(
        "--sim-dir", type=Path, default=None, help="the simulated GPU's directory (default: the state dir's)"
    )
    p.set_defaults(run=_command)


def _command(args: argparse.Namespace) -> int:
    root = args.sim_dir or default_sim_dir(args.state_dir or default_state_dir())
    done = clean(root)  # a BackendError is the command line's one-line error, status 1
    if not done.existed:
        print(f"nothing to clean: no simulated GPU state at {root}")
        return 0
    print(
        f"removed the simulated GPU state at {root}: {done.jobs} job(s), {done.parked} parked region(s), "
        f"{human_size(done.nbytes)} of memory"
    )
    if done.kept:
        print(f"left in place (not the simulated GPU's): {', '.join(done.kept)}", file=sys.stderr)
    return 0
