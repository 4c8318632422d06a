"""What the engine backends do so that a park loses nothing: requests in flight, discarded weights, checked states.

Each guard is shown against a fake engine that imitates the real one's documented behaviour, and the
fakes' own tests show that the hazard is real there (an SGLang release with requests running kills the
server; a vLLM sleep in its default mode aborts them), so the guards' tests can fail.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from tests.fakes.engines import FakeSglang, FakeVllm
from tests.helpers.engines import SGLANG_PARK, SGLANG_UNPARK, SLEEP, raises, refused, rig, run, target, until
from timesliced import errors
from timesliced.backends.engines import SglangBackend

# --- vLLM: requests in flight ---------------------------------------------------------------


def test_vllm_sleep_lets_the_requests_in_flight_finish_first() -> None:
    async def body() -> None:
        async with rig(FakeVllm) as (b, [f]):
            f.run_requests(2)
            move = asyncio.ensure_future(b.snapshot(target([f])))
            await until(lambda: f.draining)
            assert not move.done() and not f.sleeping  # the sleep waits for them
            f.run_requests(0)
            await move
            assert f.sleeping and (f.aborted, f.slept_with_requests) == (0, 0)
            assert f.paths()[0] == SLEEP

    run(body())


def test_fake_vllm_sleep_in_its_default_mode_aborts_the_requests() -> None:
    # Why the backend names the mode: vLLM's own default aborts what runs.
    async def body() -> None:
        f = FakeVllm()
        url = await f.start()
        try:
            f.run_requests(3)
            async with aiohttp.ClientSession() as http, http.post(url + "/sleep?level=1") as r:
                assert r.status == 200
            assert f.sleeping and f.aborted == 3 and f.in_flight == 0
        finally:
            await f.stop()

    run(body())


@pytest.mark.slow
def test_vllm_sleep_whose_requests_do_not_finish_in_time_is_undone() -> None:
    async def body() -> None:
        async with rig(FakeVllm, timeout=0.3, rollback_timeout=5) as (b, [f]):
            f.run_requests(1)
            move = asyncio.ensure_future(b.snapshot(target([f])))
            await until(lambda: f.draining)
            f.hold()
            await until(lambda: f.held == 1)  # the sleep timed out: the rollback's wake arrives
            f.run_requests(0)  # the sleep happens after all, then the wake queued behind it
            f.release()
            err = await refused(errors.BackendTimeout, move)
            assert "did not answer within 0.3 s" in err.message and f"woke {f.url} again" in err.message
            assert f.paths() == [SLEEP, "/wake_up", "/is_sleeping"] and not f.sleeping and f.aborted == 0
            assert b.job_state("j") == "unknown"

    run(body())


def test_vllm_before_pause_modes_sleeps_at_once() -> None:
    # The documented limit: a vLLM whose /sleep reads only the level cannot wait for requests.
    async def body() -> None:
        async with rig(lambda: FakeVllm(pause_modes=False)) as (b, [f]):
            f.run_requests(2)
            await b.snapshot(target([f]))
            assert f.sleeping and f.slept_with_requests == 2

    run(body())


# --- vLLM: level 2 discards the weights ------------------------------------------------------


def test_vllm_level_2_is_refused_unless_the_job_reloads_its_weights() -> None:
    async def body() -> None:
        async with rig(FakeVllm) as (b, [f]):
            err = await raises(errors.BackendError, b.snapshot(target([f], level=2)), "level 2 discards the weights")
            assert "reloads_weights=True" in err.message and "reload_weights" in err.message
            assert f.calls == []
            job = target([f], level=2, reloads_weights=True)
            await b.snapshot(job)
            await b.restore(job)
            assert f.paths()[0] == "/sleep?level=2&mode=wait"
            assert not f.sleeping and f.weights_lost  # awake, on weights nobody has loaded yet
            # What the job promised to do: reload them in place.
            async with (
                aiohttp.ClientSession() as http,
                http.post(f.url + "/collective_rpc", json={"method": "reload_weights"}) as r,
            ):
                assert r.status == 200
            assert not f.weights_lost

    run(body())


# --- vLLM: the state is confirmed after each move ---------------------------------------------


def test_vllm_sleep_that_did_nothing_fails_and_the_job_stays_resident() -> None:
    async def body() -> None:
        async with rig(FakeVllm) as (b, [f]):
            f.inject(path="/sleep", status=200, body="")  # success, without sleeping
            err = await refused(errors.EndpointError, b.snapshot(target([f])), "the engine is still awake")
            assert f'GET {f.url}/is_sleeping answered {{"is_sleeping": false}} after POST /sleep' in err.message
            assert f"woke {f.url} again" in err.message
            assert not f.sleeping and b.job_state("j") == "unknown"
            assert f.paths() == [SLEEP, "/is_sleeping", "/wake_up", "/is_sleeping"]

    run(body())


def test_vllm_is_sleeping_that_disagrees_after_a_sleep_wakes_the_engine_again() -> None:
    async def body() -> None:
        async with rig(FakeVllm, n=2) as (b, fakes):
            fakes[1].inject(path="/is_sleeping", status=200, body='{"is_sleeping": false}')
            err = await refused(errors.EndpointError, b.snapshot(target(fakes)), "still awake")
            assert "1 of 2 vLLM replicas failed" in err.message
            assert f"woke {fakes[0].url}, {fakes[1].url} again" in err.message
            assert not any(f.sleeping for f in fakes)

    run(body())


def test_vllm_wake_that_did_nothing_fails_and_the_job_stays_parked() -> None:
    async def body() -> None:
        async with rig(FakeVllm) as (b, [f]):
            job = target([f])
            await b.snapshot(job)
            f.inject(path="/wake_up", status=200, body="")
            err = await refused(errors.EndpointError, b.restore(job), "the engine is still asleep")
            assert f"put {f.url} back to sleep" in err.message
            assert f.sleeping and b.job_state("j") == "parked"

    run(body())


def test_vllm_is_sleeping_that_is_not_an_answer() -> None:
    async def body() -> None:
        async with rig(FakeVllm) as (b, [f]):
            f.inject(path="/is_sleeping", status=200, body="maybe")
            err = await refused(errors.EndpointError, b.snapshot(target([f])), 'not {"is_sleeping"')
            assert f"woke {f.url} again" in err.message and not f.sleeping

    run(body())


# --- SGLang: the server's settings at the first park -------------------------------------------


def test_sglang_settings_are_asked_once_per_job() -> None:
    async def body() -> None:
        async with rig(FakeSglang, backend=SglangBackend) as (b, [f]):
            job = target([f], "sglang")
            for _ in range(2):
                await b.snapshot(job)
                await b.restore(job)
            assert f.paths().count("/server_info") == 1
            await b.reclaim(job)
            await b.snapshot(job)
            assert f.paths().count("/server_info") == 2

    run(body())


def test_sglang_without_weights_backup_is_refused_before_anything_changes() -> None:
    async def body() -> None:
        async with rig(lambda: FakeSglang(weights_cpu_backup=False), backend=SglangBackend) as (b, [f]):
            err = await raises(errors.BackendError, b.snapshot(target([f], "sglang")), "--enable-weights-cpu-backup")
            assert "nothing was changed" in err.message and "reloads_weights=True" in err.message
            assert "kv_cache, cuda_graph" in err.message and "/update_weights_from_disk" in err.message
            assert f.paths() == ["/server_info"] and not f.paused and b.job_state("j") == "unknown"
            # Parking only what needs no backup is fine.
            await b.snapshot(target([f], "sglang", tags=("kv_cache",)))
            assert f.released() == {"kv_cache"} and not f.weights_lost

    run(body())


def test_sglang_without_weights_backup_parks_a_job_that_reloads_them() -> None:
    async def body() -> None:
        async with rig(lambda: FakeSglang(weights_cpu_backup=False), backend=SglangBackend) as (b, [f]):
            job = target([f], "sglang", reloads_weights=True)
            await b.snapshot(job)
            await b.restore(job)
            assert f.weights_lost and not f.paused  # the job reloads them now, as it promised
            async with (
                aiohttp.ClientSession() as http,
                http.post(f.url + "/update_weights_from_disk", json={"model_path": "m"}) as r,
            ):
                assert r.status == 200
            assert not f.weights_lost

    run(body())


def test_sglang_too_old_to_keep_weights() -> None:
    async def body() -> None:
        async with rig(lambda: FakeSglang(weights_cpu_backup=None, version="0.4.9"), backend=SglangBackend) as (
            b,
            [f],
        ):
            err = await raises(errors.BackendError, b.snapshot(target([f], "sglang")), "before 0.5.3")
            assert "(version 0.4.9)" in err.message

    run(body())


def test_sglang_without_memory_saver_is_refused() -> None:
    async def body() -> None:
        async with rig(lambda: FakeSglang(memory_saver=False), backend=SglangBackend) as (b, [f]):
            err = await raises(errors.BackendError, b.snapshot(target([f], "sglang")), "--enable-memory-saver")
            assert "frees none of its device memory" in err.message
            # Even the opt-in for weights does not make a release free memory.
            await raises(errors.BackendError, b.snapshot(target([f], "sglang", reloads_weights=True)), "memory-saver")
            assert f.paths() == ["/server_info"] * 2

    run(body())


@pytest.mark.parametrize(
    ("fault", "match"),
    [
        ({"status": 200, "body": "[]"}, "not a map of the server's settings"),
        ({"drop": True, "times": 2}, "Server disconnected"),
    ],
)
def test_sglang_settings_that_cannot_be_read(fault: dict[str, Any], match: str) -> None:
    async def body() -> None:
        async with rig(FakeSglang, n=2, backend=SglangBackend) as (b, fakes):
            fakes[1].inject(path="/server_info", **fault)
            err = await refused(errors.EndpointError, b.snapshot(target(fakes, "sglang")), match)
            assert "nothing was changed" in err.message and err.details["endpoints"] == [fakes[1].url]
            asked = len(fakes[1].paths())  # twice where the connection dropped: aiohttp sends a GET again
            assert [f.paths() for f in fakes] == [["/server_info"], ["/server_info"] * asked]
            await b.snapshot(target(fakes, "sglang"))  # asked again next time, where it was not answered
            assert [f.paths().count("/server_info") for f in fakes] == [1, asked + 1]

    run(body())


def test_sglang_from_before_server_info_is_asked_by_the_older_name() -> None:
    async def body() -> None:
        async with rig(lambda: FakeSglang(server_info=False), backend=SglangBackend) as (b, [f]):
            await b.snapshot(target([f], "sglang"))
            assert f.paths()[:2] == ["/server_info", "/get_server_info"] and f.released()
            f.inject(path="/get_server_info", status=404, body='{"detail": "Not Found"}')
            await b.reclaim(target([f], "sglang"))
            err = await refused(errors.EndpointError, b.snapshot(target([f], "sglang", name="k")), "HTTP 404")
            assert f"GET {f.url}/get_server_info answered HTTP 404" in err.message
            assert "recent enough" in err.message and "nothing was changed" in err.message

    run(body())


# --- SGLang: paused around the release -----------------------------------------------------------


def test_fake_sglang_dies_on_a_release_while_requests_run() -> None:
    # The hazard the pause and the idle probe guard against (SGLang's scheduler asserts idleness).
    async def body() -> None:
        f = FakeSglang()
        url = await f.start()
        try:
            f.run_requests(1)
            async with aiohttp.ClientSession() as http:
                with pytest.raises(aiohttp.ServerDisconnectedError):
                    async with http.post(url + "/release_memory_occupation", json={}):
                        pass
                assert "should be called only when server is idle" in f.crashed
                with pytest.raises(aiohttp.ServerDisconnectedError):  # the server is gone
                    async with http.get(url + "/server_info"):
                        pass
        finally:
            await f.stop()

    run(body())


def test_sglang_with_requests_in_flight_is_not_released_and_loses_none() -> None:
    async def body() -> None:
        async with rig(FakeSglang, backend=SglangBackend) as (b, [f]):
            f.run_requests(3)
            err = await refused(errors.EndpointError, b.snapshot(target([f], "sglang")), "not idle")
            assert f"POST {f.url}/flush_cache: the server is not idle" in err.message
            assert "let the job's requests finish" in err.message and f"woke {f.url} again" in err.message
            assert not f.crashed and f.released() == set() and not f.paused
            assert (f.running, f.waiting, f.aborted) == (3, 0, 0)  # retracted, then taken up again
            assert f.paths() == ["/server_info", "/pause_generation", "/flush_cache", "/continue_generation"]
            f.run_requests(0)
            await b.snapshot(target([f], "sglang"))  # idle now: it parks
            assert f.released() == {"weights", "kv_cache", "cuda_graph"}

    run(body())


def test_sglang_whose_release_accepts_retracted_requests_keeps_them_for_after_the_restore() -> None:
    async def body() -> None:
        async with rig(lambda: FakeSglang(idle_ignores_paused=True), backend=SglangBackend) as (b, [f]):
            f.run_requests(2)
            job = target([f], "sglang")
            await b.snapshot(job)
            assert not f.crashed and f.paused and (f.running, f.waiting) == (0, 2)
            await b.restore(job)
            assert not f.paused and (f.running, f.waiting, f.aborted) == (2, 0, 0)
            assert f.paths() == ["/server_info", *SGLANG_PARK, *SGLANG_UNPARK]

    run(body())


def test_sglang_refused_pause_changes_nothing() -> None:
    async def body() -> None:
        async with rig(FakeSglang, backend=SglangBackend) as (b, [f]):
            f.inject(path="/pause_generation", status=400, body="no")
            await refused(errors.EndpointError, b.snapshot(target([f], "sglang")), "HTTP 400")
            assert f.paths() == ["/server_info", "/pause_generation"] and not f.paused

    run(body())


def test_sglang_restore_that_fails_to_continue_is_parked_again() -> None:
    async def body() -> None:
        async with rig(FakeSglang, backend=SglangBackend) as (b, [f]):
            job = target([f], "sglang")
            await b.snapshot(job)
            f.inject(path="/continue_generation", status=500, body="boom", apply=True)  # it did continue
            err = await refused(errors.EndpointError, b.restore(job), "boom")
            assert f"put {f.url} back to sleep" in err.message
            assert f.paused and f.released() == {"weights", "kv_cache", "cuda_graph"}
            assert f.paths()[-5:] == [*SGLANG_UNPARK, *SGLANG_PARK]
            assert b.job_state("j") == "parked"
            await b.restore(job)
            assert not f.paused and f.released() == set()

    run(body())
