"""A fake ``srun`` and ``scontrol`` for running Slurm batch scripts on one machine.

``python fake_slurm.py srun [OPTIONS] CMD ARGS...`` and ``python fake_slurm.py scontrol show hostnames
[LIST]``; :func:`install` writes ``srun`` and ``scontrol`` wrappers into a directory for the PATH.

The fake allocation is the batch environment's ``SLURM_JOB_ID``, ``SLURM_JOB_NODELIST`` and
``SLURM_JOB_NUM_NODES``; every "node" is this machine. What the fake does is what srun(1) documents
for the options it accepts, no more:

- a step runs one task per node on ``--nodes`` nodes (the first ones of the allocation, or those of
  ``--nodelist``), ``--ntasks`` in all, at most ``--ntasks-per-node`` on each; more tasks than
  nodes times tasks per node, or nodes outside the allocation, are refused as srun refuses them;
- each task gets the caller's environment (``--export=ALL``, the default) plus ``SLURMD_NODENAME``,
  ``SLURM_NODEID``, ``SLURM_PROCID``, ``SLURM_STEP_ID``, ``SLURM_STEP_NUM_NODES`` and
  ``SLURM_STEP_NUM_TASKS``;
- ``--output`` with ``%j`` (job id), ``%N`` (node name), ``%t`` (task id) and ``%s`` (step id)
  sends each task's output there, else to srun's own;
- SIGTERM, SIGINT, SIGHUP, SIGUSR1 and SIGUSR2 sent to srun are forwarded to every task (srun(1):
  "Signals sent to the srun command are automatically forwarded to the tasks it is controlling");
- srun exits with the highest task exit code, or 128 + the highest signal that ended a task.

Unknown options are refused, so a script that relies on more than this fails here rather than on a
real cluster. Every step appends what happened to ``$FAKE_SLURM_LOG`` as JSON lines: ``start``
(argv, options, the task list with node and pid, and the names of the shared-token variables in
the step's environment), ``signal`` and ``exit`` (status). A task
whose srun is killed with SIGKILL is killed with it (PR_SET_PDEATHSIG), as slurmstepd would.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
# srun options that take a value, and those that do not (the ones the batch scripts use).
VALUED = {"--nodes", "-N", "--ntasks", "-n", "--ntasks-per-node", "--nodelist", "-w", "--output", "-o"}
FLAGS = {"--overlap", "--label", "-l"}
PR_SET_PDEATHSIG = 1  # prctl(2): the signal a child gets when its parent thread dies


def hostnames(text: str) -> list[str]:
    """Expand a Slurm hostlist as ``scontrol show hostnames`` does."""
    from timesliced.cluster.discovery import expand_hostlist

    return expand_hostlist(text)


def log(event: dict[str, Any]) -> None:
    path = os.environ.get("FAKE_SLURM_LOG")
    if path:
        with open(path, "a") as f:  # one short line per write: appends from several sruns do not interleave
            f.write(json.dumps({"at": time.monotonic(), **event}) + "\n")


def fail(message: str, status: int = 1) -> None:
    print(f"srun: error: {message}", file=sys.stderr)
    raise SystemExit(status)


def parse(argv: list[str]) -> tuple[dict[str, Any], list[str]]:
    """srun's options and the command; stops at the first word that is not an option."""
    options: dict[str, Any] = {"overlap": False}
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        word = argv[i]
        name, eq, value = word.partition("=")
        if name in FLAGS:
            options[name.lstrip("-")] = True
        elif name in VALUED:
            if not eq:
                i += 1
                if i >= len(argv):
                    fail(f"option {name} needs a value")
                value = argv[i]
            key = {"-N": "nodes", "-n": "ntasks", "-w": "nodelist", "-o": "output"}.get(name, name.lstrip("-"))
            options[key] = value
        else:
            fail(f"the fake srun does not know the option {word!r}")
        i += 1
    if i >= len(argv):
        fail("no command to run")
    return options, argv[i:]


