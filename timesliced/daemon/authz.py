"""Who may register what: the processes a connection may put under its job.

A Unix-socket client is trusted as far as the kernel vouches for it: the socket's
file mode decides who may connect, and SO_PEERCRED says which process and user
did. A TCP client proves the deployment's shared token instead (``wire.proof``),
and its PIDs would be another machine's.
"""

from __future__ import annotations

from typing import Any

from .. import errors
from ..util.processes import PID_MAX, descends_from, owner_uid


def checked_pids(claimed: list[int], peer: Any) -> set[int]:
    """The PIDs a connection may register for its job; raises ``BadRequest`` / ``PermissionDenied``.

    The kernel's word (SO_PEERCRED) is always in. Any other PID must exist, belong
    to the peer's user and descend from the peer's process: a client registers its
    own process tree, so it can never have the daemon park (or follow) another
    program's memory. Root may register any process. Over TCP the PIDs would be
    another machine's: the job is followed through its connections alone.
    """
    if peer.pid is None:
        return set()
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
