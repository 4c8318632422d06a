"""One job of the GPU check: fill device memory, take turns on the GPU, verify every byte after every turn.

Run by ``check.py``, two at a time against one daemon::

    python tests/gpu/workload.py --job check-a --socket S --method cuda-checkpoint|offload \\
        --gib 4 --rounds 10 [--torch auto|on|off] [--peers 2]

- ``cuda-checkpoint``: plain ``cuMemAlloc`` allocations (at most 1 GiB each) in
  the primary context of GPU 0; the daemon parks the whole process with the
  driver's checkpoint API, and the job registers no offloader.
- ``offload``: regions of an ``Offloader`` over ``CudaDeviceMemory`` (tag
  ``weights``, at most 1 GiB each), which the daemon directs the job to park
  and unpark in its own client thread.
- torch (``auto``: where it imports and sees CUDA): one more tensor, filled
  with a value; with ``offload`` it is registered with a ``TorchOffload``
  under the same tag.

All GPU work (context, allocations, copies) happens inside granted slices,
never while the daemon may have the job parked: the first slice allocates and
fills, each of the ``--rounds`` slices after it first verifies every byte
against what the previous slice wrote, then writes a new pattern. Each 64 MiB
chunk of each allocation holds its own 32-bit word per job and round, so a
chunk restored to the wrong place or from the wrong round is caught, not just
a lost one. A mismatch is counted and reported, never raised.

With ``--plan-dir D`` the number of rounds is planned during the run
(``check.py`` sizes it from the first measured switch): the first job to get
a turn that came with a restore writes ``D/first-turn.json`` (its switch time
and its verify and fill time) and, still holding the GPU so that no job moves
on, waits for ``D/plan.json`` (``{"rounds": N}``); every job reads the plan
after each of its turns and stops after round ``min(N, --rounds)``. Both files
are created once, atomically (``os.link`` of a finished file), so every job
reads the same plan; a job that waits in vain (``--plan-timeout``) writes
``--rounds`` as the plan itself.

Prints one JSON object on stdout at the end; exit status 0 when every round
ran and every byte matched, 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import json
import os
import struct
import sys
import time
import traceback
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
GROUP = "gpu-check"
TAG = "weights"
MiB = 1 << 20
GiB = 1 << 30
CHUNK = 64 * MiB  # one verification copy; allocations are split into chunks of this size
MAX_ALLOC = GiB  # the largest single allocation
ALIGN = 2 * MiB  # allocation sizes are rounded up to this (the VMM granularity of current GPUs)
MAX_SAMPLES = 5  # mismatches described in detail
FIRST_TURN = "first-turn.json"
PLAN = "plan.json"


def bootstrap() -> None:
    """Make the repository importable when this file runs as a script from a checkout."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))


# --- the driver ---------------------------------------------------------------------------


class CudaError(RuntimeError):
    """A driver call that did not return CUDA_SUCCESS."""

    def __init__(self, call: str, result: Any) -> None:
        name = getattr(result, "name", None) or f"CUresult {int(result)}"
        super().__init__(f"{call} failed: {name}")
        self.call = call
        self.result = name


class Driver:
    """``cuda.bindings.driver`` calls that raise :class:`CudaError` instead of returning a failing CUresult."""

    def __init__(self) -> None:
        from cuda.bindings import driver

        self.d: Any = driver

    def __call__(self, name: str, *args: Any) -> Any:
        """The call's outputs: None, one value, or a tuple of them."""
        out = getattr(self.d, name)(*args)
        if not isinstance(out, tuple):
            out = (out,)
        if int(out[0]) != 0:
            raise CudaError(name, out[0])
        values = out[1:]
        if not values:
            return None
        return values[0] if len(values) == 1 else values

    def ptr(self, address: int) -> Any:
        return self.d.CUdeviceptr(address)

    def primary_context(self, ordinal: int) -> tuple[Any, Any]:
        """(device, retained primary context) of GPU ``ordinal``; ``cuInit`` first."""
        self("cuInit", 0)
        device = self("cuDeviceGet", ordinal)
        return device, self("cuDevicePrimaryCtxRetain", device)


