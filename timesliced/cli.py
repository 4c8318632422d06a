"""The ``timesliced`` command: serve, status, advise, demo, bench."""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import math
import os
import signal
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import errors
from .client import launch
from .cluster.discovery import DEFAULT_PEER_PORT, Member, NotListedYet, local_addresses, resolve_cluster, settle
from .config import DEFAULT_WEB, ClusterConfig, DaemonConfig, parse_queue_policy, parse_slice_policy
from .daemon.config_commands import add_config_commands, with_config_file
from .daemon.configfile import apply_groups, size_arg
from .daemon.parking import CHOICES
from .env import ADMIN_TOKEN_ENV, PEER_TOKEN_ENV, TOKEN_ENV, default_state_dir, read_admin_token, read_token
from .sim import DEFAULT_BANDWIDTH, DEFAULT_POOL
from .sim import clean as sim_clean
from .util.parse import parse_host_port
from .version import __version__

log = logging.getLogger(__name__)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    try:
        args = with_config_file(parser, args, argv)  # a config file's values under the flags
        return int(args.run(args) or 0)
    except errors.TimeslicedError as exc:
        print(f"timesliced: {exc.message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="timesliced", description="Co-operative GPU time-slicing daemon and tools.")
    parser.add_argument("--version", action="version", version=f"timesliced {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    serve = sub.add_parser("serve", help="run the node daemon")
    add_daemon_options(serve)
    levels = ["DEBUG", "INFO", "WARNING", "ERROR"]
    serve.add_argument("--log-level", default="INFO", choices=levels, help="the least severe log lines shown")
    serve.set_defaults(run=cmd_serve)
    add_config_commands(sub, serve)  # serve --config FILE, and timesliced config check|show|keys

    status = sub.add_parser("status", help="show groups, jobs and devices of a running daemon")
    status.add_argument("--address", help="daemon socket path or HOST:PORT (default: the local daemon)")
    status.add_argument("--json", action="store_true", help="print one JSON object")
    status.set_defaults(run=cmd_status)

    advise = sub.add_parser(
        "advise", help="suggest which jobs of a running daemon to group so that their busy phases interleave"
    )
    advise.add_argument("--address", help="daemon socket path or HOST:PORT (default: the local daemon)")
    advise.add_argument("--json", action="store_true", help="print one JSON object")
    advise.add_argument(
        "--min-phases", type=int, default=5, metavar="N", help="GPU phases and gaps a job needs to be advised on"
    )
    advise.add_argument(
        "--max-slowdown", type=float, default=1.25, metavar="X", help="the most a suggested group may slow a job"
    )
    advise.add_argument(
        "--switch-s", type=float, default=None, metavar="S", help="a switch's cost (default: the measured median)"
    )
    advise.add_argument(
        "--work-s", type=float, default=3600.0, metavar="S", help="each job's run time left, alone (makespan unit)"
    )
    advise.set_defaults(run=cmd_advise)

    launch.add_command(sub)  # timesliced run
    sim_clean.add_command(sub)  # timesliced sim clean

    demo = sub.add_parser("demo", help="run a mixed RL/SFT workload on simulated GPUs and print its figures")
    demo.add_argument("--json", action="store_true", help="print one JSON object")
    demo.add_argument("--scale", type=float, default=1.0, help="stretch every phase by this factor")
    demo.add_argument("--no-serial", action="store_true", help="skip the serial comparison run")
    demo.add_argument(
        "--web",
        default=f"{DEFAULT_WEB[0]}:{DEFAULT_WEB[1]}",
        metavar="HOST:PORT|off",
        help="serve the dashboard while the demo runs (a free port if this one is taken)",
    )
    demo.add_argument("--keep", action="store_true", help="keep the daemon and its dashboard up until Ctrl-C")
    demo.set_defaults(run=cmd_demo)

    bench = sub.add_parser("bench", help="benchmarks that print figures")
    bench_sub = bench.add_subparsers(dest="bench", metavar="BENCH", required=True)
    handoff = bench_sub.add_parser("handoff", help="lock handoff latency between jobs with zero-cost state")
    handoff.add_argument("--rounds", type=int, default=2000)
    handoff.add_argument("--jobs", type=int, default=2, help="jobs ping-ponging the group")
    handoff.add_argument("--json", action="store_true", help="print one JSON object")
    handoff.add_argument("--nodes", type=int, default=1, help="N > 1: a cluster of N daemons; clients on a follower")
    handoff.add_argument(
        "--gap",
        type=float,
        default=0.0,
        metavar="MS",
        help="each job waits MS after its release before it asks again (its work off the GPU; below the 1 ms hold)",
    )
    failover = bench_sub.add_parser("failover", help="kill -9 the leader of 3 daemons; time to the next grant")
    failover.add_argument("--kills", type=int, default=20)
    failover.add_argument("--json", action="store_true", help="print one JSON object")
    failover.set_defaults(run=cmd_bench_failover)
    handoff.set_defaults(run=cmd_bench_handoff)
    offload = bench_sub.add_parser("offload", help="in-process offload copy bandwidth and switch cost")
    offload.add_argument("--mib", type=int, default=1024, help="MiB of regions to park and unpark")
    offload.add_argument("--rounds", type=int, default=5)
    offload.add_argument("--device", choices=["host", "cuda"], default="host", help="host: the CPU stand-in")
    offload.add_argument("--switches", type=int, default=200, help="switches between two jobs through a daemon")
    offload.add_argument(
        "--swaps", type=int, default=8, help="switches of the swap figures, each run (streamed, then park then restore)"
    )
    offload.add_argument("--swap-mib", type=int, default=256, help="MiB of regions of each job in the swap figures")
    offload.add_argument("--swap-region-mib", type=int, default=16, help="MiB per region in the swap figures")
    offload.add_argument(
        "--swap-gbps",
        type=float,
        default=2.0,
        help="the CPU stand-in's link in the swap figures, GB/s each way (0: as fast as memory copies go)",
    )
    offload.add_argument("--json", action="store_true", help="print one JSON object")
    offload.set_defaults(run=cmd_bench_offload)
    load = bench_sub.add_parser(
        "load",
        help="many job processes take rounds on one daemon; throughput, latency, lost grants",
        description="One daemon with a simulated GPU per group and N job processes (round-robin over the groups) "
        "that take rounds for S seconds: acquire, check that their 1 MiB region still holds the bytes they wrote "
        "last round, write new ones, release. Each GPU has room for half its group's jobs, so most grants park one "
        "job and restore another. Prints rounds per second, per-round time waiting on the daemon (acquire plus "
        "release, p50 and p99), the daemon's CPU time and memory, and the failures: errors (exceptions in the jobs), "
        "data_errors (bytes lost), double_grants (two jobs holding a group at once) and lost_grants (grants the "
        "daemon made that no job received, i.e. gaps in a group's fences, plus acquires still waiting 10 s after "
        "the end and job processes that gave no summary). Exits 1 if any failure is counted.",
    )
    load.add_argument("--clients", type=int, default=64, help="job processes, one job each")
    load.add_argument("--groups", type=int, default=8, help="groups, each on its own simulated GPU")
    load.add_argument("--seconds", type=float, default=30.0, help="how long the jobs take rounds")
    load.add_argument("--json", action="store_true", help="print one JSON object")
    load.set_defaults(run=cmd_bench_load)
    workload = bench_sub.add_parser(
        "workload",
        help="the published experiment's shape (2 RL jobs, 1 SFT job) in four modes, with checked bytes",
        description="Runs a scenario of synchronous RL jobs (a sampler process and a trainer process each: rollout, "
        "reward on the CPU, train, weight sync) and SFT jobs as real client processes on a simulated-GPU daemon, "
        "time-scaled, in the modes dedicated (a GPU per worker), serial (one job after another on 2 GPUs), reference "
        "(time-sliced, parking on every handoff, no prefetch) and timesliced. Prints makespan, GPU hours, duty per "
        "GPU, switches, bytes moved, median switch and wait, data errors and overlaps per mode, and the lower bound "
        "(the busiest GPU's work or the longest job alone). Exits 1 if any mode lost a byte or overlapped two jobs.",
    )
    workload.add_argument(
        "--scenario",
        type=Path,
        default=None,
        metavar="FILE",
        help="a TOML scenario, or a packaged one by name: short-gaps (two SFT jobs that cannot share a GPU, with "
        "short data loads over a slow link) (default: the published shape)",
    )
    workload.add_argument(
        "--modes",
        default=None,
        metavar="M,...",
        help="modes to run, comma-separated (default: the four above; also anticipating: the daemon with "
        "--anticipate 5)",
    )
    workload.add_argument("--quick", action="store_true", help="the scenario's [quick] clock and share of iterations")
    workload.add_argument("--json", action="store_true", help="print one JSON object")
    workload.add_argument(
        "--plot", type=Path, default=None, metavar="FILE", help="write a PNG (needs timesliced[plot])"
    )
    workload.set_defaults(run=cmd_bench_workload)
    scale = bench_sub.add_parser(
        "scale",
        help="the pure cores' cost per event at 10 and 1,000 jobs, and a new leader's rebuild (no sockets)",
        description="Drives the leader's orchestrator and its scheduler directly, as 16 simulated nodes of 8 GPUs "
        "would: jobs in groups of one GPU each take turns (acquire, simulated memory on the first grant, release), "
        "every handoff parks one job and restores the next. Prints the time per input (per_event_us) and a new "
        "leader's rebuild from the nodes' reports (rebuild_ms), keyed by job count. Exits 1 if a check failed "
        "(two holders of a group, a fence that did not increase, a refused input, a rebuild that left pieces out).",
    )
    scale.add_argument("--jobs", type=int, nargs="+", default=[10, 1000], help="job counts to run")
    scale.add_argument("--events", type=int, default=20000, help="inputs fed at each job count")
    scale.add_argument("--check", action="store_true", help="also the scheduler's invariants after every input (slow)")
    scale.add_argument("--json", action="store_true", help="print one JSON object")
    scale.set_defaults(run=cmd_bench_scale)
    copy = bench_sub.add_parser(
        "copy",
        help="this machine's memory copy ceiling, and the sim's moves against their bandwidth model",
        description="Measures a warm memory copy (the machine's ceiling), a copy into fresh and into pre-faulted "
        "tmpfs pages, then the simulated GPU's snapshot, restore and swap of 1 MiB to 1 GiB at several model "
        "bandwidths, without and with its pool of warm parked-file buffers: the time the model gives, the time "
        "taken, and their ratio (1.0: on the model).",
    )
    copy.add_argument(
        "--bandwidth",
        type=float,
        action="append",
        metavar="GB/S",
        help="a model bandwidth to try (repeatable; default: 1, 2, half and 0.9 of the two-copy ceiling, and 0.9 of "
        "the one-copy ceiling)",
    )
    copy.add_argument("--mib", type=int, action="append", help="a move size in MiB (repeatable; default 1 16 256 1024)")
    copy.add_argument("--rounds", type=int, default=3, help="moves of each kind per size (the median is shown)")
    copy.add_argument(
        "--pool",
        choices=("both", "on", "off"),
        default="both",
        help="the sim's moves with its pool of warm parked-file buffers (--sim-pool), without it, or both (the "
        "before and after)",
    )
    copy.add_argument("--json", action="store_true", help="print one JSON object")
    copy.set_defaults(run=cmd_bench_copy)
    return parser


def add_daemon_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--state-dir", type=Path, default=None, help=f"state directory (default {default_state_dir()})")
    p.add_argument("--socket", type=Path, default=None, help="Unix socket path (default STATE_DIR/timesliced.sock)")
    p.add_argument(
        "--listen",
        type=parse_host_port,
        default=None,
        metavar="HOST:PORT",
        help="also serve clients over TCP; they must prove the shared token (--token-file)",
    )
    p.add_argument(
        "--token-file",
        "--peer-token-file",
        dest="token_file",
        type=Path,
        default=None,
        metavar="PATH",
        help=f"the deployment's shared token (16 characters or more) that peers and TCP clients prove; "
        f"or ${TOKEN_ENV} (older spellings: --peer-token-file, ${PEER_TOKEN_ENV})",
    )
    p.add_argument(
        "--web",
        default=None,
        metavar="HOST:PORT|off",
        help=f"dashboard, JSON API and /metrics (default {DEFAULT_WEB[0]}:{DEFAULT_WEB[1]}; off: none)",
    )
    p.add_argument(
        "--admin-token-file",
        type=Path,
        default=None,
        metavar="PATH",
        help=f"enables the dashboard's admin actions (or ${ADMIN_TOKEN_ENV}); without it the dashboard is read-only",
    )
    p.add_argument("--node", default=None, help="node name (default: the host name)")
    p.add_argument(
        "--backend",
        default="auto",
        choices=CHOICES,
        help="how jobs that name no method are parked; auto: cuda-checkpoint where the driver supports it, else sim",
    )
    p.add_argument("--gpus", type=int, default=2, help="number of simulated GPUs")
    p.add_argument("--gpu-memory", type=size_arg, default="16GiB", metavar="SIZE", help="memory per simulated GPU")
    p.add_argument(
        "--bandwidth",
        type=float,
        default=DEFAULT_BANDWIDTH / 1e9,
        metavar="GB/S",
        help="simulated host<->device copy bandwidth in GB/s, each direction (default %(default)g; 0: as fast as "
        "memory allows; `timesliced bench copy` shows what this machine can honour)",
    )
    p.add_argument("--sim-dir", type=Path, default=None, help="where simulated device memory lives (tmpfs)")
    p.add_argument(
        "--sim-pool",
        type=size_arg,
        default=f"{DEFAULT_POOL >> 30}GiB",
        metavar="SIZE",
        help="host memory the simulated GPU keeps of restored jobs' parked files, mapped, for the next parks to copy "
        "into at the machine's warm copy rate (default %(default)s; 0: none); counted as room for parked state, "
        "shown as host_memory.sim_pool in status",
    )
    p.add_argument(
        "--lock-timeout", type=float, default=10.0, metavar="S", help="cuda-checkpoint: wait for a process to lock"
    )
    p.add_argument("--op-timeout", type=float, default=600.0, metavar="S", help="one snapshot or restore, any method")
    p.add_argument("--engine-timeout", type=float, default=120.0, metavar="S", help="vllm/sglang: one sleep or wake")
    p.add_argument("--offload-verify", action="store_true", help="offload: checksum every region after restore")
    host = p.add_argument_group("host memory for parked state")
    host.add_argument(
        "--host-memory-limit",
        type=size_arg,
        default=None,
        metavar="SIZE",
        help="a budget for all parked state on this node (default: what the host and its cgroups allow, less a "
        "margin); a park that does not fit is not started, and the job that needed it is told why",
    )
    host.add_argument(
        "--host-memory-margin",
        type=size_arg,
        default=None,
        metavar="SIZE",
        help="host memory kept free of parked state (default: 5%% of the host's memory, 512MiB to 8GiB)",
    )
    residency = p.add_argument_group("co-residency and prefetch")
    residency.add_argument(
        "--memory-headroom",
        type=size_arg,
        default="1GiB",
        metavar="SIZE",
        help="device memory kept free on each GPU beside jobs that declared their memory: jobs whose footprints "
        "plus this fit a GPU stay resident together (default: 1GiB, for CUDA contexts and allocator slack)",
    )
    residency.add_argument(
        "--no-prefetch",
        action="store_true",
        help="do not restore the next waiter beside the holder before its turn (it is restored at its grant)",
    )
    residency.add_argument(
        "--no-stream-switches",
        action="store_true",
        help="park the outgoing job whole before the incoming job's restore starts, instead of streaming the "
        "restore into the room the park frees (a switch then takes the park plus the restore, not about the "
        "longer of the two); for a backend whose streamed switches misbehave on this machine",
    )
    residency.add_argument(
        "--anticipate",
        type=float,
        default=0.0,
        metavar="S",
        help="keep the turn of a holder that yielded, for at most S seconds, when its measured gaps are shorter "
        "than parking it for the next waiter and coming back would take; each decision is in the event log "
        "(default: 0, never)",
    )
    residency.add_argument(
        "--park-every-handoff",
        action="store_true",
        help="every handoff with a waiter parks the outgoing job even when both fit: the behaviour of systems "
        "without co-residency, for comparisons",
    )
    slices = p.add_argument_group("leases and slices")
    slices.add_argument(
        "--max-slice",
        action="append",
        default=[],
        metavar="[GROUP=]S[:ACTION]",
        help="how long a holder may keep its group while others wait (repeatable; no GROUP: every group); "
        "ACTION warn or preempt, default --slice-action",
    )
    slices.add_argument(
        "--policy",
        action="append",
        default=[],
        metavar="[GROUP=]NAME",
        help="who of a group's waiters goes next: fifo (default), priority (higher first, FIFO among equals) "
        "or fair (weighted share of the time held); repeatable, no GROUP: every group",
    )
    slices.add_argument(
        "--aging",
        type=float,
        default=60.0,
        metavar="S",
        help="under priority and fair: waiting this long is worth one priority level, or one second of "
        "weighted hold (bounds every waiter's wait)",
    )
    slices.add_argument(
        "--slice-action",
        choices=("warn", "preempt"),
        default="warn",
        help="past the maximum slice: warn the holder, or also park it after --preempt-grace and queue it again",
    )
    slices.add_argument(
        "--preempt-grace", type=float, default=10.0, metavar="S", help="time from the warning to the preemption"
    )
    slices.add_argument(
        "--lease",
        type=float,
        default=30.0,
        metavar="S",
        help="a client silent this long is disconnected, and loses the lock it held (clients heartbeat; 0: never)",
    )
    slices.add_argument(
        "--recovery-grace",
        type=float,
        default=30.0,
        metavar="S",
        help="after a restart, how long the jobs of the last run keep their places in the queues",
    )
    cluster = p.add_argument_group("cluster (several nodes elect one leader; give one source of members)")
    cluster.add_argument("--peers", default=None, metavar="[ID=]HOST:PORT,...", help="every member, this node's too")
    cluster.add_argument("--slurm", action="store_true", help="members: the nodes of $SLURM_JOB_NODELIST")
    cluster.add_argument("--dns", default=None, metavar="NAME", help="members: the addresses of a headless service")
    cluster.add_argument(
        "--dns-wait",
        type=float,
        default=60.0,
        metavar="S",
        help="with --dns: how long to try again while the name lists no address of this node (a new pod's is late)",
    )
    cluster.add_argument("--node-id", default=None, help="which member this node is (default: found by host name)")
    cluster.add_argument("--peer-port", type=int, default=DEFAULT_PEER_PORT, help="default peer port of members")
    cluster.add_argument(
        "--peer-listen", type=parse_host_port, default=None, metavar="HOST:PORT", help="default: 0.0.0.0:OWN_PORT"
    )
    cluster.add_argument(
        "--election-timeout", type=float, default=1.0, metavar="S", help="randomized in [S, 2S); heartbeats every S/4"
    )


def config_from_args(args: argparse.Namespace) -> DaemonConfig:
    config = DaemonConfig(
        backend=args.backend,
        gpus=args.gpus,
        gpu_memory=args.gpu_memory,
        bandwidth=args.bandwidth * 1e9,
        sim_pool=args.sim_pool,
        listen=args.listen,
        sim_dir=args.sim_dir,
        socket_path=args.socket,
        op_timeout=args.op_timeout,
        lock_timeout=args.lock_timeout,
        engine_timeout=args.engine_timeout,
        offload_verify=args.offload_verify,
        lease=args.lease,
        recovery_grace=args.recovery_grace,
        host_memory_limit=args.host_memory_limit,
        host_memory_margin=args.host_memory_margin,
        memory_headroom=args.memory_headroom,
        prefetch=not args.no_prefetch,
        stream_switches=not args.no_stream_switches,
        park_every_handoff=args.park_every_handoff,
        anticipate=args.anticipate,
    )
    try:
        config.slice_policies = dict(
            parse_slice_policy(s, args.slice_action, args.preempt_grace) for s in args.max_slice
        )
    except ValueError as exc:
        raise SystemExit(f"timesliced: --max-slice: {exc}") from None
    try:
        config.queue_policies = dict(parse_queue_policy(s, args.aging) for s in args.policy)
    except ValueError as exc:
        raise SystemExit(f"timesliced: --policy: {exc}") from None
    try:
        apply_groups(config, args)  # the config file's [groups.NAME] tables, under the flags
    except ValueError as exc:  # a flag the file's groups take (--aging, --preempt-grace) out of range
        raise SystemExit(f"timesliced: {exc}") from None
    if args.lease < 0 or args.recovery_grace < 0:
        raise SystemExit("timesliced: --lease and --recovery-grace must be >= 0 seconds")
    if not 0 <= args.anticipate < float("inf"):  # NaN fails too
        raise SystemExit("timesliced: --anticipate must be a number of seconds >= 0 (0: never keep a turn)")
    if args.web is None:
        config.web, config.web_any_port = DEFAULT_WEB, True
    elif args.web != "off":
        try:
            config.web = parse_host_port(args.web)
        except ValueError as exc:
            raise SystemExit(f"timesliced: --web: {exc}") from None
    try:
        config.admin_token = read_admin_token(args.admin_token_file)
        config.token = read_token(args.token_file)
    except ValueError as exc:
        raise SystemExit(f"timesliced: {exc}") from None
    if config.listen is not None and config.token is None:
        raise SystemExit(
            "timesliced: --listen serves clients over TCP, and they must prove a shared token: "
            f"give --token-file PATH or set ${TOKEN_ENV}"
        )
    if args.state_dir is not None:
        config.state_dir = args.state_dir
    if args.node:
        config.node = args.node
    if config.gpus < 1:
        raise SystemExit("timesliced: --gpus must be at least 1")
    if not (math.isfinite(args.dns_wait) and args.dns_wait >= 0):
        raise SystemExit("timesliced: --dns-wait must be 0 or more seconds")
    if args.peers is not None or args.slurm or args.dns is not None:
        try:
            config.cluster, config.node = cluster_from_args(args, config.token)
        except ValueError as exc:
            raise SystemExit(f"timesliced: {exc}") from None
    for flag in ("op_timeout", "lock_timeout", "engine_timeout"):
        if not getattr(config, flag) > 0:
            raise SystemExit(f"timesliced: --{flag.replace('_', '-')} must be a positive number of seconds")
    return config


def cluster_from_args(args: argparse.Namespace, token: str | None) -> tuple[ClusterConfig, str]:
    """The cluster this daemon is a member of, and its node id; raises ``ValueError``."""
    if token is None:
        raise ValueError(f"a cluster needs a shared token: give --token-file PATH or set ${TOKEN_ENV}")

    def attempt() -> tuple[tuple[Member, ...], Member]:
        return resolve_cluster(
            peers=args.peers,
            slurm=args.slurm,
            dns=args.dns,
            node_id=args.node_id,
            port=args.peer_port,
            environ=os.environ,
            hostname=socket.gethostname(),
            addresses=local_addresses(),
        )

    def retry(exc: NotListedYet) -> None:
        log.warning("%s; trying again (--dns-wait %gs)", exc, args.dns_wait)

    members, me = settle(attempt, args.dns_wait if args.dns is not None else 0.0, on_retry=retry)
    if not args.election_timeout > 0:
        raise ValueError("--election-timeout must be a positive number of seconds")
    lo = args.election_timeout
    cluster = ClusterConfig(
        members={m.id: m.address for m in members},
        listen=args.peer_listen or ("0.0.0.0", me.port),
        token=token,
        election_timeout=(lo, 2 * lo),
        heartbeat_interval=lo / 4,
        dns=(args.dns, args.peer_port) if args.dns is not None else None,
    )
    return cluster, me.id


def cmd_serve(args: argparse.Namespace) -> int:
    from .daemon.root import Daemon

    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        daemon = Daemon(config_from_args(args))
    except errors.BackendUnavailable as exc:
        print(f"timesliced: {exc.message}", file=sys.stderr)
        return 2

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, daemon.stop)
        # Everything built at start-up lives as long as the daemon: keep it out of the collector's
        # full passes, which otherwise walk it and stall a grant by milliseconds now and then.
        await daemon.run(ready=lambda _: gc.freeze())

    asyncio.run(serve())
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from .client.sync import daemon_status

    status = daemon_status(args.address)
    if args.json:
        print(json.dumps(status, indent=2, sort_keys=True))
    else:
        print(format_status(status))
    return 0


def cmd_advise(args: argparse.Namespace) -> int:
    from .client.sync import daemon_status
    from .core.advisor import Options, advise

    try:
        options = Options(args.min_phases, args.max_slowdown, args.switch_s, args.work_s)
        advice = advise(daemon_status(args.address), options)
    except ValueError as exc:
        raise SystemExit(f"timesliced: advise: {exc}") from None
    if args.json:
        print(json.dumps(advice, indent=2, sort_keys=True))
    elif advice["jobs"]:
        print(format_advice(advice))
    if advice["message"] is not None:
        print(f"timesliced: {advice['message']}", file=sys.stderr)
        return 1
    return 0


def format_advice(advice: Any) -> str:
    """``timesliced advise``'s table: the jobs, the current grouping, the suggested one."""
    lines = [
        f"switch cost {advice['switch_s'] * 1000:.0f} ms ({advice['switch_source']}); makespans for "
        f"{advice['work_s']:g} s of each job's own run time; groups slow a job at most {advice['max_slowdown']:g}x",
        "",
        "JOBS",
    ]
    for j in advice["jobs"]:
        lines.append(
            f"  {j['job']}  group={j['group']}  gpus={j['gpus']}  busy={j['busy_s']:.3f}s  gap={j['gap_s']:.3f}s  "
            f"duty={_pct(j['duty'])}  memory={_size(j['memory_bytes'])}"
        )
    for m in advice["missing"]:
        lines.append(f"  {m['job']}  not enough history: {m['phases']} phases, {m['gaps']} gaps (run it longer)")
    for title, plan in (("CURRENT", advice["current"]), ("SUGGESTED", advice["plan"])):
        lines += ["", f"{title}  {plan['gpus']} GPUs  makespan {plan['makespan_s']:.0f}s"]
        for g in plan["groups"]:
            name = f"{g['group']}: " if g["group"] else ""
            lines.append(
                f"  {name}{' + '.join(g['jobs'])}  gpus={g['gpus']}  duty={_pct(g['predicted_duty'])}  "
                f"makespan={g['predicted_makespan_s']:.0f}s ({g['predicted_slowdown']:.2f}x)"
            )
            lines.append(f"      {g['reason']}")
    lines += ["", advice["summary"]]
    return "\n".join(lines)


def cmd_demo(args: argparse.Namespace) -> int:
    from .bench.demo import format_report, run_demo

    say = (lambda msg: print(msg, file=sys.stderr, flush=True)) if args.json else print
    try:
        web = None if args.web == "off" else parse_host_port(args.web)
    except ValueError as exc:
        raise SystemExit(f"timesliced: --web: {exc}") from None

    def keep(daemon: Any) -> None:
        where = f" at {daemon.web_url}" if daemon.web_url else ""
        signal.signal(signal.SIGTERM, _interrupt)
        try:  # before saying so: a Ctrl-C right after the message must end the wait, not the program
            say(f"the demo is done; the daemon stays up{where} (Ctrl-C to stop)")
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass

    report = run_demo(
        scale=args.scale, serial=not args.no_serial, progress=say, web=web, keep=keep if args.keep else None
    )
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0 if report["data_errors"] == 0 else 1


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def cmd_bench_handoff(args: argparse.Namespace) -> int:
    from .bench.handoff import format_handoff, run_handoff

    try:
        result = run_handoff(rounds=args.rounds, jobs=args.jobs, nodes=args.nodes, gap_s=args.gap / 1000)
    except ValueError as exc:
        raise SystemExit(f"timesliced: bench handoff: {exc}") from None
    print(json.dumps(result, indent=2) if args.json else format_handoff(result))
    return 0


def cmd_bench_failover(args: argparse.Namespace) -> int:
    from .bench.cluster import bench_failover
    from .bench.common import print_figures

    print_figures(bench_failover(args.kills), args.json)
    return 0


def cmd_bench_scale(args: argparse.Namespace) -> int:
    from .bench.scale import format_scale, run_scale

    try:
        result = run_scale(tuple(args.jobs), events=args.events, check=args.check)
    except ValueError as exc:
        raise SystemExit(f"timesliced: bench scale: {exc}") from None
    print(json.dumps(result, indent=2) if args.json else format_scale(result))
    return 0 if result["ok"] else 1


def cmd_bench_offload(args: argparse.Namespace) -> int:
    from .bench.offload import format_offload, run_offload

    result = run_offload(
        mib=args.mib,
        rounds=args.rounds,
        device=args.device,
        switches=args.switches,
        swap_mib=args.swap_mib,
        swap_region_mib=args.swap_region_mib,
        swaps=args.swaps,
        swap_gbps=args.swap_gbps,
    )
    print(json.dumps(result, indent=2) if args.json else format_offload(result))
    return 0


def cmd_bench_copy(args: argparse.Namespace) -> int:
    from .bench.copy import SIZES_MIB, format_copy, run_copy

    sizes = tuple(args.mib) if args.mib else SIZES_MIB
    if any(m < 1 for m in sizes) or any(b <= 0 for b in args.bandwidth or ()) or args.rounds < 1:
        raise SystemExit("timesliced: bench copy: sizes, bandwidths and rounds must be positive")
    pools = {"both": (False, True), "on": (True,), "off": (False,)}[args.pool]
    result = run_copy(bandwidths=args.bandwidth, sizes=sizes, reps=args.rounds, pools=pools)
    print(json.dumps(result, indent=2) if args.json else format_copy(result))
    return 0


def cmd_bench_load(args: argparse.Namespace) -> int:
    from .bench.common import print_figures
    from .bench.load import failed, run_load

    signal.signal(signal.SIGTERM, _interrupt)  # stop the daemon and the job processes on the way out
    try:
        figures = run_load(clients=args.clients, groups=args.groups, seconds=args.seconds)
    except ValueError as exc:
        raise SystemExit(f"timesliced: bench load: {exc}") from None
    except RuntimeError as exc:
        print(f"timesliced: bench load: {exc}", file=sys.stderr)
        return 1
    print_figures(figures, args.json)
    return 1 if failed(figures) else 0


def cmd_bench_workload(args: argparse.Namespace) -> int:
    from .bench.scenario import load as load_scenario
    from .bench.workload import failed, format_workload, run_workload

    try:
        scenario = load_scenario(args.scenario)
        if args.quick:
            scenario = scenario.quick()
        modes = [m.strip() for m in args.modes.split(",") if m.strip()] if args.modes else None
        if args.plot is not None:
            from .bench.workload_plot import check_writable, require_matplotlib

            require_matplotlib()
            check_writable(args.plot)
    except ValueError as exc:
        raise SystemExit(f"timesliced: bench workload: {exc}") from None
    signal.signal(signal.SIGTERM, _interrupt)  # stop the daemon and the workers on the way out
    say = (lambda msg: print(msg, file=sys.stderr, flush=True)) if args.json else print
    try:
        report = run_workload(scenario, modes, progress=say)
    except ValueError as exc:
        raise SystemExit(f"timesliced: bench workload: {exc}") from None
    except RuntimeError as exc:
        print(f"timesliced: bench workload: {exc}", file=sys.stderr)
        return 1
    if args.json:  # the figures first: a plot that cannot be written loses none of them
        print(json.dumps(report, indent=2), flush=True)
    else:
        print(format_workload(report), flush=True)
    if args.plot is not None:
        from .bench.workload_plot import plot

        try:
            plot(report, args.plot)
        except OSError as exc:
            print(
                f"timesliced: bench workload: the plot could not be written ({exc}); the figures are above",
                file=sys.stderr,
            )
            return 1
        say(f"plot: {args.plot}")
    return 1 if failed(report) else 0


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _pct(x: Any) -> str:
    return "-" if x is None else f"{x * 100:.0f}%"


def _ms(s: Any) -> str:
    return "-" if s is None else f"{s * 1000:.1f} ms"


def format_status(status: dict[str, Any]) -> str:
    lines = [
        f"timesliced {status['version']} on {status['node']}  backend={status['backend']}  "
        f"uptime={status['uptime_s']:.0f}s  connections={status['connections']}",
    ]
    if parking := status.get("parking"):
        methods = ", ".join(f"{m}" if v == "available" else f"{m} (no: {v})" for m, v in parking["methods"].items())
        lines += [
            f"parking: default {parking['default']} ({parking['why']}); {parking['device_source']} GPUs",
            f"methods: {methods}",
        ]
        if held := parking.get("sim_held"):
            shown = ", ".join(
                f"{job} {_size(h['bytes'])}{' (its park unfinished)' if h['unfinished'] else ''}"
                for job, h in held.items()
            )
            lines.append(
                f"simulated memory parked jobs hold until their writes land (check the sim's file system): {shown}"
            )
    lines += ["", "DEVICES"]
    telemetry = {g["index"]: g for g in status.get("telemetry", {}).get("gpus", [])}
    for d in status["devices"]:
        jobs = ", ".join(f"{name} {_size(v['bytes'])} {v['location']}" for name, v in d["jobs"].items()) or "-"
        t = telemetry.get(d["index"], {})
        duty = f"duty {_pct(t.get('duty_now'))} now, {_pct(t.get('duty_window'))} over {t.get('window_s', 0):.0f}s"
        used = t.get("memory_used") if t.get("memory_used") is not None else d["used"]
        lines.append(f"  gpu{d['index']}  {_size(used)} / {_size(d['capacity'])}  {duty}  {jobs}")
    lines += ["", "GROUPS"]
    for g in status["groups"] or []:
        holder = f"{g['holder']} ({g['held_s']:.1f}s)" if g["holder"] else "-"
        queue = ", ".join(f"{w['job']} ({w['waited_s']:.1f}s{_queue_mark(w)})" for w in g["queue"]) or "-"
        lines.append(
            f"  {g['group']}  gpus={g['gpus']}  state={g['state']}  fence={g['fence']}  holder={holder}  queue={queue}"
        )
        lines.append(
            f"      grants={g['grants']} switches={g['switches']} median switch={_ms(g['median_switch_s'])} "
            f"p95 switch={_ms(g['p95_switch_s'])} median wait={_ms(g['median_wait_s'])} moved={_size(g['bytes_moved'])}"
        )
        if g.get("max_slice_s") is not None:
            overdue = f", holder overdue {g['overdue_s']:.1f}s" if g.get("overdue_s") is not None else ""
            lines.append(
                f"      max slice={g['max_slice_s']:g}s then {g['slice_action']}{overdue}  "
                f"preemptions={g.get('preemptions', 0)}"
            )
        if g.get("policy") not in (None, "fifo"):
            lines.append(f"      policy {g['policy']} (aging {g.get('aging_s', 0):g}s)")
        if g.get("waiting_for"):
            lines.append(f"      next waits for {g['waiting_for']}")
    if not status["groups"]:
        lines.append("  (none)")
    lines += ["", "JOBS"]
    for j in status["jobs"]:
        fault = f"  FAULTED: {j['faulted']}" if j["faulted"] else ""
        refused = f"  park refused: {j['park_refused']}" if j.get("park_refused") else ""
        parked = f"  parked={_size(j['parked_bytes'])}" if j.get("parked_bytes") else ""
        declared = (
            "  declared=" + ",".join(f"gpu{g}:{_size(n)}" for g, n in j["declared"].items())
            if j.get("declared")
            else ""
        )
        over = f"  OVER DECLARED by {_size(j['over_declared_bytes'])}" if j.get("over_declared_bytes") else ""
        lines.append(
            f"  {j['job']}  group={j['group']}  park={j.get('park')}  state={j['location']}  slices={j['slices']}  "
            f"restores={j['restores']}  gpu-s={j['gpu_seconds']:.1f}  pids={j['pids']}{parked}{declared}{over}"
            f"{fault}{refused}"
        )
    if not status["jobs"]:
        lines.append("  (none)")
    lines += ["", "HOST MEMORY FOR PARKED STATE"]
    members = (status.get("cluster") or {}).get("members") or []
    for h in status.get("host") or []:
        node = members[h["slot"]] if 0 <= h["slot"] < len(members) else h["slot"]
        limit = f"  limit={_size(h['limit'])}" if h.get("limit") is not None else ""
        pools = "  ".join(f"{p}={_size(v['parked'])}/{_size(v['budget'])}" for p, v in h.get("pools", {}).items())
        lines.append(
            f"  {node}  parked={_size(h['parked'])} / budget {_size(h['budget'])}  under way={_size(h['reserved'])}  "
            f"being freed={_size(h['freeing'])}{limit}" + (f"  {pools}" if pools else "")
        )
    reading = status.get("host_memory") or {}
    if reading.get("age_s") is not None:
        available = _size(reading["available"]) if reading.get("available") is not None else "unknown"
        lines.append(f"  this node: MemAvailable {available}, margin {_size(reading['margin'])}")
        if reading.get("error"):
            lines.append(f"  cannot read: {reading['error']}")
    elif not status.get("host"):
        lines.append("  (not read yet)")
    counters = " ".join(f"{name.replace('_', ' ')}={n}" for name, n in status["counters"].items())
    lines += ["", f"connections {counters}"]
    return "\n".join(lines)


def _queue_mark(waiter: dict[str, Any]) -> str:
    marks = []
    if waiter.get("preempted"):
        marks.append("preempted")
    if waiter.get("kept_for_s") is not None:
        marks.append(f"turn kept {waiter['kept_for_s']:.0f}s")
    if waiter.get("gang"):
        marks.append(f"gang {waiter['gang']}")
    if waiter.get("effective_priority") is not None:
        marks.append(f"priority {waiter['effective_priority']:.2f}")
    return "".join(f", {m}" for m in marks)


if __name__ == "__main__":
    raise SystemExit(main())
