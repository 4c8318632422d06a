"""The in-process offload executor, its device-memory seam and the seam's implementations."""

from __future__ import annotations

import ctypes
import inspect
import random
import sys
from collections.abc import Iterable
from typing import Any

import pytest

from timesliced import errors
from timesliced.client.gpus import GpuNumbering, uuid_text
from timesliced.client.offload import CombinedOffload, MoveStats, Offloader, Region, execute
from timesliced.client.offload.address_space import AddressSpace
from timesliced.client.offload.cuda_device_memory import CudaDeviceMemory, check_result
from timesliced.client.offload.device_memory import HostBuffer, plan_chunks, round_up
from timesliced.client.offload.host_device_memory import HostDeviceMemory
from timesliced.wire.codec import decode_body, encode

pytestmark = pytest.mark.timeout(30)

G = 4096  # the granularity the tests use: small regions stay small


@pytest.fixture
def mem() -> HostDeviceMemory:
    return HostDeviceMemory(gpus=2, granularity=G)


@pytest.fixture
def off(mem: HostDeviceMemory) -> Offloader:
    return Offloader(mem)


def fill(region: Region, rng: random.Random) -> bytes:
    data = rng.randbytes(region.nbytes)
    region.write(data)
    return data


# --- HostDeviceMemory: a faithful stand-in ------------------------------------------------


def test_mapping_really_allocates_and_unmapping_really_frees(mem: HostDeviceMemory) -> None:
    va = mem.reserve(3 * G, gpu=1)
    assert (mem.used_bytes(), mem.reserved_bytes()) == (0, 3 * G)
    mem.map(va, 3 * G)
    assert (mem.used_bytes(), mem.used_bytes(1), mem.used_bytes(0)) == (3 * G, 3 * G, 0)
    mem.write(va + 10, b"abc")
    assert mem.read(va + 9, 5) == b"\0abc\0"
    mem.unmap(va, 3 * G)
    assert mem.used_bytes() == 0
    assert mem._memory == {}  # the bytes are gone, not just hidden
    mem.map(va, 3 * G)  # the range is still reserved: it can be mapped again, with fresh memory
    assert mem.read(va + 10, 3) == b"\0\0\0"
    mem.unmap(va, 3 * G)
    mem.release_reservation(va, 3 * G)
    assert mem.reserved_bytes() == 0


def test_touching_unmapped_memory_raises(mem: HostDeviceMemory) -> None:
    va = mem.reserve(2 * G, gpu=0)
    with pytest.raises(errors.NotResident):
        mem.read(va, 1)
    with pytest.raises(errors.NotResident):
        mem.write(va + G, b"x")
    with pytest.raises(errors.NotResident):
        mem.copy_to_host_async(mem.host_alloc(8), va, 8)  # refused when queued, as the driver would
    mem.map(va, 2 * G)
    with pytest.raises(errors.BackendError, match="illegal address"):
        mem.read(va + 2 * G - 1, 2)  # runs off the end of the mapping
    with pytest.raises(errors.BackendError, match="illegal address"):
        mem.read(0x1000, 1)  # never reserved
    with pytest.raises(errors.BackendError, match="illegal address"):
        mem.read(va + 2 * G, 1)  # the gap after a reservation


@pytest.mark.parametrize(
    "action, match",
    [
        (lambda m, va: m.map(va, 2 * G), "already mapped"),  # mapping twice
        (lambda m, va: m.map(va + G, G), "already mapped"),  # overlapping an existing mapping
        (lambda m, va: m.map(va + 2 * G, 2 * G), "not inside one reservation"),  # past the reservation
        (lambda m, va: m.map(va + 1, G), "multiples"),  # misaligned
        (lambda m, va: m.map(va, 100), "multiples"),  # not a whole granule
        (lambda m, va: m.unmap(va, G), "not a mapping"),  # part of a mapping
        (lambda m, va: m.unmap(va + 2 * G, G), "not a mapping"),  # nothing there
        (lambda m, va: m.release_reservation(va, 3 * G), "still has mapped memory"),
        (lambda m, va: m.release_reservation(va, G), "no reservation"),  # wrong size
        (lambda m, va: m.reserve(G, 2), "no GPU 2"),
        (lambda m, va: m.reserve(100, 0), "multiples"),
    ],
)
def test_driver_rules_are_enforced_and_a_refused_call_changes_nothing(
    mem: HostDeviceMemory, action: Any, match: str
) -> None:
    va = mem.reserve(3 * G, gpu=0)
    mem.map(va, 2 * G)
    mem.write(va, b"keep")
    before = (mem.used_bytes(), mem.reserved_bytes(), list(mem._space.mappings), list(mem._space.reservations))
    with pytest.raises(errors.BackendError, match=match):
        action(mem, va)
    assert (mem.used_bytes(), mem.reserved_bytes(), list(mem._space.mappings), list(mem._space.reservations)) == before
    assert mem.read(va, 4) == b"keep"


def test_async_copies_land_only_at_synchronize(mem: HostDeviceMemory) -> None:
    va = mem.reserve(G, gpu=0)
    mem.map(va, G)
    mem.write(va, b"device")
    host = mem.host_alloc(6)
    mem.copy_to_host_async(host, va, 6)
    assert bytes(host.view) == b"\0" * 6
    with pytest.raises(errors.BackendError, match="queued"):
        mem.unmap(va, G)  # pulling memory out from under a queued copy is a bug
    mem.synchronize()
    assert bytes(host.view) == b"device"
    host.view[:] = b"HOST!!"
    mem.copy_to_device_async(va, host, 6)
    assert mem.read(va, 6) == b"device"
    mem.synchronize()
    assert mem.read(va, 6) == b"HOST!!"
    with pytest.raises(errors.BackendError, match="does not fit"):
        mem.copy_to_device_async(va, host, 7)


