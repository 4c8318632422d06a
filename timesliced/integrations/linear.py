"""``LinearModel``: a small real model for the training service (numpy): least squares, trained with Adam.

Its whole state is one buffer (the job's device memory), laid out as the Adam step count (int64)
then the weights, their gradients and Adam's two moments (float32, ``inputs`` x ``outputs`` each).
Every unit is a pure function of that buffer and its arguments, so a run is reproducible bit for
bit wherever its bytes have been in between.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

F32 = np.float32
Array = npt.NDArray[np.float32]


class LinearModel:
    """``outputs = inputs @ W``; ``forward_backward((x, y))`` adds the gradient of the mean squared error."""

    def __init__(self, inputs: int, outputs: int, *, seed: int = 0) -> None:
        if inputs < 1 or outputs < 1:
            raise ValueError("inputs and outputs must be at least 1")
        self.inputs = inputs
        self.outputs = outputs
        self.seed = seed
        self._n = inputs * outputs
        self.nbytes = 8 + 4 * 4 * self._n

    def _views(self, state: memoryview) -> tuple[npt.NDArray[np.int64], Array, Array, Array, Array]:
        if len(state) < self.nbytes:
            raise ValueError(f"state of {len(state)} bytes is smaller than the model's {self.nbytes}")
        step = np.frombuffer(state, dtype=np.int64, count=1, offset=0)
        shape = (self.inputs, self.outputs)
        w, g, m, v = (
            np.frombuffer(state, dtype=F32, count=self._n, offset=8 + 4 * self._n * i).reshape(shape) for i in range(4)
        )
        return step, w, g, m, v

    def init(self, state: memoryview) -> None:
        step, w, g, m, v = self._views(state)
        step[0] = 0
        w[...] = (np.random.default_rng(self.seed).standard_normal(w.shape) * 0.1).astype(F32)
        for a in (g, m, v):
            a[...] = 0

    def forward_backward(self, state: memoryview, batch: Any) -> dict[str, float]:
        x, y = (np.asarray(a, dtype=F32) for a in batch)
        _, w, g, _, _ = self._views(state)
        err = x @ w - y
        g += (F32(2) / F32(err.size)) * (x.T @ err)
        return {"loss": float(np.mean(err * err))}

    def optim_step(
        self, state: memoryview, *, learning_rate: float = 1e-3, beta1: float = 0.9, beta2: float = 0.999
    ) -> dict[str, int]:
        step, w, g, m, v = self._views(state)
        step[0] += 1
        t = int(step[0])
        b1, b2 = F32(beta1), F32(beta2)
        m[...] = b1 * m + (F32(1) - b1) * g
        v[...] = b2 * v + (F32(1) - b2) * g * g
        m_hat = m / F32(1 - beta1**t)
        v_hat = v / F32(1 - beta2**t)
        w -= F32(learning_rate) * m_hat / (np.sqrt(v_hat) + F32(1e-8))
        g[...] = 0
        return {"step": t}

    def sample(self, state: memoryview, prompts: Any) -> Array:
        _, w, _, _, _ = self._views(state)
        return np.array(np.asarray(prompts, dtype=F32) @ w, dtype=F32)
