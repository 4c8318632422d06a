"""Who is in the cluster, and which member is this node.

Every daemon of a cluster must end up with the *same* member list (ids and
peer addresses, itself included), sorted by id, so that each node's slot (its
index in that list) is the same everywhere. The list comes from exactly one
source:

- ``--peers``: written out by hand, ``ID=HOST:PORT,HOST:PORT,HOST,[::1]:7713``;
- ``--slurm``: the job's node list (``SLURM_JOB_NODELIST``), ids are the host names;
- ``--dns``: a Kubernetes headless service, every address it resolves to is a member.

Everything here is pure except the default DNS resolver, ``local_addresses`` and
``settle``'s clock and sleep; all are injected into the pure functions as arguments.
Bad input raises ``ValueError`` with a message meant for the person who wrote the
command line; ``NotListedYet`` (a ``ValueError``) where the source does not list
this node yet, which waiting may cure.
"""

from __future__ import annotations

import ipaddress
import itertools
import os
import re
import socket
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TypeVar

DEFAULT_PEER_PORT = 7713
MAX_HOSTLIST = 65536  # names one hostlist may expand to; bounds memory on a typo like [0-99999999]
MAX_ID_LENGTH = 255
MAX_HOST_LENGTH = 253  # a DNS name

_ID = re.compile(r"[A-Za-z0-9._:-]+")
_HOSTNAME = re.compile(r"[A-Za-z0-9._-]+")
_PORT = re.compile(r"[0-9]+")
_RANGE = re.compile(r"([0-9]+)(?:-([0-9]+))?")

Resolver = Callable[[str], list[str]]
_T = TypeVar("_T")


class NotListedYet(ValueError):
    """The source does not list this node yet: a name with no addresses, or none of them this node's.

    Under Kubernetes a new pod's address reaches the headless service's DNS answers some seconds after
    the pod starts, so ``--dns`` tries again for ``--dns-wait`` seconds on this error (``settle``).
    """


@dataclass(frozen=True)
class Member:
    """One node of the cluster: its id and the address its peers dial.

    Raises ``ValueError`` for an id that is not 1..255 characters of
    ``[A-Za-z0-9._:-]``, an empty host or a port outside 1..65535.
    """

    id: str
    host: str
    port: int

    def __post_init__(self) -> None:
        problem = id_problem(self.id)
        if problem:
            raise ValueError(f"bad member id {self.id!r}: {problem}")
        if not self.host:
            raise ValueError(f"member {self.id!r} has an empty host")
        if not 1 <= self.port <= 65535:
            raise ValueError(f"member {self.id!r} has bad port {self.port} (must be 1..65535)")

    @property
    def address(self) -> tuple[str, int]:
        return (self.host, self.port)


def id_problem(node_id: str) -> str | None:
    """Why ``node_id`` is not a valid node id, or None when it is."""
    if not 1 <= len(node_id) <= MAX_ID_LENGTH:
        return f"must be 1..{MAX_ID_LENGTH} characters long, not {len(node_id)}"
    if not _ID.fullmatch(node_id):
        return "may contain only letters, digits and . _ : -"
    return None


def format_address(host: str, port: int) -> str:
    """``host:port``, with an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _canonical_host(host: str) -> str:
    """An IP literal in its canonical form (``0:0::1`` -> ``::1``); a host name unchanged."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return host


def _parse_port(text: str) -> int:
    port = int(text) if _PORT.fullmatch(text) and len(text) <= 5 else 0
    if not 1 <= port <= 65535:
        raise ValueError(f"bad port {text!r} (must be 1..65535)")
    return port


def _parse_host(text: str) -> str:
    if not text:
        raise ValueError("empty host")
    if ":" in text:
        try:
            return str(ipaddress.IPv6Address(text))
        except ValueError:
            raise ValueError(f"bad IPv6 address {text!r}") from None
    if len(text) > MAX_HOST_LENGTH or not _HOSTNAME.fullmatch(text):
        raise ValueError(f"bad host {text!r} (letters, digits and . _ - only, at most {MAX_HOST_LENGTH})")
    return _canonical_host(text)


