"""Every process the GPU check starts, and stopping every one of them: the standard library only.

Three layers, so that a rerun starts on an empty GPU whatever ended this one:

1. Each child starts in its own session, hence its own process group
   (``start_new_session``), and :meth:`Children.stop` / :meth:`Children.kill_all`
   signal the whole group: SIGTERM, a grace period, then SIGKILL. The check
   calls them on a normal exit, on an exception, on SIGTERM/SIGINT/SIGHUP
   (:func:`on_signals`) and when its deadline passes (:class:`Watchdog`).
2. Each child is started through a few lines of Python that ask the kernel to
   SIGKILL it when its parent dies (``prctl(PR_SET_PDEATHSIG, SIGKILL)``,
   which survives ``execve``) and then ``exec`` the real command. So even a
   SIGKILL of the check, which runs no cleanup, takes its children with it,
   and theirs (a pytest run's daemons) with them. The death signal follows
   the thread that forked the child: children are started from the main
   thread only.
3. Each child's environment carries ``TIMESLICED_GPU_CHECK_RUN=<pid>:<start>``
   of the check that owns it (children of children keep it). :func:`marked`
   finds such processes in ``/proc``: the owner sweeps its own at the end
   (:meth:`Children.sweep`), and the next run kills those whose owner is gone
   (:func:`orphans`) before it looks at the GPU.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

MARKER = "TIMESLICED_GPU_CHECK_RUN"
PROC = Path("/proc")
KILLED_EXIT_S = 5.0  # how long a SIGKILLed process may take to exit (one in the driver takes a while)

# argv: PARENT_PID COMMAND [ARG...]. PR_SET_PDEATHSIG is 1 (<linux/prctl.h>); the parent check
# catches a parent that died before prctl ran (the child would be reparented already).
_SHIM = (
    "import ctypes, os, signal, sys\n"
    "try:\n"
    "    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)\n"
    "except Exception:\n"
    "    pass\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    os._exit(137)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def start_time(pid: int, proc: Path = PROC) -> int | None:
    """The process's start time in clock ticks since boot (``/proc/PID/stat`` field 22); None if it is gone."""
    try:
        stat = (proc / str(pid) / "stat").read_bytes()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces or parentheses itself.
    fields = stat[stat.rfind(b")") + 2 :].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def own_marker() -> str:
    """This process's marker: the one it inherited from a check above it, else its own."""
    return os.environ.get(MARKER) or f"{os.getpid()}:{start_time(os.getpid())}"


def owner_alive(marker: str, proc: Path = PROC) -> bool:
    """Whether the check that ``marker`` names still runs (the same PID and the same start time)."""
    pid_text, _, start = marker.partition(":")
    try:
        pid = int(pid_text)
    except ValueError:
        return False
    now = start_time(pid, proc)
    return now is not None and str(now) == start


def marked(proc: Path = PROC) -> dict[int, str]:
    """pid -> marker of every process whose environment carries one (those this user may read), but this one."""
    out: dict[int, str] = {}
    prefix = MARKER.encode() + b"="
    me = os.getpid()
    for entry in proc.iterdir() if proc.is_dir() else ():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        for item in environ.split(b"\0"):
            if item.startswith(prefix):
                out[int(entry.name)] = item[len(prefix) :].decode(errors="replace")
                break
    return out


def orphans(proc: Path = PROC) -> dict[int, str]:
    """Processes of an earlier check whose owner is gone: pid -> their marker."""
    return {pid: m for pid, m in marked(proc).items() if not owner_alive(m, proc)}


def kill_pids(pids: list[int], sig: int = signal.SIGKILL) -> list[int]:
    """Send ``sig`` to each PID (and to its process group where it leads one); the PIDs that were still there."""
    hit: list[int] = []
    for pid in pids:
        try:
            if os.getpgid(pid) == pid:
                os.killpg(pid, sig)
            else:
                os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            continue
        hit.append(pid)
    return hit


def _signal_group(pgid: int, sig: int) -> bool:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:
        return False
    return True


def _stat(pid: str, proc: Path = PROC) -> tuple[str, int] | None:
    """(state letter, process group) from ``/proc/PID/stat``; None if it is gone."""
    try:
        stat = (proc / pid / "stat").read_bytes()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2 :].split()  # after the command name: state, ppid, pgrp, ...
    try:
        return fields[0].decode(), int(fields[2])
    except (IndexError, ValueError):
        return None


def group_alive(pgid: int, proc: Path = PROC) -> bool:
    """Whether a process that is not a zombie is left in the group ``pgid``.

    Zombies do not count: they hold no memory, and one whose parent died is
    reaped by init (or a subreaper), not by this check.
    """
    if not _signal_group(pgid, 0):
        return False
    for entry in proc.iterdir():
        if entry.name.isdigit():
            got = _stat(entry.name, proc)
            if got is not None and got[1] == pgid and got[0] != "Z":
                return True
    return False


