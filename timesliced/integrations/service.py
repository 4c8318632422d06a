"""A Tinker-style training service: per-job queues of work units, each run inside a slice.

Users write an ordinary training loop against a ``TrainingClient``::

    service = TrainingService(group="service-gpu0", gpus=[0])
    client = service.create_training_client("sft-a", LinearModel(64, 16, seed=0))
    for batch in batches:
        fwd = client.forward_backward(batch)     # a Future, like Tinker's
        client.optim_step(learning_rate=1e-2)
        print(fwd.result()["loss"])
    outputs = client.sample(prompts).result()

and never see the time-slicing: the service keeps one queue and one worker thread per job. A
worker waits for its job's next unit, acquires the job's lock (``Client.slice``), runs the units
queued by then (up to ``units_per_slice``), and yields. Between slices the daemon parks the job's
device state (its simulated region, moved to host memory and back) whenever another job of the
group is waiting, so several jobs' loops share one GPU.

A job's device state lives in one region of device memory: the model's bytes, read and written by
its work units, and moved to host memory and back when the job is parked. Where the region is
depends on the service's parking:

- ``offloader=None`` (the default): simulated device memory (``Client.sim_alloc``) on a daemon
  with the ``sim`` backend, parked by the daemon itself;
- ``offloader=factory``: a region of the job's own ``Offloader`` (``factory(job)`` builds it:
  ``CudaDeviceMemory`` on a GPU, ``HostDeviceMemory`` elsewhere), tag ``model``, parked by the
  offload method: the daemon directs the job's client to park and unpark it.

The work units are the ``Model``'s: ``forward_backward`` (add a batch's gradients, return its
loss), ``optim_step`` (apply and clear them) and ``sample`` (outputs for prompts), each a
computation on those bytes (``LinearModel`` is a small real one).

The service runs in one process (a server would put a transport in front of ``TrainingClient``);
its jobs' clients connect to the node's daemon like any job's.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..client.offload import Offloader
from ..client.sync import Client
from ..errors import TimeslicedError
from ..wire.park import ParkSpec

log = logging.getLogger(__name__)

_STOP = None  # the queue's end marker
MODEL_TAG = "model"  # the offload tag of a job's state


class Model(Protocol):
    """What a job's model gives the service: its state's size, and work units on that state.

    ``state`` is a writable buffer of ``nbytes`` (a copy of the job's device region, written back
    after the unit); each unit returns what its future resolves to.
    """

    nbytes: int

    def init(self, state: memoryview) -> None: ...

    def forward_backward(self, state: memoryview, batch: Any) -> Any: ...

    def optim_step(self, state: memoryview, **params: Any) -> Any: ...

    def sample(self, state: memoryview, prompts: Any) -> Any: ...


@dataclass(frozen=True)
class SliceRecord:
    """One slice of a job's worker: which units it ran, and whether its grant restored the job."""

    units: tuple[str, ...]
    restored: bool
    waited_s: float


@dataclass
class _Unit:
    kind: str
    run: Callable[[memoryview], Any]
    future: concurrent.futures.Future[Any] = field(default_factory=concurrent.futures.Future)


class _Storage(Protocol):
    """Where a job's state lives between its slices (touched only while the job holds its lock)."""

    region: Any

    def load(self, view: memoryview) -> None: ...

    def store(self, view: memoryview) -> None: ...

    def free(self) -> None: ...


class _SimStorage:
    """A region of the daemon's simulated device memory, parked by the daemon."""

    def __init__(self, client: Client, nbytes: int) -> None:
        self._client = client
        self.region = client.sim_alloc(nbytes, client.gpus[0])

    def load(self, view: memoryview) -> None:
        self.region.readinto(view)

    def store(self, view: memoryview) -> None:
        self.region.write(view)

    def free(self) -> None:
        self._client.sim_free(self.region)


class _OffloadStorage:
    """A region of the job's ``Offloader`` (tag ``model``), parked when the daemon directs."""

    def __init__(self, offloader: Offloader, nbytes: int) -> None:
        self._offloader = offloader
        self.region = offloader.alloc(nbytes, tag=MODEL_TAG)

    def load(self, view: memoryview) -> None:
        view[:] = self.region.read(0, len(view))

    def store(self, view: memoryview) -> None:
        self.region.write(view)

    def free(self) -> None:
        self._offloader.free(self.region)


