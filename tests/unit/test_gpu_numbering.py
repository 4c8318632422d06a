"""CUDA ordinals and the node's GPU numbers, matched by UUID (timesliced.client.gpus).

The machine here has four GPUs whose PCI bus order (NVML's) is not the driver's
fastest-first order, so every mapping below that is not the identity would be
wrong if the code assumed ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` or read
``CUDA_VISIBLE_DEVICES`` as NVML indices.
"""

from __future__ import annotations

import types
from typing import Any

import pytest

from timesliced import errors
from timesliced.client import gpus as numbering_module
from timesliced.client.gpus import GpuNumbering, discover, match_by_uuid, node_gpus, uuid_bytes, uuid_text
from timesliced.client.protocol import register_args

from ..fakes.cuda_devices import FakeDriver, Gpu, Machine, MigNvml
from ..fakes.nvml import FakeNvml, pynvml


def uuid(n: int) -> bytes:
    return bytes([0xA0 + n, 0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, 0x88, 0x99, 0xAA, 0xBB, 0xCC, 0xDD, 0xEE, n])


# NVML (bus order) indices: 0 -> bus 0x1a, 1 -> 0x3d, 2 -> 0x88, 3 -> 0xb1.
# Fastest first: 0x3d and 0xb1 (speed 3), then 0x88 (2), then 0x1a (1), i.e. NVML [1, 3, 2, 0].
MACHINE = Machine(
    [
        Gpu(uuid(2), bus=0x88, speed=2, migs=[uuid(20), uuid(21)]),
        Gpu(uuid(0), bus=0x1A, speed=1),
        Gpu(uuid(3), bus=0xB1, speed=3),
        Gpu(uuid(1), bus=0x3D, speed=3),
    ]
)


@pytest.fixture
def nvml(monkeypatch: pytest.MonkeyPatch) -> MigNvml:
    """NVML over MACHINE, installed into pynvml (the module the code is handed)."""
    return MACHINE.nvml().install(monkeypatch)


def learn(env: dict[str, str]) -> tuple[GpuNumbering, FakeDriver]:
    driver = MACHINE.driver(env)
    return discover(driver=driver, nvml=pynvml), driver


def test_uuid_text_is_nvmls_form() -> None:
    raw = bytes(range(16))
    assert uuid_text(raw) == "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f"
    assert uuid_text(raw, "MIG") == "MIG-00010203-0405-0607-0809-0a0b0c0d0e0f"
    assert uuid_bytes("GPU-00010203-0405-0607-0809-0A0B0C0D0E0F") == raw == uuid_bytes(uuid_text(raw)[4:])
    assert MACHINE.gpus[0].text() == uuid_text(uuid(2))  # the fake NVML writes them as the real one does
    for bad in (b"short", bytes(17)):
        with pytest.raises(ValueError):
            uuid_text(bad)
    with pytest.raises(ValueError):
        uuid_bytes("GPU-0001")


