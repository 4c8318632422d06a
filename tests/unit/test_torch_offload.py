"""Parking torch modules, optimizers and tensors, per storage (CPU tensors here; the same code paths on CUDA).

Skipped where torch is not installed, unless TIMESLICED_REQUIRE_TORCH=1 (CI):
then a missing torch is a failure.

A parked tensor's storage holds no memory, and reading it crashes the process:
assertions here never show a parked tensor (pytest would print it), only
numbers computed from it.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

if os.environ.get("TIMESLICED_REQUIRE_TORCH") == "1":
    import numpy  # torch warns at import without it, and warnings are errors here
    import torch
else:
    numpy = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")

from timesliced import errors
from timesliced.client.gpus import GpuNumbering
from timesliced.client.offload import CombinedOffload, HostDeviceMemory, Offloader, TorchOffload, execute
from timesliced.client.offload.torch_state import storage_key, tensor_checksum

pytestmark = pytest.mark.timeout(60)


class Net(torch.nn.Module):  # type: ignore[misc, name-defined, unused-ignore]
    """A small model with a base, a LoRA-style adapter and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.base = torch.nn.Linear(16, 16)
        self.lora_a = torch.nn.Parameter(torch.randn(4, 16) * 0.1)
        self.lora_b = torch.nn.Parameter(torch.randn(16, 4) * 0.1)
        self.register_buffer("scale", torch.tensor([0.5, 2.0]))

    def forward(self, x: Any) -> Any:
        return self.base(x) + (x @ self.lora_a.T @ self.lora_b.T) * self.scale[0]


def make(seed: int = 0) -> tuple[Any, Any]:
    torch.manual_seed(seed)
    net = Net()
    return net, torch.optim.Adam(net.parameters(), lr=0.01)


def train_step(net: Any, opt: Any, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 16, generator=g)
    opt.zero_grad()
    net(x).pow(2).mean().backward()
    opt.step()


def snapshot(tensors: list[Any]) -> list[Any]:
    return [t.detach().clone() for t in tensors]


def held(tensors: list[Any]) -> list[int]:
    """Bytes each tensor's storage holds now (0 while parked): safe to show in an assertion."""
    return [t.untyped_storage().nbytes() for t in tensors]


def offsets(tensors: list[Any]) -> list[int]:
    """Each tensor's data address relative to the first one's: what views of one storage keep across a park."""
    return [t.data_ptr() - tensors[0].data_ptr() for t in tensors]


@pytest.mark.slow
def test_module_and_optimizer_round_trip_keeps_values_and_identities() -> None:
    net, opt = make()
    train_step(net, opt, 1)  # optimizer state exists now
    off = TorchOffload()
    assert off.register(net, tag="weights") == 5  # 4 parameters and a buffer
    off.register(opt, tag="optimizer")
    params = list(net.parameters())
    grads = [p.grad for p in params]
    state = [v for s in opt.state.values() for v in s.values()]
    n_state = len(state)
    everything = params + grads + state + [net.scale]
    before = snapshot(everything)
    ids = [id(t) for t in everything]
    shapes = [(t.shape, t.stride()) for t in everything]
    stats = off.park()
    assert (stats.regions, n_state, stats.skipped) == (5 + 4 + 12, 12, 0)  # 4 parameters, their grads, a buffer
    assert stats.nbytes == sum(t.numel() * t.element_size() for t in before)  # the grads went too
    assert held(everything) == [0] * len(everything), "parked tensors must not hold memory"
    assert all(off.is_parked(t) for t in everything)
    assert [(t.shape, t.stride()) for t in everything] == shapes  # a parked tensor keeps its shape
    assert [id(p.grad) for p in params] == [id(g) for g in grads]  # grads are parked in place, not dropped
    off.unpark()
    assert [id(t) for t in [*params, *(p.grad for p in params), *state, net.scale]] == ids
    assert list(net.parameters()) == params and opt.param_groups[0]["params"] == params
    assert [id(v) for s in opt.state.values() for v in s.values()] == ids[8:20]
    for old, new in zip(before, everything, strict=True):
        assert torch.equal(old, new) and old.stride() == new.stride()
    assert not any(off.is_parked(t) for t in everything)


