"""``timesliced run``: launch a command as a member of a job.

The launcher registers itself with the daemon as the job's root process, then starts the command
with the job, group and daemon address in its environment (``$TIMESLICED_JOB`` and the rest, see
``timesliced.env``), so that ``timesliced.Client()`` inside it needs no arguments and joins the
same job: one job with two connections, the launcher's and the command's own.

Why the launcher registers its own PID rather than keeping the command's tree registered: a
connection registers once, and the methods that need a job's processes already follow the
registered ones' descendants when they move it (cuda-checkpoint asks the driver about every live
descendant of the job's PIDs; the engine methods add them too), so every process the command forks,
now or later, is covered by the launcher's PID alone, with no poll that could miss a short-lived
child. The launcher's PID also keeps the job on the node for as long as it runs: the daemon reports
a job gone once none of its processes is alive and none of its connections is open.

Signals: SIGINT, SIGTERM, SIGHUP, SIGUSR1, SIGUSR2 and SIGQUIT are forwarded to the command. The
launcher blocks them (and SIGCHLD) in every thread before it starts any, and takes them one at a
time with ``sigtimedwait``, so none is lost or handled twice and the command's exit is seen as its
SIGCHLD. At a terminal, in its foreground, the command stays in the launcher's process group, so job
control (Ctrl-Z) and reading the terminal (a debugger's prompt) work for it; a SIGINT, SIGQUIT or
SIGHUP (a hangup) that the kernel sent (``si_code`` SI_KERNEL, as the terminal driver's are) to that
group reached the command already and is not sent a second time. Anywhere else the command leads a
process group of its own. A SIGINT, SIGTERM, SIGHUP or SIGQUIT while the launcher is still connecting
(a daemon that is restarting is waited for) ends the launch before anything was started.

Clean-up: the command's exit status is returned (128 + N for a signal N, as shells do) after the
launcher's connection is closed. A launcher killed outright (SIGKILL, the OOM killer) takes its
command with it: the command is started with ``PR_SET_PDEATHSIG`` = SIGKILL (which follows the
thread that forked it: the main thread, which lives as long as the launcher), and outside a
terminal a guard process kills the command's whole process group, so the processes it forked go
too; the daemon sees every connection drop and every process go, and drops the job.

The command is started with ``preexec_fn`` while the client's reader thread runs (the launcher
registers first, so a refused registration starts nothing). Python warns that a forked child may
deadlock on a lock another thread held; the function run there only makes system calls through
objects made before the fork, and takes no lock.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TextIO

from .. import errors
from ..env import (
    ADDRESS_ENV,
    GPUS_ENV,
    GROUP_ENV,
    JOB_ENV,
    MEMORY_ENV,
    PARK_ENV,
    PRIORITY_ENV,
    WEIGHT_ENV,
)
from ..util.parse import parse_size
from ..wire.park import METHODS
from .protocol import VISIBLE, parse_gpus, resolve_address
from .sync import Client

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT)
# The terminal sends these to its whole foreground process group (the command included): Ctrl-C,
# Ctrl-\ and, when it hangs up (an SSH session closed), SIGHUP.
KEYBOARD = (signal.SIGINT, signal.SIGQUIT, signal.SIGHUP)
WAITED = (*FORWARDED, signal.SIGCHLD)
# What ends a launch that has not started its command yet (SIGUSR1/2 have nobody to go to then).
STOPPING = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
# siginfo's si_code for a signal the kernel itself sent, as the terminal driver does
# (include/uapi/asm-generic/siginfo.h: SI_USER 0, SI_KERNEL 0x80).
SI_KERNEL = 0x80
# prctl(2): PR_SET_PDEATHSIG (1) asks the kernel to send a signal when the parent thread's process dies.
PR_SET_PDEATHSIG = 1
POLL_S = 1.0  # sigtimedwait's bound: the child is also polled, whatever became of a SIGCHLD

# The guard reads its pipe to the end: the command's process group (written by the command itself, before
# it execs), then "done" once the command has exited. An end without "done" means the launcher died.
GUARD = """
import os, sys
said = b""
while chunk := os.read(int(sys.argv[1]), 64):
    said += chunk
words = said.split()
if words and words[-1] != b"done":
    try:
        os.killpg(int(words[0]), 9)
    except OSError:
        pass
