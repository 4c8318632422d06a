"""DTensors and FSDP2 are refused by TorchOffload, by name, before anything is parked.

A real process group (gloo, one rank, an in-memory store) and a real
``fully_shard`` on CPU; skipped where torch or torch.distributed is missing,
unless TIMESLICED_REQUIRE_TORCH=1.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

if os.environ.get("TIMESLICED_REQUIRE_TORCH") == "1":
    import numpy  # noqa: F401  # torch warns at import without it, and warnings are errors here
    import torch
else:
    pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")

from timesliced import errors
from timesliced.client.offload import TorchOffload

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


@pytest.fixture
def mesh() -> Iterator[Any]:
    dist = torch.distributed
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_fsdp2_modules_and_dtensors_are_refused_by_name(mesh: Any) -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    off = TorchOffload()
    with pytest.raises(ValueError, match=r"'FSDPSequential' is sharded by FSDP \(FSDPSequential\).*cuda-checkpoint"):
        off.register(model, tag="weights")
    with pytest.raises(ValueError, match=r"'net\.0' is sharded by FSDP"):
        off.register(torch.nn.ModuleList([model[0]]), tag="weights", name="net")
    param = next(model.parameters())
    with pytest.raises(ValueError, match=r"'w\[0\]' is a DTensor \(FSDP2's fully_shard.*cuda-checkpoint"):
        off.register(param, tag="weights", name="w")
    optimizer = torch.optim.Adam(model.parameters())
    off.register(optimizer, tag="optimizer")  # no state yet: it is found at the park, and refused there
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    with pytest.raises(errors.BackendError, match=r"park refused: 'Adam\.state\[0\.0\]\.\w+' is a DTensor"):
        off.park()
    with pytest.raises(ValueError, match=r"'Adam\.state\[0\.0\]\.\w+' is a DTensor"):
        TorchOffload().register(optimizer, tag="optimizer")  # with its state there, at registration
    dt = distribute_tensor(torch.randn(4, 4), mesh, [Shard(0)])
    with pytest.raises(ValueError, match="is a DTensor"):
        off.register([dt], tag="t")
    assert off.tags() == {"optimizer"} and not any(off.is_parked(p.to_local()) for p in model.parameters())