def _parse_address(text: str, default_port: int) -> tuple[str, int]:
    """``HOST``, ``HOST:PORT``, ``[V6]``, ``[V6]:PORT``; a bare IPv6 address (``::1``) takes the default port."""
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise ValueError("unclosed '[' in an IPv6 address")
        host, rest = text[1:end], text[end + 1 :]
        if host.count(":") < 2:
            raise ValueError(f"bad IPv6 address {host!r}")
        if rest and not rest.startswith(":"):
            raise ValueError(f"unexpected {rest!r} after ']'")
        return _parse_host(host), _parse_port(rest[1:]) if rest else default_port
    if text.count(":") == 1:
        host, _, port = text.partition(":")
        return _parse_host(host), _parse_port(port)
    return _parse_host(text), default_port


def _unique_sorted(members: list[Member], where: list[str], source: str) -> tuple[Member, ...]:
    """Check that ids and addresses are distinct; ``where[i]`` names the origin of ``members[i]``."""
    by_id: dict[str, int] = {}
    by_address: dict[tuple[str, int], int] = {}
    for i, member in enumerate(members):
        if member.id in by_id:
            raise ValueError(f"{source}: duplicate id {member.id!r} ({where[by_id[member.id]]} and {where[i]})")
        by_id[member.id] = i
        # Host names are case-insensitive; IP literals are already canonical.
        address = (member.host.lower(), member.port)
        if address in by_address:
            shown = format_address(member.host, member.port)
            raise ValueError(f"{source}: duplicate address {shown} ({where[by_address[address]]} and {where[i]})")
        by_address[address] = i
    return tuple(sorted(members, key=lambda m: m.id))


def parse_peers(text: str, default_port: int = DEFAULT_PEER_PORT) -> tuple[Member, ...]:
    """The members named by ``--peers``, sorted by id.

    ``text`` is a comma-separated list of ``ID=HOST:PORT``, ``HOST:PORT`` or
    ``HOST`` (``default_port``); an IPv6 host goes in brackets, ``[::1]:7713``
    (a bare IPv6 address without brackets takes the default port). An entry
    without an id gets the id ``HOST`` when the hosts of all id-less entries
    are distinct, else ``HOST:PORT`` (so that several daemons on one machine
    can be listed by address alone). IP literals are stored in canonical form.

    Raises ``ValueError`` for an empty list, an empty entry, a bad host or
    port, a bad id (1..255 characters of ``[A-Za-z0-9._:-]``), a duplicate id
    or a duplicate address.
    """
    if not text.strip():
        raise ValueError("--peers: empty list")
    entries: list[tuple[str | None, str, int]] = []
    where: list[str] = []
    for number, raw in enumerate(text.split(","), start=1):
        entry = raw.strip()
        label = f"entry {number} {entry!r}"
        if not entry:
            raise ValueError(f"--peers: entry {number} is empty")
        node_id: str | None = None
        address = entry
        if "=" in entry:
            node_id, _, address = entry.partition("=")
            node_id = node_id.strip()
            problem = id_problem(node_id)
            if problem:
                raise ValueError(f"--peers: {label}: bad id {node_id!r}: {problem}")
        try:
            host, port = _parse_address(address.strip(), default_port)
        except ValueError as e:
            raise ValueError(f"--peers: {label}: {e}") from None
        entries.append((node_id, host, port))
        where.append(label)

    anonymous_hosts = [host for node_id, host, _ in entries if node_id is None]
    hosts_distinct = len(set(anonymous_hosts)) == len(anonymous_hosts)
    members: list[Member] = []
    for (node_id, host, port), label in zip(entries, where, strict=True):
        if node_id is None:
            node_id = host if hosts_distinct else f"{host}:{port}"
            problem = id_problem(node_id)
            if problem:
                raise ValueError(f"--peers: {label}: the id {node_id!r} made from its address is bad: {problem}")
        members.append(Member(node_id, host, port))
    return _unique_sorted(members, where, "--peers")