def test_training_after_unpark_matches_training_without_parking() -> None:
    net, opt = make(3)
    ref_net, ref_opt = make(3)
    off = TorchOffload(verify=True)
    off.register(net, tag="weights")
    off.register(opt, tag="optimizer")  # before the first step: state is found at park time
    for step in range(3):
        train_step(net, opt, step)
        train_step(ref_net, ref_opt, step)
        assert off.park().verified
        assert off.unpark().verified
    train_step(net, opt, 99)
    train_step(ref_net, ref_opt, 99)
    for p, q in zip(net.parameters(), ref_net.parameters(), strict=True):
        assert torch.equal(p, q)
    assert torch.equal(
        opt.state[next(iter(net.parameters()))]["exp_avg"], ref_opt.state[next(iter(ref_net.parameters()))]["exp_avg"]
    )


def test_lora_only_park_leaves_the_base_resident() -> None:
    net, _ = make()
    off = TorchOffload()
    off.register([net.lora_a, net.lora_b], tag="lora")
    off.register(net.base, tag="base")
    lora_before = snapshot([net.lora_a, net.lora_b])
    stats = off.park(["lora"])
    assert stats.regions == 2
    assert held([net.lora_a, net.lora_b, net.base.weight]) == [0, 0, 16 * 16 * 4]
    assert not off.is_parked(net.base.weight)
    off.unpark({"lora"})
    assert all(torch.equal(a, b) for a, b in zip(lora_before, [net.lora_a, net.lora_b], strict=True))
    with pytest.raises(ValueError, match="registered under tag 'lora'"):
        off.register(net, tag="everything")  # overlaps the adapters
    with pytest.raises(ValueError, match="registered under tag 'base'"):
        off.register(net.base.weight[3:5], tag="rows")  # a view: its storage is the base's


def test_grads_can_be_dropped() -> None:
    net, opt = make()
    train_step(net, opt, 1)
    off = TorchOffload(drop_grads=True)
    off.register(net, tag="weights")
    weight = net.base.weight.detach().clone()
    data_bytes = sum(t.numel() * t.element_size() for t in [*net.parameters(), net.scale])
    assert off.park().nbytes == data_bytes  # no grads copied
    off.unpark()
    assert all(p.grad is None for p in net.parameters())
    assert torch.equal(net.base.weight, weight)
    train_step(net, opt, 2)  # a step after a dropped-grad cycle works


def test_park_and_unpark_are_idempotent() -> None:
    a, b = torch.arange(10.0), torch.arange(5)
    off = TorchOffload()
    off.register(a, tag="a")
    off.register([b], tag="b")
    assert off.park(["a"]).regions == 1
    again = off.park("a")
    assert (again.regions, again.skipped, again.nbytes) == (0, 1, 0)
    both = off.park()
    assert (both.regions, both.skipped) == (1, 1)
    assert off.unpark().regions == 2
    again = off.unpark()
    assert (again.regions, again.skipped) == (0, 2)
    assert torch.equal(a, torch.arange(10.0)) and torch.equal(b, torch.arange(5))


def test_host_tensors_are_reused_and_capped() -> None:
    t = torch.randn(100)
    off = TorchOffload()
    off.register(t, tag="t")
    values = t.clone()
    off.park()
    host = off.host_copy(t)
    assert host is not None and off.host_copy(torch.zeros(1)) is None
    assert torch.equal(host, values) and host.shape == t.shape
    first = host.data_ptr()
    off.unpark()
    assert off.host_copy(t) is None
    off.park()
    host = off.host_copy(t)
    assert host is not None and host.data_ptr() == first  # the same host buffer, not a new allocation
    off.unpark()

    capped = TorchOffload(keep_host_bytes=0)
    capped.register(t, tag="t")
    capped.park()
    kept = capped.host_copy(t)
    capped.unpark()
    capped.park()
    again = capped.host_copy(t)
    assert kept is not None and again is not None and again.data_ptr() != kept.data_ptr()
    capped.unpark()


