"""Ray actors whose GPU phases take turns: a mixin for users' actor classes and a method decorator.

A Ray-based RL framework puts its trainer and its samplers in actors, each a process on some node;
the process that touches the GPU is the one that must register with the node's daemon (its
cuda-checkpoint parking locks and parks that process). So the client is made inside the actor
(``timeslice_connect``, called from the actor's ``__init__`` or by the driver), never pickled from
the driver: a ``Client`` holds a socket and threads.

    @ray.remote(num_gpus=1)
    class Sampler(TimeslicedActor):
        def __init__(self, job, group):
            self.timeslice_connect(job, group)

        @gpu_phase
        def generate(self, prompts):          # runs inside the job's slice
            ...

A weight sync needs the trainer's and the sampler's groups at once: give both actors' phases one
gang (``gang(2)`` on the driver, passed as ``timeslice_gang=``); the daemon grants both members in
one step or neither. The two calls must run at the same time (each waits for the other to ask), so
pass data between them out of band (NCCL in a real run, or an ``ObjectRef`` inside a list, which
Ray does not resolve before the call starts).

Nothing here imports Ray: the mixin and the decorator work on any class, Ray actor or not; Ray
itself (the ``[ray]`` extra) is what the user's driver imports.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

from ..client.codec import Grant
from ..client.sync import Client
from ..errors import NotHolder

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])

GANG_ARG = "timeslice_gang"


def gang(members: int = 2) -> dict[str, tuple[str, int]]:
    """Keyword arguments that make ``members`` ``@gpu_phase`` calls one gang: ``**gang(2)`` in each call.

    Raises ``ValueError`` for fewer than one member.
    """
    if members < 1:
        raise ValueError("a gang needs at least one member")
    return {GANG_ARG: (f"gang-{uuid.uuid4().hex}", members)}


class TimeslicedActor:
    """Mixin: the actor's own connection to its node's daemon, made in the actor's process."""

    _timeslice: Client | None = None
    timeslice_grant: Grant | None = None  # the grant of the ``@gpu_phase`` call running now (or the last)

    def timeslice_connect(self, job: str, group: str, **client_kwargs: Any) -> dict[str, Any]:
        """Register this actor's process for ``job`` in ``group`` (``Client``'s keyword arguments pass
        through: ``address``, ``gpus``, ``park``, ``memory``...). Returns the process id and the GPUs
        the daemon registered, for the driver to see. Raises what ``Client.connect`` raises
        (``ConnectionLost`` without a daemon, ``GroupMismatch``, ``PermissionDenied``)."""
        self.timeslice_close()
        client = Client(job, group, **client_kwargs)
        try:
            client.connect()
        except BaseException:
            client.close()
            raise
        self._timeslice = client
        return {"pid": os.getpid(), "job": job, "group": group, "gpus": client.gpus}

    @property
    def timeslice(self) -> Client:
        """The actor's client. Raises ``RuntimeError`` before ``timeslice_connect``."""
        if self._timeslice is None:
            raise RuntimeError(
                f"{type(self).__name__} is not connected to a timesliced daemon: call "
                "self.timeslice_connect(job, group) in the actor's __init__ first"
            )
        return self._timeslice

    def timeslice_close(self) -> None:
        """Close the connection (a held lock is released by the daemon); idempotent."""
        client, self._timeslice = self._timeslice, None
        if client is not None:
            client.close()


def gpu_phase(method: F | None = None, *, timeout: float | None = None) -> Any:
    """Decorator for a ``TimeslicedActor``'s method: each call runs holding the job's lock.

    ``@gpu_phase`` or ``@gpu_phase(timeout=30)``. A call given ``timeslice_gang=(id, members)``
    (see ``gang``) acquires as one member of that gang. The method reads its grant as
    ``self.timeslice_grant``. The lock is released when the method returns or raises. Raises
    what ``Client.acquire`` raises (``AcquireTimeout``, ``AcquireCancelled`` when another member
    of its gang stopped waiting, ``JobFaulted``).
    """

    def decorate(fn: F) -> F:
        def wrapper(
            self: TimeslicedActor, *args: Any, timeslice_gang: tuple[str, int] | None = None, **kwargs: Any
        ) -> Any:
            joined = timeslice_gang
            client = self.timeslice
            if joined is None:
                self.timeslice_grant = client.acquire(timeout)
            else:
                self.timeslice_grant = client.acquire(timeout, gang=joined[0], members=joined[1])
            try:
                return fn(self, *args, **kwargs)
            finally:
                try:
                    client.release()
                except NotHolder as exc:  # lost meanwhile (an operator's force-release): nothing to give back
                    log.warning("%s: %s", fn.__qualname__, exc)

        # Ray checks a call's arguments against the signature of the method it finds by following
        # ``__wrapped__`` (inspect.unwrap in its actor method metadata), which would hide the gang's
        # keyword: the wrapper takes the method's name and docs but no ``__wrapped__``, and its
        # ``__signature__`` (for help(); cloudpickle drops it) shows the method's with the keyword.
        functools.update_wrapper(wrapper, fn)
        del wrapper.__wrapped__  # type: ignore[attr-defined]
        sig = inspect.signature(fn)
        params = list(sig.parameters.values())
        if GANG_ARG not in sig.parameters:
            at = next((i for i, p in enumerate(params) if p.kind is p.VAR_KEYWORD), len(params))
            params.insert(at, inspect.Parameter(GANG_ARG, inspect.Parameter.KEYWORD_ONLY, default=None))
        wrapper.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
        return wrapper  # type: ignore[return-value]

    return decorate if method is None else decorate(method)
