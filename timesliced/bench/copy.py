"""``timesliced bench copy``: what memory copies cost on this machine, and whether the sim follows its model.

Figures, all measured in one run:

- ``warm_gbps``: one copy between two buffers whose pages are already mapped (the machine's copy
  ceiling).
- ``warm_chunked_gbps``: the same copy made in pieces of the size the simulated GPU copies at a time
  (``timesliced.sim.COPY_CHUNK``): what its moves can reach, so no simulated move can honour a model
  faster than this. Below ``warm_gbps`` where the C library streams only large copies past the
  cache (non-temporal stores; see ``COPY_CHUNK``).
- ``warm_duplex_gbps``: two such chunked copies at once, in two threads, as a swap makes them (its
  park and its restore; the model gives each direction the full bandwidth): the rate each reaches.
  Both share the machine's memory bandwidth, so this is at most ``warm_chunked_gbps`` on a machine
  whose one copy fills it, and it is the most a simulated swap can follow.
- ``fresh_mmap_gbps`` / ``fresh_write_gbps``: a copy into a fresh tmpfs file, through a mapping
  (every 4 KiB page faulted in by the copy) or through ``write(2)`` (the kernel allocates the pages).
- ``mapped_read_gbps``: a copy out of a tmpfs file that was written before, its mapping made and
  its page tables populated in the timed part, as a restore without the pool reads its parked file.
- ``prefaulted_gbps``: a copy into a tmpfs file whose pages were allocated (``fallocate``) and
  mapped (``MAP_POPULATE``) beforehand.
- ``sim``: for each model bandwidth and move size, the sim backend's snapshot, restore and swap:
  the time the model gives, the time the move took, and ``ratio`` = achieved / model bandwidth
  (1.0: the move took exactly the modelled time; under 1.0: slower than the model), and
  ``ceiling_gbps``, the most this machine lets that move follow (``row_ceiling``): a model above it
  cannot be followed, and the summary marks such rows. Each is run
  twice, without the pool of warm parked-file buffers (``pool`` off: every park writes new tmpfs
  pages, as before the pool) and with it (on: parks write into the buffers restores left). A move's
  time is what the backend measured of it (``MoveResult.seconds``; a swap's is its later half's),
  so the event loop's hop to the worker thread, common to every method, is not in it.
"""

from __future__ import annotations

import asyncio
import ctypes
import mmap
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..env import default_sim_dir
from ..sim import COPY_CHUNK, SWAP_THREAD_MIN

MiB = 1 << 20
SIZES_MIB = (1, 16, 256, 1024)
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def _best(reps: int, nbytes: int, once: Callable[[], Callable[[], None]]) -> float:
    """GB/s of the fastest of ``reps`` runs; ``once`` sets up (untimed) and returns the timed part."""
    best = float("inf")
    for _ in range(reps):
        go = once()
        start = time.perf_counter()
        go()
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def _fresh_file(folder: Path, name: str, size: int) -> int:
    path = folder / name
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, size)
    return fd


def warm_ceiling(mib: int = 64, reps: int = 5, *, chunk: int = COPY_CHUNK) -> float:
    """GB/s of a warm memory copy of ``mib`` MiB made ``chunk`` bytes at a time (best of ``reps``).

    With the simulated GPU's chunk (the default): the most any simulated move can honour.
    """
    src = bytearray(os.urandom(MiB) * mib)
    dst = bytearray(src)  # a copy: its pages are touched already
    return _best(reps, mib * MiB, _copier(dst, src, chunk))


def _copier(dst: bytearray, src: bytearray, chunk: int) -> Callable[[], Callable[[], None]]:
    sv, dv = memoryview(src), memoryview(dst)

    def once() -> Callable[[], None]:
        def go() -> None:
            for pos in range(0, len(sv), chunk):
                dv[pos : pos + chunk] = sv[pos : pos + chunk]

        return go

    return once