def test_capacity_makes_mapping_fail_like_out_of_memory() -> None:
    mem = HostDeviceMemory(gpus=2, granularity=G, capacity=2 * G)
    a, b = mem.reserve(2 * G, 0), mem.reserve(G, 0)
    mem.map(a, 2 * G)
    with pytest.raises(errors.BackendError, match="out of memory on GPU 0"):
        mem.map(b, G)
    other = mem.reserve(2 * G, 1)
    mem.map(other, 2 * G)  # capacity is per GPU
    mem.unmap(a, 2 * G)
    mem.map(b, G)
    assert mem.used_bytes(0) == G


def test_bandwidth_model_charges_copies_at_synchronize() -> None:
    slept: list[float] = []
    mem = HostDeviceMemory(granularity=G, bandwidth=1000.0, sleep=slept.append)
    va = mem.reserve(G, 0)
    mem.map(va, G)
    host = mem.host_alloc(G)
    mem.copy_to_host_async(host, va, 500)
    mem.copy_to_device_async(va, host, 1500)
    assert slept == []
    mem.synchronize()
    assert slept == [2.0]
    mem.read(va, 250)
    assert slept == [2.0, 0.25]


def test_address_space_resolves_only_inside_mappings() -> None:
    space = AddressSpace()
    space.reserve(0x10000, 0x3000, gpu=1)
    space.map(0x11000, 0x1000)
    assert space.resolve(0x11000, 0x1000).gpu == 1
    assert space.resolve(0x11FFF, 1).va == 0x11000
    assert space.resolve(0x11800, 0).va == 0x11000
    for va, n, error in [
        (0x10000, 1, errors.NotResident),  # reserved, unmapped
        (0x12000, 1, errors.NotResident),
        (0x11FFF, 2, errors.BackendError),  # runs past the mapping
        (0x13000, 1, errors.BackendError),  # past the reservation
        (0x0, 1, errors.BackendError),
    ]:
        with pytest.raises(error):
            space.resolve(va, n)
    with pytest.raises(errors.BackendError):
        space.reserve(0x12000, 0x2000, gpu=0)  # overlaps a reservation
    assert space.mapped_bytes() == space.mapped_bytes(1) == 0x1000
    assert space.mapped_bytes(0) == 0


# --- the executor -----------------------------------------------------------------------


def test_registry_names_tags_and_misuse(off: Offloader, mem: HostDeviceMemory) -> None:
    w = off.alloc(10_000, tag="weights")
    o = off.alloc(5_000, tag="optimizer", gpu=1)
    lo = off.alloc(100, tag="lora", name="adapter-a")
    w2 = off.alloc(1, tag="weights")
    assert [r.name for r in off.regions()] == ["weights/0", "optimizer/0", "adapter-a", "weights/1"]
    assert off.regions(["weights"]) == [w, w2]
    assert off.regions("lora") == [lo]
    assert off.tags() == {"weights", "optimizer", "lora"}
    assert (w.size, o.size, lo.size, w2.size) == (3 * G, 2 * G, G, G)
    assert off.footprint() == {0: 5 * G, 1: 2 * G} == off.resident()
    assert mem.used_bytes() == 7 * G
    assert len({r.ptr for r in off.regions()}) == 4
    with pytest.raises(ValueError, match="exists already"):
        off.alloc(1, tag="lora", name="adapter-a")
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError):
            off.alloc(bad, tag="x")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        off.alloc(1, tag="")
    with pytest.raises(errors.BackendError):
        off.alloc(1, tag="x", gpu=5)
    assert len(off.regions()) == 4 and mem.used_bytes() == 7 * G
    with pytest.raises(errors.UnknownRegion):
        off.park(["weights", "nope"])
    assert all(r.resident for r in off.regions())
    with pytest.raises(ValueError, match="outside region"):
        lo.read(90, 20)
    full = off.alloc(G, tag="x")
    assert full.read(G) == b"" and full.read(5, 0) == b""  # empty reads at the very end are fine
    full.write(b"", G)
    off.free(full)
    off.free(w2)
    with pytest.raises(errors.UnknownRegion):
        off.free(w2)
    with pytest.raises(errors.UnknownRegion):
        w2.read()
    off.close()
    assert (mem.used_bytes(), mem.reserved_bytes(), off.host_bytes()) == (0, 0, 0)


def test_round_trips_restore_every_byte_at_the_same_address(off: Offloader, mem: HostDeviceMemory) -> None:
    rng = random.Random(1)
    regions = [
        off.alloc(n, tag=t, gpu=g) for n, t, g in [(12_345, "w", 0), (1, "w", 1), (3 * G, "o", 0), (777, "o", 1)]
    ]
    ptrs = [r.ptr for r in regions]
    footprint = off.footprint()
    for cycle in range(3):
        data = [fill(r, rng) for r in regions]
        stats = off.park()
        assert stats.regions == 4 and stats.skipped == 0
        assert stats.nbytes == sum(r.nbytes for r in regions)
        assert stats.per_gpu == {0: 12_345 + 3 * G, 1: 1 + 777}
        assert stats.resident == {} and stats.footprint == footprint
        assert mem.used_bytes() == 0 and off.resident() == {}
        for r, d in zip(regions, data, strict=True):
            assert not r.resident
            assert r.host is not None and bytes(r.host.view) == d
        stats = off.unpark()
        assert stats.regions == 4 and stats.resident == footprint
        assert [r.ptr for r in regions] == ptrs, f"pointers moved in cycle {cycle}"
        assert [r.read() for r in regions] == data
        assert [mem.read(r.ptr, r.nbytes) for r in regions] == data  # through the raw pointer too
        assert mem.used_bytes() == sum(footprint.values())