def test_verify_catches_a_corrupted_host_copy() -> None:
    t = torch.randn(64)
    u = torch.randn(8)
    values = t.clone()
    off = TorchOffload(verify=True)
    off.register(t, tag="weights", name="w")
    off.register(u, tag="lora", name="adapter")
    off.park()
    host = off.host_copy(u)
    host[3] += 1
    with pytest.raises(errors.BackendError, match="'adapter\\[0\\]' \\(tag 'lora'\\)") as info:
        off.unpark()
    assert info.value.details["tag"] == "lora" and info.value.details["region"] == "adapter[0]"
    assert off.is_parked(t) and off.is_parked(u)  # nothing came back
    assert held([t, u]) == [0, 0]
    host[3] -= 1
    off.unpark()
    assert torch.equal(t, values)


class Flaky(TorchOffload):
    """Fails the n-th device (or host) allocation."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fail_device_at = 0
        self.fail_host_at = 0
        self.device_calls = 0
        self.host_calls = 0

    def _allocate(self, storage: Any, nbytes: int) -> None:
        self.device_calls += 1
        if self.device_calls == self.fail_device_at:
            raise RuntimeError("CUDA out of memory (injected)")
        super()._allocate(storage, nbytes)

    def _new_host_tensor(self, nbytes: int, device: Any) -> Any:
        self.host_calls += 1
        if self.host_calls == self.fail_host_at:
            raise RuntimeError("cannot pin memory (injected)")
        return super()._new_host_tensor(nbytes, device)


def test_a_failing_park_leaves_everything_resident() -> None:
    net, opt = make()
    train_step(net, opt, 1)
    off = Flaky()
    off.register(net, tag="weights")
    before = snapshot(list(net.parameters()))
    off.fail_host_at = 4
    with pytest.raises(errors.BackendError, match="every tensor is still resident") as info:
        off.park()
    assert "injected" in info.value.details["cause"] and info.value.details["parked"] == []
    assert all(not off.is_parked(p) and p.untyped_storage().nbytes() > 0 for p in net.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters(), strict=True))
    assert all(p.grad is not None and p.grad.untyped_storage().nbytes() > 0 for p in net.parameters())
    assert off.park().regions == 5 + 4  # and the grads


def test_a_failing_unpark_leaves_everything_parked() -> None:
    net, opt = make()
    train_step(net, opt, 1)
    off = Flaky()
    off.register(net, tag="weights")
    off.register(opt, tag="optimizer")
    before = snapshot(list(net.parameters()))
    off.park()
    off.fail_device_at = off.device_calls + 5
    with pytest.raises(errors.BackendError, match="every tensor of the call is still parked"):
        off.unpark()
    assert all(off.is_parked(p) for p in net.parameters())
    assert held(list(net.parameters())) == [0] * 4  # the four allocated before the failure were freed again
    off.unpark()
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters(), strict=True))
    train_step(net, opt, 2)


def test_registration_checks() -> None:
    off = TorchOffload()
    with pytest.raises(TypeError):
        off.register("weights", tag="t")
    with pytest.raises(TypeError):
        off.register([torch.zeros(1), 3], tag="t")
    with pytest.raises(ValueError, match="dense"):
        off.register(torch.zeros(3, 3).to_sparse(), tag="t")
    with pytest.raises(ValueError, match="meta tensor"):
        off.register(torch.zeros(3, device="meta"), tag="t")
    with pytest.raises(ValueError, match=r"from_numpy.*t\.clone\(\)"):
        off.register(torch.from_numpy(numpy.zeros(4)), tag="t")
    with pytest.raises(ValueError):
        off.register(torch.zeros(1), tag="")
    assert off.tags() == set()
    t = torch.zeros(3)
    off.register(t, tag="t")
    with pytest.raises(errors.UnknownRegion):
        off.park(["t", "nope"])
    assert not off.is_parked(t)
    off.park()
    with pytest.raises(ValueError, match="parked"):
        off.register(torch.zeros(1), tag="t")
    with pytest.raises(ValueError, match="parked"):
        off.unregister("t")
    off.unpark()
    off.unregister("t")
    assert off.tags() == set()
    with pytest.raises(errors.UnknownRegion):
        off.unregister("t")


def test_one_directive_over_raw_regions_and_torch_state() -> None:
    mem = HostDeviceMemory(granularity=4096)
    raw = Offloader(mem)
    region = raw.alloc(1000, tag="kv")
    region.write(b"k" * 1000)
    net, _ = make()
    tor = TorchOffload()
    tor.register(net, tag="weights")
    stats = execute("park", [raw, tor])
    assert stats.regions == 1 + 5
    assert mem.used_bytes() == 0 and net.base.weight.untyped_storage().nbytes() == 0
    stats = execute("unpark", [raw, tor], ["weights"])
    assert stats.regions == 5 and not region.resident
    assert CombinedOffload(raw, tor).unpark().regions == 1
    assert region.read() == b"k" * 1000


def test_checksum_covers_every_dtype_and_shape() -> None:
    assert tensor_checksum(torch.zeros(0)) == 0
    for t in (torch.tensor(3.0), torch.randn(3, 4).T, torch.ones(5, dtype=torch.bfloat16), torch.tensor([True, False])):
        c = tensor_checksum(t)
        assert c == tensor_checksum(t.clone())
        bumped = t.clone()
        first = (0,) * t.dim()
        bumped[first] = 0 if t.dtype != torch.bool else not bool(t[first])
        if not torch.equal(bumped, t):
            assert tensor_checksum(bumped) != c


# --- per storage: views, flat buffers, expand, shared grads -----------------------------------------------


def test_views_of_one_storage_are_parked_once_and_keep_sharing_memory() -> None:
    base = torch.arange(24.0)
    rows = base.view(4, 6)
    col = rows[:, 2]  # strided view
    tail = base[10:]
    off = TorchOffload(verify=True)
    assert off.register([base, rows, col, tail], tag="t") == 4
    before, ids, rel = (
        snapshot([base, rows, col, tail]),
        [id(x) for x in (base, rows, col, tail)],
        offsets([base, col, tail]),
    )
    stats = off.park()
    assert (stats.regions, stats.nbytes) == (1, 24 * 4)  # one storage, once
    assert held([base, rows, col, tail]) == [0, 0, 0, 0]
    assert all(off.is_parked(x) for x in (base, rows, col, tail))
    assert off.unpark().verified
    assert [id(x) for x in (base, rows, col, tail)] == ids
    assert offsets([base, col, tail]) == rel and len({storage_key(x) for x in (base, rows, col, tail)}) == 1
    assert all(torch.equal(a, b) for a, b in zip(before, [base, rows, col, tail], strict=True))
    base[12] = -1.0  # still one memory: a write through one is seen through the others
    assert rows[2, 0].item() == -1.0 and tail[2].item() == -1.0 and col[2].item() == 14.0


def flat_net(seed: int) -> tuple[Any, Any, Any]:
    """A module whose parameters are all cut from one flat buffer, and its optimizer."""
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    params = list(net.parameters())
    flat = torch.nn.utils.parameters_to_vector(params)
    at = 0
    for p in params:
        p.data = flat[at : at + p.numel()].view_as(p)  # what flat-parameter wrappers do
        at += p.numel()
    return net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9), flat


def flat_step(net: Any, opt: Any, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    opt.zero_grad(set_to_none=False)
    net(torch.randn(4, 8, generator=g)).pow(2).sum().backward()
    opt.step()


def test_parameters_cut_from_one_flat_buffer_stay_views_of_it() -> None:
    net, opt, flat = flat_net(1)
    ref_net, ref_opt, _ = flat_net(1)
    flat_step(net, opt, 0)
    flat_step(ref_net, ref_opt, 0)
    off = TorchOffload(verify=True)
    off.register(net, tag="weights")
    off.register(opt, tag="optimizer")
    params = list(net.parameters())
    keys, rel = {storage_key(p) for p in params}, offsets([flat, *params])
    assert keys == {storage_key(flat)}
    stats = off.park()
    # one parameter storage, the grads' four storages, four momentum buffers
    assert stats.regions == 1 + 4 + 4 and held([flat]) == [0]
    assert off.unpark().verified
    assert {storage_key(p) for p in params} == keys and offsets([flat, *params]) == rel
    assert list(net.parameters()) == params and all(
        p is q for p, q in zip(opt.param_groups[0]["params"], params, strict=True)
    )
    for step in (1, 2):
        flat_step(net, opt, step)
        flat_step(ref_net, ref_opt, step)
        off.park()
        off.unpark()
    assert torch.equal(torch.nn.utils.parameters_to_vector(net.parameters()), flat)  # still one buffer
    assert torch.equal(flat, torch.nn.utils.parameters_to_vector(ref_net.parameters()))


def test_an_expanded_buffer_keeps_its_zero_strides() -> None:
    net = torch.nn.Module()
    net.register_buffer("mask", torch.arange(4.0).expand(3, 4))
    net.register_buffer("scale", torch.ones(2))
    off = TorchOffload()
    off.register(net, tag="b")
    mask, stride = net.mask, net.mask.stride()
    assert stride == (0, 1)
    stats = off.park()
    assert (stats.regions, stats.nbytes) == (2, 4 * 4 + 2 * 4)  # the expanded buffer's 4 floats, not 12
    off.unpark()
    assert net.mask is mask and mask.stride() == stride and torch.equal(mask, torch.arange(4.0).expand(3, 4))


def test_grads_that_are_views_of_one_bucket_come_back_as_views_of_it() -> None:
    net, _ = make(4)
    params = list(net.parameters())
    bucket = torch.zeros(sum(p.numel() for p in params))
    at = 0
    for p in params:  # what DDP's gradient_as_bucket_view=True does
        p.grad = bucket[at : at + p.numel()].view_as(p)
        at += p.numel()
    net(torch.randn(2, 16)).sum().backward()  # accumulates into the bucket views
    off = TorchOffload(drop_grads=False)
    off.register(net, tag="w")
    grads, rel, values = [p.grad for p in params], offsets([bucket, *[p.grad for p in params]]), bucket.clone()
    stats = off.park()
    assert stats.regions == 4 + 1 + 1 and held([bucket]) == [0]  # parameters, the scale buffer, one bucket
    off.unpark()
    assert [p.grad for p in params] == grads and offsets([bucket, *grads]) == rel and torch.equal(bucket, values)


def test_a_graph_saved_for_backward_survives_a_park() -> None:
    w = torch.nn.Parameter(torch.randn(5))
    y = (w * w).sum()  # saves w for backward
    expected = 2 * w.detach().clone()
    off = TorchOffload()
    off.register(w, tag="w")
    version = w._version
    off.park()
    off.unpark()
    assert w._version == version  # the copy back is no in-place op on w: autograd's checks pass
    y.backward()
    assert w.grad is not None and torch.allclose(w.grad, expected)


def test_a_storage_belongs_to_one_tag() -> None:
    flat = torch.zeros(10)
    off = TorchOffload()
    off.register(flat[:5], tag="a")
    with pytest.raises(ValueError, match=r"\[0\]' is on the storage of 'a\[0\]', registered under tag 'a'"):
        off.register(flat[5:], tag="b")
    assert off.tags() == {"a"}
    # Optimizer state is found at every park: state on another tag's storage is refused then, nothing moved.
    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([p], lr=0.1)
    off.register(opt, tag="opt")
    opt.state[p]["momentum_buffer"] = flat[2:4]
    with pytest.raises(errors.BackendError, match=r"park refused: .*shares its storage") as info:
        off.park(["opt"])
    assert "still resident" in info.value.message and held([flat]) == [40] and not off.is_parked(flat)
    with pytest.raises(errors.BackendError, match="park refused"):
        off.park()
    del opt.state[p]["momentum_buffer"]
    assert off.park().regions == 1


class PooledOffload(TorchOffload):
    """Pretends some storages live in a CUDA graph's private memory pool."""

    def __init__(self, pooled: list[Any]) -> None:
        super().__init__()
        self.pooled = pooled
        self.asked: list[set[Any]] = []

    def _private_pool_ranges(self, devices: set[Any]) -> list[tuple[int, int]]:
        self.asked.append(devices)
        spans = [t.untyped_storage() for t in self.pooled]
        return [(s.data_ptr(), s.data_ptr() + s.nbytes()) for s in spans]


