"""vLLM and SGLang jobs through a real daemon, with fake engines as separate processes."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

import timesliced
from timesliced import errors
from timesliced.daemon.embedded import EmbeddedDaemon
from timesliced.wire.park import ParkSpec

from ..helpers.processes import REPO, wait_for

pytestmark = pytest.mark.slow  # the quick loop (-m "not slow") leaves these out


class EngineProcess:
    """``python -m tests.fakes.engines KIND`` on a free port, driven over its control routes."""

    def __init__(self, kind: str, *flags: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.fakes.engines", kind, "--port", "0", *flags],
            cwd=REPO,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        self.url = self.proc.stdout.readline().strip()
        assert self.url.startswith("http://"), self.url

    def state(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"{self.url}/_fake/state", timeout=10) as r:
            return json.loads(r.read())  # type: ignore[no-any-return]

    def inject(self, **fault: Any) -> None:
        body = json.dumps(fault).encode()
        request = urllib.request.Request(f"{self.url}/_fake/inject", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10):
            pass

    def run_requests(self, n: int) -> None:
        body = json.dumps({"running": n}).encode()
        request = urllib.request.Request(f"{self.url}/_fake/requests", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10):
            pass

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        assert self.proc.stdout is not None
        self.proc.stdout.close()


@pytest.fixture
def engines() -> Iterator[dict[str, EngineProcess]]:
    running = {"vllm": EngineProcess("vllm"), "sglang": EngineProcess("sglang")}
    try:
        yield running
    finally:
        for engine in running.values():
            engine.stop()


def engine_client(daemon: EmbeddedDaemon, job: str, method: str, url: str, **spec: Any) -> timesliced.Client:
    c = timesliced.Client(job=job, group="g", address=daemon.socket, park=ParkSpec(method, (url,), **spec))
    try:
        c.connect()
    except BaseException:
        c.close()
        raise
    return c


def job_status(c: timesliced.Client, job: str) -> dict[str, Any]:
    return next(j for j in c.status()["jobs"] if j["job"] == job)


def test_a_vllm_and_an_sglang_job_take_turns(daemon: EmbeddedDaemon, engines: dict[str, EngineProcess]) -> None:
    vllm, sglang = engines["vllm"], engines["sglang"]
    with (
        engine_client(daemon, "sampler", "vllm", vllm.url) as a,
        engine_client(daemon, "judge", "sglang", sglang.url) as b,
    ):
        a.acquire()  # both engines started awake; the judge is put to sleep for the sampler
        assert sglang.state()["released"] == ["cuda_graph", "kv_cache", "weights"]
        assert not vllm.state()["sleeping"]
        got: list[timesliced.Grant] = []
        t = threading.Thread(target=lambda: got.append(b.acquire()))
        t.start()
        wait_for(lambda: len(a.status()["groups"][0]["queue"]) == 1)
        a.release()
        t.join(10)
        assert got and got[0].job == "judge" and got[0].restored
        assert vllm.state()["sleeping"] and vllm.state()["level"] == 1
        assert sglang.state()["released"] == []
        calls = [(c["path"], c["query"]) for c in vllm.state()["calls"]]
        assert calls == [("/sleep", [["level", "1"], ["mode", "wait"]]), ("/is_sleeping", [])]
        sglang_paths = [c["path"] for c in sglang.state()["calls"]]
        assert sglang_paths == [
            "/server_info",
            "/pause_generation",
            "/flush_cache",
            "/release_memory_occupation",
            "/resume_memory_occupation",
            "/continue_generation",
        ]
        assert job_status(a, "sampler")["location"] == "parked"


def test_an_engine_error_faults_the_job_with_the_http_status(
    daemon: EmbeddedDaemon, engines: dict[str, EngineProcess]
) -> None:
    vllm, sglang = engines["vllm"], engines["sglang"]
    with (
        engine_client(daemon, "sampler", "vllm", vllm.url) as a,
        engine_client(daemon, "judge", "sglang", sglang.url) as b,
    ):
        a.acquire()
        sglang.inject(path="/resume_memory_occupation", status=503, body="engine is reloading")
        got: list[Any] = []

        def acquire() -> None:
            try:
                got.append(b.acquire(timeout=20))
            except errors.TimeslicedError as exc:
                got.append(exc)

        t = threading.Thread(target=acquire)
        t.start()
        wait_for(lambda: len(a.status()["groups"][0]["queue"]) == 1)
        a.release()
        t.join(20)
        assert got and isinstance(got[0], errors.JobFaulted)
        reason = job_status(a, "judge")["faulted"]
        assert "503" in reason and "engine is reloading" in reason and "/resume_memory_occupation" in reason
        assert a.acquire().job == "sampler"  # the group goes on with the other job


def test_an_engine_that_does_not_answer_in_time(engines: dict[str, EngineProcess]) -> None:
    vllm, sglang = engines["vllm"], engines["sglang"]
    with (
        EmbeddedDaemon(gpus=1, gpu_memory=8 << 20, engine_timeout=0.5) as d,
        engine_client(d, "sampler", "vllm", vllm.url) as a,
    ):
        assert a.acquire(timeout=10).job == "sampler"
        a.release()
        vllm.inject(path="/sleep", delay=5.0)
        with engine_client(d, "judge", "sglang", sglang.url) as b:
            # Putting the sampler to sleep times out; the sleep is undone (the wake is confirmed),
            # so the sampler stays usable and the judge is told why it cannot have the GPU.
            with pytest.raises(errors.SwitchFailed, match=r"did not answer within 0\.5 s"):
                b.acquire(timeout=15)
            st = job_status(b, "sampler")
            assert st["faulted"] is None and st["location"] == "resident"
            assert "did not answer within 0.5 s" in st["park_refused"]
            assert not vllm.state()["sleeping"]
            assert a.acquire(timeout=5).job == "sampler"  # its engine never slept: its next slice just works


def test_vllm_level_2_is_refused_at_registration_unless_the_job_reloads_its_weights(
    daemon: EmbeddedDaemon, engines: dict[str, EngineProcess]
) -> None:
    url = engines["vllm"].url
    with pytest.raises(errors.BadRequest, match="level 2 discards the engine's weights") as info:
        engine_client(daemon, "sampler", "vllm", url, level=2)
    assert "'reloads_weights': true" in info.value.message
    with engine_client(daemon, "sampler", "vllm", url, level=2, reloads_weights=True) as c:
        assert c.acquire(timeout=10).job == "sampler"
    assert engines["vllm"].state()["calls"] == []  # refused before anything was sent


def test_an_sglang_job_whose_server_would_discard_its_weights_is_refused_at_its_first_park(
    daemon: EmbeddedDaemon, engines: dict[str, EngineProcess]
) -> None:
    sglang = EngineProcess("sglang", "--no-weights-cpu-backup")
    try:
        with (
            engine_client(daemon, "judge", "sglang", sglang.url) as b,
            engine_client(daemon, "sampler", "vllm", engines["vllm"].url) as a,
        ):
            # Parking the judge for the sampler is refused before anything changes: the judge
            # stays usable where it is (resident), and the sampler is told what to do.
            with pytest.raises(errors.SwitchFailed, match="--enable-weights-cpu-backup") as info:
                a.acquire(timeout=10)
            assert "reloads_weights=True" in info.value.message
            st = job_status(a, "judge")
            assert st["faulted"] is None and "--enable-weights-cpu-backup" in st["park_refused"]
            state = sglang.state()
            assert [c["path"] for c in state["calls"]] == ["/server_info"]
            assert state["released"] == [] and not state["weights_lost"] and not state["paused"]
            assert b.acquire(timeout=5).job == "judge"
    finally:
        sglang.stop()


def test_an_sglang_job_that_yields_with_requests_running_is_not_parked_and_its_server_goes_on(
    daemon: EmbeddedDaemon, engines: dict[str, EngineProcess]
) -> None:
    vllm, sglang = engines["vllm"], engines["sglang"]
    with (
        engine_client(daemon, "judge", "sglang", sglang.url) as b,
        engine_client(daemon, "sampler", "vllm", vllm.url) as a,
    ):
        sglang.run_requests(2)  # the judge's engine still generates when the sampler wants the GPU
        with pytest.raises(errors.SwitchFailed, match="let the job's requests finish"):
            a.acquire(timeout=10)
        st = job_status(a, "judge")
        assert st["faulted"] is None and "not idle" in st["park_refused"]
        state = sglang.state()
        assert not state["crashed"] and state["released"] == [] and not state["paused"]
        assert (state["running"], state["aborted"]) == (2, 0)  # its requests go on
        assert b.acquire(timeout=5).job == "judge"