def test_lora_only_park_leaves_the_base_resident(off: Offloader, mem: HostDeviceMemory) -> None:
    rng = random.Random(2)
    base = off.alloc(16 * G, tag="weights")
    lora = [off.alloc(3000, tag="lora"), off.alloc(5000, tag="lora")]
    base_data, lora_data = fill(base, rng), [fill(r, rng) for r in lora]
    stats = off.park({"lora"})
    assert (stats.regions, stats.nbytes, stats.skipped) == (2, 8000, 0)
    assert mem.used_bytes() == 16 * G  # only the adapters' memory went away
    assert stats.resident == {0: 16 * G} and stats.footprint == {0: 19 * G}  # 3000 and 5000 bytes: 1 + 2 granules
    assert base.resident and base.read() == base_data
    base.write(b"trained")  # the shared base keeps working
    for r in lora:
        with pytest.raises(errors.NotResident):
            r.read()
    off.unpark(["lora"])
    assert [r.read() for r in lora] == lora_data
    assert base.read(0, 7) == b"trained"


def test_park_and_unpark_are_idempotent(off: Offloader, mem: HostDeviceMemory) -> None:
    a, b = off.alloc(100, tag="a"), off.alloc(100, tag="b")
    a.write(b"A" * 100)
    b.write(b"B" * 100)
    assert off.park(["a"]).regions == 1
    again = off.park(["a"])
    assert (again.regions, again.skipped, again.nbytes) == (0, 1, 0)
    both = off.park()
    assert (both.regions, both.skipped) == (1, 1)
    assert mem.used_bytes() == 0
    assert off.unpark(["b"]).regions == 1
    again = off.unpark(["b"])
    assert (again.regions, again.skipped) == (0, 1)
    assert (off.unpark().regions, off.unpark().regions) == (1, 0)
    assert (a.read(), b.read()) == (b"A" * 100, b"B" * 100)


def test_touching_a_parked_region_raises_not_resident(off: Offloader, mem: HostDeviceMemory) -> None:
    r = off.alloc(64, tag="weights")
    off.park()
    with pytest.raises(errors.NotResident) as info:
        r.read()
    assert info.value.details == {"region": "weights/0", "tag": "weights"}
    with pytest.raises(errors.NotResident):
        r.write(b"x")
    with pytest.raises(errors.NotResident):
        mem.read(r.ptr, 1)  # a kernel's view: the address is reserved but has no memory behind it


def test_verify_catches_a_corrupted_host_copy(mem: HostDeviceMemory) -> None:
    off = Offloader(mem, verify=True)
    rng = random.Random(3)
    good = off.alloc(5000, tag="weights")
    bad = off.alloc(6000, tag="lora", name="adapter")
    data = [fill(good, rng), fill(bad, rng)]
    assert off.park().verified
    assert bad.host is not None
    bad.host.view[4321] ^= 0x40
    with pytest.raises(errors.BackendError, match=r"'adapter' \(tag 'lora'\)") as info:
        off.unpark()
    assert info.value.details["region"] == "adapter" and info.value.details["tag"] == "lora"
    assert info.value.details["parked"] == ["weights/0", "adapter"]
    assert not good.resident and not bad.resident and mem.used_bytes() == 0
    bad.host.view[4321] ^= 0x40  # repaired: now it goes through
    stats = off.unpark()
    assert stats.verified and [good.read(), bad.read()] == data


def test_verify_on_request_only(mem: HostDeviceMemory) -> None:
    off = Offloader(mem)
    r = off.alloc(100, tag="t")
    assert not off.park().verified
    assert r.host is not None
    r.host.view[0] ^= 1
    assert not off.unpark().verified  # nothing checked: the corruption goes through unnoticed
    off.park(verify=True)
    r.host.view[0] ^= 1
    with pytest.raises(errors.BackendError, match="does not match"):
        off.unpark(verify=True)


