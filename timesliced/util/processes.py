"""Process liveness and process trees, as the daemon needs them to follow jobs."""

from __future__ import annotations

import os
from collections.abc import Iterable

PID_MAX = 1 << 22  # the kernel's ceiling for pid_max on 64-bit systems


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie waiting to be reaped."""
    if not 0 < pid <= PID_MAX:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return True  # no procfs: trust kill(0)
    # The state letter follows the parenthesised command name, which may itself hold ')'.
    return stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] != b"Z"


def descendants(pids: Iterable[int]) -> set[int]:
    """The live descendants of ``pids`` (children, grandchildren, ...), not ``pids`` themselves.

    One pass over ``/proc``: every process's parent comes from its ``stat``.
    Zombies count as dead (their children have already been handed to a
    reaper, so the walk would not reach them anyway). Processes that exit
    during the pass are simply missing. Without procfs the answer is empty.
    A PID that the kernel reuses between this call and its use is not
    detected here; callers cross-check with what holds device memory.
    """
    roots = set(pids)
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return set()
    for entry in entries:
        if not entry.isdigit():
            continue
        parsed = _parent_and_state(entry)
        if parsed is None:
            continue
        ppid, state = parsed
        if state in (b"Z", b"X"):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found: set[int] = set()
    todo = list(roots)
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found and child not in roots:
                found.add(child)
                todo.append(child)
    return found


def descends_from(pid: int, ancestor: int) -> bool:
    """True if ``pid`` is a live descendant of ``ancestor`` (a child, grandchild, ...), not ``ancestor`` itself.

    Walks up the parents of ``pid`` in ``/proc``: a few reads, not a pass over
    every process like ``descendants()``. A process whose parent exited has
    been handed to a reaper and no longer descends from it. Without procfs
    the answer is False.
    """
    seen: set[int] = set()
    current = pid
    while current > 1 and current not in seen:  # pid 1 (or 0, the kernel) ends every chain
        seen.add(current)
        parsed = _parent_and_state(str(current))
        if parsed is None or (current == pid and parsed[1] in (b"Z", b"X")):
            return False
        current = parsed[0]
        if current == ancestor:
            return True
    return False


def _parent_and_state(pid: str) -> tuple[int, bytes] | None:
    """(ppid, state letter) from ``/proc/<pid>/stat``; None if the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and ')', so split after the last ')'.
    fields = stat[stat.rfind(b")") + 2 :].split()
    if len(fields) < 2:
        return None
    try:
        return int(fields[1]), fields[0]
    except ValueError:
        return None


def owner_uid(pid: int) -> int | None:
    """The real uid of ``pid``, or None if it is gone (or there is no procfs)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Uid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def namespace_pids(pid: int) -> tuple[int, ...] | None:
    """``pid``'s numbers in the nested PID namespaces it is in, outermost (this ``/proc``'s) first.

    From the ``NSpid`` line of ``/proc/PID/status`` (proc(5), Linux 4.1 and later): one number for
    a process of this ``/proc``'s PID namespace, more for one in a namespace nested below it (a
    container's), whose last number is what the process itself sees as its PID. None if the
    process is gone, or the kernel has no ``NSpid``.
    """
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"NSpid:"):
                    return tuple(int(n) for n in line.split()[1:]) or None
    except (OSError, ValueError):
        return None
    return None


def pids_as_seen_inside(root: int) -> dict[int, int]:
    """``root`` and its live descendants that share its PID namespace, by the PID that namespace gives them.

    The values are the PIDs of this ``/proc``. A descendant in a namespace nested further down
    (its ``NSpid`` longer than ``root``'s) is left out: its innermost number is another
    namespace's.
    """
    own = namespace_pids(root)
    if own is None:
        return {}
    found = {own[-1]: root}
    for pid in descendants([root]):
        chain = namespace_pids(pid)
        if chain is not None and len(chain) == len(own):
            found[chain[-1]] = pid
    return found
