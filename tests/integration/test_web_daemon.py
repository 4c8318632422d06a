"""The dashboard's HTTP side on a real daemon: JSON API, /metrics, health, admin actions."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

import timesliced
from timesliced import errors
from timesliced.daemon.embedded import EmbeddedDaemon

from ..helpers.processes import wait_for

TOKEN = "s3cret-admin-token-0123456789"


@pytest.fixture
def served() -> Iterator[EmbeddedDaemon]:
    with EmbeddedDaemon(gpus=2, gpu_memory=64 << 20, bandwidth=0, web=("127.0.0.1", 0), admin_token=TOKEN) as d:
        yield d


def call(d: EmbeddedDaemon, path: str, *, method: str = "GET", token: str | None = None) -> tuple[int, Any]:
    assert d.web_url is not None
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    request = urllib.request.Request(d.web_url.rstrip("/") + path, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            body = r.read()
            status = r.status
            ctype = r.headers.get("Content-Type", "")
    except urllib.error.HTTPError as e:
        body, status, ctype = e.read(), e.code, e.headers.get("Content-Type", "")
        e.close()
    return status, json.loads(body) if ctype.startswith("application/json") else body.decode()


def test_the_api_shows_what_the_socket_shows(served: EmbeddedDaemon) -> None:
    with timesliced.Client(job="a", group="g", address=served.socket) as a:
        a.acquire()
        status, doc = call(served, "/api/v1/status")
        assert status == 200
        socket_doc = a.status()
        assert [g["group"] for g in doc["groups"]] == [g["group"] for g in socket_doc["groups"]] == ["g"]
        assert doc["groups"][0]["holder"] == "a" and doc["backend"] == "sim"
        assert call(served, "/api/v1/groups/g")[1]["holder"] == "a"
        assert call(served, "/api/v1/jobs/a")[1]["location"] == "resident"
        assert call(served, "/api/v1/groups/nope")[0] == 404
        status, timeline = call(served, "/api/v1/timeline?window=60")
        assert status == 200 and [s["job"] for s in timeline["spans"]] == ["a"]
        assert timeline["spans"][0]["end"] is None
        kinds = [e["kind"] for e in call(served, "/api/v1/events?after=0&limit=100")[1]]
        assert kinds[:2] == ["registered", "granted"]


def test_metrics_health_and_readiness(served: EmbeddedDaemon) -> None:
    with timesliced.Client(job="a", group="g", address=served.socket) as a:
        a.acquire()
        a.release()
        status, text = call(served, "/metrics")
        assert status == 200
        assert 'timesliced_group_queue_depth{group="g"} 0.0' in text
        assert 'timesliced_acquire_wait_seconds_count{group="g"} 1.0' in text
        assert 'timesliced_info{backend="sim"' in text
        assert call(served, "/healthz")[0] == 200
        assert call(served, "/readyz")[0] == 200


@pytest.mark.slow
def test_admin_actions_need_the_token(served: EmbeddedDaemon) -> None:
    with (
        timesliced.Client(job="stuck", group="g", address=served.socket) as stuck,
        timesliced.Client(job="next", group="g", address=served.socket) as nxt,
    ):
        stuck.acquire()
        got: list[Any] = []
        t = threading.Thread(target=lambda: got.append(nxt.acquire(timeout=20)))
        t.start()
        wait_for(lambda: len(nxt.status()["groups"][0]["queue"]) == 1)
        assert call(served, "/api/v1/groups/g/release", method="POST")[0] == 401
        assert call(served, "/api/v1/groups/g/release", method="POST", token="wrong-token-0123456789")[0] == 403
        assert stuck.status()["groups"][0]["holder"] == "stuck"  # refused: nothing changed
        status, result = call(served, "/api/v1/groups/g/release", method="POST", token=TOKEN)
        assert status == 200 and result["released"] == "stuck"
        t.join(10)
        assert got and got[0].job == "next"
        wait_for(lambda: any(e["kind"] == "admin" for e in call(served, "/api/v1/events?after=0")[1]))
        with pytest.raises(errors.NotHolder):
            stuck.release()  # its lock was taken
        assert call(served, "/api/v1/groups/g/drain", method="POST", token=TOKEN)[1]["draining"] is True
        with pytest.raises(errors.GroupDraining):
            stuck.acquire(timeout=5)
        assert call(served, "/api/v1/groups/g/resume", method="POST", token=TOKEN)[1]["draining"] is False
        nxt.release()
        assert stuck.acquire(timeout=5).job == "stuck"
        assert call(served, "/api/v1/groups/nope/release", method="POST", token=TOKEN)[0] == 404


def test_without_a_token_the_dashboard_is_read_only() -> None:
    with EmbeddedDaemon(gpus=1, web=("127.0.0.1", 0)) as d:
        assert call(d, "/api/v1/groups/g/release", method="POST", token=TOKEN)[0] == 403
        assert call(d, "/api/v1/status")[0] == 200


def test_a_taken_port_is_an_error_unless_any_port_will_do(served: EmbeddedDaemon) -> None:
    assert served.web_url is not None
    port = int(served.web_url.rsplit(":", 1)[1].strip("/"))
    with pytest.raises(OSError):
        EmbeddedDaemon(gpus=1, web=("127.0.0.1", port)).start()
    with EmbeddedDaemon(gpus=1, web=("127.0.0.1", port), web_any_port=True) as other:
        assert other.web_url is not None and other.web_url != served.web_url


def test_an_operator_resumes_a_faulted_job_once_its_state_is_whole(tmp_path: Any) -> None:
    """A snapshot that timed out faults its job (nobody knew how far it got); the sim's rollback kept it whole."""
    slow = {"bandwidth": 8 << 20, "op_timeout": 0.2, "pid_poll_interval": 0.1}
    config = {"gpus": 1, "gpu_memory": 64 << 20, "web": ("127.0.0.1", 0), "admin_token": TOKEN, **slow}
    with EmbeddedDaemon(**config) as d:
        a = timesliced.Client(job="a", group="g", address=d.socket, gpus=[0])
        b = timesliced.Client(job="b", group="g", address=d.socket, gpus=[0])
        with a, b:
            a.acquire()
            region = a.sim_alloc(8 << 20)  # a second to copy at this bandwidth: the op timeout cuts it short
            region.fill(b"kept")
            a.release()
            b.acquire()
            with pytest.raises(errors.OutOfMemory):
                b.sim_alloc(60 << 20)  # parking a for it times out: a is faulted, the allocation refused
            wait_for(lambda: call(d, "/api/v1/jobs/a")[1]["faulted"] is not None and a.faulted is not None)
            assert "timed out after 0.2 s" in call(d, "/api/v1/jobs/a")[1]["faulted"]
            assert call(d, "/api/v1/jobs/a/resume", method="POST")[0] == 401
            assert call(d, "/api/v1/jobs/b/resume", method="POST", token=TOKEN)[0] == 400  # b is not faulted
            wait_for(
                lambda: (
                    d.daemon is not None
                    and d.daemon.parking.sim is not None
                    and d.daemon.parking.sim.verify("a") == "resident"
                )
            )  # its rollback has finished
            status, answer = call(d, "/api/v1/jobs/a/resume", method="POST", token=TOKEN)
            assert status == 200 and answer["job"] == "a" and answer["location"] == "resident"
            assert call(d, "/api/v1/jobs/a")[1]["faulted"] is None
            wait_for(lambda: a.faulted is None)  # the client heard it too
            kinds = [e["kind"] for e in call(d, "/api/v1/events?after=0&limit=100")[1]]
            assert "admin" in kinds
            b.release()
            a.acquire()  # resumed: its next slice just works, with its bytes as they were
            assert region.read(4) == b"kept"
