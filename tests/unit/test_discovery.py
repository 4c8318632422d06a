"""Cluster discovery: --peers, Slurm hostlists, DNS, and which member is this node."""

from __future__ import annotations

import socket
from typing import Any

import pytest

from timesliced.cluster import discovery
from timesliced.cluster.discovery import (
    DEFAULT_PEER_PORT,
    MAX_HOSTLIST,
    Member,
    NotListedYet,
    expand_hostlist,
    find_self,
    local_addresses,
    parse_peers,
    peers_from_dns,
    peers_from_slurm,
    resolve_cluster,
    settle,
)

P = DEFAULT_PEER_PORT

# --- Member ----------------------------------------------------------------------------------


def test_member_is_frozen_and_has_an_address() -> None:
    m = Member("a", "h", 1)
    assert m.address == ("h", 1)
    with pytest.raises(AttributeError):
        m.port = 2  # type: ignore[misc]


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (("", "h", 1), "bad member id '': must be 1..255"),
        (("x" * 256, "h", 1), "must be 1..255 characters long, not 256"),
        (("a b", "h", 1), "may contain only"),
        (("a", "", 1), "empty host"),
        (("a", "h", 0), "bad port 0"),
        (("a", "h", 65536), "bad port 65536"),
    ],
)
def test_member_rejects_bad_fields(args: tuple[str, str, int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Member(*args)


# --- parse_peers -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("a=h1:1", [("a", "h1", 1)]),
        ("h1:1", [("h1", "h1", 1)]),
        ("h1", [("h1", "h1", P)]),
        (" b=h2:2 , a=h1:1 ", [("a", "h1", 1), ("b", "h2", 2)]),  # spaces ignored, sorted by id
        ("c=h:1,a=h:2,b=h:3", [("a", "h", 2), ("b", "h", 3), ("c", "h", 1)]),
        ("10.0.0.2,10.0.0.1:9", [("10.0.0.1", "10.0.0.1", 9), ("10.0.0.2", "10.0.0.2", P)]),
        # several daemons on one host: the hosts of id-less entries repeat, so ids are HOST:PORT
        (
            "127.0.0.1:7001,127.0.0.1:7002",
            [("127.0.0.1:7001", "127.0.0.1", 7001), ("127.0.0.1:7002", "127.0.0.1", 7002)],
        ),
        # an explicit id does not count toward the id-less hosts
        ("x=h:1,h:2", [("h", "h", 2), ("x", "h", 1)]),
        ("node-1.rack_2:a=gpu01.cluster:80", [("node-1.rack_2:a", "gpu01.cluster", 80)]),
        ("a=gpu01", [("a", "gpu01", P)]),
    ],
)
def test_parse_peers(text: str, expected: list[tuple[str, str, int]]) -> None:
    assert parse_peers(text) == tuple(Member(*m) for m in expected)


