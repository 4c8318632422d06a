"""Gang acquire: several clients' groups held together, all granted in one step or none.

A trainer's weight sync into its sampler needs both pools at once: ``with timesliced.gang(trainer,
sampler):`` asks for every client's group as one gang and holds them all for the block. The daemon
(the cluster's leader, for clients on several nodes) grants every member in one step, never some
of them; gangs that share groups are ordered alike in each, so two gangs cannot each hold half of
what the other needs. Clients of other processes or nodes join a gang with
``client.acquire(gang=ID, members=N)``.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from typing import TYPE_CHECKING, Any

from .. import errors

if TYPE_CHECKING:
    import asyncio

    from .aio import AsyncClient
    from .codec import Grant
    from .sync import Client, Waiter

# a gang waits apart until every member asked: each client submits its member before any waits


def _members(clients: Sequence[Any], name: str | None) -> tuple[str, int]:
    if len(clients) < 1:
        raise ValueError("a gang needs at least one client")
    if len({id(c) for c in clients}) != len(clients):
        raise ValueError("each client may be a member of a gang once")
    return name or f"gang-{uuid.uuid4().hex}", len(clients)


@contextmanager
def gang(*clients: Client, timeout: float | None = None, name: str | None = None) -> Iterator[list[Grant]]:
    """Hold every client's group for the block: all granted at once, or none; returns their grants.

    ``timeout`` bounds the wait for all of them; ``name``: the gang's id (default: a fresh one).
    Raises what the members' acquires raise (``AcquireTimeout``; ``AcquireCancelled`` when another
    member stopped waiting; ``BadRequest`` for clients of one group or of groups that share GPUs);
    then none of them holds. On leaving the block each releases.
    """
    grants = acquire_gang(*clients, timeout=timeout, name=name)
    try:
        yield grants
    except BaseException:
        _every([functools.partial(_release_quietly, client) for client in clients])  # the block's exception goes on
        raise
    if (error := _every([functools.partial(_release_quietly, client) for client in clients])) is not None:
        raise error


def acquire_gang(*clients: Client, timeout: float | None = None, name: str | None = None) -> list[Grant]:
    """Acquire every client's group as one gang and keep them: ``gang`` without the block.

    Each client then holds its lock until its own ``release()``, so a caller can give the
    groups back one at a time. Raises what ``gang`` raises; then none of them holds, and none
    waits: an interrupt (``KeyboardInterrupt``) while the members are submitted or waited for
    withdraws every member submitted (a grant that won the race goes back).
    """
    gang_id, size = _members(clients, name)
    waiters: list[Waiter] = []
    grants: list[Grant] = []
    try:
        # Inside the ``try``: a member submitted is withdrawn below if a later one's submit raises.
        for client in clients:
            waiters.append(client._submit(functools.partial(client._core.acquire, timeout, gang=gang_id, members=size)))
        for client, waiter in zip(clients, waiters, strict=True):
            grants.append(client._wait(waiter))
    except BaseException:
        # Every member submitted and not in ``grants`` is withdrawn: the one whose wait raised withdrew
        # itself already (withdrawing it again changes nothing), and one whose grant came back just as
        # the interrupt landed gives it back. Then the members granted release.
        _every([functools.partial(c._withdraw, w[0]) for c, w in zip(clients, waiters, strict=False)][len(grants) :])
        _every([functools.partial(_release_quietly, client) for client in clients[: len(grants)]])
        raise
    return grants


@asynccontextmanager
async def gang_async(
    *clients: AsyncClient, timeout: float | None = None, name: str | None = None
) -> AsyncIterator[list[Grant]]:
    """``async with timesliced.gang_async(a, b):``: ``gang`` for ``AsyncClient``s (same raises)."""
    grants = await acquire_gang_async(*clients, timeout=timeout, name=name)
    try:
        yield grants
    except BaseException:
        await _aevery([functools.partial(_arelease_quietly, client) for client in clients])  # the block's goes on
        raise
    if (error := await _aevery([functools.partial(_arelease_quietly, client) for client in clients])) is not None:
        raise error


async def acquire_gang_async(
    *clients: AsyncClient, timeout: float | None = None, name: str | None = None
) -> list[Grant]:
    """``acquire_gang`` for ``AsyncClient``s: each holds its lock until its own ``release()`` (same raises).

    A cancellation (or an error) while the members are submitted or waited for withdraws every
    member submitted, as ``acquire_gang`` does.
    """
    gang_id, size = _members(clients, name)
    waiters: list[tuple[int, asyncio.Future[Any]]] = []
    grants: list[Grant] = []
    try:
        for client in clients:  # inside the ``try``, as in ``acquire_gang``
            waiters.append(client._submit(functools.partial(client._core.acquire, timeout, gang=gang_id, members=size)))
        for client, waiter in zip(clients, waiters, strict=True):
            grants.append(await client._wait(waiter))
    except BaseException:
        _every([functools.partial(c._withdraw, w[0]) for c, w in zip(clients, waiters, strict=False)][len(grants) :])
        await _aevery([functools.partial(_arelease_quietly, client) for client in clients[: len(grants)]])
        raise
    return grants


def _every(calls: Sequence[Callable[[], object]]) -> BaseException | None:
    """Each call, one per member, whatever one of them raises (a second Ctrl-C, a lost daemon); returns
    the first error. A member left out would keep a group held or queued that its caller thinks it let go."""
    error: BaseException | None = None
    for call in calls:
        try:
            call()
        except BaseException as exc:
            error = error or exc
    return error


async def _aevery(calls: Sequence[Callable[[], Awaitable[object]]]) -> BaseException | None:
    """``_every`` for coroutines: a cancellation while one member releases does not skip the others."""
    error: BaseException | None = None
    for call in calls:
        try:
            await call()
        except BaseException as exc:
            error = error or exc
    return error


def _release_quietly(client: Client) -> None:
    try:
        client.release()
    except errors.NotHolder:
        pass  # never granted, or lost meanwhile: nothing to give back


async def _arelease_quietly(client: AsyncClient) -> None:
    try:
        await client.release()
    except errors.NotHolder:
        pass