def _split_hostlist(text: str) -> list[str]:
    """Split at the commas outside brackets; checks that brackets balance and do not nest."""
    parts: list[str] = []
    start = 0
    depth = 0
    for i, char in enumerate(text):
        if char == "[":
            if depth:
                raise ValueError(f"hostlist {text!r}: nested '[' at position {i}")
            depth = 1
        elif char == "]":
            if not depth:
                raise ValueError(f"hostlist {text!r}: unbalanced ']' at position {i}")
            depth = 0
        elif char == "," and not depth:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"hostlist {text!r}: unbalanced '['")
    parts.append(text[start:])
    return parts


def _parse_group(group: str, text: str) -> list[tuple[int, int, int]]:
    """``01-03,07`` -> ``[(1, 3, 2), (7, 7, 2)]`` as (low, high, width)."""
    if not group:
        raise ValueError(f"hostlist {text!r}: empty group '[]'")
    ranges = []
    for item in group.split(","):
        match = _RANGE.fullmatch(item)
        if not match:
            raise ValueError(f"hostlist {text!r}: bad range {item!r} in [{group}] (want N or N-M)")
        low_text, high_text = match.group(1), match.group(2) or match.group(1)
        low, high = int(low_text), int(high_text)
        if high < low:
            raise ValueError(f"hostlist {text!r}: reversed range {item!r} in [{group}]")
        # As in Slurm, the width of the lower bound sets the zero padding: [08-10] -> 08 09 10, [8-10] -> 8 9 10.
        ranges.append((low, high, len(low_text)))
    return ranges


def expand_hostlist(text: str) -> list[str]:
    """Expand a Slurm hostlist into host names, in order.

    ``gpu[01-03,07],login1`` -> ``gpu01 gpu02 gpu03 gpu07 login1``. A name may
    hold several bracket groups, expanded as a cartesian product with the
    left-most group varying slowest (``rack[1-2]-n[1-2]`` -> ``rack1-n1
    rack1-n2 rack2-n1 rack2-n2``). Zero padding is kept (``[08-10]`` -> ``08
    09 10``). Duplicates are kept, as Slurm does.

    Raises ``ValueError`` on an empty list or name, unbalanced or nested
    brackets, an empty group, a malformed or reversed range, or more than
    ``MAX_HOSTLIST`` names in all.
    """
    if not text.strip():
        raise ValueError("hostlist is empty")
    names: list[str] = []
    for part in _split_hostlist(text.strip()):
        expression = part.strip()
        if not expression:
            raise ValueError(f"hostlist {text!r}: empty name")
        # re.split with a capture group alternates literal, group, literal, ...; brackets are balanced here.
        pieces = re.split(r"\[([^\]]*)\]", expression)
        literals, groups = pieces[0::2], [_parse_group(g, text) for g in pieces[1::2]]
        # Counted before anything is built, so that a typo like [0-99999999] never builds a huge list.
        count = 1
        for group in groups:
            count *= sum(high - low + 1 for low, high, _ in group)
        if len(names) + count > MAX_HOSTLIST:
            raise ValueError(f"hostlist {text!r} expands to more than {MAX_HOSTLIST} names")
        choices = [[f"{n:0{width}d}" for low, high, width in group for n in range(low, high + 1)] for group in groups]
        for combination in itertools.product(*choices):
            name = literals[0]
            for value, literal in zip(combination, literals[1:], strict=True):
                name += value + literal
            names.append(name)
    return names