class FlakyMemory(HostDeviceMemory):
    """A device whose n-th call of a method fails once (1-based counts per method)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(gpus=2, granularity=G, **kwargs)
        self.fail_at: dict[str, int] = {}
        self.calls: dict[str, int] = {}

    def _maybe_fail(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1
        if self.fail_at.get(name) == self.calls[name]:
            raise errors.BackendError(f"injected {name} failure")

    def copy_to_host_async(self, dst: HostBuffer, va: int, nbytes: int) -> None:
        self._maybe_fail("copy_to_host_async")
        super().copy_to_host_async(dst, va, nbytes)

    def copy_to_device_async(self, va: int, src: HostBuffer, nbytes: int) -> None:
        self._maybe_fail("copy_to_device_async")
        super().copy_to_device_async(va, src, nbytes)

    def unmap(self, va: int, nbytes: int) -> None:
        self._maybe_fail("unmap")
        super().unmap(va, nbytes)

    def map(self, va: int, nbytes: int) -> None:
        self._maybe_fail("map")
        super().map(va, nbytes)

    def synchronize(self) -> None:
        self._maybe_fail("synchronize")
        super().synchronize()

    def host_alloc(self, nbytes: int) -> HostBuffer:
        self._maybe_fail("host_alloc")
        return super().host_alloc(nbytes)

    def arm(self, name: str, nth: int) -> None:
        """Fail the ``nth`` call of ``name`` from now on."""
        self.fail_at = {name: self.calls.get(name, 0) + nth}


def three_regions(off: Offloader, rng: random.Random) -> tuple[list[Region], list[bytes]]:
    regions = [off.alloc(n, tag=t, gpu=g) for n, t, g in [(5000, "w", 0), (3000, "o", 1), (7000, "w", 0)]]
    return regions, [fill(r, rng) for r in regions]


@pytest.mark.parametrize(
    "name, nth", [("host_alloc", 2), ("copy_to_host_async", 1), ("copy_to_host_async", 3), ("synchronize", 1)]
)
def test_a_park_failing_while_copying_leaves_everything_resident(name: str, nth: int) -> None:
    mem = FlakyMemory()
    off = Offloader(mem)
    regions, data = three_regions(off, random.Random(4))
    used = mem.used_bytes()
    mem.arm(name, nth)
    with pytest.raises(errors.BackendError, match="every region is still resident") as info:
        off.park()
    assert info.value.details["parked"] == []
    assert info.value.details["resident"] == [r.name for r in regions]
    assert "injected" in info.value.details["cause"]
    assert all(r.resident for r in regions) and mem.used_bytes() == used
    assert [r.read() for r in regions] == data
    assert mem._queue == []  # no copy left behind in flight
    assert off.park().regions == 3  # and the next try works


def test_a_park_failing_while_unmapping_is_rolled_back() -> None:
    mem = FlakyMemory()
    off = Offloader(mem)
    regions, data = three_regions(off, random.Random(5))
    used = mem.used_bytes()
    mem.arm("unmap", 2)  # the first region is parked by then
    with pytest.raises(errors.BackendError, match="park failed at region 'o/0'") as info:
        off.park()
    assert info.value.details["rollback"] == "ok"
    assert info.value.details["parked"] == []
    assert all(r.resident for r in regions) and mem.used_bytes() == used
    assert [r.read() for r in regions] == data


def test_a_park_whose_rollback_fails_says_which_regions_are_parked() -> None:
    mem = FlakyMemory()
    off = Offloader(mem)
    regions, data = three_regions(off, random.Random(6))
    mem.fail_at = {"unmap": mem.calls.get("unmap", 0) + 2, "map": mem.calls.get("map", 0) + 1}
    with pytest.raises(errors.BackendError) as info:
        off.park()
    details = info.value.details
    assert details["rollback"].startswith("failed")
    assert details["parked"] == ["w/0"] and details["resident"] == ["o/0", "w/1"]
    assert [r.resident for r in regions] == [False, True, True]
    assert mem.used_bytes() == regions[1].size + regions[2].size  # each region fully one thing or the other
    with pytest.raises(errors.NotResident):
        regions[0].read()
    assert [r.read() for r in regions[1:]] == data[1:]
    off.unpark()
    assert [r.read() for r in regions] == data


@pytest.mark.parametrize("name", ["map", "copy_to_device_async", "synchronize"])
def test_an_unpark_failing_midway_leaves_every_region_parked(name: str) -> None:
    mem = FlakyMemory()
    off = Offloader(mem)
    regions, data = three_regions(off, random.Random(7))
    off.park()
    mem.arm(name, 2 if name != "synchronize" else 1)
    with pytest.raises(errors.BackendError, match="unpark failed") as info:
        off.unpark()
    assert info.value.details["parked"] == [r.name for r in regions]
    assert not any(r.resident for r in regions) and mem.used_bytes() == 0
    assert off.unpark().regions == 3
    assert [r.read() for r in regions] == data


def test_an_unpark_without_room_fails_cleanly_and_works_once_there_is_room() -> None:
    mem = HostDeviceMemory(granularity=G, capacity=4 * G)
    off = Offloader(mem)
    a, b = off.alloc(2 * G, tag="job"), off.alloc(2 * G, tag="job")
    a.write(b"a" * 2 * G)
    b.write(b"b" * 2 * G)
    off.park()
    squatter = off.alloc(1, tag="other")
    with pytest.raises(errors.BackendError, match="out of memory"):
        off.unpark(["job"])
    assert mem.used_bytes() == G and not a.resident and not b.resident
    off.free(squatter)
    off.unpark(["job"])
    assert (a.read(), b.read()) == (b"a" * 2 * G, b"b" * 2 * G)


def test_host_buffers_are_allocated_once_and_kept_within_the_cap(mem: HostDeviceMemory) -> None:
    off = Offloader(mem)
    r = off.alloc(1000, tag="t")
    assert r.host is None and off.host_bytes() == 0
    off.park()
    first = r.host
    off.unpark()
    assert r.host is first and off.host_bytes() == 1000  # kept for the next park
    off.park()
    assert r.host is first
    off.unpark()

    capped = Offloader(mem, keep_host_bytes=1500)
    small, big = capped.alloc(1000, tag="t"), capped.alloc(1000, tag="t")
    capped.park()
    assert capped.host_bytes() == 2000  # while parked the copies are the data
    capped.unpark()
    assert small.host is not None and big.host is None and capped.host_bytes() == 1000

    none = Offloader(mem, keep_host_bytes=0)
    r = none.alloc(10, tag="t")
    r.write(b"0123456789")
    none.park()
    none.unpark()
    assert r.host is None and none.host_bytes() == 0
    none.park()
    none.unpark()
    assert r.read() == b"0123456789"


def test_freeing_a_parked_region_releases_everything(off: Offloader, mem: HostDeviceMemory) -> None:
    r = off.alloc(G, tag="t")
    off.park()
    off.free(r)
    assert (mem.used_bytes(), mem.reserved_bytes(), off.host_bytes(), off.tags()) == (0, 0, 0, set())


def test_stats_travel_over_the_wire(off: Offloader) -> None:
    off.alloc(1000, tag="w", gpu=1)
    stats = off.park()
    wire = stats.to_wire()
    assert decode_body(encode(wire)[4:]) == wire  # string GPU keys: the codec refuses int map keys
    assert set(wire) == {
        "op",
        "nbytes",
        "seconds",
        "copy_seconds",
        "gbps",
        "regions",
        "skipped",
        "verified",
        "per_gpu",
        "resident",
        "footprint",
    }
    assert wire["op"] == "park" and wire["per_gpu"] == {"1": 1000} and wire["footprint"] == {"1": G}
    assert wire["resident"] == {} and wire["gbps"] >= 0 and wire["seconds"] >= wire["copy_seconds"] >= 0


def test_move_stats_figures() -> None:
    a = MoveStats("park", nbytes=2_000_000_000, copy_seconds=1.0, regions=1, per_gpu={0: 5}, verified=True)
    b = MoveStats("park", nbytes=1_000_000_000, copy_seconds=0.5, regions=2, per_gpu={0: 1, 1: 2}, verified=True)
    m = a.merged(b)
    assert (m.nbytes, m.regions, m.per_gpu, m.verified) == (3_000_000_000, 3, {0: 6, 1: 2}, True)
    assert m.gbps == pytest.approx(2.0) and MoveStats("park").gbps == 0.0
    assert not a.merged(MoveStats("park")).verified
    with pytest.raises(ValueError):
        a.merged(MoveStats("unpark"))


@pytest.mark.parametrize("seed", range(8))
def test_random_sequences_keep_every_byte_and_the_accounting(seed: int) -> None:
    rng = random.Random(seed)
    mem = HostDeviceMemory(gpus=2, granularity=G)
    off = Offloader(mem, verify=rng.random() < 0.5, keep_host_bytes=rng.choice([None, 0, 6000]))
    tags = ["weights", "optimizer", "lora"]
    regions = [off.alloc(rng.randint(1, 3 * G), tag=rng.choice(tags), gpu=rng.randint(0, 1)) for _ in range(8)]
    model = {r.name: fill(r, rng) for r in regions}
    for _ in range(40):
        known = sorted(off.tags())
        chosen = set(rng.sample(known, rng.randint(0, len(known))))
        op = rng.random()
        if op < 0.35:
            before = {r.name: r.resident for r in regions}
            stats = off.park(chosen)
            hit = [r for r in regions if not chosen or r.tag in chosen]
            assert stats.regions == sum(before[r.name] for r in hit)
            assert stats.skipped == len(hit) - stats.regions
        elif op < 0.7:
            off.unpark(chosen)
        else:
            for r in regions:
                if r.resident and rng.random() < 0.5:
                    off_ = rng.randrange(r.nbytes)
                    patch = rng.randbytes(rng.randint(0, r.nbytes - off_))
                    r.write(patch, off_)
                    model[r.name] = model[r.name][:off_] + patch + model[r.name][off_ + len(patch) :]
        # invariants after every step
        assert mem.used_bytes() == sum(r.size for r in regions if r.resident)
        for gpu in (0, 1):
            assert mem.used_bytes(gpu) == off.resident().get(gpu, 0)
        for r in regions:
            if r.resident:
                assert r.read() == model[r.name]
            else:
                assert r.host is not None and bytes(r.host.view) == model[r.name]
    off.unpark()
    assert {r.name: r.read() for r in regions} == model


# --- directives over several executors ----------------------------------------------------


class Broken:
    """An executor that fails every park / unpark."""

    def __init__(self, tags: set[str]) -> None:
        self._tags = tags

    def tags(self) -> set[str]:
        return self._tags

    def park(self, tags: Iterable[str] = (), *, verify: bool | None = None) -> MoveStats:
        raise errors.BackendError("broken park")

    def unpark(self, tags: Iterable[str] = (), *, verify: bool | None = None) -> MoveStats:
        raise errors.BackendError("broken unpark")

    def footprint(self) -> dict[int, int]:
        return {}


def test_execute_splits_tags_across_executors_and_merges_figures(mem: HostDeviceMemory) -> None:
    one, two = Offloader(mem), Offloader(mem)
    w = one.alloc(100, tag="weights")
    lo = two.alloc(200, tag="lora", gpu=1)
    stats = execute("park", [one, two], ["lora"])
    assert (stats.regions, stats.nbytes, stats.per_gpu) == (1, 200, {1: 200})
    assert w.resident and not lo.resident
    assert stats.resident == {0: G} and stats.footprint == {0: G, 1: G}
    stats = execute("park", [one, two])
    assert (stats.regions, stats.skipped) == (1, 1)
    assert execute("unpark", [one, two]).regions == 2
    with pytest.raises(errors.UnknownRegion):
        execute("park", [one, two], ["weights", "typo"])
    assert w.resident and lo.resident
    with pytest.raises(ValueError):
        execute("evict", [one])
    assert execute("park", []).regions == 0


def test_execute_moves_the_others_back_when_one_executor_fails(mem: HostDeviceMemory) -> None:
    good = Offloader(mem)
    r = good.alloc(100, tag="weights")
    r.write(b"w" * 100)
    with pytest.raises(errors.BackendError, match="broken park") as info:
        execute("park", [good, Broken({"optimizer"})])
    assert info.value.details["rollback"] == "ok"
    assert r.resident and r.read() == b"w" * 100
    good.park()
    with pytest.raises(errors.BackendError, match="broken unpark") as info:
        execute("unpark", [good, Broken({"optimizer"})])
    assert info.value.details["rollback"] == "ok"
    assert not r.resident
    with pytest.raises(errors.BackendError) as info:
        execute("unpark", [Broken({"x"}), good])
    assert info.value.details["rollback"] == "none needed"


def test_combined_offload_is_one_executor_for_the_client(mem: HostDeviceMemory) -> None:
    one, two = Offloader(mem), Offloader(mem, verify=True)
    w, lo = one.alloc(100, tag="weights"), two.alloc(300, tag="lora")
    both = CombinedOffload(one, two)
    assert both.tags() == {"weights", "lora"} and both.footprint() == {0: 2 * G} == both.resident()
    stats = both.park("lora")  # a lone string is one tag
    assert (stats.regions, stats.nbytes, stats.verified) == (1, 300, True)
    assert w.resident and not lo.resident and both.resident() == {0: G}
    assert both.unpark().regions == 1 and lo.resident
    assert CombinedOffload().park().regions == 0 and CombinedOffload().tags() == set()


# --- CudaDeviceMemory: pure helpers --------------------------------------------------------


@pytest.mark.parametrize(
    "n, g, out", [(0, 4096, 4096), (1, 4096, 4096), (4096, 4096, 4096), (4097, 4096, 8192), (3 << 30, 2 << 20, 3 << 30)]
)
def test_round_up(n: int, g: int, out: int) -> None:
    assert round_up(n, g) == out


@pytest.mark.parametrize(
    "n, chunk, out",
    [
        (0, 10, []),
        (10, 10, [(0, 10)]),
        (25, 10, [(0, 10), (10, 10), (20, 5)]),
        (9, 10, [(0, 9)]),
        (1 << 30, 1 << 28, [(i << 28, 1 << 28) for i in range(4)]),
    ],
)
def test_plan_chunks(n: int, chunk: int, out: list[tuple[int, int]]) -> None:
    assert plan_chunks(n, chunk) == out


def test_helpers_refuse_nonsense() -> None:
    for call in (lambda: round_up(1, 0), lambda: round_up(-1, 8), lambda: plan_chunks(1, 0), lambda: plan_chunks(-1)):
        with pytest.raises(ValueError):
            call()


class FakeResult(int):
    @property
    def name(self) -> str:
        return {0: "CUDA_SUCCESS", 2: "CUDA_ERROR_OUT_OF_MEMORY"}.get(int(self), "?")


def test_check_result_unpacks_values_and_names_failures() -> None:
    assert check_result((FakeResult(0),), "cuInit") == ()
    assert check_result((FakeResult(0), 42), "cuMemAlloc") == (42,)
    with pytest.raises(errors.BackendError, match="cuMemCreate failed: CUDA_ERROR_OUT_OF_MEMORY") as info:
        check_result((FakeResult(2), None), "cuMemCreate")
    assert info.value.details == {"call": "cuMemCreate", "result": "CUDA_ERROR_OUT_OF_MEMORY"}
    with pytest.raises(errors.BackendError, match="CUresult 999"):
        check_result((999,), "cuX")
    with pytest.raises(errors.BackendError, match="expected"):
        check_result(None, "cuX")


# --- CudaDeviceMemory against a stand-in driver ----------------------------------------------


class FakeDriver:
    """Just enough of ``cuda.bindings.driver``, over host memory.

    Types and enums come from the real module, and every call is checked
    against the real function's signature, so a wrong name or argument
    count fails here as it would on a GPU.
    """

    def __init__(self, real: Any, granularity: int = G, gpus: int = 2) -> None:
        self.real = real
        self.granularity = granularity
        self.uuids = [bytes([0x5A, ordinal, *range(14)]) for ordinal in range(gpus)]  # one per CUDA ordinal
        self._uuid_buffers: list[Any] = []
        if hasattr(real, "cuDeviceGetUuid_v2"):  # cuda-python 12.x: the MIG-aware call is the _v2 one
            self.cuDeviceGetUuid_v2 = self.cuDeviceGetUuid
        self.calls: list[str] = []
        self.fail: dict[str, Any] = {}  # call -> CUresult to return once
        self.handles: dict[int, bytearray] = {}
        self.mapped: dict[int, bytearray] = {}
        self.host: dict[int, Any] = {}
        self.ctx_stack: list[Any] = []
        self.queue: list[Any] = []
        self._next = 0x7000_0000

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def _enter(self, name: str, *args: Any) -> Any:
        inspect.signature(getattr(self.real, name)).bind(*args)
        self.calls.append(name)
        if name != "cuInit":
            assert self.ctx_stack or name.startswith(("cuDevice", "cuCtxPush")), f"{name} without a context"
        failure = self.fail.pop(name, None)
        return (failure,) if failure is not None else None  # a failing call returns just its CUresult

    def _ok(self, *values: Any) -> tuple[Any, ...]:
        return (self.real.CUresult.CUDA_SUCCESS, *values)

    def _device(self, va: int, n: int) -> tuple[bytearray, int]:
        for start, mem in self.mapped.items():
            if start <= va and va + n <= start + len(mem):
                return mem, va - start
        raise AssertionError(f"illegal address {va:#x}")

    def cuInit(self, flags: int) -> Any:
        return self._enter("cuInit", flags) or self._ok()

    def cuDeviceGet(self, ordinal: int) -> Any:
        return self._enter("cuDeviceGet", ordinal) or self._ok(self.real.CUdevice(ordinal))

    def cuDeviceGetCount(self) -> Any:
        return self._enter("cuDeviceGetCount") or self._ok(len(self.uuids))

    def cuDeviceGetUuid(self, dev: Any) -> Any:
        r = self._enter("cuDeviceGetUuid", dev)
        if r:
            return r
        buf = ctypes.create_string_buffer(self.uuids[int(dev)], 16)
        self._uuid_buffers.append(buf)  # the real CUuuid struct reads these 16 bytes
        return self._ok(self.real.CUuuid(ctypes.addressof(buf)))

    def cuDevicePrimaryCtxRetain(self, dev: Any) -> Any:
        return self._enter("cuDevicePrimaryCtxRetain", dev) or self._ok(self.real.CUcontext(0x100 + int(dev)))

    def cuDevicePrimaryCtxRelease(self, dev: Any) -> Any:
        return self._enter("cuDevicePrimaryCtxRelease", dev) or self._ok()

    def cuCtxPushCurrent(self, ctx: Any) -> Any:
        r = self._enter("cuCtxPushCurrent", ctx)
        self.ctx_stack.append(ctx)
        return r or self._ok()

    def cuCtxPopCurrent(self) -> Any:
        r = self._enter("cuCtxPopCurrent")
        return r or self._ok(self.ctx_stack.pop())

    def cuMemGetAllocationGranularity(self, prop: Any, option: Any) -> Any:
        assert isinstance(prop, self.real.CUmemAllocationProp)
        assert prop.type == self.real.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        assert prop.location.type == self.real.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        assert option == self.real.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        return self._enter("cuMemGetAllocationGranularity", prop, option) or self._ok(self.granularity)

    def cuMemAddressReserve(self, size: int, alignment: int, addr: Any, flags: int) -> Any:
        assert isinstance(addr, self.real.CUdeviceptr) and size % self.granularity == 0
        r = self._enter("cuMemAddressReserve", size, alignment, addr, flags)
        if r:
            return r
        va, self._next = self._next, self._next + size + self.granularity
        return self._ok(self.real.CUdeviceptr(va))

    def cuMemAddressFree(self, ptr: Any, size: int) -> Any:
        return self._enter("cuMemAddressFree", ptr, size) or self._ok()

    def cuMemCreate(self, size: int, prop: Any, flags: int) -> Any:
        r = self._enter("cuMemCreate", size, prop, flags)
        if r:
            return r
        handle = len(self.handles) + 1
        self.handles[handle] = bytearray(size)
        return self._ok(self.real.CUmemGenericAllocationHandle(handle))

    def cuMemMap(self, ptr: Any, size: int, offset: int, handle: Any, flags: int) -> Any:
        r = self._enter("cuMemMap", ptr, size, offset, handle, flags)
        if not r:
            assert int(ptr) not in self.mapped
            self.mapped[int(ptr)] = self.handles[int(handle)]
        return r or self._ok()

    def cuMemRelease(self, handle: Any) -> Any:
        del self.handles[int(handle)]  # the mapping, if any, keeps the memory
        return self._enter("cuMemRelease", handle) or self._ok()

    def cuMemSetAccess(self, ptr: Any, size: int, desc: Any, count: int) -> Any:
        assert len(desc) == count and all(isinstance(d, self.real.CUmemAccessDesc) for d in desc)
        assert desc[0].flags == self.real.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        return self._enter("cuMemSetAccess", ptr, size, desc, count) or self._ok()

    def cuMemUnmap(self, ptr: Any, size: int) -> Any:
        r = self._enter("cuMemUnmap", ptr, size)
        if not r:
            assert not self.queue, "unmapped with copies in flight"
            del self.mapped[int(ptr)]
        return r or self._ok()

    def cuMemHostAlloc(self, size: int, flags: int) -> Any:
        assert flags == self.real.CU_MEMHOSTALLOC_PORTABLE
        r = self._enter("cuMemHostAlloc", size, flags)
        if r:
            return r
        buf = ctypes.create_string_buffer(size)
        self.host[ctypes.addressof(buf)] = buf
        return self._ok(ctypes.addressof(buf))

    def cuMemFreeHost(self, p: int) -> Any:
        del self.host[p]
        return self._enter("cuMemFreeHost", p) or self._ok()

    def cuStreamCreate(self, flags: int) -> Any:
        assert flags == int(self.real.CUstream_flags.CU_STREAM_NON_BLOCKING)
        return self._enter("cuStreamCreate", flags) or self._ok(self.real.CUstream(0x5000 + len(self.calls)))

    def cuStreamDestroy(self, stream: Any) -> Any:
        return self._enter("cuStreamDestroy", stream) or self._ok()

    def cuCtxSynchronize(self) -> Any:
        return self._enter("cuCtxSynchronize") or self._ok()  # the workload queued nothing of its own here

    def cuStreamSynchronize(self, stream: Any) -> Any:
        r = self._enter("cuStreamSynchronize", stream)
        queue, self.queue = self.queue, []
        if not r:
            for copy in queue:
                copy()
        return r or self._ok()

    def cuMemcpyDtoHAsync(self, dst: int, src: Any, n: int, stream: Any) -> Any:
        mem, off = self._device(int(src), n)
        self.queue.append(lambda: ctypes.memmove(dst, bytes(mem[off : off + n]), n))
        return self._enter("cuMemcpyDtoHAsync", dst, src, n, stream) or self._ok()

    def cuMemcpyHtoDAsync(self, dst: Any, src: int, n: int, stream: Any) -> Any:
        mem, off = self._device(int(dst), n)

        def run() -> None:
            mem[off : off + n] = ctypes.string_at(src, n)

        self.queue.append(run)
        return self._enter("cuMemcpyHtoDAsync", dst, src, n, stream) or self._ok()

    def cuMemcpyDtoH(self, dst: bytearray, src: Any, n: int) -> Any:
        mem, off = self._device(int(src), n)
        dst[:n] = mem[off : off + n]
        return self._enter("cuMemcpyDtoH", dst, src, n) or self._ok()

    def cuMemcpyHtoD(self, dst: Any, src: Any, n: int) -> Any:
        mem, off = self._device(int(dst), n)
        mem[off : off + n] = bytes(memoryview(src)[:n])
        return self._enter("cuMemcpyHtoD", dst, src, n) or self._ok()


@pytest.fixture
def driver() -> FakeDriver:
    real = pytest.importorskip(
        "cuda.bindings.driver", reason="cuda-python is not installed: FakeDriver takes its types from the bindings"
    )
    return FakeDriver(real)


def test_cuda_device_memory_parks_through_the_driver_api(driver: FakeDriver) -> None:
    mem = CudaDeviceMemory(driver=driver, chunk_bytes=3000, numbering=GpuNumbering.identity())
    off = Offloader(mem, verify=True)
    rng = random.Random(8)
    a, b = off.alloc(10_000, tag="weights"), off.alloc(100, tag="lora", gpu=1)
    data = [fill(a, rng), fill(b, rng)]
    assert a.size == 3 * G and mem.used_bytes() == 4 * G
    assert len(driver.handles) == 0  # released right after mapping: unmapping alone frees the memory
    driver.calls.clear()
    off.park()
    assert driver.calls.count("cuMemcpyDtoHAsync") == 4 + 1  # 10 000 bytes in 3 000-byte chunks, then 100
    # The job's own work is waited for once per GPU, before the first copy out of it.
    assert driver.calls.count("cuCtxSynchronize") == 2
    assert driver.calls.index("cuCtxSynchronize") < driver.calls.index("cuMemcpyDtoHAsync")
    assert driver.calls.count("cuMemHostAlloc") == 2 and driver.calls.count("cuMemUnmap") == 2
    assert driver.mapped == {} and mem.used_bytes() == 0
    assert driver.calls.index("cuStreamSynchronize") > max(
        i for i, c in enumerate(driver.calls) if c == "cuMemcpyDtoHAsync"
    )  # all copies queued first, one wait
    with pytest.raises(errors.NotResident):
        mem.read(a.ptr, 1)
    ptrs = (a.ptr, b.ptr)
    off.unpark()
    assert (a.ptr, b.ptr) == ptrs and [a.read(), b.read()] == data
    assert "cuMemSetAccess" in driver.calls and driver.ctx_stack == []
    off.park()
    assert driver.calls.count("cuMemHostAlloc") == 2  # pinned buffers reused
    off.unpark()
    off.close()
    mem.close()
    assert driver.host == {} and driver.mapped == {} and driver.ctx_stack == []
    assert driver.calls.count("cuDevicePrimaryCtxRelease") == 2


def test_cuda_device_memory_reports_the_failing_call_and_result(driver: FakeDriver) -> None:
    mem = CudaDeviceMemory(driver=driver, numbering=GpuNumbering.identity())
    off = Offloader(mem)
    r = off.alloc(G, tag="weights")
    off.park()
    driver.fail["cuMemCreate"] = driver.real.CUresult.CUDA_ERROR_OUT_OF_MEMORY
    with pytest.raises(errors.BackendError, match="cuMemCreate failed: CUDA_ERROR_OUT_OF_MEMORY") as info:
        off.unpark()
    assert info.value.details["parked"] == ["weights/0"]
    assert mem.used_bytes() == 0 and driver.ctx_stack == []  # bookkeeping and context stack unwound
    driver.fail["cuMemMap"] = driver.real.CUresult.CUDA_ERROR_INVALID_VALUE
    with pytest.raises(errors.BackendError, match="cuMemMap failed: CUDA_ERROR_INVALID_VALUE"):
        off.unpark()
    assert driver.handles == {} and mem.used_bytes() == 0  # the handle of the failed map was released
    off.unpark()
    assert r.resident


def test_cuda_device_memory_without_a_driver_is_unavailable(
    monkeypatch: pytest.MonkeyPatch, driver: FakeDriver
) -> None:
    def no_lib(flags: int) -> Any:
        raise RuntimeError("libcuda.so.1 not found")

    driver.cuInit = no_lib  # type: ignore[method-assign]
    with pytest.raises(errors.BackendUnavailable, match="cannot be loaded"):
        CudaDeviceMemory(driver=driver)
    driver.cuInit = lambda flags: (driver.real.CUresult.CUDA_ERROR_NO_DEVICE,)  # type: ignore[method-assign]
    with pytest.raises(errors.BackendUnavailable, match="CUDA_ERROR_NO_DEVICE"):
        CudaDeviceMemory(driver=driver)


def test_cuda_device_memory_without_cuda_python_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", None)
    with pytest.raises(errors.BackendUnavailable, match="cuda-python"):
        CudaDeviceMemory()


# --- GPU numbering: figures go out in the node's numbers ---------------------------------------------------


def test_figures_are_keyed_by_the_node_gpus_of_the_memorys_devices() -> None:
    # A process with CUDA_VISIBLE_DEVICES=3,1 sees the node's GPU 3 as device 0 and GPU 1 as device 1.
    mem = HostDeviceMemory(gpus=2, granularity=G, numbering=GpuNumbering((3, 1)))
    off = Offloader(mem)
    a, b = off.alloc(G, tag="w"), off.alloc(2 * G, tag="w", gpu=1)
    assert (a.gpu, a.node_gpu, b.gpu, b.node_gpu) == (0, 3, 1, 1)
    assert off.footprint() == {3: G, 1: 2 * G} == off.resident()
    stats = off.park()
    assert stats.per_gpu == {3: G, 1: 2 * G} and stats.resident == {} and stats.footprint == {3: G, 1: 2 * G}
    assert stats.to_wire()["footprint"] == {"1": 2 * G, "3": G}  # what offload_done carries
    assert mem.used_bytes(0) == 0  # the memory itself still speaks its own numbers
    off.unpark()
    narrow = Offloader(HostDeviceMemory(gpus=2, granularity=G, numbering=GpuNumbering((3,))))
    with pytest.raises(errors.BackendError, match="CUDA device 1 is not visible"):
        narrow.alloc(G, tag="w", gpu=1)  # a device it cannot name is refused before anything is allocated
    assert narrow.regions() == [] and narrow.memory.used_bytes() == 0


def test_cuda_device_memory_names_its_devices_by_their_uuids(
    driver: FakeDriver, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ..fakes.nvml import FakeGpu, FakeNvml

    # NVML lists the driver's device 1 first: the node's GPU 0 is CUDA device 1, and GPU 1 is device 0.
    nvml = FakeNvml([FakeGpu(uuid=uuid_text(driver.uuids[1])), FakeGpu(uuid=uuid_text(driver.uuids[0]))])
    nvml.install(monkeypatch)
    mem = CudaDeviceMemory(driver=driver)  # learns the numbering from this driver and NVML, on first use
    off = Offloader(mem)
    a, b = off.alloc(G, tag="w"), off.alloc(3 * G, tag="w", gpu=1)
    assert (a.node_gpu, b.node_gpu) == (1, 0) and mem.node_gpu(0) == 1
    assert driver.calls.count("cuDeviceGetUuid") == 2 and nvml.refcount == 0
    assert off.park().per_gpu == {1: G, 0: 3 * G}
    with pytest.raises(errors.BackendError, match="CUDA device 2 is not visible"):
        off.alloc(G, tag="w", gpu=2)
    off.unpark()
    off.close()
    mem.close()