"""

USAGE = 2  # bad use, as argparse and shells report it
NOT_FOUND = 127  # the command is not found (sh, bash)
NOT_EXECUTABLE = 126  # found but cannot be run


class LaunchRefused(Exception):
    """Why ``timesliced run`` did not start the command: a one-line message and the exit status."""

    def __init__(self, message: str, status: int = USAGE) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


@dataclass(frozen=True)
class Launch:
    """What ``timesliced run`` was asked to do; every option left None is the client's default."""

    job: str
    group: str
    command: tuple[str, ...]
    address: str | None = None
    park: str | None = None
    memory: str | None = None
    gpus: str | None = None
    priority: int | None = None
    weight: float | None = None


@dataclass(frozen=True)
class Prepared:
    """A launch checked: the program to run, the client's arguments and the command's environment."""

    argv: tuple[str, ...]
    memory: int | None
    gpus: list[int] | str | None
    env: dict[str, str]


def prepare(launch: Launch, environ: Mapping[str, str] = os.environ) -> Prepared:
    """Check everything that can be checked before the daemon is asked; raises ``LaunchRefused``."""
    if not launch.job or not launch.group:
        raise LaunchRefused("timesliced run needs --job J and --group G (the job to join and its group)")
    if not launch.command:
        raise LaunchRefused("timesliced run needs a command to launch: timesliced run --job J --group G -- CMD ARGS...")
    if launch.park is not None and launch.park not in METHODS:
        raise LaunchRefused(f"unknown parking method {launch.park!r} for --park; choose one of {', '.join(METHODS)}")
    memory = None
    if launch.memory is not None:
        try:
            memory = parse_size(launch.memory)
        except ValueError:
            memory = None
        if memory is None or memory < 1:
            raise LaunchRefused(
                f"--memory {launch.memory!r} is not a size; give the device memory per GPU like 16GiB, 512MiB or 1.5GB"
            )
    gpus: list[int] | str | None = None
    if launch.gpus is not None:
        gpus = _gpus(launch.gpus)
    if launch.weight is not None and not 0 < launch.weight < float("inf"):
        raise LaunchRefused(f"--weight must be a positive number, not {launch.weight}")
    try:
        address = resolve_address(launch.address)
    except ValueError as exc:  # from --address, or else from $TIMESLICED_ADDRESS, which the message names
        if launch.address is None:
            raise LaunchRefused(str(exc)) from None
        raise LaunchRefused(f"--address {launch.address!r}: {exc}; give a socket path or tcp://HOST:PORT") from None
    program = launch.command[0]
    found = shutil.which(program, path=environ.get("PATH")) if "/" not in program else program
    if found is None or not os.path.exists(found):
        raise LaunchRefused(f"{program}: command not found (check its name and $PATH)", NOT_FOUND)
    if os.path.isdir(found) or not os.access(found, os.X_OK):
        raise LaunchRefused(f"{program}: permission denied (it is not an executable file)", NOT_EXECUTABLE)
    env = dict(environ)
    env[JOB_ENV], env[GROUP_ENV] = launch.job, launch.group
    # A socket path made absolute: the command may change its directory before it connects.
    env[ADDRESS_ENV] = os.path.abspath(address.path) if address.kind == "unix" else f"tcp://{address}"
    for name, value in (
        (PARK_ENV, launch.park),
        (MEMORY_ENV, None if memory is None else str(memory)),
        (GPUS_ENV, None if gpus is None else (gpus if isinstance(gpus, str) else ",".join(map(str, gpus)))),
        (PRIORITY_ENV, None if launch.priority is None else str(launch.priority)),
        (WEIGHT_ENV, None if launch.weight is None else repr(launch.weight)),
    ):
        if value is not None:
            env[name] = value
    return Prepared((found, *launch.command[1:]), memory, gpus, env)


def _gpus(text: str) -> list[int] | str:
    try:
        return parse_gpus(text)
    except ValueError:
        raise LaunchRefused(f"--gpus {text!r}: give the node's GPU numbers (like 0,1) or {VISIBLE!r}") from None