def test_storages_of_a_cuda_graph_pool_are_refused() -> None:
    captured, free = torch.zeros(8), torch.zeros(8)
    off = PooledOffload([captured])
    with pytest.raises(ValueError, match=r"private memory pool .*CUDA graph"):
        off.register([free, captured[2:]], tag="t")
    assert off.tags() == set()
    off.register(free, tag="t")
    # State found later is checked at the park that first sees it, once.
    p = torch.nn.Parameter(torch.zeros(8))
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    off.register(opt, tag="opt")
    opt.state[p]["momentum_buffer"] = captured
    asked = len(off.asked)
    with pytest.raises(errors.BackendError, match=r"park refused: .*private memory pool"):
        off.park()
    assert not off.is_parked(free)
    opt.state[p]["momentum_buffer"] = torch.zeros(8)
    off.park()
    off.unpark()
    n = len(off.asked)
    off.park()
    assert len(off.asked) == n and n == asked + 2  # storages seen before are not looked up again


@pytest.mark.parametrize("older_torch", [False, True])
def test_private_pools_are_read_from_the_allocators_segments(monkeypatch: Any, older_torch: bool) -> None:
    """Every segment outside the default pool (0, 0) is a private range; a torch whose memory_snapshot takes no
    include_traces (older releases) is asked without it."""
    segments = [
        {"address": 4096, "total_size": 2048, "segment_pool_id": (0, 0)},
        {"address": 65536, "total_size": 1024, "segment_pool_id": (1, 7)},
        {"address": 8192, "total_size": 512},  # no pool id: the default pool
    ]
    calls: list[dict[str, Any]] = []

    def memory_snapshot(mempool_id: Any = None, **kwargs: Any) -> list[dict[str, Any]]:
        if older_torch and kwargs:
            raise TypeError(f"memory_snapshot() got an unexpected keyword argument {next(iter(kwargs))!r}")
        calls.append(kwargs)
        return segments

    monkeypatch.setattr(torch.cuda, "memory_snapshot", memory_snapshot)
    ranges = TorchOffload()._private_pool_ranges({torch.device("cuda", 0)})
    assert ranges == [(65536, 66560)]
    assert calls == ([{}] if older_torch else [{"include_traces": False}])
    assert TorchOffload()._private_pool_ranges({torch.device("cpu")}) == [] and len(calls) == 1  # no CUDA: not asked


def test_wrapper_subclasses_are_refused_by_name() -> None:
    two_tensor = pytest.importorskip("torch.testing._internal.two_tensor")
    t = two_tensor.TwoTensor(torch.zeros(3), torch.ones(3))
    with pytest.raises(ValueError, match=r"'w\[0\]' is a TwoTensor, a tensor subclass that wraps other tensors"):
        TorchOffload().register(t, tag="t", name="w")


def test_per_gpu_figures_use_the_node_numbering() -> None:
    off = TorchOffload(numbering=GpuNumbering((5, 2)))
    from timesliced.client.offload.torch_state import _Storage

    entries = [
        _Storage(1, None, None, "t", "a", torch.device("cuda", 0), 100),
        _Storage(2, None, None, "t", "b", torch.device("cuda", 1), 10),
        _Storage(3, None, None, "t", "c", torch.device("cuda", 1), 1),
        _Storage(4, None, None, "t", "d", torch.device("cpu"), 7),  # host memory is no GPU's
    ]
    assert off._per_gpu(entries) == {5: 100, 2: 11}
    with pytest.raises(errors.UnknownDevice, match="CUDA device 2 is not visible"):
        off._per_gpu([_Storage(5, None, None, "t", "e", torch.device("cuda", 2), 1)])