class HostDriver:
    """A host stand-in for the CUDA calls a job makes, over ``HostDeviceMemory``: the check's own tests need no GPU.

    Only what :class:`Memory` calls with the offload method; device pointers
    are the fake addresses of the host device memory, host buffers are real
    ``ctypes`` memory (so :func:`uniform` reads them as it reads pinned memory).
    """

    def __init__(self, memory: Any) -> None:
        self.memory = memory
        self._buffers: dict[int, Any] = {}

    def __call__(self, name: str, *args: Any) -> Any:
        call = getattr(self, f"_{name}", None)
        if call is None:
            raise CudaError(name, _NotSupported())
        return call(*args)

    def ptr(self, address: int) -> int:
        return address

    def primary_context(self, ordinal: int) -> tuple[Any, Any]:
        return ordinal, None

    def _cuCtxSetCurrent(self, context: Any) -> None:
        return None

    def _cuMemHostAlloc(self, nbytes: int, flags: int) -> int:
        buf = (ctypes.c_char * nbytes)()
        address = ctypes.addressof(buf)
        self._buffers[address] = buf
        return address

    def _cuMemsetD32(self, ptr: int, value: int, count: int) -> None:
        self.memory.write(ptr, struct.pack("<I", value) * count)

    def _cuMemcpyDtoH(self, host: int, ptr: int, nbytes: int) -> None:
        ctypes.memmove(host, self.memory.read(ptr, nbytes), nbytes)

    def _cuCtxSynchronize(self) -> None:
        self.memory.synchronize()


class _NotSupported(int):
    name = "CUDA_ERROR_NOT_SUPPORTED (the host stand-in has no such call)"

    def __new__(cls) -> _NotSupported:
        return super().__new__(cls, 801)


_libc: Any = None


def _memcmp(a: int, b: int, n: int) -> int:
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        libc.memcmp.restype = ctypes.c_int
        _libc = libc
    return int(_libc.memcmp(a, b, n))


def uniform(address: int, nbytes: int, word: bytes) -> bool:
    """Whether the ``nbytes`` of host memory at ``address`` are ``word`` (4 bytes) over and over.

    The first word matches and every byte equals the one four bytes later,
    so every byte is checked, with one ``memcmp`` and no expected buffer.
    """
    if nbytes % 4 or len(word) != 4:
        raise ValueError("nbytes must be a multiple of 4 and word 4 bytes long")
    if nbytes == 0:
        return True
    if ctypes.string_at(address, 4) != word:
        return False
    return nbytes == 4 or _memcmp(address, address + 4, nbytes - 4) == 0


def first_mismatch(address: int, nbytes: int, word: bytes) -> tuple[int, bytes]:
    """(offset, the 4 bytes found there) of the first word that is not ``word``; (-1, b"") if none."""
    step = MiB
    expected = word * (step // 4)
    for start in range(0, nbytes, step):
        n = min(step, nbytes - start)
        data = ctypes.string_at(address + start, n)
        if data != expected[:n]:
            for i in range(0, n, 4):
                if data[i : i + 4] != word:
                    return start + i, data[i : i + 4]
    return -1, b""


def pattern(seed: int, rnd: int, alloc: int, chunk: int) -> int:
    """The 32-bit word that ``chunk`` of allocation ``alloc`` holds after round ``rnd`` (never 0)."""
    x = (seed * 0x9E3779B1 + rnd * 0x85EBCA77 + alloc * 0xC2B2AE3D + chunk * 0x27D4EB2F + 0x165667B1) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x2C1B3C6D) & 0xFFFFFFFF
    x ^= x >> 12
    x = (x * 0x297A2D39) & 0xFFFFFFFF
    x ^= x >> 15
    return x or 1