class TrainingClient:
    """One job's handle on the service: each call queues a work unit and returns its ``Future``.

    Units run in the order they were queued. A unit that raises sets its future's exception; the
    job's later units still run. ``slices``: what each slice ran (for inspection and tests);
    ``region``: the job's device memory (a ``SimRegion``, or the offloader's ``Region``), where its
    model's bytes live (from offset 0).
    Raises ``RuntimeError`` for a call after ``close()``.
    """

    def __init__(
        self,
        service: TrainingService,
        job: str,
        model: Model,
        client: Client,
        *,
        device_memory: int,
        offloader: Offloader | None = None,
    ) -> None:
        self.job = job
        self.model = model
        self.client = client
        self.slices: list[SliceRecord] = []
        self._service = service
        self._queue: queue.Queue[_Unit | None] = queue.Queue()
        self._closed = False
        initial = bytearray(model.nbytes)
        model.init(memoryview(initial))
        # The job's device memory: the model's bytes, padded to what the job declares it occupies.
        # Between slices they live there only (parked by the daemon when another job's turn needs it).
        nbytes = max(device_memory, model.nbytes)
        storage: _Storage
        with client.slice(service.timeout):
            storage = _SimStorage(client, nbytes) if offloader is None else _OffloadStorage(offloader, nbytes)
            storage.store(memoryview(initial))
        self._storage = storage
        self.region: Any = storage.region
        self._worker = threading.Thread(target=self._run, name=f"timesliced-service-{job}", daemon=True)
        self._worker.start()

    # --- the Tinker-shaped calls ---------------------------------------------------------

    def forward_backward(self, batch: Any) -> concurrent.futures.Future[Any]:
        """Queue a forward and backward pass over ``batch``: its gradients add up until ``optim_step``."""
        return self._submit("forward_backward", lambda s: self.model.forward_backward(s, batch))

    def optim_step(self, **params: Any) -> concurrent.futures.Future[Any]:
        """Queue an optimizer step with ``params`` (the model's: ``learning_rate=`` for ``LinearModel``)."""
        return self._submit("optim_step", lambda s: self.model.optim_step(s, **params))

    def sample(self, prompts: Any) -> concurrent.futures.Future[Any]:
        """Queue sampling: the model's outputs for ``prompts`` with the weights as of this point in the queue."""
        return self._submit("sample", lambda s: self.model.sample(s, prompts))

    def state(self) -> concurrent.futures.Future[bytes]:
        """Queue a copy of the job's device state (the model's bytes), read from the device."""
        return self._submit("state", lambda s: bytes(s))

    # --- the worker ----------------------------------------------------------------------

    def _submit(self, kind: str, run: Callable[[memoryview], Any]) -> concurrent.futures.Future[Any]:
        if self._closed:
            raise RuntimeError(f"training client {self.job!r} is closed: create another with the service")
        unit = _Unit(kind, run)
        self._queue.put(unit)
        return unit.future

    def _run(self) -> None:
        stopping = False
        while not stopping:
            first = self._queue.get()
            if first is None:
                return
            units = [first]
            while len(units) < self._service.units_per_slice:  # what is queued by now runs in this slice
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    stopping = True
                    break
                units.append(nxt)
            self._run_slice(units)

    def _run_slice(self, units: list[_Unit]) -> None:
        try:
            with self.client.slice(self._service.timeout) as grant:
                view = memoryview(bytearray(self.model.nbytes))
                self._storage.load(view)  # the device's bytes, as the last restore left them
                for unit in units:
                    if not unit.future.set_running_or_notify_cancel():
                        continue
                    try:
                        unit.future.set_result(unit.run(view))
                    except Exception as exc:  # the user's unit failed: its future says why
                        unit.future.set_exception(exc)
                self._storage.store(view)
            self.slices.append(SliceRecord(tuple(u.kind for u in units), grant.restored, grant.waited_s))
        except Exception as exc:  # no slice (timeout, lost daemon, faulted job), or the storage failed
            if not isinstance(exc, TimeslicedError):
                log.exception("%s: a slice failed", self.job)
            for unit in units:
                if not unit.future.done():
                    unit.future.set_exception(exc)

    def close(self) -> None:
        """Run what is queued, then free the job's device memory and close its connection."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(_STOP)
        self._worker.join()
        try:
            self._storage.free()
        except TimeslicedError as exc:
            log.warning("freeing %s's device memory failed: %s", self.job, exc)
        self.client.close()
        if self._service.clients.get(self.job) is self:
            del self._service.clients[self.job]  # the job may have a training client again


class TrainingService:
    """The service: creates per-job training clients whose units share the group's GPUs.

    ``group``, ``gpus``, ``address``, ``token``: where the jobs' clients register (``Client``'s
    arguments). ``timeout``: how long a unit waits for its job's turn (``AcquireTimeout`` in its
    future). ``units_per_slice``: at most this many queued units run in one slice.
    ``offloader``: ``None`` to keep each job's state in simulated device memory, or a function
    that builds a job's ``Offloader`` (given the job's name) to park it with the offload method.
    """

    def __init__(
        self,
        *,
        group: str = "service",
        gpus: list[int] | None = None,
        address: str | None = None,
        token: str | None = None,
        timeout: float | None = 60.0,
        units_per_slice: int = 8,
        offloader: Callable[[str], Offloader] | None = None,
    ) -> None:
        if units_per_slice < 1:
            raise ValueError("units_per_slice must be at least 1")
        self.group = group
        self.gpus = gpus
        self.address = address
        self.token = token
        self.timeout = timeout
        self.units_per_slice = units_per_slice
        self.offloader = offloader
        self.clients: dict[str, TrainingClient] = {}

    def create_training_client(self, job: str, model: Model, *, device_memory: int = 0) -> TrainingClient:
        """A training client for ``job``, its model's state placed in device memory.

        ``device_memory``: the bytes the job occupies on its GPU (at least the model's state).
        Raises ``ValueError`` for a job that has one, and what ``Client`` raises on connecting
        (``ConnectionLost`` without a daemon) or ``sim_alloc`` (``OutOfMemory``).
        """
        if job in self.clients:
            raise ValueError(f"job {job!r} has a training client already: use it, or close it first")
        offloader = None if self.offloader is None else self.offloader(job)
        park = None if offloader is None else ParkSpec("offload", tags=(MODEL_TAG,))
        client = Client(
            job, self.group, address=self.address, gpus=self.gpus, token=self.token, park=park, offloader=offloader
        )
        try:
            training = TrainingClient(self, job, model, client, device_memory=device_memory, offloader=offloader)
        except BaseException:
            client.close()
            raise
        self.clients[job] = training
        return training

    def close(self) -> None:
        """Close every job's client (each runs what is queued first)."""
        for training in list(self.clients.values()):
            training.close()
        self.clients.clear()

    def __enter__(self) -> TrainingService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