def test_parse_peers_default_port() -> None:
    assert parse_peers("h1,h2:5", default_port=9000) == (Member("h1", "h1", 9000), Member("h2", "h2", 5))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[::1]:7714", [("::1", "::1", 7714)]),
        ("[::1]", [("::1", "::1", P)]),
        ("::1", [("::1", "::1", P)]),  # a bare IPv6 address cannot carry a port
        ("a=[fe80::1]:5", [("a", "fe80::1", 5)]),
        ("[0:0::1]:1", [("::1", "::1", 1)]),  # IP literals are canonical
        ("[::1]:1,[::1]:2", [("::1:1", "::1", 1), ("::1:2", "::1", 2)]),
        ("[::1]:1,127.0.0.1:1", [("127.0.0.1", "127.0.0.1", 1), ("::1", "::1", 1)]),
    ],
)
def test_parse_peers_ipv6(text: str, expected: list[tuple[str, str, int]]) -> None:
    assert parse_peers(text) == tuple(Member(*m) for m in expected)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("", "--peers: empty list"),
        ("  ", "--peers: empty list"),
        ("a=h:1,,b=h:2", "--peers: entry 2 is empty"),
        ("a=h:1,", "--peers: entry 2 is empty"),
        ("a=h:0", r"entry 1 'a=h:0': bad port '0' \(must be 1..65535\)"),
        ("a=h:65536", "bad port '65536'"),
        ("a=h:", "bad port ''"),
        ("a=h:x", "bad port 'x'"),
        ("a=h:-1", "bad port '-1'"),
        ("a=h:99999999999999999999", "bad port"),
        ("[::1]:99999", "bad port '99999'"),
        ("a=h:1,a=g:2", r"duplicate id 'a' \(entry 1 'a=h:1' and entry 2 'a=g:2'\)"),
        ("h:1,h=g:2", "duplicate id 'h'"),  # a made-up id can clash with an explicit one
        ("a=h:1,b=h:1", r"duplicate address h:1 \(entry 1 'a=h:1' and entry 2 'b=h:1'\)"),
        ("a=H:1,b=h:1", "duplicate address h:1"),  # host names are case-insensitive
        ("a=[::1]:1,b=[0::1]:1", r"duplicate address \[::1\]:1"),
        ("a=h:1,h:1", "duplicate address"),
        ("=h:1", "bad id '': must be 1..255 characters long, not 0"),
        ("a b=h:1", "bad id 'a b': may contain only letters, digits and . _ : -"),
        ("a/b=h:1", "bad id 'a/b'"),
        ("a=b=h:1", "bad host 'b=h'"),  # '=' never belongs to an id: the first one ends it
        (f"{'x' * 256}=h:1", "bad id 'x+': must be 1..255 characters long, not 256"),
        ("a=", "empty host"),
        ("a=:1", "empty host"),
        ("a=h h:1", "bad host 'h h'"),
        (f"a={'h' * 254}", "bad host"),
        ("a=[::1", "unclosed '\\['"),
        ("a=[::1]x", "unexpected 'x' after '\\]'"),
        ("a=[1.2.3.4]:1", "bad IPv6 address '1.2.3.4'"),
        ("a=1::2::3", "bad IPv6 address '1::2::3'"),
        # the made-up HOST:PORT id of a 253-character host is too long
        (f"{'h' * 253}:10001,{'h' * 253}:10002", "the id 'h+:10001' made from its address is bad: must be 1..255"),
    ],
)
def test_parse_peers_rejects(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_peers(text)


def test_parse_peers_accepts_ids_of_255_characters() -> None:
    (member,) = parse_peers(f"{'x' * 255}=h")
    assert len(member.id) == 255


# --- expand_hostlist ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("login1", ["login1"]),
        ("a,b,c", ["a", "b", "c"]),
        ("gpu[01-03,07],login1", ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]),
        ("n[08-10]", ["n08", "n09", "n10"]),  # zero padding kept
        ("n[8-10]", ["n8", "n9", "n10"]),  # and only where written
        ("n[001-002]", ["n001", "n002"]),
        ("n[5]", ["n5"]),
        ("n[05]", ["n05"]),
        ("[1-3]", ["1", "2", "3"]),
        ("n[3,1]", ["n3", "n1"]),  # order as written
        ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
        (
            "r[1-2]c[0-1]s[7,9]",  # three groups: left-most varies slowest
            ["r1c0s7", "r1c0s9", "r1c1s7", "r1c1s9", "r2c0s7", "r2c0s9", "r2c1s7", "r2c1s9"],
        ),
        ("a[1-2].b,c", ["a1.b", "a2.b", "c"]),
        (" a , b ", ["a", "b"]),
        ("n[1,1]", ["n1", "n1"]),  # duplicates kept, as Slurm does
    ],
)
def test_expand_hostlist(text: str, expected: list[str]) -> None:
    assert expand_hostlist(text) == expected


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("", "hostlist is empty"),
        ("   ", "hostlist is empty"),
        ("a,,b", "empty name"),
        ("a,", "empty name"),
        ("n[1-2", "unbalanced '\\['"),
        ("n1-2]", "unbalanced '\\]' at position 4"),
        ("n[1[2]]", "nested '\\[' at position 3"),
        ("n[]", "empty group '\\[\\]'"),
        ("n[1,]", "bad range '' in \\[1,\\]"),
        ("n[a-b]", "bad range 'a-b'"),
        ("n[1-]", "bad range '1-'"),
        ("n[-1]", "bad range '-1'"),
        ("n[ 1]", "bad range ' 1'"),
        ("n[3-1]", "reversed range '3-1' in \\[3-1\\]"),
        ("n[0-65536]", "expands to more than 65536 names"),
        ("n[0-99999999999999]", "expands to more than 65536 names"),
        ("a[0-255]b[0-255]c,extra", "expands to more than 65536 names"),  # 65536 + 1
    ],
)
def test_expand_hostlist_rejects(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        expand_hostlist(text)


def test_expand_hostlist_allows_exactly_the_cap() -> None:
    assert len(expand_hostlist("n[1-65536]")) == MAX_HOSTLIST == 65536
    names = expand_hostlist("a[0-255]b[0-255]c")
    assert len(names) == 65536
    assert names[:2] == ["a0b0c", "a0b1c"] and names[-1] == "a255b255c"


# --- peers_from_slurm ----------------------------------------------------------------------


def test_peers_from_slurm() -> None:
    members = peers_from_slurm({"SLURM_JOB_NODELIST": "gpu[02,01],login"}, port=9)
    assert members == (Member("gpu01", "gpu01", 9), Member("gpu02", "gpu02", 9), Member("login", "login", 9))


def test_peers_from_slurm_default_port_and_fallback() -> None:
    assert peers_from_slurm({"SLURM_NODELIST": "n1"}) == (Member("n1", "n1", P),)
    both = {"SLURM_JOB_NODELIST": "job1", "SLURM_NODELIST": "other1"}
    assert peers_from_slurm(both) == (Member("job1", "job1", P),)
    # an empty SLURM_JOB_NODELIST counts as unset
    assert peers_from_slurm({"SLURM_JOB_NODELIST": "", "SLURM_NODELIST": "n2"}) == (Member("n2", "n2", P),)


@pytest.mark.parametrize(
    ("environ", "match"),
    [
        ({}, "--slurm: neither SLURM_JOB_NODELIST nor SLURM_NODELIST is set"),
        ({"SLURM_JOB_NODELIST": " "}, "neither SLURM_JOB_NODELIST nor SLURM_NODELIST is set"),
        ({"SLURM_JOB_NODELIST": "n[1-"}, "--slurm: SLURM_JOB_NODELIST: hostlist 'n\\[1-': unbalanced"),
        ({"SLURM_NODELIST": "n[2-1]"}, "--slurm: SLURM_NODELIST: hostlist 'n\\[2-1\\]': reversed range"),
        ({"SLURM_JOB_NODELIST": "n[1,1]"}, "--slurm: SLURM_JOB_NODELIST: duplicate id 'n1'"),
        ({"SLURM_JOB_NODELIST": "bad/name"}, "node name 'bad/name' is not a valid id"),
    ],
)
def test_peers_from_slurm_rejects(environ: dict[str, str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        peers_from_slurm(environ)


# --- peers_from_dns --------------------------------------------------------------------------

SERVICE = "timesliced.gpu-system.svc.cluster.local"


def test_peers_from_dns() -> None:
    asked: list[str] = []

    def resolve(name: str) -> list[str]:
        asked.append(name)
        return ["10.0.0.2", "10.0.0.1", "10.0.0.2", "fd00::0:1"]

    members = peers_from_dns(SERVICE, 9, resolve)
    assert asked == [SERVICE]
    assert members == (
        Member("10.0.0.1", "10.0.0.1", 9),
        Member("10.0.0.2", "10.0.0.2", 9),
        Member("fd00::1", "fd00::1", 9),
    )


def test_peers_from_dns_port_in_the_service_name() -> None:
    members = peers_from_dns(f"{SERVICE}:7800", 9, lambda name: ["10.0.0.1"] if name == SERVICE else [])
    assert members == (Member("10.0.0.1", "10.0.0.1", 7800),)
    assert peers_from_dns("svc", resolve=lambda _: ["10.0.0.1"])[0].port == P


def test_peers_from_dns_default_resolver() -> None:
    members = peers_from_dns("localhost", 9)
    assert members and all(m.id == m.host and m.port == 9 for m in members)
    assert {m.host for m in members} <= {"127.0.0.1", "::1"}


def test_getaddrinfo_resolver_sorts_and_deduplicates(monkeypatch: pytest.MonkeyPatch) -> None:
    def fake(name: str, *_: object, **__: object) -> list[tuple[object, ...]]:
        assert name == "svc"
        return [
            (socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("fd00::2", 0, 0, 0)),
            (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.9", 0)),
            (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.10", 0)),
            (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.9", 0)),
            (socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("fd00::1", 0, 0, 0)),
        ]

    monkeypatch.setattr(socket, "getaddrinfo", fake)
    assert discovery.getaddrinfo_resolver("svc") == ["10.0.0.9", "10.0.0.10", "fd00::1", "fd00::2"]


def _fails(name: str) -> list[str]:
    raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")


@pytest.mark.parametrize(
    ("service", "resolve", "match"),
    [
        (SERVICE, lambda _: [], f"--dns '{SERVICE}': '{SERVICE}' resolved to no addresses"),
        (SERVICE, _fails, f"--dns '{SERVICE}': cannot resolve '{SERVICE}': .*Name or service not known"),
        (f"{SERVICE}:0", lambda _: ["10.0.0.1"], "bad port '0'"),
        (f"{SERVICE}:x", lambda _: ["10.0.0.1"], "bad port 'x'"),
        ("", lambda _: ["10.0.0.1"], "bad service name"),
        (":80", lambda _: ["10.0.0.1"], "bad service name"),
        ("a:b:c", lambda _: ["10.0.0.1"], "bad service name"),
        ("bad name", lambda _: ["10.0.0.1"], "bad service name"),
        (SERVICE, lambda _: ["fe80::1%eth0"], "address 'fe80::1%eth0' is not a valid id"),
    ],
)
def test_peers_from_dns_rejects(service: str, resolve: discovery.Resolver, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        peers_from_dns(service, resolve=resolve)


def test_peers_from_dns_default_resolver_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    # no real DNS lookup: a test machine without a resolver could take seconds to fail
    monkeypatch.setattr(socket, "getaddrinfo", lambda *_, **__: _fails(""))
    with pytest.raises(ValueError, match=r"--dns 'svc': cannot resolve 'svc': .*Name or service not known"):
        peers_from_dns("svc")


# --- find_self ---------------------------------------------------------------------------------

CLUSTER = parse_peers("gpu01=gpu01.cluster.example:1,gpu02=10.0.0.2:1,login=login.example:1")


@pytest.mark.parametrize(
    ("hostname", "addresses", "expected"),
    [
        ("gpu01", [], "gpu01"),  # the member id
        ("gpu01.cluster.example", [], "gpu01"),  # the member host
        ("GPU01.Other.Domain", [], "gpu01"),  # short form, any case
        ("login.example", [], "login"),  # full host
        ("login.elsewhere", [], "login"),  # short form matches the id
        ("unknown", ["10.0.0.2"], "gpu02"),  # by address
        ("unknown", ["::1", "10.0.0.2"], "gpu02"),
    ],
)
def test_find_self(hostname: str, addresses: list[str], expected: str) -> None:
    assert find_self(CLUSTER, None, hostname=hostname, addresses=addresses).id == expected


def test_find_self_by_canonical_ipv6_address() -> None:
    members = parse_peers("a=[fd00::1]:1,b=[fd00::2]:1")
    assert find_self(members, None, hostname="x", addresses=["fd00:0::2"]).id == "b"


def test_find_self_by_node_id_wins() -> None:
    # the hostname would say gpu01, the explicit id says login
    assert find_self(CLUSTER, "login", hostname="gpu01", addresses=["10.0.0.2"]).id == "login"


def test_find_self_unknown_node_id() -> None:
    with pytest.raises(ValueError, match="--node-id 'gpu09' is not a cluster member; members are: gpu01, gpu02, login"):
        find_self(CLUSTER, "gpu09", hostname="gpu01", addresses=[])


def test_find_self_none_matches() -> None:
    with pytest.raises(
        ValueError,
        match=r"cannot tell which cluster member this node is \(hostname 'other', addresses 10.9.9.9\); "
        r"none of gpu01, gpu02, login matches; pass --node-id",
    ):
        find_self(CLUSTER, None, hostname="other", addresses=["10.9.9.9"])


def test_find_self_ambiguous() -> None:
    with pytest.raises(ValueError, match=r"gpu01, gpu02 all match; pass --node-id"):
        find_self(CLUSTER, None, hostname="gpu01", addresses=["10.0.0.2"])
    local = parse_peers("127.0.0.1:7001,127.0.0.1:7002")
    with pytest.raises(ValueError, match=r"addresses 127.0.0.1\): 127.0.0.1:7001, 127.0.0.1:7002 all match"):
        find_self(local, None, hostname="box", addresses=["127.0.0.1"])
    assert find_self(local, "127.0.0.1:7002", hostname="box", addresses=["127.0.0.1"]).port == 7002


# --- resolve_cluster ---------------------------------------------------------------------------

ENV = {"SLURM_JOB_NODELIST": "gpu[01-02]"}


def _resolve(
    peers: str | None = None, slurm: bool = False, dns: str | None = None, **kw: Any
) -> tuple[tuple[Member, ...], Member]:
    args: dict[str, Any] = {
        "node_id": None,
        "port": 9,
        "environ": ENV,
        "hostname": "gpu02",
        "addresses": [],
        "resolve": lambda _: ["10.0.0.1", "10.0.0.2"],
    }
    args.update(kw)
    return resolve_cluster(peers=peers, slurm=slurm, dns=dns, **args)


def test_resolve_cluster_from_each_source() -> None:
    slurm = (Member("gpu01", "gpu01", 9), Member("gpu02", "gpu02", 9))
    assert _resolve(slurm=True) == (slurm, slurm[1])
    assert _resolve(peers="gpu01,gpu02:5") == (
        (Member("gpu01", "gpu01", 9), Member("gpu02", "gpu02", 5)),
        Member("gpu02", "gpu02", 5),
    )
    members, me = _resolve(dns="svc", addresses=["10.0.0.1"])
    assert [m.id for m in members] == ["10.0.0.1", "10.0.0.2"] and me.id == "10.0.0.1"
    assert _resolve(slurm=True, node_id="gpu01")[1] == slurm[0]


@pytest.mark.parametrize(
    ("sources", "match"),
    [
        ({}, r"give exactly one of --peers, --slurm, --dns \(got none\)"),
        ({"peers": "a", "slurm": True}, r"\(got --peers and --slurm\)"),
        ({"slurm": True, "dns": "svc"}, r"\(got --slurm and --dns\)"),
        ({"peers": "a", "slurm": True, "dns": "svc"}, r"\(got --peers and --slurm and --dns\)"),
        ({"peers": ""}, "--peers: empty list"),  # an empty --peers is given, and wrong
        ({"slurm": True, "environ": {}}, "neither SLURM_JOB_NODELIST"),
        ({"dns": "svc", "resolve": lambda _: []}, "resolved to no addresses"),
        ({"slurm": True, "hostname": "nope"}, "pass --node-id"),
    ],
)
def test_resolve_cluster_rejects(sources: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _resolve(**sources)


def test_only_what_waiting_may_cure_is_not_listed_yet() -> None:
    """A name with no addresses yet, or none of them this node's, may list it later; a typo never."""
    for sources in ({"dns": "svc", "resolve": lambda _: []}, {"dns": "svc", "addresses": ["10.0.0.9"]}):
        with pytest.raises(NotListedYet):
            _resolve(**sources)
    with pytest.raises(ValueError) as bad:
        _resolve(dns="bad name")
    assert not isinstance(bad.value, NotListedYet)
    with pytest.raises(ValueError, match="all match") as ambiguous:
        _resolve(dns="svc", addresses=["10.0.0.1", "10.0.0.2"])
    assert not isinstance(ambiguous.value, NotListedYet)


# --- settle ----------------------------------------------------------------------------------


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def test_settle_tries_again_until_this_node_is_listed() -> None:
    answers = [[], ["10.0.0.2"], ["10.0.0.1", "10.0.0.2"]]  # the pod's own address comes last
    clock, retried = _Clock(), []
    members, me = settle(
        lambda: _resolve(dns="svc", addresses=["10.0.0.1"], resolve=lambda _: answers.pop(0)),
        60,
        on_retry=lambda exc: retried.append(str(exc)),
        sleep=clock.sleep,
        clock=lambda: clock.now,
    )
    assert me.id == "10.0.0.1" and [m.id for m in members] == ["10.0.0.1", "10.0.0.2"]
    assert clock.slept == [2.0, 2.0] and answers == []
    assert "resolved to no addresses" in retried[0] and "none of 10.0.0.2 matches; the service 'svc'" in retried[1]


def test_settle_gives_up_after_its_patience_saying_so() -> None:
    clock = _Clock()
    with pytest.raises(
        NotListedYet, match=r"resolved to no addresses; check .* \(still so after waiting 5s: see --dns-wait\)"
    ):
        settle(lambda: _resolve(dns="svc", resolve=lambda _: []), 5, sleep=clock.sleep, clock=lambda: clock.now)
    assert clock.slept == [2.0, 2.0, 1.0]


def test_settle_does_not_wait_on_a_mistake_or_without_patience() -> None:
    clock = _Clock()
    with pytest.raises(ValueError, match="bad service name"):
        settle(lambda: _resolve(dns="bad name"), 60, sleep=clock.sleep, clock=lambda: clock.now)
    with pytest.raises(NotListedYet, match=r"selects the daemon pods \(ready or not\)$"):
        settle(lambda: _resolve(dns="svc", resolve=lambda _: []), 0, sleep=clock.sleep, clock=lambda: clock.now)
    assert clock.slept == []


def test_serve_waits_for_its_own_address_under_dns(monkeypatch: pytest.MonkeyPatch) -> None:
    """``timesliced serve --dns``: a pod whose address the service does not list yet waits for it."""
    from timesliced import cli

    answers = [["10.0.0.2"], ["10.0.0.1", "10.0.0.2"]]
    monkeypatch.setattr(discovery, "getaddrinfo_resolver", lambda name: answers.pop(0))
    monkeypatch.setattr(cli, "local_addresses", lambda: {"10.0.0.1"})
    for name in ("TIMESLICED_TOKEN_FILE", "TIMESLICED_PEER_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TIMESLICED_TOKEN", "a-shared-token-of-some-length")
    argv = ["serve", "--dns", "svc", "--dns-wait", "0.2"]
    config = cli.config_from_args(cli.build_parser().parse_args(argv))
    assert (
        config.node == "10.0.0.1"
        and config.cluster is not None
        and sorted(config.cluster.members)
        == [
            "10.0.0.1",
            "10.0.0.2",
        ]
    )
    assert answers == []
    answers[:] = [["10.0.0.2"]] * 10
    with pytest.raises(SystemExit, match=r"none of 10.0.0.2 matches; the service 'svc' lists no address of this node"):
        cli.config_from_args(cli.build_parser().parse_args(argv))
    for wait in ("nan", "-1"):
        with pytest.raises(SystemExit, match="--dns-wait must be 0 or more seconds"):
            cli.config_from_args(cli.build_parser().parse_args([*argv[:3], "--dns-wait", wait]))


def test_serve_waits_only_under_dns(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--peers`` and ``--slurm`` lists do not change by waiting: a node missing from them fails at once."""
    from timesliced import cli

    def no_sleep(seconds: float) -> None:
        raise AssertionError("waited")

    monkeypatch.setattr(discovery.time, "sleep", no_sleep)
    monkeypatch.setattr(cli, "local_addresses", lambda: {"10.0.0.1"})
    monkeypatch.setenv("TIMESLICED_TOKEN", "a-shared-token-of-some-length")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[01-02]")
    for source in (["--peers", "gpu01,gpu02"], ["--slurm"]):
        with pytest.raises(SystemExit, match=r"none of gpu01, gpu02 matches; pass --node-id$"):
            cli.config_from_args(cli.build_parser().parse_args(["serve", *source, "--dns-wait", "600"]))


# --- local_addresses ---------------------------------------------------------------------------


def test_local_addresses(monkeypatch: pytest.MonkeyPatch) -> None:
    def fake(name: str, *_: object, **__: object) -> list[tuple[object, ...]]:
        assert name == "box"
        return [
            (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.1.2.3", 0)),
            (socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("fe80::1%eth0", 0, 0, 2)),
        ]

    monkeypatch.setattr(socket, "gethostname", lambda: "box")
    monkeypatch.setattr(socket, "getaddrinfo", fake)
    monkeypatch.setenv("POD_IP", " 10.9.9.9 ")
    assert local_addresses() == {"10.1.2.3", "fe80::1", "10.9.9.9"}


def test_local_addresses_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    def fails(*_: object, **__: object) -> list[tuple[object, ...]]:
        raise socket.gaierror(socket.EAI_NONAME, "nope")

    monkeypatch.setattr(socket, "getaddrinfo", fails)
    monkeypatch.delenv("POD_IP", raising=False)
    assert local_addresses() == set()
    monkeypatch.setenv("POD_IP", "10.0.0.7")
    assert local_addresses() == {"10.0.0.7"}

    def bad_name() -> str:
        raise UnicodeError("label too long")

    monkeypatch.setattr(socket, "gethostname", bad_name)
    assert local_addresses() == {"10.0.0.7"}


def test_local_addresses_for_real() -> None:
    assert isinstance(local_addresses(), set)