class Children:
    """The process groups this process started, each led by one child; thread-safe.

    ``owner``: this process is the outermost check (it made the marker), so it
    may sweep every process that carries the marker; a check started under
    another one (a pytest run of the check) only stops what it started itself.
    """

    def __init__(self, marker: str | None = None) -> None:
        inherited = os.environ.get(MARKER)
        self.marker = marker or own_marker()
        self.owner = marker is None and not inherited
        self._lock = threading.RLock()
        self._groups: dict[int, subprocess.Popen[bytes]] = {}  # pgid -> its leader
        self.started: list[int] = []  # every PID started, in order

    def spawn(
        self,
        argv: list[str],
        *,
        stdout: IO[bytes] | int | None = subprocess.DEVNULL,
        stderr: IO[bytes] | int | None = subprocess.DEVNULL,
        cwd: str | Path | None = None,
        env: dict[str, str] | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` in a new session through the death-signal shim; the child's PID is its group's."""
        full_env = dict(os.environ if env is None else env)
        full_env[MARKER] = self.marker
        shim = [sys.executable, "-S", "-E", "-c", _SHIM, str(os.getpid()), *argv]
        with self._lock:
            proc = subprocess.Popen(
                shim,
                stdout=stdout,
                stderr=stderr,
                stdin=subprocess.DEVNULL,
                cwd=cwd,
                env=full_env,
                start_new_session=True,
            )
            self._groups[proc.pid] = proc
            self.started.append(proc.pid)
        return proc

    def groups(self) -> list[int]:
        with self._lock:
            return list(self._groups)

    def stop(self, proc: subprocess.Popen[bytes], grace: float = 10.0) -> None:
        """SIGTERM the child's group, SIGKILL it after ``grace`` seconds, reap the child, SIGKILL any straggler."""
        self._stop_groups({proc.pid: proc}, grace)

    def kill_all(self, grace: float = 3.0) -> list[int]:
        """Stop every group still registered, all at once; the groups that were still there."""
        with self._lock:
            groups = dict(self._groups)
        return self._stop_groups(groups, grace)

    def _stop_groups(self, groups: dict[int, subprocess.Popen[bytes]], grace: float) -> list[int]:
        present = [pgid for pgid in groups if group_alive(pgid)]
        for pgid in groups:
            if groups[pgid].poll() is None:
                _signal_group(pgid, signal.SIGTERM)
        end = time.monotonic() + grace
        for proc in groups.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.0, end - time.monotonic()))
        for pgid, proc in groups.items():
            _signal_group(pgid, signal.SIGKILL)  # the leader's group may hold more than the leader
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
        # A killed member outlives its leader's reaping by a moment (it is still exiting): wait for it
        # too, a bounded time, so that a group reported stopped is gone.
        end = time.monotonic() + KILLED_EXIT_S
        while any(group_alive(pgid) for pgid in groups) and time.monotonic() < end:
            time.sleep(0.01)
        with self._lock:
            for pgid in groups:
                if not group_alive(pgid):
                    self._groups.pop(pgid, None)
        return present

    def survivors(self, proc: Path = PROC) -> list[int]:
        """PIDs still running with this check's marker (this owner's sweep would kill them), plus live groups."""
        pids = {pid for pid, m in marked(proc).items() if m == self.marker}
        pids |= {pgid for pgid in self.groups() if group_alive(pgid)}
        return sorted(pids)

    def sweep(self, proc: Path = PROC) -> list[int]:
        """SIGKILL every process with this check's marker; only the owner does. The PIDs that were there."""
        if not self.owner:
            return []
        return kill_pids(sorted(pid for pid, m in marked(proc).items() if m == self.marker))


# --- signals and the deadline ---------------------------------------------------------------

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class Interrupted(KeyboardInterrupt):
    """A stop signal arrived; ``signum`` says which."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum


@contextlib.contextmanager
def on_signals(first: Callable[[int], None] | None = None, quiet: threading.Event | None = None) -> Iterator[list[int]]:
    """Within: the first SIGTERM, SIGINT or SIGHUP raises :class:`Interrupted` in the main thread.

    Later signals, and any while ``quiet`` is set (the cleanup runs), are only
    noted: the cleanup that the first one started must not be cut short by a
    second. ``first(signum)`` runs before the raise (the check moves its
    watchdog up there, so a cleanup that hangs still ends). Yields the signals seen.
    """
    seen: list[int] = []

    def handler(signum: int, frame: Any) -> None:
        seen.append(signum)
        if len(seen) > 1 or (quiet is not None and quiet.is_set()):
            return
        if first is not None:
            first(signum)
        raise Interrupted(signum)

    previous = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    try:
        yield seen
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


class Watchdog:
    """Calls ``fire()`` on its own thread once ``clock()`` passes the deadline, unless cancelled first."""

    def __init__(self, deadline: float, fire: Callable[[], None], clock: Callable[[], float] = time.monotonic) -> None:
        self._deadline = deadline
        self._fire = fire
        self._clock = clock
        self._cond = threading.Condition()
        self._cancelled = False
        self.fired = False
        self._thread = threading.Thread(target=self._run, name="gpu-check watchdog", daemon=True)

    @property
    def deadline(self) -> float:
        return self._deadline

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def move(self, deadline: float) -> None:
        """Fire at ``deadline`` instead (earlier or later)."""
        with self._cond:
            self._deadline = deadline
            self._cond.notify_all()

    def cancel(self) -> None:
        with self._cond:
            self._cancelled = True
            self._cond.notify_all()

    def _run(self) -> None:
        with self._cond:
            while not self._cancelled:
                left = self._deadline - self._clock()
                if left <= 0:
                    break
                self._cond.wait(min(left, 1.0))
            if self._cancelled:
                return
            self.fired = True
        self._fire()
