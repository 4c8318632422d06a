"""``timesliced run`` as users run it: a real launcher process, its command, and a daemon.

The command is told nothing but the environment; it joins the job with ``Client()``. Every
wait here is on something a process says (a line it prints) or on the daemon's status, never on
a sleep.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import timesliced
from timesliced.client.sync import daemon_status
from timesliced.daemon.embedded import EmbeddedDaemon
from timesliced.util.processes import descendants, pid_alive

from ..helpers.processes import REPO, wait_for

pytestmark = pytest.mark.slow  # real processes: the quick loop leaves these out

# A command that joins its job with no arguments, acquires, and says what the daemon sees.
JOIN = """
import json, os, sys, timesliced
c = timesliced.Client()
with c.slice() as grant:
    jobs = [(j["job"], j["sessions"], j["pids"]) for j in c.status()["jobs"]]
    print(json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "fence": grant.fence, "jobs": jobs}), flush=True)
c.close()
sys.exit(int(sys.argv[1]))
"""


def launcher(sock: str, *command: str, job: str = "a", extra: tuple[str, ...] = ()) -> list[str]:
    return [
        sys.executable,
        "-m",
        "timesliced",
        "run",
        "--job",
        job,
        "--group",
        "g",
        "--address",
        sock,
        *extra,
        "--",
        *command,
    ]


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO)}


def start(argv: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env()
    )


def line(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    text = proc.stdout.readline()
    assert text, f"the command said nothing; the launcher's stderr: {proc.stderr.read() if proc.stderr else ''}"
    return text.strip()


def jobs(sock: str) -> list[str]:
    return [j["job"] for j in daemon_status(sock)["jobs"]]


@pytest.fixture
def launched() -> Iterator[list[subprocess.Popen[str]]]:
    """Processes a test starts; whatever is left is killed at the end (by pid)."""
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def test_the_command_joins_the_job_with_no_arguments_and_its_exit_status_comes_back(daemon: EmbeddedDaemon) -> None:
    result = subprocess.run(
        launcher(daemon.socket, sys.executable, "-c", JOIN, "3"),
        capture_output=True,
        text=True,
        env=env(),
        timeout=60,
    )
    assert result.returncode == 3, result.stderr
    said = json.loads(result.stdout)
    launcher_pid = said["ppid"]
    # One job, not two: the launcher's connection and the command's, the launcher's PID its root.
    assert said["jobs"] == [["a", 2, sorted([launcher_pid, said["pid"]])]]
    assert said["fence"] == 1
    wait_for(lambda: jobs(daemon.socket) == [], timeout=30, interval=0.05)  # both gone: the job left the daemon


def test_a_grandchild_the_command_forks_later_is_in_the_job(
    daemon: EmbeddedDaemon, launched: list[subprocess.Popen[str]]
) -> None:
    # The command forks a grandchild only after it has started, and waits for it. The grandchild
    # stays until it gets SIGUSR1, so that it is surely alive while the test looks at the tree.
    stays = JOIN.replace("c.close()", "signal.sigwait([signal.SIGUSR1])\nc.close()").replace(
        "import json", "import signal; signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR1])\nimport json"
    )
    command = textwrap.dedent(
        f"""
        import subprocess, sys
        print("started", flush=True)
        sys.exit(subprocess.call([sys.executable, "-c", {stays!r}, "0"]))
        """
    )
    proc = start(launcher(daemon.socket, sys.executable, "-c", command))
    launched.append(proc)
    assert line(proc) == "started"
    said = json.loads(line(proc))
    ((name, sessions, pids),) = said["jobs"]
    assert (name, sessions) == ("a", 2)  # the grandchild's connection joined the launcher's job
    # The launcher's PID is the job's root; the grandchild, forked after registration, descends from it,
    # which is how the methods that move processes (cuda-checkpoint, the engines) find it.
    assert proc.pid in pids and said["pid"] in pids
    assert said["pid"] in descendants([proc.pid])
    os.kill(said["pid"], signal.SIGUSR1)
    assert proc.wait(30) == 0


# The command reports each signal it gets; SIGTERM it leaves at its default, so it dies of it.
CATCHER = """
import os, signal, sys, timesliced
def caught(n, frame):
    print("got", n, flush=True)
for s in (signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT):
    signal.signal(s, caught)
c = timesliced.Client()
c.connect()
print("ready", os.getpid(), flush=True)
while True:
    signal.pause()