def peers_from_slurm(environ: Mapping[str, str], port: int = DEFAULT_PEER_PORT) -> tuple[Member, ...]:
    """The members of a Slurm job: one per node of ``SLURM_JOB_NODELIST``, sorted by id.

    Falls back to ``SLURM_NODELIST``; ids and hosts are the node names, every
    member listens on ``port``. Raises ``ValueError`` when neither variable is
    set, or for a bad hostlist, a node name that is not a valid id, or a node
    listed twice.
    """
    for variable in ("SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        nodelist = environ.get(variable, "").strip()
        if nodelist:
            break
    else:
        raise ValueError("--slurm: neither SLURM_JOB_NODELIST nor SLURM_NODELIST is set (not inside a Slurm job?)")
    source = f"--slurm: {variable}"
    try:
        hosts = expand_hostlist(nodelist)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None
    members = []
    for host in hosts:
        problem = id_problem(host)
        if problem:
            raise ValueError(f"{source}: node name {host!r} is not a valid id: {problem}")
        members.append(Member(host, host, port))
    return _unique_sorted(members, [f"node {host!r}" for host in hosts], source)


def getaddrinfo_resolver(name: str) -> list[str]:
    """Every IPv4 and IPv6 address ``name`` resolves to, deduplicated and sorted (IPv4 first).

    Raises ``OSError`` (``socket.gaierror``) when the name does not resolve.
    """
    infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    found = {
        ipaddress.ip_address(str(info[4][0]).partition("%")[0])
        for info in infos
        if info[0] in (socket.AF_INET, socket.AF_INET6)
    }
    return [str(address) for address in sorted(found, key=lambda a: (a.version, a))]


def peers_from_dns(service: str, port: int = DEFAULT_PEER_PORT, resolve: Resolver | None = None) -> tuple[Member, ...]:
    """The members behind a headless service: one per address ``service`` resolves to, sorted by id.

    ``service`` is a DNS name such as ``timesliced.gpu-system.svc.cluster.local``,
    optionally ``name:port`` (which overrides ``port``). The id of each member
    is its address. ``resolve`` maps a name to addresses (default:
    ``getaddrinfo_resolver``). Raises ``ValueError``, naming the service, for a
    bad service or port, a resolver failure (``OSError``) or no addresses.
    """
    name, port_text = service.strip(), ""
    if name.count(":") == 1:
        name, _, port_text = name.partition(":")
    if not name or ":" in name or not _HOSTNAME.fullmatch(name):
        raise ValueError(f"--dns {service!r}: bad service name (want NAME or NAME:PORT)")
    if port_text:
        try:
            port = _parse_port(port_text)
        except ValueError as e:
            raise ValueError(f"--dns {service!r}: {e}") from None
    try:
        addresses = (resolve or getaddrinfo_resolver)(name)
    except (OSError, UnicodeError) as e:
        raise NotListedYet(f"--dns {service!r}: cannot resolve {name!r}: {e}; {_CHECK_SERVICE}") from None
    canonical = sorted({_canonical_host(address) for address in addresses})
    if not canonical:
        raise NotListedYet(f"--dns {service!r}: {name!r} resolved to no addresses; {_CHECK_SERVICE}")
    members = []
    for address in canonical:
        problem = id_problem(address)
        if problem:
            raise ValueError(f"--dns {service!r}: address {address!r} is not a valid id: {problem}")
        members.append(Member(address, address, port))
    return _unique_sorted(members, [f"address {a!r}" for a in canonical], f"--dns {service!r}")


_CHECK_SERVICE = "check the name, and that the headless service selects the daemon pods (ready or not)"


def find_self(
    members: tuple[Member, ...],
    node_id: str | None,
    *,
    hostname: str,
    addresses: Iterable[str],
    unlisted: str = "pass --node-id",
) -> Member:
    """The member that is this node.

    With ``node_id``, the member of that id. Otherwise the one member whose id
    or host equals ``hostname`` or its short form (before the first dot; case
    does not matter), or whose host is one of ``addresses`` (this machine's IPs).

    Raises ``NotListedYet`` when ``node_id`` is not a member id (listing the
    ids) or no member matches (ending with ``unlisted``: what to do), and
    ``ValueError`` when more than one matches (asking for ``--node-id``).
    """
    ids = ", ".join(m.id for m in members)
    if node_id is not None:
        for member in members:
            if member.id == node_id:
                return member
        raise NotListedYet(f"--node-id {node_id!r} is not a cluster member; members are: {ids}")
    names = {hostname.lower(), hostname.partition(".")[0].lower()} - {""}
    ips = {_canonical_host(a) for a in addresses}
    matches = [m for m in members if m.id.lower() in names or m.host.lower() in names or m.host in ips]
    seen_as = f"hostname {hostname!r}, addresses {', '.join(sorted(ips)) or 'none'}"
    if not matches:
        raise NotListedYet(
            f"cannot tell which cluster member this node is ({seen_as}); none of {ids} matches; {unlisted}"
        )
    if len(matches) > 1:
        both = ", ".join(m.id for m in matches)
        raise ValueError(f"cannot tell which cluster member this node is ({seen_as}): {both} all match; pass --node-id")
    return matches[0]


def resolve_cluster(
    *,
    peers: str | None,
    slurm: bool,
    dns: str | None,
    node_id: str | None,
    port: int,
    environ: Mapping[str, str],
    hostname: str,
    addresses: Iterable[str],
    resolve: Resolver | None = None,
) -> tuple[tuple[Member, ...], Member]:
    """``(members, self)`` from exactly one source among ``peers``, ``slurm`` and ``dns``.

    ``port`` is the default port of ``--peers`` entries and the port of every
    ``--slurm`` and ``--dns`` member. Raises ``ValueError`` when no source or
    more than one is given, and whatever the source or ``find_self`` raises.
    """
    given = [
        name for name, on in (("--peers", peers is not None), ("--slurm", slurm), ("--dns", dns is not None)) if on
    ]
    if len(given) != 1:
        got = " and ".join(given) if given else "none"
        raise ValueError(f"give exactly one of --peers, --slurm, --dns (got {got})")
    if peers is not None:
        members = parse_peers(peers, port)
    elif dns is not None:
        members = peers_from_dns(dns, port, resolve)
        unlisted = (
            f"the service {dns!r} lists no address of this node: check that it selects the daemon pods and that "
            "they run on their nodes' network (the cluster component), whose address is the pod's POD_IP"
        )
        return members, find_self(members, node_id, hostname=hostname, addresses=addresses, unlisted=unlisted)
    else:
        members = peers_from_slurm(environ, port)
    return members, find_self(members, node_id, hostname=hostname, addresses=addresses)


def settle(
    attempt: Callable[[], _T],
    patience: float,
    *,
    interval: float = 2.0,
    on_retry: Callable[[NotListedYet], None] = lambda _: None,
    sleep: Callable[[float], None] | None = None,
    clock: Callable[[], float] | None = None,
) -> _T:
    """``attempt()``, tried again every ``interval`` seconds while it raises ``NotListedYet``, for ``patience``.

    Raises the last ``NotListedYet`` once ``patience`` is spent, with how long it waited; any other
    ``ValueError`` at once (a typo does not get better by waiting).
    """
    sleep, clock = sleep or time.sleep, clock or time.monotonic  # looked up here: a test may replace them
    deadline = clock() + patience
    while True:
        try:
            return attempt()
        except NotListedYet as exc:
            left = deadline - clock()
            if left <= 0:
                if patience > 0:
                    raise NotListedYet(f"{exc} (still so after waiting {patience:g}s: see --dns-wait)") from None
                raise
            on_retry(exc)
            sleep(min(interval, left))


def local_addresses() -> set[str]:
    """This machine's IPs, best effort: what its host name resolves to, plus ``POD_IP`` if set. Never raises."""
    found: set[str] = set()
    try:
        for info in socket.getaddrinfo(socket.gethostname(), None, type=socket.SOCK_STREAM):
            found.add(_canonical_host(str(info[4][0]).partition("%")[0]))
    except (OSError, ValueError):  # no resolvable host name (UnicodeError is a ValueError)
        pass
    pod_ip = os.environ.get("POD_IP", "").strip()
    if pod_ip:
        found.add(_canonical_host(pod_ip))
    return found
