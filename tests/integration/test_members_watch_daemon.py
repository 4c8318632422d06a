"""A daemon under ``--dns`` looks at the name again, and says when it lists other members than it started with."""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path

import pytest

from timesliced.bench.common import free_port
from timesliced.client.sync import daemon_status
from timesliced.cluster import discovery
from timesliced.config import ClusterConfig, DaemonConfig

from ..helpers.daemon import TOKEN, serving

ME = "127.0.0.1"


def wait_for_look(socket: str, listed: list[str], timeout: float = 10.0) -> dict[str, object]:
    deadline = time.monotonic() + timeout
    while True:
        look = daemon_status(socket)["cluster"]["dns"]
        if look is not None and look["listed"] == listed:
            return dict(look)
        assert time.monotonic() < deadline, f"the daemon's look never found {listed}: {look}"
        time.sleep(0.05)


def scrape(web_url: str | None) -> str:
    assert web_url is not None
    with urllib.request.urlopen(web_url.rstrip("/") + "/metrics", timeout=10) as answer:
        return str(answer.read().decode())


@pytest.mark.slow
def test_a_daemon_under_dns_says_when_the_name_lists_other_members(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    answer = [ME]
    monkeypatch.setattr(discovery, "getaddrinfo_resolver", lambda name: list(answer))
    port = free_port()
    config = DaemonConfig(
        state_dir=tmp_path / "state",
        backend="sim",
        gpus=1,
        node=ME,
        web=("127.0.0.1", 0),
        cluster=ClusterConfig(
            members={ME: (ME, port)}, listen=(ME, port), token=TOKEN, dns=("svc", port), dns_check_interval=0.05
        ),
    )
    with serving(config) as daemon:
        agrees = wait_for_look(daemon.socket, [ME])
        assert agrees["differs"] is False and agrees["name"] == "svc" and agrees["error"] is None
        answer.append("10.0.0.9")  # a daemon started on a node that joined
        assert wait_for_look(daemon.socket, ["10.0.0.9", ME])["differs"] is True
        assert "timesliced_cluster_dns_members_differ 1.0" in scrape(daemon.web_url)
        answer.remove("10.0.0.9")
        assert wait_for_look(daemon.socket, [ME])["differs"] is False
        assert "timesliced_cluster_dns_members_differ 0.0" in scrape(daemon.web_url)
    told = [r.getMessage() for r in caplog.records if "now lists" in r.getMessage()]
    assert len(told) == 1 and "new: 10.0.0.9; gone: none" in told[0]