def duplex_ceiling(
    mib: int = 64, reps: int = 5, *, chunk: int = COPY_CHUNK, first: tuple[bytearray, bytearray] | None = None
) -> float:
    """GB/s each of two warm copies of ``mib`` MiB made at once, ``chunk`` bytes at a time (best of ``reps``).

    One copy runs in a second thread and one in this one, as a simulated swap's park and restore
    do; ``ctypes.memmove`` lets go of the GIL, as the sim's copies do, so the two really overlap.
    ``first``: a destination and source of ``mib`` MiB, both touched, for the first copy (a caller's,
    so the measure adds only the second pair to the memory it takes).
    """
    n = mib * MiB
    pairs = [first] if first is not None else []
    while len(pairs) < 2:
        src = bytearray(os.urandom(MiB) * mib)
        pairs.append((bytearray(src), src))  # the destination a copy: its pages are touched already
    addresses = [(_address(dst), _address(src)) for dst, src in pairs]

    def copy(dst: int, src: int) -> None:
        for pos in range(0, n, chunk):
            ctypes.memmove(dst + pos, src + pos, min(chunk, n - pos))

    def other(both: threading.Barrier) -> None:
        both.wait()
        copy(*addresses[1])

    best = float("inf")
    for _ in range(reps):
        both = threading.Barrier(2)
        helper = threading.Thread(target=other, args=(both,), name="timesliced-bench-copy")
        helper.start()
        both.wait()
        start = time.perf_counter()
        copy(*addresses[0])
        helper.join()
        best = min(best, time.perf_counter() - start)
    return n / best / 1e9


def _address(buf: bytearray) -> int:
    return ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))


def link_figures(model_bps: float) -> dict[str, float]:
    """The sim's model bandwidth next to this machine's warm copy ceiling (in the sim's chunks), for the
    benchmarks that time switches.

    A model above the ceiling cannot be honoured: switches then take longer than the model says; one
    above the duplex ceiling (two copies at once) cannot be honoured by swaps.
    """
    return {"model_gbps": model_bps / 1e9, "copy_ceiling_gbps": warm_ceiling(), "duplex_ceiling_gbps": duplex_ceiling()}


def describe_link(figures: dict[str, float]) -> str:
    model, ceiling, duplex = figures["model_gbps"], figures["copy_ceiling_gbps"], figures["duplex_ceiling_gbps"]
    line = (
        f"sim link model {model:g} GB/s each way{' (unpaced)' if not model else ''}; "
        f"this machine's warm copy ceiling {ceiling:.1f} GB/s (in the sim's {COPY_CHUNK >> 20} MiB copies), "
        f"{duplex:.1f} GB/s each for two at once (a swap)"
    )
    if model > ceiling:
        line += " (the model is faster than this machine copies: switches take longer than it says)"
    elif model > duplex:
        line += " (the model is faster than this machine makes two copies at once: swaps take longer than it says)"
    return line


def measure_ceiling(folder: Path, mib: int = 256, reps: int = 3) -> dict[str, float]:
    """Copy figures for ``mib`` MiB on ``folder`` (a tmpfs, to be meaningful); see the module docstring."""
    n = mib * MiB
    src = bytearray(os.urandom(MiB) * mib)
    sv = memoryview(src)
    dst = bytearray(n)  # zeroed by calloc, so not yet touched: touch it once
    dst[:] = src
    out: dict[str, float] = {}
    out["warm_gbps"] = _best(reps, n, _copier(dst, src, n))
    out["warm_chunked_gbps"] = _best(reps, n, _copier(dst, src, COPY_CHUNK))
    out["warm_duplex_gbps"] = duplex_ceiling(mib, reps, first=(dst, src))
    # The mapping of the run being timed. Each run's set-up unmaps the one before first: that run's file
    # is unlinked by then, so its mapping is all that holds its pages, and kept they would add up to
    # ``reps`` times ``mib`` of tmpfs.
    maps: list[mmap.mmap] = []

    def copy_into(fd: int, flags: int = mmap.MAP_SHARED) -> Callable[[], None]:
        """A copy of the source into ``fd``'s pages through a shared mapping (closes ``fd``)."""
        m = mmap.mmap(fd, n, flags=flags)
        os.close(fd)
        maps.append(m)

        def go() -> None:
            with memoryview(m) as mv:
                mv[:] = sv

        return go

    def fresh_mmap() -> Callable[[], None]:
        _unmap(maps)
        return copy_into(_fresh_file(folder, "fresh", n))

    out["fresh_mmap_gbps"] = _best(reps, n, fresh_mmap)

    def fresh_write() -> Callable[[], None]:
        _unmap(maps)
        fd = _fresh_file(folder, "fresh", 0)

        def go() -> None:
            _write_all(fd, sv)
            os.close(fd)

        return go

    out["fresh_write_gbps"] = _best(reps, n, fresh_write)

    def mapped_read() -> Callable[[], None]:
        from ..backends.sim_buffers import Buffer

        _unmap(maps)
        fd = _fresh_file(folder, "fresh", 0)
        _write_all(fd, sv)
        os.close(fd)
        out_at = _address(dst)

        def go() -> None:  # as a restore without the pool: map the parked file, populate, copy out
            buf = Buffer.open(folder / "fresh")
            try:
                for pos in range(0, n, COPY_CHUNK):
                    ctypes.memmove(out_at + pos, buf.address + pos, min(COPY_CHUNK, n - pos))
            finally:
                buf.close()

        return go

    out["mapped_read_gbps"] = _best(reps, n, mapped_read)

    def prefaulted() -> Callable[[], None]:
        _unmap(maps)
        fd = _fresh_file(folder, "fresh", 0)
        os.posix_fallocate(fd, 0, n)
        return copy_into(fd, mmap.MAP_SHARED | _POPULATE)

    out["prefaulted_gbps"] = _best(reps, n, prefaulted)
    _unmap(maps)
    (folder / "fresh").unlink(missing_ok=True)
    return out


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        data = data[os.write(fd, data) :]