def run(launch: Launch, *, stderr: TextIO = sys.stderr) -> int:
    """Run the command as a member of the job; returns its exit status (what to exit with).

    Bad use (no command, an unknown method, a bad size, no daemon, a registration the daemon
    refuses) prints one line to ``stderr`` and returns 2; a command that is not found, 127; one
    that cannot be executed, 126.
    """
    try:
        prepared = prepare(launch)
    except LaunchRefused as exc:
        print(f"timesliced run: {exc.message}", file=stderr)
        return exc.status
    # Blocked before any thread starts (threads inherit the mask), so only sigtimedwait takes them.
    before = signal.pthread_sigmask(signal.SIG_BLOCK, WAITED)
    try:
        return _member(launch, prepared, before, stderr)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def _member(launch: Launch, prepared: Prepared, mask: Iterable[int], stderr: TextIO) -> int:
    try:
        client = Client(
            launch.job,
            launch.group,
            address=prepared.env[ADDRESS_ENV],  # what the command's own client reaches, to the letter
            park=launch.park,
            memory=prepared.memory,
            gpus=prepared.gpus,
            priority=launch.priority,
            weight=launch.weight,
        )
    except ValueError as exc:  # a malformed $TIMESLICED_* variable that the command would inherit
        print(f"timesliced run: {exc}", file=stderr)
        return USAGE
    except errors.TimeslicedError as exc:  # --gpus visible where CUDA or NVML cannot be asked
        print(f"timesliced run: {exc.message}", file=stderr)
        return USAGE
    try:
        try:
            stopped = _connect(client)
        except errors.ConnectionLost as exc:
            print(
                f"timesliced run: {exc.message}; start the daemon (`timesliced serve`) or pass --address", file=stderr
            )
            return USAGE
        except errors.TimeslicedError as exc:
            print(f"timesliced run: the daemon refused job {launch.job!r}: {exc.message}", file=stderr)
            return USAGE
        if stopped is not None:
            print(
                f"timesliced run: {signal.Signals(stopped).name} while connecting to the daemon; nothing was started",
                file=stderr,
            )
            return 128 + stopped
        # At a terminal, in its foreground: the command stays in our process group, so job control and
        # reading the terminal (a debugger's prompt) work as without the launcher. Anywhere else it gets
        # a process group of its own, which a guard kills if the launcher dies without a word.
        alone = not _in_foreground()
        with _guard() if alone else contextlib.nullcontext(None) as report:
            try:
                child = subprocess.Popen(
                    prepared.argv, env=prepared.env, preexec_fn=_child_setup(os.getpid(), mask, report=report)
                )
            except FileNotFoundError:
                print(f"timesliced run: {launch.command[0]}: command not found", file=stderr)
                return NOT_FOUND
            except PermissionError:
                print(f"timesliced run: {launch.command[0]}: permission denied", file=stderr)
                return NOT_EXECUTABLE
            return _supervise(child)
    finally:
        client.close()


def _connect(client: Client) -> int | None:
    """Connect and register, taking the signals meanwhile; the signal that ended the wait, or None.

    ``connect`` waits up to the client's ``reconnect`` window for a daemon that is restarting, so it
    runs in a thread (which inherits the blocked mask) while this one takes the signals: a Ctrl-C or
    a scheduler's SIGTERM ends the launch at once. The thread wakes this one when it is done (a
    SIGCHLD to this thread, which nothing else takes for a child). Raises what ``connect`` raised.
    """
    failed: list[BaseException] = []
    done = threading.Event()
    main = threading.get_ident()

    def connect() -> None:
        try:
            client.connect()
        except BaseException as exc:
            failed.append(exc)
        finally:
            done.set()
            signal.pthread_kill(main, signal.SIGCHLD)  # wakes the sigtimedwait below (SIGCHLD is waited for)

    threading.Thread(target=connect, name="timesliced-run-connect", daemon=True).start()
    while not done.is_set():
        info = signal.sigtimedwait(WAITED, POLL_S)
        if info is not None and info.si_signo in STOPPING:
            return info.si_signo
    if failed:
        raise failed[0]
    return None


def _in_foreground() -> bool:
    """True when stdin is a terminal whose foreground process group is ours (an interactive shell's job)."""
    try:
        return os.isatty(0) and os.tcgetpgrp(0) == os.getpgrp()
    except OSError:
        return False


@contextlib.contextmanager
def _guard() -> Iterator[int]:
    """A guard process for the block, which yields the pipe the command reports its process group on.

    Should the launcher die (SIGKILL, the OOM killer), the pipe reads end-of-file without "done" and
    the guard kills that process group: the command and everything it forked that stayed in its group,
    orphans included (an orphan keeps its group). The guard starts before the command, and the command
    names its group before it execs, so no process of the job ever runs unguarded.

    The guard is a bare interpreter (``-I -S``) blocked in ``read``; it inherits the launcher's blocked
    signals, so the terminal's and the scheduler's signals to our group leave it alone. A block that
    ends (the command exited, or never started) says "done", and the guard leaves without killing.
    """
    r, w = os.pipe()  # both ends close on exec: only the guard gets r (pass_fds), nobody else gets w
    try:
        guard = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", GUARD, str(r)],
            pass_fds=(r,),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    except BaseException:
        os.close(w)
        raise
    finally:
        os.close(r)
    try:
        yield w
    finally:
        try:
            os.write(w, b" done\n")
        finally:
            os.close(w)
        guard.wait()


