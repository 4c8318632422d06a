"""Who may register what: the processes a connection may put under its job.

A Unix-socket client is trusted as far as the kernel vouches for it: the socket's
file mode decides who may connect, and SO_PEERCRED says which process and user
did. A TCP client proves the deployment's shared token instead (``wire.proof``),
and its PIDs would be another machine's.

PID namespaces: the kernel reports the peer's PID as the daemon's namespace numbers it, but the
client claims PIDs as its own namespace numbers them. A client in a container (a Kubernetes job
pod beside the daemon's pod) is in another namespace: the kernel says 0 where the daemon cannot
see it at all (its own PID namespace), and a number of the daemon's where it can (the daemon in
the host's namespace, ``hostPID``); the claims are translated there, through ``NSpid``.
"""

from __future__ import annotations

from typing import Any

from .. import errors
from ..util.processes import PID_MAX, descends_from, namespace_pids, owner_uid, pids_as_seen_inside


def checked_pids(claimed: list[int], peer: Any) -> set[int]:
    """The PIDs a connection may register for its job; raises ``BadRequest`` / ``PermissionDenied``.

    The kernel's word (SO_PEERCRED) is always in. Any other PID must exist, belong
    to the peer's user and descend from the peer's process: a client registers its
    own process tree, so it can never have the daemon park (or follow) another
    program's memory. Root may register any process. Over TCP the PIDs would be
    another machine's: the job is followed through its connections alone.

    A peer in a PID namespace the daemon cannot see (SO_PEERCRED's PID is 0) is followed
    through its connections alone too. A peer in a namespace nested below the daemon's claims
    PIDs as its namespace numbers them: each is translated to the daemon's number, and must be
    the peer's own process or a descendant in its namespace (for root too: the other processes
    of a container's namespace are not the peer's to register).
    """
    if peer.pid is None or peer.pid == 0:
        return set()
    chain = namespace_pids(peer.pid)
    if chain is not None and len(chain) > 1:
        return _translated(claimed, peer)
    pids = {peer.pid}
    for pid in sorted(set(claimed) - pids):
        if not 2 <= pid <= PID_MAX:
            raise errors.BadRequest(f"PID {pid} is not a process id")
        owner = owner_uid(pid)
        if owner is None:
            raise errors.BadRequest(f"no process {pid} on this node")
        if peer.uid != 0:
            if peer.uid != owner:
                raise errors.PermissionDenied(f"process {pid} belongs to another user")
            if not descends_from(pid, peer.pid):
                raise errors.PermissionDenied(
                    f"process {pid} is not a descendant of the connecting process {peer.pid}: "
                    "a client may register only its own process tree (root may register any process)"
                )
        pids.add(pid)
    return pids


def _translated(claimed: list[int], peer: Any) -> set[int]:
    """``claimed`` (PIDs of the peer's nested namespace) as this daemon's PIDs; raises like ``checked_pids``."""
    inside = pids_as_seen_inside(peer.pid)
    pids = {peer.pid}
    for pid in sorted(set(claimed)):
        if not 1 <= pid <= PID_MAX:  # PID 1 is a container's first process, often the job itself
            raise errors.BadRequest(f"PID {pid} is not a process id")
        outer = inside.get(pid)
        if outer is None:
            raise errors.PermissionDenied(
                f"process {pid} of the client's PID namespace is neither the connecting process nor one of "
                "its descendants: a client in a container may register only its own process tree"
            )
        if peer.uid != 0 and owner_uid(outer) != peer.uid:
            raise errors.PermissionDenied(f"process {pid} belongs to another user")
        pids.add(outer)
    return pids