def _unmap(maps: list[mmap.mmap]) -> None:
    for m in maps:
        m.close()
    maps.clear()


async def _sim_moves(
    root: Path, sizes: tuple[int, ...], bandwidth: float, reps: int, *, pool: bool
) -> list[dict[str, Any]]:
    from ..backends.base import MoveResult
    from ..backends.sim import SimBackend
    from ..sim.region import SimRegion

    page = 2 * MiB
    top = max(sizes) * MiB
    capacity = 2 * -(-top // page) * page  # room for two jobs of the largest size: a swap needs both
    backend = SimBackend(
        root, gpus=1, capacity=capacity, page_size=page, bandwidth=bandwidth, pool=capacity if pool else 0
    )
    rows: list[dict[str, Any]] = []
    try:
        for mib in sizes:
            n = mib * MiB
            pattern = os.urandom(MiB)
            for job in ("a", "b"):
                with SimRegion.open(backend.alloc(job, 0, n)) as region:
                    region.fill(pattern)
            await backend.snapshot("b")
            times: dict[str, list[float]] = {"snapshot": [], "restore": [], "swap": []}
            for _ in range(reps):
                times["snapshot"].append((await backend.snapshot("a")).seconds)
                times["restore"].append((await backend.restore("a")).seconds)
                for out, in_ in (("a", "b"), ("b", "a")):
                    done = await backend.swap(out, in_)
                    if not (isinstance(done.park, MoveResult) and isinstance(done.restore, MoveResult)):
                        raise RuntimeError(f"bench copy: a swap failed: {done}")
                    times["swap"].append(max(done.park.seconds, done.restore.seconds))
            model = n / bandwidth if bandwidth else 0.0
            for kind, seconds in times.items():
                if not seconds:
                    continue
                took = sorted(seconds)[len(seconds) // 2]
                row: dict[str, Any] = {
                    "model_gbps": bandwidth / 1e9,
                    "pool": "on" if pool else "off",
                    "mib": mib,
                    "kind": kind,
                    "model_s": model,
                    "took_s": took,
                    "achieved_gbps": n / took / 1e9 if took > 0 else 0.0,
                    "ratio": model / took if took > 0 and model else None,
                }
                rows.append(row)
            await backend.reclaim("a")
            await backend.reclaim("b")
    finally:
        await backend.aclose()
    return rows


def row_ceiling(ceiling: dict[str, float], kind: str, nbytes: int, *, pool: bool) -> float:
    """The most a simulated move of ``kind`` and ``nbytes`` can follow on this machine, in GB/s.

    A lone move makes one copy at a time (``warm_chunked_gbps``). Without the pool a park writes
    new tmpfs pages (``fresh_write_gbps``) and a restore maps its parked file first
    (``mapped_read_gbps``). A swap makes its park's copy and its restore's at once, each at most
    ``warm_duplex_gbps``, except below ``SWAP_THREAD_MIN``, where it makes them one after the other.
    """
    lone = ceiling["warm_chunked_gbps"]
    park = lone if pool else min(lone, ceiling["fresh_write_gbps"])
    restore = lone if pool else min(lone, ceiling["mapped_read_gbps"])
    if kind == "snapshot":
        return park
    if kind == "restore":
        return restore
    if min(nbytes, COPY_CHUNK) < SWAP_THREAD_MIN:
        return 1 / (1 / park + 1 / restore)
    return min(ceiling["warm_duplex_gbps"], park, restore)


def run_copy(
    *,
    bandwidths: list[float] | None = None,
    sizes: tuple[int, ...] = SIZES_MIB,
    reps: int = 3,
    mib: int = 256,
    pools: tuple[bool, ...] = (False, True),
) -> dict[str, Any]:
    """Measure the copy ceiling, then the sim's moves at each model bandwidth (GB/s; default: a spread).

    ``pools``: run the moves without the pool of warm buffers (False), with it (True), or both.
    """
    base = Path(tempfile.mkdtemp(prefix="timesliced-copy-", dir=default_sim_dir(Path(tempfile.gettempdir())).parent))
    try:
        ceiling = measure_ceiling(base, mib=mib, reps=reps)
        lone, duplex = ceiling["warm_chunked_gbps"], ceiling["warm_duplex_gbps"]  # what the sim's moves can reach
        chosen = bandwidths or sorted({1.0, 2.0, round(duplex * 0.5, 1), round(duplex * 0.9, 1), round(lone * 0.9, 1)})
        sim: list[dict[str, Any]] = []
        for gbps in chosen:
            for pool in pools:
                root = base / f"sim-{gbps:g}-{pool}"
                sim += asyncio.run(_sim_moves(root, sizes, gbps * 1e9, reps, pool=pool))
                shutil.rmtree(root, ignore_errors=True)
        for row in sim:
            row["ceiling_gbps"] = row_ceiling(ceiling, row["kind"], row["mib"] * MiB, pool=row["pool"] == "on")
        return {"ceiling": ceiling, "sim": sim}
    finally:
        shutil.rmtree(base, ignore_errors=True)


def format_copy(result: dict[str, Any]) -> str:
    c = result["ceiling"]
    lines = [
        f"copy ceiling on this machine: warm {c['warm_gbps']:.2f} GB/s, in the sim's {COPY_CHUNK >> 20} MiB copies "
        f"{c['warm_chunked_gbps']:.2f} GB/s (the most a lone simulated move can follow), "
        f"{c['warm_duplex_gbps']:.2f} GB/s each for two at once (the most a swap can follow)   into fresh tmpfs "
        f"pages {c['fresh_mmap_gbps']:.2f} (mmap) / {c['fresh_write_gbps']:.2f} (write) GB/s   "
        f"out of a file mapped afresh {c['mapped_read_gbps']:.2f} GB/s   "
        f"into pre-faulted tmpfs pages {c['prefaulted_gbps']:.2f} GB/s",
        f"{'model GB/s':>10} {'pool':>4} {'MiB':>6} {'move':>9} {'model ms':>9} {'took ms':>9} {'GB/s':>7} "
        f"{'ratio':>6}",
    ]
    for r in result["sim"]:
        ratio = f"{r['ratio']:.2f}" if r["ratio"] is not None else "-"
        lines.append(
            f"{r['model_gbps']:>10.1f} {r['pool']:>4} {r['mib']:>6} {r['kind']:>9} {r['model_s'] * 1e3:>9.2f} "
            f"{r['took_s'] * 1e3:>9.2f} {r['achieved_gbps']:>7.2f} {ratio:>6}"
        )
    lines.append(
        "ratio = achieved / model GB/s (1.00: on the model); lowest per model bandwidth, pool, size and kind "
        "(lone: snapshot and restore); * where the model is above this machine's ceiling for that kind:"
    )
    lowest: dict[tuple[float, str, str], dict[int, tuple[float, bool]]] = {}
    for r in result["sim"]:
        if r["ratio"] is not None:
            sizes = lowest.setdefault((r["model_gbps"], r["pool"], "swap" if r["kind"] == "swap" else "lone"), {})
            worst = min(sizes.get(r["mib"], (r["ratio"], False))[0], r["ratio"])
            sizes[r["mib"]] = (worst, r["model_gbps"] > r["ceiling_gbps"])
    for (gbps, pool, kind), sizes in lowest.items():
        shown = "  ".join(
            f"{mib} MiB {ratio:.2f}{'*' if above else ''}" for mib, (ratio, above) in sorted(sizes.items())
        )
        lines.append(f"  {gbps:>5.1f} GB/s pool {pool:>3} {kind:>4}: {shown}")
    return "\n".join(lines)