def plan(options: dict[str, Any]) -> list[str]:
    """The node of each task, in task order."""
    if not os.environ.get("SLURM_JOB_ID"):
        fail("no allocation: SLURM_JOB_ID is not set (the fake runs inside a batch script only)")
    allocation = hostnames(os.environ["SLURM_JOB_NODELIST"])
    if "nodelist" in options:
        nodes = hostnames(options["nodelist"])
        outside = [n for n in nodes if n not in allocation]
        if outside:
            fail(f"requested nodes {','.join(outside)} are not in the allocation")
    else:
        nodes = allocation[: int(options.get("nodes", len(allocation)))]
    if int(options.get("nodes", len(nodes))) != len(nodes):
        fail(f"--nodes={options['nodes']} does not match the {len(nodes)} nodes of --nodelist")
    if len(nodes) > len(allocation):
        fail(f"--nodes={len(nodes)} is more than the {len(allocation)} nodes of the allocation")
    ntasks = int(options.get("ntasks", len(nodes)))
    per_node = int(options.get("ntasks-per-node", ntasks))
    if ntasks > len(nodes) * per_node or ntasks < len(nodes):
        fail(f"cannot run {ntasks} tasks on {len(nodes)} nodes with at most {per_node} per node")
    # Block distribution: fill each node up to its share before the next one.
    return [nodes[min(t // per_node, len(nodes) - 1)] for t in range(ntasks)]


def _die_with_parent() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def srun(argv: list[str]) -> int:
    options, command = parse(argv)
    nodes = plan(options)
    step = int(time.monotonic_ns() % 1_000_000_000)
    job = os.environ["SLURM_JOB_ID"]
    tasks: list[subprocess.Popen[bytes]] = []
    files = []

    def forward(signum: int, frame: Any) -> None:
        log({"event": "signal", "srun": os.getpid(), "signal": signal.Signals(signum).name})
        for p in tasks:
            if p.poll() is None:
                p.send_signal(signum)

    for sig in FORWARDED:  # before the first task starts: no signal can come too early to be forwarded
        signal.signal(sig, forward)
    for task, node in enumerate(nodes):
        env = {
            **os.environ,
            "SLURMD_NODENAME": node,
            "SLURM_NODEID": str(sorted(set(nodes), key=nodes.index).index(node)),
            "SLURM_PROCID": str(task),
            "SLURM_STEP_ID": str(step),
            "SLURM_STEP_NUM_NODES": str(len(set(nodes))),
            "SLURM_STEP_NUM_TASKS": str(len(nodes)),
        }
        out = None
        if "output" in options:
            name = options["output"].replace("%j", job).replace("%N", node).replace("%t", str(task))
            out = open(name.replace("%s", str(step)), "ab")  # noqa: SIM115 (closed once the tasks end)
            files.append(out)
        tasks.append(subprocess.Popen(command, env=env, stdout=out, stderr=out, preexec_fn=_die_with_parent))
    started = [{"node": n, "pid": p.pid} for n, p in zip(nodes, tasks, strict=True)]
    # Which shared-token variables the step's environment holds (their names, never their values).
    tokens = sorted(name for name in ("TIMESLICED_TOKEN", "TIMESLICED_PEER_TOKEN") if name in os.environ)
    log(
        {
            "event": "start",
            "srun": os.getpid(),
            "argv": argv,
            "options": options,
            "command": command,
            "tasks": started,
            "tokens": tokens,
        }
    )
    codes = [p.wait() for p in tasks]  # PEP 475: a forwarded signal does not interrupt the wait
    for f in files:
        f.close()
    exits = [c for c in codes if c >= 0]
    signals = [-c for c in codes if c < 0]
    status = 128 + max(signals) if signals else max(exits, default=0)
    log({"event": "exit", "srun": os.getpid(), "status": status, "codes": codes})
    return status


def scontrol(argv: list[str]) -> int:
    if argv[:2] != ["show", "hostnames"] or len(argv) > 3:
        print(f"scontrol: the fake knows only 'show hostnames [LIST]', not {' '.join(argv)!r}", file=sys.stderr)
        return 1
    text = argv[2] if len(argv) == 3 else os.environ.get("SLURM_JOB_NODELIST", "")
    try:
        names = hostnames(text)
    except ValueError as exc:
        print(f"scontrol: error: {exc}", file=sys.stderr)
        return 1
    print("\n".join(names))
    return 0


def install(bin_dir: Path, python: str = sys.executable, pythonpath: str | None = None) -> None:
    """Write ``srun`` and ``scontrol`` into ``bin_dir``, running this module with ``python``."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    here = Path(__file__).resolve()
    path = f"PYTHONPATH={pythonpath} " if pythonpath else ""
    for tool in ("srun", "scontrol"):
        wrapper = bin_dir / tool
        wrapper.write_text(f'#!/bin/sh\n{path}exec "{python}" "{here}" {tool} "$@"\n')
        wrapper.chmod(0o755)


if __name__ == "__main__":
    tool, *rest = sys.argv[1:]
    raise SystemExit(srun(rest) if tool == "srun" else scontrol(rest))