"""


def test_signals_reach_the_command_and_sigterm_exits_143(
    daemon: EmbeddedDaemon, launched: list[subprocess.Popen[str]]
) -> None:
    proc = start(launcher(daemon.socket, sys.executable, "-c", CATCHER))
    launched.append(proc)
    word, pid = line(proc).split()
    assert word == "ready" and pid_alive(int(pid))
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT):
        proc.send_signal(sig)
        assert line(proc) == f"got {int(sig)}"  # the command got it, once, and the launcher is still there
    assert proc.poll() is None
    proc.send_signal(signal.SIGTERM)
    # 143 = 128 + SIGTERM: the command died of the forwarded signal (the launcher itself would be -15).
    assert proc.wait(30) == 128 + signal.SIGTERM
    wait_for(lambda: not pid_alive(int(pid)) and jobs(daemon.socket) == [], timeout=30, interval=0.05)


def test_a_command_killed_ends_the_launcher_with_137_and_the_job_leaves(
    daemon: EmbeddedDaemon, launched: list[subprocess.Popen[str]]
) -> None:
    proc = start(launcher(daemon.socket, sys.executable, "-c", CATCHER))
    launched.append(proc)
    _, pid = line(proc).split()
    assert jobs(daemon.socket) == ["a"]
    os.kill(int(pid), signal.SIGKILL)
    assert proc.wait(30) == 128 + signal.SIGKILL
    wait_for(lambda: jobs(daemon.socket) == [], timeout=30, interval=0.05)


def test_a_launcher_killed_outright_takes_its_command_and_grandchildren_and_the_job_leaves(
    daemon: EmbeddedDaemon, launched: list[subprocess.Popen[str]]
) -> None:
    # The command forks a grandchild that joins the job too and would outlive its parent.
    command = textwrap.dedent(
        f"""
        import subprocess, sys
        grandchild = subprocess.Popen([sys.executable, "-c", {CATCHER!r}])
        grandchild.wait()
        """
    )
    proc = start(launcher(daemon.socket, sys.executable, "-c", command))
    launched.append(proc)
    _, grandchild = line(proc).split()
    status: dict[str, Any] = daemon_status(daemon.socket)
    (job,) = status["jobs"]
    assert job["sessions"] == 2 and proc.pid in job["pids"]
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(30) == -signal.SIGKILL
    # The daemon sees the launcher's connection drop; the guard kills the command's process group, the
    # grandchild with it, whose connection drops too; with none of its processes left, the job goes.
    wait_for(lambda: not pid_alive(int(grandchild)), timeout=30, interval=0.05)
    wait_for(lambda: jobs(daemon.socket) == [], timeout=30, interval=0.05)


@pytest.mark.parametrize(
    ("args", "status", "says"),
    [
        (["--job", "a", "--group", "g", "--"], 2, "needs a command to launch"),
        (["--group", "g", "--", "true"], 2, "needs --job J and --group G"),
        (["--job", "a", "--group", "g", "--park", "teleport", "--", "true"], 2, "unknown parking method 'teleport'"),
        (
            ["--job", "a", "--group", "g", "--memory", "banana", "--", "true"],
            2,
            "give the device memory per GPU like 16GiB",
        ),
        (["--job", "a", "--group", "g", "--gpus", "x", "--", "true"], 2, "give the node's GPU numbers"),
        (["--job", "a", "--group", "g", "--priority", "high", "--", "true"], 2, "is not an integer"),
        (["--job", "a", "--group", "g", "--", "no-such-command-here"], 127, "command not found"),
        (["--job", "a", "--group", "g", "--", "{plain}"], 126, "permission denied"),
    ],
)
def test_bad_use_is_one_line_and_a_shell_like_status(tmp_path: Path, args: list[str], status: int, says: str) -> None:
    plain = tmp_path / "data.txt"  # a file that is not executable
    plain.write_text("not a program\n")
    plain.chmod(0o644)
    args = [a.format(plain=plain) for a in args]
    result = subprocess.run(
        [sys.executable, "-m", "timesliced", "run", "--address", str(tmp_path / "none.sock"), *args],
        capture_output=True,
        text=True,
        env=env(),
        timeout=60,
    )
    assert result.returncode == status
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("timesliced run: ")
    assert says in result.stderr


def test_a_malformed_variable_the_command_would_inherit_is_one_line(tmp_path: Path) -> None:
    result = subprocess.run(
        launcher(str(tmp_path / "none.sock"), "true"),
        capture_output=True,
        text=True,
        env={**env(), "TIMESLICED_MEMORY": "banana"},
        timeout=60,
    )
    assert result.returncode == 2
    assert (
        result.stderr
        == "timesliced run: $TIMESLICED_MEMORY='banana' is not a size; give one like 16GiB, 512MiB or 1.5GB\n"
    )


def test_no_daemon_is_one_line_that_says_what_to_do(tmp_path: Path) -> None:
    result = subprocess.run(
        [*launcher(str(tmp_path / "none.sock"), "true")], capture_output=True, text=True, env=env(), timeout=60
    )
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "start the daemon (`timesliced serve`) or pass --address" in result.stderr
    assert str(tmp_path / "none.sock") in result.stderr


def test_a_registration_the_daemon_refuses_is_one_line_and_the_command_never_runs(
    daemon: EmbeddedDaemon, tmp_path: Path
) -> None:
    marker = tmp_path / "ran"
    result = subprocess.run(
        launcher(daemon.socket, "touch", str(marker), extra=("--park", "cuda-checkpoint")),
        capture_output=True,
        text=True,
        env=env(),
        timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "the daemon refused job 'a'" in result.stderr
    assert not marker.exists()


def test_at_a_terminal_the_command_keeps_the_terminal_and_ctrl_c_reaches_it_once(daemon: EmbeddedDaemon) -> None:
    """In a terminal's foreground the command stays in the launcher's process group (job control, a
    debugger's prompt); the terminal's Ctrl-C reaches it from the kernel and is not forwarded again."""
    import re
    import select

    # The launcher in a session of its own whose controlling terminal is a pty, as a terminal starts
    # a shell's job (a wrapper takes the terminal, then becomes the launcher: no fork in this process).
    master, slave = os.openpty()
    take_terminal = (
        "import os, sys; os.setsid(); fd = os.open(sys.argv[1], os.O_RDWR); "
        "[os.dup2(fd, n) for n in (0, 1, 2)]; os.execv(sys.argv[2], sys.argv[2:])"
    )
    argv = launcher(daemon.socket, sys.executable, "-c", CATCHER)
    proc = subprocess.Popen(
        [sys.executable, "-c", take_terminal, os.ttyname(slave), *argv],
        env=env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    pid = proc.pid  # the slave stays open here too: a pty whose every slave is closed reads EIO
    said = ""

    def wait_for_text(pattern: str) -> re.Match[str]:
        nonlocal said
        while not (found := re.search(pattern, said)):
            ready, _, _ = select.select([master], [], [], 30)
            assert ready, f"the terminal showed no {pattern!r}; it showed {said!r}"
            said += os.read(master, 4096).decode(errors="replace")
        return found

    try:
        command = int(wait_for_text(r"ready (\d+)").group(1))
        assert os.getpgid(command) == pid  # the launcher's group: the terminal's foreground
        os.write(master, b"\x03")  # Ctrl-C: the kernel signals the whole foreground group
        wait_for_text(r"got 2")
        os.kill(pid, signal.SIGUSR1)  # a signal to the launcher alone is forwarded
        wait_for_text(r"got 10")
        assert re.findall(r"got \d+", said) == ["got 2", "got 10"]
        os.kill(pid, signal.SIGTERM)
        assert proc.wait(30) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        os.close(master)
        os.close(slave)


# An offload job's command: its executor does the moving, over the command's own connection.
OFFLOADED = """
import signal, timesliced

class Executor:
    def park(self, tags=(), *, verify=None):
        print("parked", 1 << 20, flush=True)
        return {"nbytes": 1 << 20, "seconds": 0.001, "per_gpu": {0: 1 << 20}}

    def unpark(self, tags=(), *, verify=None):
        print("unparked", flush=True)
        return {"nbytes": 1 << 20, "seconds": 0.001, "per_gpu": {0: 1 << 20}}

c = timesliced.Client(offloader=Executor())
with c.slice():
    pass
print("released", flush=True)
while True:
    signal.pause()
"""


def test_an_offload_job_is_parked_by_its_commands_executor_as_one_job(
    daemon: EmbeddedDaemon, launched: list[subprocess.Popen[str]]
) -> None:
    proc = start(launcher(daemon.socket, sys.executable, "-c", OFFLOADED, extra=("--park", "offload")))
    launched.append(proc)
    assert line(proc) == "released"
    with timesliced.Client(job="b", group="g", address=daemon.socket, park="offload") as b:
        b.acquire()  # a is idle and resident: it is parked first, through both of its connections
        assert line(proc) == f"parked {1 << 20}"  # the command's executor moved the job's memory
        (a,) = [j for j in b.status()["jobs"] if j["job"] == "a"]
        assert (a["sessions"], a["location"], a["snapshots"]) == (2, "parked", 1)
        b.release()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 128 + signal.SIGTERM


def blocked_signals(pid: int) -> int:
    """The signals some thread of ``pid`` blocks (one in ``sigtimedwait`` shows its waited ones unblocked)."""
    mask = 0
    for status in Path(f"/proc/{pid}/task").glob("*/status"):
        try:
            rows = status.read_text().splitlines()
        except OSError:  # the thread ended meanwhile
            continue
        mask |= next((int(row.split()[1], 16) for row in rows if row.startswith("SigBlk:")), 0)
    return mask


@pytest.mark.slow
def test_a_signal_while_waiting_for_a_restarting_daemon_ends_the_launch_at_once(
    tmp_path: Path, launched: list[subprocess.Popen[str]]
) -> None:
    import socket

    stale = tmp_path / "stale.sock"  # a socket file with nothing listening: a daemon that crashed
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(stale))
    marker = tmp_path / "ran"
    proc = start(launcher(str(stale), "touch", str(marker)))
    launched.append(proc)
    term = 1 << (signal.SIGTERM - 1)
    # From here on the launcher takes SIGTERM itself (it is waiting for the daemon, up to a minute).
    wait_for(lambda: blocked_signals(proc.pid) & term, timeout=30, interval=0.02)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(10) == 128 + signal.SIGTERM
    assert proc.stderr is not None
    said = proc.stderr.read()
    assert said == "timesliced run: SIGTERM while connecting to the daemon; nothing was started\n", said
    assert not marker.exists()
