"""A client with no arguments where ``timesliced run`` set the environment, and the decorator's grant."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest

import timesliced
from timesliced.client.protocol import process_party
from timesliced.daemon.embedded import EmbeddedDaemon


def _group(status: dict[str, Any]) -> dict[str, Any]:
    return next(g for g in status["groups"] if g["group"] == "g")


def test_client_and_async_client_need_no_arguments_inside_a_member(
    daemon: EmbeddedDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TIMESLICED_ADDRESS", daemon.socket)
    monkeypatch.setenv("TIMESLICED_JOB", "a")
    monkeypatch.setenv("TIMESLICED_GROUP", "g")
    monkeypatch.setenv("TIMESLICED_MEMORY", "8MiB")
    with timesliced.Client() as c:
        assert (c.job, c.group) == ("a", "g")
        with c.slice() as grant:
            assert (grant.job, grant.group) == ("a", "g")
        (job,) = c.status()["jobs"]
        assert job["declared"] == {"0": 8 << 20, "1": 8 << 20}

    async def scenario() -> None:
        async with timesliced.AsyncClient() as a, a.aslice() as grant:
            assert (grant.job, grant.group) == ("a", "g")

    asyncio.run(scenario())


def test_an_explicit_job_wins_over_the_environment(daemon: EmbeddedDaemon, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIMESLICED_JOB", "from-env")
    monkeypatch.setenv("TIMESLICED_GROUP", "g")
    with timesliced.Client("mine", address=daemon.socket) as c:
        assert [j["job"] for j in c.status()["jobs"]] == ["mine"]


def test_the_sync_decorator_passes_the_grant_when_asked(daemon: EmbeddedDaemon) -> None:
    with timesliced.Client(job="a", group="g", address=daemon.socket) as a:

        @a.on_accelerators(pass_grant=True)
        def step(x: int, *, grant: timesliced.Grant) -> tuple[int, int, str]:
            assert _group(a.status())["holder"] == "a"
            return x, grant.fence, grant.job

        assert step(7) == (7, 1, "a")
        assert step(8) == (8, 2, "a")  # each call has its own grant
        assert _group(a.status())["holder"] is None

        @a.on_accelerators()
        def plain(**kwargs: Any) -> dict[str, Any]:
            return kwargs

        assert plain() == {}  # without pass_grant the function's arguments are its callers' alone


def test_the_async_decorator_passes_the_grant_when_asked(daemon: EmbeddedDaemon) -> None:
    async def scenario() -> None:
        async with timesliced.AsyncClient(job="a", group="g", address=daemon.socket) as a:

            @a.on_accelerators(pass_grant=True)
            async def step(*, grant: timesliced.Grant) -> tuple[int, Any]:
                return grant.fence, _group(await a.status())["holder"]

            assert await step() == (1, "a")
            assert await step() == (2, "a")
            assert _group(await a.status())["holder"] is None

    asyncio.run(scenario())


def test_a_forked_child_is_a_party_of_its_own() -> None:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its own party, though the parent made one first
        os.write(write, process_party().encode())
        os._exit(0)
    os.close(write)
    child = os.read(read, 1024).decode()
    os.waitpid(pid, 0)
    os.close(read)
    assert child and child != process_party() and str(pid) in child
