"""Parking torch modules, optimizers and tensors (CPU tensors here; the same code paths on CUDA).

Skipped where torch is not installed, unless TIMESLICED_REQUIRE_TORCH=1 (CI):
then a missing torch is a failure.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

if os.environ.get("TIMESLICED_REQUIRE_TORCH") == "1":
    import numpy  # noqa: F401  # torch warns at import without it, and warnings are errors here
    import torch
else:
    pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")

from timesliced import errors
from timesliced.client.offload import CombinedOffload, HostDeviceMemory, Offloader, TorchOffload, execute
from timesliced.client.offload.torch_state import tensor_checksum

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


@pytest.mark.slow
def test_module_and_optimizer_round_trip_keeps_values_and_identities() -> None:
    net, opt = make()
    train_step(net, opt, 1)  # optimizer state exists now
    off = TorchOffload()
    assert off.register(net, tag="weights") == 5  # 4 parameters and a buffer
    off.register(opt, tag="optimizer")
    params = list(net.parameters())
    state = [v for s in opt.state.values() for v in s.values()]
    before = snapshot(params + state + [net.scale])
    ids = [id(t) for t in params + state]
    grad_bytes = sum(p.grad.numel() * p.grad.element_size() for p in params)
    stats = off.park()
    assert stats.regions == 5 + len(state) == 5 + 12 and stats.skipped == 0
    assert stats.nbytes == sum(t.numel() * t.element_size() for t in before) + grad_bytes  # the grads went too
    for t in params + state + [net.scale]:
        assert t.untyped_storage().nbytes() == 0, "parked tensors must not hold memory"
        assert off.is_parked(t)
    assert all(p.grad is None for p in params)
    off.unpark()
    after = params + state + [net.scale]
    assert [id(t) for t in params + state] == ids
    assert list(net.parameters()) == params and opt.param_groups[0]["params"] == params
    for old, new in zip(before, after, strict=True):
        assert torch.equal(old, new) and old.stride() == new.stride()
    assert all(p.grad is not None for p in params)  # grads came back too
    assert not any(off.is_parked(t) for t in after)


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
    assert net.lora_a.untyped_storage().nbytes() == 0 and net.lora_b.untyped_storage().nbytes() == 0
    assert net.base.weight.untyped_storage().nbytes() == 16 * 16 * 4
    assert not off.is_parked(net.base.weight)
    off.unpark({"lora"})
    assert all(torch.equal(a, b) for a, b in zip(lora_before, [net.lora_a, net.lora_b], strict=True))
    with pytest.raises(ValueError, match="registered under tag 'lora'"):
        off.register(net, tag="everything")  # overlaps the adapters


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
    off.park()
    host = off.host_copy(t)
    assert host is not None and off.host_copy(torch.zeros(1)) is None
    off.unpark()
    assert off.host_copy(t) is None
    off.park()
    assert off.host_copy(t) is host  # the same host tensor, not a new allocation
    off.unpark()

    capped = TorchOffload(keep_host_bytes=0)
    capped.register(t, tag="t")
    capped.park()
    first = capped.host_copy(t)
    capped.unpark()
    capped.park()
    assert capped.host_copy(t) is not first


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
    assert t.untyped_storage().nbytes() == 0
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

    def _new_device_tensor(self, host: Any, device: Any) -> Any:
        self.device_calls += 1
        if self.device_calls == self.fail_device_at:
            raise RuntimeError("CUDA out of memory (injected)")
        return super()._new_device_tensor(host, device)

    def _new_host_tensor(self, like: Any) -> Any:
        self.host_calls += 1
        if self.host_calls == self.fail_host_at:
            raise RuntimeError("cannot pin memory (injected)")
        return super()._new_host_tensor(like)


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
    assert all(p.grad is not None for p in net.parameters())
    assert off.park().regions == 5


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
    assert all(off.is_parked(p) and p.untyped_storage().nbytes() == 0 for p in net.parameters())
    off.unpark()
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters(), strict=True))
    train_step(net, opt, 2)


def test_registration_checks() -> None:
    off = TorchOffload()
    with pytest.raises(TypeError):
        off.register("weights", tag="t")
    with pytest.raises(TypeError):
        off.register([torch.zeros(1), 3], tag="t")
    with pytest.raises(ValueError, match="view"):
        off.register(torch.zeros(4)[1:], tag="t")
    with pytest.raises(ValueError, match="dense"):
        off.register(torch.zeros(3, 3).to_sparse(), tag="t")
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