def chunks(nbytes: int, size: int = CHUNK) -> list[tuple[int, int]]:
    return [(off, min(size, nbytes - off)) for off in range(0, nbytes, size)]


def split(total: int, most: int = MAX_ALLOC, align: int = ALIGN) -> list[int]:
    """``total`` bytes (rounded up to ``align``) as allocation sizes of at most ``most``."""
    total = max(align, -(-total // align) * align)
    return [min(most, total - off) for off in range(0, total, most)]


# --- memory under test ------------------------------------------------------------------


@dataclass
class Allocation:
    ptr: int
    nbytes: int
    region: Any = None  # the offload Region, for the offload method


@dataclass
class Mismatch:
    round: int
    what: str  # "alloc 2" or "torch"
    offset: int
    expected: str
    found: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "round": self.round,
            "what": self.what,
            "offset": self.offset,
            "expected": self.expected,
            "found": self.found,
        }


@dataclass
class Round:
    round: int
    restored: bool
    switch_s: float
    waited_s: float
    verify_s: float = 0.0
    fill_s: float = 0.0
    bad: int = 0  # chunks (or the torch tensor) that did not hold what the last round wrote
    done: bool = False  # verified (round 0: allocated) and filled

    def to_dict(self) -> dict[str, Any]:
        return {
            "round": self.round,
            "restored": self.restored,
            "switch_s": self.switch_s,
            "waited_s": self.waited_s,
            "verify_s": self.verify_s,
            "fill_s": self.fill_s,
            "bad": self.bad,
            "done": self.done,
        }


@dataclass
class Memory:
    """Every allocation of the job, its fill and its verification; CUDA calls happen on the calling thread."""

    seed: int
    gpu: int = 0
    cu: Any = None  # Driver, set before the first CUDA call
    offloader: Any = None  # Offloader (offload method)
    torch_offload: Any = None  # TorchOffload (offload method with torch)
    allocs: list[Allocation] = field(default_factory=list)
    tensor: Any = None
    tensor_numel: int = 0
    host: int = 0  # pinned staging buffer of CHUNK bytes
    context: Any = None
    mismatches: list[Mismatch] = field(default_factory=list)
    data_errors: int = 0

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.allocs) + self.tensor_numel * 4

    def setup(self, total: int, torch: Any, torch_bytes: int) -> None:
        """Make the primary context current here, allocate everything and the staging buffer."""
        _, self.context = self.cu.primary_context(self.gpu)
        self.cu("cuCtxSetCurrent", self.context)
        for size in split(total):
            if self.offloader is not None:
                region = self.offloader.alloc(size, tag=TAG, gpu=self.gpu)
                self.allocs.append(Allocation(region.ptr, size, region))
            else:
                self.allocs.append(Allocation(int(self.cu("cuMemAlloc", size)), size))
        self.host = int(self.cu("cuMemHostAlloc", CHUNK, 0))
        if torch is not None:
            self.tensor_numel = torch_bytes // 4
            self.tensor = torch.empty(self.tensor_numel, dtype=torch.int32, device=f"cuda:{self.gpu}")
            if self.torch_offload is not None:
                self.torch_offload.register(self.tensor, tag=TAG, name="check-tensor")

    def fill(self, rnd: int) -> None:
        for a_index, alloc in enumerate(self.allocs):
            for c_index, (off, n) in enumerate(chunks(alloc.nbytes)):
                value = pattern(self.seed, rnd, a_index, c_index)
                self.cu("cuMemsetD32", self.cu.ptr(alloc.ptr + off), value, n // 4)
        if self.tensor is not None:
            self.tensor.fill_(self._torch_value(rnd))
        # Everything written before the slice ends: an offload park copies on its own stream.
        self.cu("cuCtxSynchronize")

    def verify(self, rnd: int) -> int:
        """Check every byte against what round ``rnd`` wrote; returns how many chunks were wrong."""
        bad = 0
        for a_index, alloc in enumerate(self.allocs):
            what = f"alloc {a_index}"
            if alloc.region is not None and (not alloc.region.resident or alloc.region.ptr != alloc.ptr):
                bad += self._record(rnd, what, 0, "resident at the same address", "parked or moved")
                continue
            for c_index, (off, n) in enumerate(chunks(alloc.nbytes)):
                word = struct.pack("<I", pattern(self.seed, rnd, a_index, c_index))
                self.cu("cuMemcpyDtoH", self.host, self.cu.ptr(alloc.ptr + off), n)
                if not uniform(self.host, n, word):
                    where, found = first_mismatch(self.host, n, word)
                    bad += self._record(rnd, what, off + max(where, 0), word[::-1].hex(), found[::-1].hex())
        if self.tensor is not None:
            bad += self._verify_tensor(rnd)
        return bad

    def _verify_tensor(self, rnd: int) -> int:
        value = self._torch_value(rnd)
        t = self.tensor
        if t.untyped_storage().nbytes() != self.tensor_numel * 4:  # parked per storage: the shape stays
            have = t.untyped_storage().nbytes()
            return self._record(rnd, "torch", 0, f"{self.tensor_numel * 4} bytes", f"{have} (still parked?)")
        wrong = int((t != value).count_nonzero().item())
        if wrong:
            return self._record(rnd, "torch", 0, f"{value:#x} everywhere", f"{wrong} elements differ")
        return 0

    def _torch_value(self, rnd: int) -> int:
        return pattern(self.seed, rnd, 1 << 16, 0) >> 1  # fits a signed 32-bit element

    def _record(self, rnd: int, what: str, offset: int, expected: str, found: str) -> int:
        self.data_errors += 1
        if len(self.mismatches) < MAX_SAMPLES:
            self.mismatches.append(Mismatch(rnd, what, offset, expected, found))
        return 1


# --- coordination through the daemon ----------------------------------------------------


def group_jobs(address: str) -> tuple[list[dict[str, Any]], str | None]:
    """The daemon's jobs of the check's group, and the group's holder."""
    from timesliced.client.sync import daemon_status

    status = daemon_status(address, timeout=5)
    jobs = [j for j in status.get("jobs", []) if j.get("group") == GROUP]
    holder = next((g.get("holder") for g in status.get("groups", []) if g.get("group") == GROUP), None)
    return jobs, holder


def wait_for_peers(address: str, count: int, timeout: float) -> None:
    """Until ``count`` jobs are registered in the group, so that the turns start at once."""
    deadline = time.monotonic() + timeout
    while True:
        jobs, _ = group_jobs(address)
        if len(jobs) >= count:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {len(jobs)} of {count} jobs registered with the daemon after {timeout:.0f}s")
        time.sleep(0.05)


def wait_until_peers_done(address: str, me: str, slices: int, timeout: float) -> bool:
    """Until every other job of the group has had ``slices`` slices and released the last one.

    Exiting earlier would race with the daemon parking this job for a peer's
    next turn. False when the peers took longer than ``timeout``.
    """
    deadline = time.monotonic() + timeout
    while True:
        jobs, holder = group_jobs(address)
        others = [j for j in jobs if j["job"] != me]
        if all(j.get("faulted") or (j["slices"] >= slices and holder != j["job"]) for j in others):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


# --- the plan -------------------------------------------------------------------------


def write_once(path: Path, data: dict[str, Any]) -> bool:
    """Create ``path`` holding ``data`` unless it exists, atomically; whether this call created it.

    The content is written to a private file first and linked into place:
    ``link(2)`` fails with EEXIST when the name exists, so a reader never sees
    a half-written file and only one writer wins.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data))
    try:
        os.link(tmp, path)
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)
    return True


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def planned_rounds(plan_dir: Path, asked: int) -> int | None:
    """The rounds of the plan in ``plan_dir`` (at most ``asked``), or None while there is none."""
    plan = read_json(plan_dir / PLAN)
    if plan is None or not isinstance(plan.get("rounds"), int):
        return None
    return max(1, min(asked, int(plan["rounds"])))


def announce(plan_dir: Path, job: str, record: Round, asked: int, timeout: float) -> str | None:
    """Write the first restored turn (unless another job did) and wait for the plan; a note if it never came."""
    first = {
        "job": job,
        "round": record.round,
        "switch_s": record.switch_s,
        "waited_s": record.waited_s,
        "verify_s": record.verify_s,
        "fill_s": record.fill_s,
        "at": time.monotonic(),
    }
    if not write_once(plan_dir / FIRST_TURN, first):
        return None
    deadline = time.monotonic() + timeout
    while not (plan_dir / PLAN).exists():
        if time.monotonic() > deadline:
            why = f"no plan within {timeout:.0f}s of the first restored turn; every job takes all {asked} rounds"
            if write_once(plan_dir / PLAN, {"rounds": asked, "by": job, "why": why}):
                return why
            return None
        time.sleep(0.02)
    return None


# --- the job ----------------------------------------------------------------------------


def load_torch(mode: str) -> tuple[Any, str]:
    """(torch or None, why not): ``on`` requires it, ``auto`` takes it where it imports."""
    if mode == "off":
        return None, "--torch off"
    try:
        import torch
    except ImportError as exc:
        if mode == "on":
            raise RuntimeError(f"--torch on, but torch does not import: {exc}") from exc
        return None, "not installed"
    return torch, ""


@contextlib.contextmanager
def timed(into: list[float]) -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        into.append(time.perf_counter() - start)


def run(args: argparse.Namespace) -> dict[str, Any]:
    bootstrap()
    from timesliced import Client

    started = time.perf_counter()
    report: dict[str, Any] = {
        "job": args.job,
        "method": args.method,
        "pid": os.getpid(),
        "gib": args.gib,
        "rounds_asked": args.rounds,
        "rounds": [],
        "errors": [],
        "notes": [],
    }
    torch: Any = None
    torch_why = ""
    memory = Memory(seed=zlib.crc32(args.job.encode()), gpu=args.gpu)
    client: Any = None
    rounds: list[Round] = []
    planned = args.rounds  # lowered by the plan, if there is one
    try:
        executor: Any = None
        if args.host_memory:
            from timesliced.client.offload import HostDeviceMemory, Offloader

            if args.method != "offload":
                raise RuntimeError("--host-memory runs the offload method only")
            device = HostDeviceMemory(bandwidth=args.host_bandwidth * 1e9 or None)
            memory.cu = HostDriver(device)
            memory.offloader = Offloader(device, verify=False)
            executor = memory.offloader
            torch_why = "--host-memory"
        else:
            torch, torch_why = load_torch(args.torch)
            memory.cu = Driver()
        if args.method == "offload" and not args.host_memory:
            from timesliced.client.offload import CombinedOffload, CudaDeviceMemory, Offloader

            memory.offloader = Offloader(CudaDeviceMemory(), verify=False)
            executor = memory.offloader
            if torch is not None:
                from timesliced.client.offload import TorchOffload

                memory.torch_offload = TorchOffload()
                executor = CombinedOffload(memory.offloader, memory.torch_offload)
        client = Client(args.job, GROUP, address=args.socket, gpus=[args.gpu], park=args.method, offloader=executor)
        client.connect()
        wait_for_peers(args.socket, args.peers, args.start_timeout)
        plan_dir = Path(args.plan_dir) if args.plan_dir else None
        rnd = 0
        while rnd <= planned:
            with client.slice(timeout=args.acquire_timeout) as grant:
                record = Round(rnd, grant.restored, grant.switch_s, grant.waited_s)
                rounds.append(record)
                if rnd == 0:
                    # First CUDA work of the process: inside the slice, like all of it.
                    if torch is not None and not torch.cuda.is_available():
                        torch, torch_why = None, "installed without CUDA"
                        if args.torch == "on":
                            raise RuntimeError("--torch on, but torch sees no CUDA device")
                    memory.setup(int(args.gib * GiB), torch, args.torch_mib * MiB)
                else:
                    spent: list[float] = []
                    with timed(spent):
                        record.bad = memory.verify(rnd - 1)
                    record.verify_s = spent[0]
                spent = []
                with timed(spent):
                    memory.fill(rnd)
                record.fill_s = spent[0]
                record.done = True
                if plan_dir is not None and grant.restored and rnd >= 1:
                    # Still holding the GPU: no job takes another turn until the plan is there.
                    note = announce(plan_dir, args.job, record, args.rounds, args.plan_timeout)
                    if note:
                        report["notes"].append(note)
            rnd += 1
            if plan_dir is not None:
                planned = planned_rounds(plan_dir, args.rounds) or planned
        if args.peers > 1 and not wait_until_peers_done(args.socket, args.job, planned + 1, args.end_timeout):
            report["notes"].append(f"the other jobs had not finished {args.end_timeout:.0f}s after this one")
    except Exception as exc:
        report["errors"].append(f"{type(exc).__name__}: {exc}")
        report["traceback"] = traceback.format_exc(limit=8)
    finally:
        if client is not None:
            client.close()
    report.update(
        torch=f"on ({torch.__version__})" if memory.tensor is not None else f"off: {torch_why or 'not used'}",
        allocations=len(memory.allocs),
        nbytes=memory.nbytes,
        rounds=[r.to_dict() for r in rounds],
        rounds_done=sum(1 for r in rounds if r.round > 0 and r.done),
        restores=sum(1 for r in rounds if r.restored),
        data_errors=memory.data_errors,
        mismatches=[m.to_dict() for m in memory.mismatches],
        seconds=time.perf_counter() - started,
    )
    report["rounds_planned"] = planned
    report["ok"] = (
        not report["errors"] and memory.data_errors == 0 and report["rounds_done"] == report["rounds_planned"]
    )
    return report


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="One job of the timesliced GPU check (see check.py).")
    p.add_argument("--job", required=True)
    p.add_argument("--socket", required=True, help="the daemon's Unix socket")
    p.add_argument("--method", required=True, choices=["cuda-checkpoint", "offload"])
    p.add_argument("--gib", type=float, default=4.0, help="device memory to allocate and verify (GiB)")
    p.add_argument("--rounds", type=int, default=10, help="turns after the first, each verified")
    p.add_argument("--torch", choices=["auto", "on", "off"], default="auto")
    p.add_argument("--torch-mib", type=int, default=256, help="size of the torch tensor (MiB)")
    p.add_argument("--gpu", type=int, default=0)
    p.add_argument("--peers", type=int, default=2, help="jobs that take turns (this one included)")
    p.add_argument("--start-timeout", type=float, default=60.0)
    p.add_argument("--acquire-timeout", type=float, default=120.0)
    p.add_argument("--end-timeout", type=float, default=120.0)
    p.add_argument("--plan-dir", default=None, help="plan the rounds with check.py through this folder")
    p.add_argument("--plan-timeout", type=float, default=15.0, help="seconds to wait for the plan")
    p.add_argument(
        "--host-memory",
        action="store_true",
        help="offload only: device memory in host buffers, no GPU (the check's own tests)",
    )
    p.add_argument("--host-bandwidth", type=float, default=0.0, help="with --host-memory: copy GB/s (0: unlimited)")
    return p


def main(argv: list[str] | None = None) -> None:
    # CUDA numbers GPUs fastest first unless told otherwise; NVML (and the daemon) by PCI bus.
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    args = build_parser().parse_args(argv)
    if args.gib <= 0 or args.rounds < 1 or args.torch_mib < 1:
        raise SystemExit("--gib, --rounds and --torch-mib must be positive")
    report = run(args)
    print(json.dumps(report), flush=True)
    sys.stderr.flush()
    # Skip interpreter teardown: no finalizer may touch CUDA while the daemon has this process parked.
    os._exit(0 if report["ok"] else 1)


if __name__ == "__main__":
    main()
