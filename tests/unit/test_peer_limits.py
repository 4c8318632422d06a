"""Who counts as one client for the daemon's per-client connection limit."""

from __future__ import annotations

from timesliced.daemon.server import Peer


def test_a_process_and_a_host_each_count_as_one_client() -> None:
    assert Peer("unix", pid=42, uid=1000).client == Peer("unix", pid=42, uid=0).client == "process 42"
    assert Peer("tcp", address="10.0.0.7:5123").client == Peer("tcp", address="10.0.0.7:6000").client


def test_connections_from_processes_the_daemon_cannot_see_never_share_a_budget() -> None:
    # Pods in PID namespaces of their own: the kernel reports PID 0 for every one of them.
    one, other = Peer("unix", pid=0, uid=1000), Peer("unix", pid=0, uid=1000)
    assert one.client != other.client
    assert one.client == one.client and "another PID namespace" in one.client
