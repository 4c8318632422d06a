"""The vllm and sglang backends against fake engine servers on loopback."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.fakes.engines import FakeEngine, FakeSglang, FakeVllm, GiB
from tests.helpers.engines import SGLANG_PARK, SGLANG_UNPARK, SLEEP, raises, refused, rig, run, target, until
from timesliced import errors
from timesliced.backends.base import JobTarget
from timesliced.backends.engines import SglangBackend, VllmBackend, make_engine_backend
from timesliced.wire.park import ParkSpec

REPO = Path(__file__).resolve().parents[2]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


# --- moves that work -----------------------------------------------------------------


def test_vllm_sleeps_and_wakes() -> None:
    async def body() -> None:
        async with rig(FakeVllm) as (b, [f]):
            job = target([f])
            assert b.job_state("j") == "unknown"
            result = await b.snapshot(job)
            assert (result.nbytes, result.footprint) == (0, {}) and result.seconds >= 0
            assert f.sleeping and f.level == 1 and not f.weights_lost
            assert b.job_state("j") == "parked"
            await b.restore(job)
            assert not f.sleeping and f.resident_bytes() == 12 * GiB
            assert b.job_state("j") == "resident"
            assert f.paths() == [SLEEP, "/is_sleeping", "/wake_up", "/is_sleeping"]
            assert [c.method for c in f.calls] == ["POST", "GET", "POST", "GET"]

    run(body())


def test_vllm_level_and_tags_pass_through() -> None:
    async def body() -> None:
        async with rig(FakeVllm) as (b, [f]):
            job = target([f], tags=("weights", "kv_cache"), level=2, reloads_weights=True)
            await b.snapshot(job)
            assert f.level == 2 and f.weights_lost
            await b.restore(job)
            assert f.paths() == [
                "/sleep?level=2&mode=wait",
                "/is_sleeping",
                "/wake_up?tags=weights&tags=kv_cache",
                "/is_sleeping",
            ]
            assert not f.sleeping

    run(body())


def test_vllm_partial_wake_leaves_the_rest_asleep_and_the_next_sleep_does_nothing() -> None:
    # What vLLM itself does: the job must wake the kv cache before it yields again.
    async def body() -> None:
        async with rig(FakeVllm) as (b, [f]):
            job = target([f], tags=("weights",))
            await b.snapshot(job)
            await b.restore(job)
            assert f.sleeping_tags == {"kv_cache"} and f.resident_bytes() == 4 * GiB
            await b.snapshot(job)
            assert f.resident_bytes() == 4 * GiB  # "already sleeping": the weights stay

    run(body())


def test_sglang_releases_and_resumes_everything_with_an_empty_body() -> None:
    async def body() -> None:
        async with rig(FakeSglang, backend=SglangBackend) as (b, [f]):
            job = target([f], "sglang")
            await b.snapshot(job)
            assert f.released() == {"weights", "kv_cache", "cuda_graph"} and f.resident_bytes() == 0
            await b.restore(job)
            assert f.released() == set() and not f.paused
            assert [(c.path, c.body, c.status) for c in f.calls] == [
                ("/server_info", None, 200),
                ("/pause_generation", {"mode": "retract"}, 200),
                ("/flush_cache", None, 200),
                ("/release_memory_occupation", {}, 200),
                ("/resume_memory_occupation", {}, 200),
                ("/continue_generation", {}, 200),
            ]

    run(body())


def test_sglang_tags_pass_through() -> None:
    async def body() -> None:
        async with rig(FakeSglang, backend=SglangBackend) as (b, [f]):
            job = target([f], "sglang", tags=("kv_cache", "cuda_graph"))
            await b.snapshot(job)
            assert f.released() == {"kv_cache", "cuda_graph"} and f.resident_bytes() == 4 * GiB
            await b.restore(job)
            memory = [c.body for c in f.calls if c.path.endswith("_memory_occupation")]
            assert memory == [{"tags": ["kv_cache", "cuda_graph"]}] * 2
            assert f.released() == set()

    run(body())


def test_endpoint_with_a_path_prefix_and_trailing_slash() -> None:
    async def body() -> None:
        async with rig(FakeVllm) as (b, [f]):
            job = JobTarget("j", (0,), (), ParkSpec("vllm", (f.url + "/",)))
            await b.snapshot(job)
            assert f.sleeping
            prefixed = JobTarget("j", (0,), (), ParkSpec("vllm", (f.url + "/engine0",)))
            err = await refused(errors.EndpointError, b.restore(prefixed), match="404")
            assert "/engine0/wake_up" in err.message

    run(body())


# --- engines that refuse ---------------------------------------------------------------


def test_vllm_without_dev_mode_is_a_clear_404() -> None:
    async def body() -> None:
        async with rig(lambda: FakeVllm(dev_mode=False)) as (b, [f]):
            err = await refused(errors.EndpointError, b.snapshot(target([f])))
            assert f"POST {f.url}/sleep?level=1&mode=wait answered HTTP 404" in err.message
            assert "VLLM_SERVER_DEV_MODE=1" in err.message and "--enable-sleep-mode" in err.message
            assert b.job_state("j") == "unknown"

    run(body())


def test_vllm_without_sleep_mode_fails_in_the_engine() -> None:
    async def body() -> None:
        async with rig(lambda: FakeVllm(sleep_mode=False)) as (b, [f]):
            await refused(errors.EndpointError, b.snapshot(target([f])), match="HTTP 500")
            assert not f.sleeping

    run(body())


def test_error_answer_names_method_url_status_and_an_excerpt() -> None:
    async def body() -> None:
        async with rig(FakeSglang, backend=SglangBackend) as (b, [f]):
            f.inject(path="/release_memory_occupation", status=503, body="overloaded " + "x" * 400 + " TAIL")
            err = await raises(errors.EndpointError, b.snapshot(target([f], "sglang")))
            assert f"POST {f.url}/release_memory_occupation answered HTTP 503 Service Unavailable" in err.message
            assert "overloaded xxx" in err.message and "TAIL" not in err.message
            assert err.details["job"] == "j" and err.details["endpoints"] == [f.url]
            assert isinstance(err.__cause__, errors.EndpointError) and err.__cause__.details["status"] == 503
            # A 5xx may come after the release happened, and a second release breaks SGLang: left alone.
            assert f"the state of {f.url} is unknown" in err.message
            assert f.released() == set() and f.paused

    run(body())


@pytest.mark.slow
def test_timeout_names_the_endpoint_and_the_sleep_is_undone() -> None:
    # The engine finishes the sleep after the backend gave up; the wake queues behind it.
    async def body() -> None:
        async with rig(FakeVllm, timeout=0.2, rollback_timeout=5) as (b, [f]):
            f.inject(path="/sleep", delay=0.6)
            err = await refused(errors.BackendTimeout, b.snapshot(target([f])))
            assert f"vLLM endpoint {f.url} did not answer within 0.2 s" in err.message
            assert f"woke {f.url} again" in err.message
            assert f.paths() == [SLEEP, "/wake_up", "/is_sleeping"] and not f.sleeping

    run(body())


def test_unreachable_endpoint() -> None:
    async def body() -> None:
        b = VllmBackend(timeout=5)
        url = f"http://127.0.0.1:{closed_port()}"
        try:
            job = JobTarget("j", (0,), (), ParkSpec("vllm", (url,)))
            # Neither the sleep nor its undo reached the engine, so nothing confirms where it is.
            err = await raises(errors.EndpointError, b.snapshot(job), match="cannot reach vLLM endpoint")
            assert url in err.message
        finally:
            await b.aclose()

    run(body())


def test_dropped_connection() -> None:
    async def body() -> None:
        async with rig(FakeVllm) as (b, [f]):
            f.inject(path="/sleep", drop=True)
            await refused(errors.EndpointError, b.snapshot(target([f])), match="Server disconnected")
            # the dropped sleep, then a (harmless) wake, confirmed
            assert [c.status for c in f.calls] == [None, 200, 200]
            assert not f.sleeping
            await b.snapshot(target([f]))  # the next call is served again
            assert f.sleeping

    run(body())


# --- several replicas ----------------------------------------------------------------


def test_replicas_are_called_in_parallel() -> None:
    async def body() -> None:
        async with rig(FakeVllm, n=3) as (b, fakes):
            for f in fakes:
                f.hold()
            move = asyncio.ensure_future(b.snapshot(target(fakes)))
            await until(lambda: all(f.held == 1 for f in fakes))  # all three asked before any answered
            for f in fakes:
                f.release()
            await move
            assert all(f.sleeping for f in fakes)

    run(body())


def test_failed_snapshot_wakes_the_replicas_that_slept() -> None:
    async def body() -> None:
        async with rig(FakeVllm, n=3) as (b, fakes):
            fakes[1].inject(status=400, body="no")
            err = await refused(errors.EndpointError, b.snapshot(target(fakes)))
            assert "1 of 3 vLLM replicas failed" in err.message and err.details["endpoints"] == [fakes[1].url]
            assert not any(f.sleeping for f in fakes)
            # The refusing replica did not sleep, so it is not woken; the others are.
            slept_and_woke = [SLEEP, "/is_sleeping", "/wake_up", "/is_sleeping"]
            assert [f.paths() for f in fakes] == [slept_and_woke, [SLEEP], slept_and_woke]
            assert b.job_state("j") == "unknown"

    run(body())


def test_failed_restore_puts_the_woken_replicas_back_to_sleep() -> None:
    async def body() -> None:
        async with rig(FakeVllm, n=2) as (b, fakes):
            job = target(fakes, level=2, reloads_weights=True)
            await b.snapshot(job)
            fakes[1].inject(path="/wake_up", status=500, body="CUDA out of memory")
            err = await refused(errors.EndpointError, b.restore(job), match="CUDA out of memory")
            assert f"put {fakes[0].url}, {fakes[1].url} back to sleep" in err.message
            assert all(f.sleeping and f.level == 2 for f in fakes)
            assert b.job_state("j") == "parked"

    run(body())


def test_sglang_rolls_back_only_what_surely_moved() -> None:
    # A replica whose answer was lost may or may not have released; resuming what SGLang
    # did not release breaks it, so that replica is left alone and reported.
    async def body() -> None:
        async with rig(FakeSglang, n=2, backend=SglangBackend) as (b, fakes):
            fakes[1].inject(path="/release_memory_occupation", drop=True, apply=True)
            err = await raises(errors.EndpointError, b.snapshot(target(fakes, "sglang")))
            assert f"woke {fakes[0].url} again" in err.message
            assert f"the state of {fakes[1].url} is unknown" in err.message
            assert fakes[0].released() == set() and not fakes[0].paused
            assert fakes[1].released() == {"weights", "kv_cache", "cuda_graph"}
            # Not even continued: generating on memory that may be released would fail.
            assert fakes[1].paths() == ["/server_info", *SGLANG_PARK] and fakes[1].paused

    run(body())


def test_sglang_failed_restore_releases_the_resumed_replicas_again() -> None:
    async def body() -> None:
        async with rig(FakeSglang, n=2, backend=SglangBackend) as (b, fakes):
            job = target(fakes, "sglang", tags=("weights",))
            await b.snapshot(job)
            fakes[0].inject(path="/resume_memory_occupation", status=400, body='{"error": {"message": "busy"}}')
            await refused(errors.EndpointError, b.restore(job), match="busy")
            assert all(f.released() == {"weights"} and f.paused for f in fakes)
            # Put back to sleep as it was parked: paused, checked idle, released.
            assert fakes[1].paths() == ["/server_info", *SGLANG_PARK, *SGLANG_UNPARK, *SGLANG_PARK]
            assert fakes[0].paths()[-1] == "/resume_memory_occupation"  # refused: nothing to undo

    run(body())


def test_a_failed_rollback_is_reported() -> None:
    async def body() -> None:
        async with rig(FakeSglang, n=2, backend=SglangBackend) as (b, fakes):
            fakes[1].inject(path="/release_memory_occupation", status=400, body="refused")
            fakes[0].inject(path="/resume_memory_occupation", status=500, body="stuck")
            err = await raises(errors.EndpointError, b.snapshot(target(fakes, "sglang")))
            assert f"could not wake {fakes[0].url}" in err.message and "stuck" in err.message
            assert "the job's replicas are now in different states" in err.message
            assert fakes[0].released() and not fakes[1].released()
            assert fakes[0].paused and not fakes[1].paused  # not continued on released memory

    run(body())


@pytest.mark.slow
def test_all_replicas_timing_out_is_a_timeout() -> None:
    async def body() -> None:
        async with rig(FakeVllm, n=2, timeout=0.2) as (b, fakes):
            for f in fakes:
                f.inject(path="/sleep", delay=0.5)
            err = await refused(errors.BackendTimeout, b.snapshot(target(fakes)))
            assert "2 of 2 vLLM replicas failed" in err.message
            assert not any(f.sleeping for f in fakes)

    run(body())


def test_cancelled_snapshot_is_rolled_back() -> None:
    # The caller gives up while one replica is still busy sleeping: both are woken,
    # the busy one after its sleep (the engine takes one call at a time).
    async def body() -> None:
        async with rig(FakeVllm, n=2, rollback_timeout=5) as (b, [f, g]):
            g.hold()
            move = asyncio.ensure_future(b.snapshot(target([f, g])))
            await until(lambda: f.sleeping and g.held == 1)
            move.cancel()
            await until(lambda: g.held == 2)  # the rollback's wake queues behind the sleep
            g.release()
            with pytest.raises(asyncio.CancelledError):
                await move
            assert not f.sleeping and not g.sleeping
            assert g.paths() == [SLEEP, "/wake_up", "/is_sleeping"]
            assert b.job_state("j") == "unknown"

    run(body())


# --- what is refused before anything is sent --------------------------------------------


@pytest.mark.parametrize(
    ("endpoints", "match"),
    [
        ((), "names no endpoints"),
        (("ftp://127.0.0.1:1",), "not the base URL"),
        (("127.0.0.1:8000",), "not the base URL"),
        (("http://",), "not the base URL"),
        (("http://127.0.0.1:1/?x=1",), "not the base URL"),
        (("http://127.0.0.1:1", "http://127.0.0.1:1/"), "twice"),
    ],
)
def test_bad_endpoints(endpoints: tuple[str, ...], match: str) -> None:
    async def body() -> None:
        b = VllmBackend()
        try:
            await raises(errors.BackendError, b.snapshot(JobTarget("j", (0,), (), ParkSpec("vllm", endpoints))), match)
            assert b._session is None  # nothing was sent
        finally:
            await b.aclose()

    run(body())


def test_options_the_engine_cannot_honour() -> None:
    async def body() -> None:
        async with rig(FakeVllm) as (b, [f]):
            await raises(errors.BackendError, b.snapshot(target([f], level=3)), "level must be 1")
            await raises(errors.BackendError, b.snapshot(target([f], level=0)), "level must be 1")
            await raises(errors.BackendError, b.snapshot(target([f], level=2)), "level 2 discards the weights")
            await raises(errors.BackendError, b.restore(target([f], tags=("cuda_graph",))), "cannot park 'cuda_graph'")
            assert f.calls == []
        async with rig(FakeSglang, backend=SglangBackend) as (b, [f]):
            await raises(errors.BackendError, b.snapshot(target([f], "sglang", tags=("weight",))), "cannot park")
            assert f.calls == []

    run(body())


def test_one_move_per_job_at_a_time() -> None:
    async def body() -> None:
        async with rig(FakeVllm, n=2) as (b, [f, g]):
            f.hold()
            first = asyncio.ensure_future(b.snapshot(target([f])))
            await until(lambda: f.held == 1)
            await raises(errors.BackendError, b.restore(target([f])), "already being moved")
            await b.snapshot(target([g], name="other"))  # other jobs move meanwhile
            f.release()
            await first
            assert f.paths() == [SLEEP, "/is_sleeping"] and g.sleeping

    run(body())


# --- device memory ---------------------------------------------------------------------


class FakeMemory:
    """Device memory per process, as the driver would report it: each fake engine is one pid on one GPU."""

    def __init__(self, engines: dict[int, tuple[int, FakeEngine]], others: dict[int, dict[int, int]] | None = None):
        self.engines = engines
        self.others = others or {}
        self.broken = False

    def free_bytes(self, gpu: int) -> int:
        return 80 * GiB - sum(n for per in self.process_memory().values() for g, n in per.items() if g == gpu)

    def process_memory(self) -> dict[int, dict[int, int]]:
        if self.broken:
            raise RuntimeError("NVML: driver not loaded")
        table = {pid: {gpu: fake.resident_bytes()} for pid, (gpu, fake) in self.engines.items()}
        return {**table, **self.others}


def test_memory_moved_and_footprint() -> None:
    async def body() -> None:
        fakes = [FakeVllm(weights=2 * GiB, kv_cache=6 * GiB), FakeVllm(weights=1 * GiB, kv_cache=3 * GiB)]
        memory = FakeMemory({10: (0, fakes[0]), 11: (1, fakes[1])}, others={99: {0: 5 * GiB}})
        async with rig(iter(fakes).__next__, n=2, memory=memory) as (b, _):
            job = target(fakes, gpus=(0, 1), pids=(10, 11))
            parked = await b.snapshot(job)
            assert parked.nbytes == 12 * GiB and parked.footprint == {0: 8 * GiB, 1: 4 * GiB}
            restored = await b.restore(job)
            assert restored.nbytes == 12 * GiB and restored.footprint == {0: 8 * GiB, 1: 4 * GiB}

    run(body())


def test_memory_of_a_partial_park() -> None:
    async def body() -> None:
        fake = FakeSglang(weights=2 * GiB, kv_cache=6 * GiB, cuda_graph=1 * GiB)
        memory = FakeMemory({10: (0, fake)})
        async with rig(lambda: fake, backend=SglangBackend, memory=memory) as (b, _):
            job = target([fake], "sglang", tags=("kv_cache",), pids=(10,))
            assert (await b.snapshot(job)).nbytes == 6 * GiB
            assert (await b.restore(job)).footprint == {0: 9 * GiB}

    run(body())


def test_a_failed_measurement_does_not_fail_the_move(caplog: pytest.LogCaptureFixture) -> None:
    async def body() -> None:
        fake = FakeVllm()
        memory = FakeMemory({10: (0, fake)})
        memory.broken = True
        async with rig(lambda: fake, memory=memory) as (b, _):
            result = await b.snapshot(target([fake], pids=(10,)))
            assert (result.nbytes, result.footprint) == (0, {}) and fake.sleeping

    with caplog.at_level(logging.WARNING, logger="timesliced.backends.engines"):
        run(body())
    assert "NVML: driver not loaded" in caplog.text


def test_a_snapshot_that_frees_nothing_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    async def body() -> None:
        fake = FakeSglang()
        async with rig(lambda: fake, backend=SglangBackend, memory=FakeMemory({}, {10: {0: GiB}})) as (b, _):
            assert (await b.snapshot(target([fake], "sglang", pids=(10,)))).nbytes == 0

    with caplog.at_level(logging.WARNING, logger="timesliced.backends.engines"):
        run(body())
    assert "freed no device memory" in caplog.text and "--enable-memory-saver" in caplog.text


# --- the rest of the API ----------------------------------------------------------------


def test_reclaim_forgets_the_job_and_sends_nothing() -> None:
    async def body() -> None:
        async with rig(FakeVllm) as (b, [f]):
            await b.snapshot(target([f]))
            await b.reclaim(target([f]))
            assert b.job_state("j") == "unknown" and f.sleeping and len(f.calls) == 2
            await b.reclaim(target([f], name="never-seen"))

    run(body())


def test_aclose() -> None:
    async def body() -> None:
        async with rig(FakeVllm) as (b, [f]):
            await b.snapshot(target([f]))
            session = b._session
            assert session is not None
            await b.aclose()
            await b.aclose()
            assert session.closed
            await raises(errors.BackendError, b.restore(target([f])), "closed")
            assert f.sleeping
        await VllmBackend().aclose()  # never used: nothing to close

    run(body())


def test_is_sleeping() -> None:
    async def body() -> None:
        async with rig(FakeVllm) as (b, [f]):
            assert isinstance(b, VllmBackend)
            assert await b.is_sleeping(f.url) is False
            await b.snapshot(target([f]))
            assert await b.is_sleeping(f.url) is True
            f.dev_mode = False
            await raises(errors.EndpointError, b.is_sleeping(f.url), "404")

    run(body())


def test_make_engine_backend() -> None:
    b = make_engine_backend("vllm", timeout=5, rollback_timeout=1)
    assert isinstance(b, VllmBackend) and (b.name, b.timeout, b.rollback_timeout) == ("vllm", 5, 1)
    assert isinstance(make_engine_backend("sglang"), SglangBackend)
    with pytest.raises(ValueError, match="no engine backend 'sim'"):
        make_engine_backend("sim")
    with pytest.raises(ValueError, match="timeout must be positive"):
        SglangBackend(timeout=0)


# --- the fakes themselves ----------------------------------------------------------------


def test_fake_vllm_answers_as_vllm_does() -> None:
    async def body() -> None:
        f = FakeVllm()
        url = await f.start()
        try:
            async with aiohttp.ClientSession() as http:

                async def call(method: str, path: str) -> tuple[int, str]:
                    async with http.request(method, url + path) as r:
                        return r.status, await r.text()

                assert await call("POST", "/sleep?level=abc") == (500, "Internal Server Error")
                assert (await call("POST", "/sleep?level=3"))[0] == 400
                assert await call("GET", "/is_sleeping") == (200, '{"is_sleeping": false}')
                assert await call("POST", "/wake_up") == (200, "")  # awake already: a no-op
                assert await call("POST", "/sleep") == (200, "")  # level 1 by default
                assert (f.level, f.sleeping_tags) == (1, {"weights", "kv_cache"})
                assert await call("POST", "/sleep?level=2") == (200, "")  # asleep already: a no-op
                assert f.level == 1
                assert await call("POST", "/wake_up?tags=bogus") == (200, "")  # ignored
                assert f.sleeping_tags == {"weights", "kv_cache"}
                assert (await call("GET", "/sleep"))[0] == 405
                f.dev_mode = False
                assert await call("GET", "/is_sleeping") == (404, '{"detail": "Not Found"}')
        finally:
            await f.stop()

    run(body())


def test_fake_sglang_answers_as_sglang_does() -> None:
    async def body() -> None:
        f = FakeSglang()
        url = await f.start()
        try:
            async with aiohttp.ClientSession() as http:

                async def call(path: str, **kw: Any) -> tuple[int, Any]:
                    async with http.post(url + path, **kw) as r:
                        return r.status, await r.json()

                status, answer = await call("/release_memory_occupation")  # no body
                assert status == 400 and answer["object"] == "error"
                assert (await call("/release_memory_occupation", json={"tags": "weights"}))[0] == 400
                assert await call("/release_memory_occupation", json={"tags": ["kv_cache"]}) == (200, None)
                status, answer = await call("/resume_memory_occupation", json={})  # all: weights were not released
                assert status == 400 and "not released" in answer["error"]["message"]
                assert await call("/resume_memory_occupation", json={"tags": ["kv_cache"]}) == (200, None)
                assert f.released() == set()
        finally:
            await f.stop()

    run(body())


def test_fake_as_a_process() -> None:
    async def body(url: str) -> None:
        b = VllmBackend(timeout=5)
        try:
            async with aiohttp.ClientSession() as http:
                async with http.post(url + "/_fake/inject", json={"path": "/sleep", "status": 503}) as r:
                    assert r.status == 200
                await refused(errors.EndpointError, b.snapshot(JobTarget("j", (0,), (), ParkSpec("vllm", (url,)))))
                await b.snapshot(JobTarget("j", (0,), (), ParkSpec("vllm", (url,))))
                async with http.get(url + "/_fake/state") as r:
                    state = await r.json()
            assert state["sleeping"] is True
            assert [(c["path"], c["status"]) for c in state["calls"]] == [
                ("/sleep", 503),
                ("/wake_up", 200),
                ("/is_sleeping", 200),
                ("/sleep", 200),
                ("/is_sleeping", 200),
            ]
        finally:
            await b.aclose()

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.fakes.engines", "vllm", "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=REPO,
    )
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:")
        run(body(url))
    finally:
        proc.terminate()
        assert proc.wait(timeout=10) == 0
        assert proc.stdout is not None
        proc.stdout.close()