@pytest.mark.parametrize(
    ("env", "nodes"),
    [
        ({}, (1, 3, 2, 0)),  # FASTEST_FIRST is the default: not NVML's order
        ({"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}, (0, 1, 2, 3)),
        ({"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "2,0"}, (2, 0)),
        ({"CUDA_VISIBLE_DEVICES": "2,0"}, (2, 1)),  # indices into the fastest-first order
        ({"CUDA_VISIBLE_DEVICES": f"GPU-{uuid(3).hex()[:6]},GPU-{uuid(0).hex()[:8]}"}, (3, 0)),  # prefixes
        ({"CUDA_VISIBLE_DEVICES": MACHINE.gpus[0].text("MIG", uuid(21))}, (2,)),  # a MIG instance of bus 0x88
        ({"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "0,7,1"}, (0,)),  # an invalid entry ends it
    ],
)
def test_ordinals_map_to_nvml_indices_by_uuid(nvml: MigNvml, env: dict[str, str], nodes: tuple[int, ...]) -> None:
    numbering, driver = learn(env)
    assert numbering.nodes == nodes and not numbering.problem
    assert numbering.nodes_of(range(len(nodes))) == list(nodes)
    assert [numbering.local(n) for n in nodes] == list(range(len(nodes)))
    assert numbering.local(max(set(range(4)) - set(nodes), default=99)) is None
    assert numbering.uuids == tuple(uuid_text(u) for u in MACHINE.visible(env) or [])
    assert "cuInit" in driver.calls and driver.calls.count("cuDeviceGetUuid") == len(nodes)
    assert nvml.inits >= 1 and nvml.refcount == 0  # NVML is closed again (it is reference counted)
    with pytest.raises(errors.UnknownDevice, match=f"CUDA device {len(nodes)} is not visible"):
        numbering.node(len(nodes))


def test_a_process_that_sees_no_gpu_has_no_ordinals(nvml: MigNvml) -> None:
    numbering, _ = learn({"CUDA_VISIBLE_DEVICES": ""})
    assert numbering.nodes == ()
    with pytest.raises(errors.UnknownDevice, match="sees no CUDA device"):
        numbering.node(0)


def test_bytes_per_ordinal_become_bytes_per_node_gpu(nvml: MigNvml) -> None:
    numbering, _ = learn({"CUDA_VISIBLE_DEVICES": "2,0"})  # ordinal 0 -> 2, 1 -> 1
    assert numbering.per_node({0: 10, 1: 5}) == {2: 10, 1: 5}
    both = GpuNumbering((4, 4))  # two MIG instances of one GPU
    assert both.per_node({0: 1, 1: 2}) == {4: 3}
    with pytest.raises(ValueError):
        numbering.node(-1)


def test_without_nvml_the_numbering_is_the_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeNvml(init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND).install(monkeypatch)
    driver = MACHINE.driver({})
    numbering = discover(driver=driver, nvml=pynvml)
    assert numbering.is_identity and numbering.node(7) == 7 and numbering.local(3) == 3
    assert driver.calls == []  # CUDA is not even asked
    assert discover(driver=driver, nvml=FakeNvml([])).is_identity  # an NVML with no GPU: the same


class NoV2Driver:
    """A cuda-python 12.x binding: ``cuDeviceGetUuid`` is v1, ``cuDeviceGetUuid_v2`` returns MIG UUIDs."""

    def __init__(self, inner: FakeDriver) -> None:
        self.inner = inner
        self.v1 = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def cuDeviceGetUuid(self, dev: Any) -> Any:
        self.v1 += 1
        raise AssertionError("the v1 call is not used where _v2 exists")

    def cuDeviceGetUuid_v2(self, dev: Any) -> Any:
        return self.inner.cuDeviceGetUuid(dev)


def test_the_v2_uuid_call_is_used_where_the_binding_has_it(nvml: MigNvml) -> None:
    driver = NoV2Driver(MACHINE.driver({"CUDA_VISIBLE_DEVICES": MACHINE.gpus[0].text("MIG", uuid(20))}))
    numbering = discover(driver=driver, nvml=pynvml)
    assert numbering.nodes == (2,) and driver.v1 == 0


class Props:
    def __init__(self, raw: bytes, with_bytes: bool) -> None:
        text = uuid_text(raw)[4:]  # torch's _CUuuid prints 8-4-4-4-12 hex, no prefix
        self.uuid: Any = types.SimpleNamespace(bytes=raw) if with_bytes else text


def fake_torch(raws: list[bytes], with_bytes: bool) -> Any:
    cuda = types.SimpleNamespace(
        device_count=lambda: len(raws), get_device_properties=lambda i: Props(raws[i], with_bytes)
    )
    return types.SimpleNamespace(cuda=cuda)


@pytest.mark.parametrize("with_bytes", [True, False])
def test_torch_stands_in_for_cuda_python(nvml: MigNvml, monkeypatch: pytest.MonkeyPatch, with_bytes: bool) -> None:
    monkeypatch.setattr(numbering_module, "_import", lambda name: None if name.startswith("cuda") else pynvml)
    torch = fake_torch([uuid(3), uuid(0)], with_bytes)
    numbering = discover(torch=torch)
    assert numbering.nodes == (3, 0) and numbering.source.startswith("torch")


def test_without_any_way_to_ask_cuda_the_map_is_unknown(nvml: MigNvml, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(numbering_module, "_import", lambda name: None if name.startswith("cuda") else pynvml)
    monkeypatch.delitem(__import__("sys").modules, "torch", raising=False)
    numbering = discover()
    assert not numbering.is_identity
    with pytest.raises(errors.BackendUnavailable, match=r"cuda-python is not installed.*pip install"):
        numbering.node(0)
    with pytest.raises(errors.BackendUnavailable):
        numbering.local(0)

    class Broken:
        def cuInit(self, flags: int) -> Any:
            raise RuntimeError("libcuda.so.1 not found")

    numbering = discover(driver=Broken(), nvml=pynvml)
    with pytest.raises(errors.BackendUnavailable, match="CUDA driver cannot be loaded: libcuda"):
        numbering.node(0)


def test_a_cuda_device_that_nvml_does_not_list_is_named(nvml: MigNvml) -> None:
    stranger = Machine([Gpu(uuid(9), bus=1)])
    numbering = discover(driver=stranger.driver({}), nvml=pynvml)
    with pytest.raises(errors.BackendUnavailable, match=r"CUDA device 0 \(GPU-a9112233-.*\) is not one of the GPUs"):
        numbering.node(0)
    with pytest.raises(errors.UnknownDevice):
        match_by_uuid([uuid(9)], {uuid_text(uuid(1)): 1})
    assert match_by_uuid([uuid(1)], {uuid_text(uuid(1)).upper(): 1}) == (1,)  # NVML's case does not matter


def test_process_numbering_is_learned_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    def fake_discover(**kwargs: Any) -> GpuNumbering:
        calls.append(1)
        return GpuNumbering((3, 1))

    monkeypatch.setattr(numbering_module, "_process", None)
    monkeypatch.setattr(numbering_module, "discover", fake_discover)
    assert numbering_module.process_numbering() is numbering_module.process_numbering()
    assert calls == [1]
    assert node_gpus() == [3, 1] and node_gpus([1]) == [1] and node_gpus([]) == []
    with pytest.raises(errors.UnknownDevice):
        node_gpus([2])


def test_gpus_visible_registers_the_node_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(numbering_module, "_process", GpuNumbering((2, 0)))
    assert register_args("j", "g", "visible", None)["gpus"] == [2, 0]
    assert register_args("j", "g", [0, 1], None)["gpus"] == [0, 1]  # numbers are the node's, as before
    assert register_args("j", "g", None, None)["gpus"] is None
    with pytest.raises(ValueError, match="'visible'"):
        register_args("j", "g", "all", None)
    monkeypatch.setattr(numbering_module, "_process", GpuNumbering.identity())
    with pytest.raises(errors.BackendUnavailable, match=r"name the node's GPUs as numbers"):
        register_args("j", "g", "visible", None)
    monkeypatch.setattr(numbering_module, "_process", GpuNumbering(()))
    with pytest.raises(errors.BackendUnavailable, match=r"sees no CUDA device"):
        register_args("j", "g", "visible", None)
