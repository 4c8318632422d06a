"""Cluster-wide names for node-local things (pure).

Every daemon knows the same sorted list of member ids, so a node's *slot* (its
index in that list) is the same everywhere. The leader's scheduler sees GPUs
and sessions of every node through one flat integer space:

- GPU ``g`` of the node in slot ``s`` is ``s * GPU_STRIDE + g``;
- connection ``c`` of the node in slot ``s`` is session ``s * SESSION_STRIDE + c``.

A single daemon is slot 0, so its global ids are its local ones.
"""

from __future__ import annotations

GPU_STRIDE = 100  # GPUs per node, at most; global GPU 103 is GPU 3 of the node in slot 1
SESSION_STRIDE = 1 << 40  # connection ids of one daemon run stay far below this


def global_gpu(slot: int, gpu: int) -> int:
    if not 0 <= gpu < GPU_STRIDE:
        raise ValueError(f"GPU index {gpu} is out of range (0..{GPU_STRIDE - 1})")
    return slot * GPU_STRIDE + gpu


def gpu_slot(gpu: int) -> int:
    return gpu // GPU_STRIDE


def local_gpu(gpu: int) -> int:
    return gpu % GPU_STRIDE


def global_session(slot: int, conn: int) -> int:
    return slot * SESSION_STRIDE + conn


def session_slot(session: int) -> int:
    return session // SESSION_STRIDE


def local_conn(session: int) -> int:
    return session % SESSION_STRIDE