def _child_setup(parent: int, mask: Iterable[int], *, report: int | None) -> Callable[[], None]:
    """What the command's process does between fork and exec: die with the launcher, take the signals.

    ``report``: the guard's pipe; the command then leads a process group of its own and writes its
    number there (the pipe's end closes at exec). Runs in the forked child, so it only makes system
    calls (no locks, no allocation to speak of).
    """
    libc = ctypes.CDLL(None, use_errno=True)  # the interpreter's own symbols, libc's among them
    prctl = libc.prctl
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    restored = set(mask)

    def setup() -> None:
        if report is not None:
            os.setpgid(0, 0)
            os.write(report, b"%d\n" % os.getpid())
        prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:  # the launcher died before the request took effect: nobody supervises us
            os._exit(NOT_EXECUTABLE)
        signal.pthread_sigmask(signal.SIG_SETMASK, restored)  # the command starts with the mask the launcher had

    return setup


def _supervise(child: subprocess.Popen[bytes]) -> int:
    """Forward signals to ``child`` until it exits; its exit status, 128 + N for a signal N."""
    ours = os.getpgrp()
    while True:
        info = signal.sigtimedwait(WAITED, POLL_S)
        if info is not None and info.si_signo != signal.SIGCHLD and not _had_it(info, child.pid, ours):
            child.send_signal(info.si_signo)  # a no-op once the child is reaped
        code = child.poll()
        if code is not None:
            return 128 - code if code < 0 else code


def _had_it(info: signal.struct_siginfo, pid: int, ours: int) -> bool:
    """True for a terminal's SIGINT, SIGQUIT or SIGHUP to the process group that the command is still in."""
    return info.si_signo in KEYBOARD and info.si_code == SI_KERNEL and _group_of(pid) == ours


def _group_of(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def add_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``timesliced run``'s parser, on the command line's subcommands."""
    p = sub.add_parser(
        "run",
        help="launch a command as a member of a job (Client() inside needs no arguments)",
        description=(
            "Register with the node's daemon as job J of group G, then run CMD with $TIMESLICED_JOB, "
            "$TIMESLICED_GROUP, $TIMESLICED_ADDRESS (and $TIMESLICED_PARK, $TIMESLICED_MEMORY, $TIMESLICED_GPUS, "
            "$TIMESLICED_PRIORITY, $TIMESLICED_WEIGHT where given) in its environment, so that timesliced.Client() "
            "and AsyncClient() inside it join the job with no arguments. Every process CMD forks belongs to the job. "
            "SIGINT, SIGTERM, SIGHUP, SIGUSR1, SIGUSR2 and SIGQUIT are forwarded to CMD; the exit status is CMD's "
            "(128+N when a signal N ended it), 2 for bad use or no daemon, 127 when CMD is not found."
        ),
    )
    p.add_argument("--job", help="the job to join (required)")
    p.add_argument("--group", help="the job's group (required)")
    p.add_argument(
        "--park", metavar="METHOD", help=f"how the job is parked: {', '.join(METHODS)} (default: the daemon's)"
    )
    p.add_argument("--memory", metavar="SIZE", help="device memory the job declares per GPU, like 16GiB or 1.5GB")
    p.add_argument(
        "--address", help="daemon socket path or tcp://HOST:PORT (default: $TIMESLICED_ADDRESS, else the local daemon)"
    )
    p.add_argument("--gpus", metavar="LIST", help=f"the group's GPUs as the node numbers them (0,1) or {VISIBLE!r}")
    p.add_argument("--priority", metavar="N", help="the job's priority in its group's queue (an integer, higher first)")
    p.add_argument("--weight", metavar="X", help="the job's share of its group's time (> 0)")
    p.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- CMD ARGS", help="the command to launch")
    p.set_defaults(run=_command)


def _command(args: argparse.Namespace) -> int:
    argv = list(args.argv)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    try:
        priority = None if args.priority is None else int(args.priority)
    except ValueError:
        print(f"timesliced run: --priority {args.priority!r} is not an integer", file=sys.stderr)
        return USAGE
    try:
        weight = None if args.weight is None else float(args.weight)
    except ValueError:
        print(f"timesliced run: --weight {args.weight!r} is not a number", file=sys.stderr)
        return USAGE
    launch = Launch(
        job=args.job or "",
        group=args.group or "",
        command=tuple(argv),
        address=args.address,
        park=args.park,
        memory=args.memory,
        gpus=args.gpus,
        priority=priority,
        weight=weight,
    )
    return run(launch)
