"""What the process environment says: where the daemon's socket and state live, and the deployment's tokens.

Shared by the daemon and its clients (which find the daemon and the token here), so it imports
nothing of either.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

SOCKET_ENV = "TIMESLICED_SOCKET"
STATE_DIR_ENV = "TIMESLICED_STATE_DIR"
SOCKET_NAME = "timesliced.sock"

# What ``timesliced run`` hands the command it launches, so that ``Client()`` and ``AsyncClient()``
# need no arguments inside it (an argument given explicitly always wins over these).
ADDRESS_ENV = "TIMESLICED_ADDRESS"  # the daemon: a socket path, or tcp://HOST:PORT
JOB_ENV = "TIMESLICED_JOB"
GROUP_ENV = "TIMESLICED_GROUP"
PARK_ENV = "TIMESLICED_PARK"  # a parking method's name, or the register's ``park`` map as JSON
MEMORY_ENV = "TIMESLICED_MEMORY"  # the device memory the job declares on each of its GPUs ("20GiB")
GPUS_ENV = "TIMESLICED_GPUS"  # the group's GPUs: "0,1" (the node's numbers) or "visible"
PRIORITY_ENV = "TIMESLICED_PRIORITY"
WEIGHT_ENV = "TIMESLICED_WEIGHT"
# The party a process acts for (``Client(party=...)``): processes that hold one group while they ask
# for another on each other's behalf (an RL run's trainer and sampler actors) name the same party.
PARTY_ENV = "TIMESLICED_PARTY"
MEMBER_ENVS = (ADDRESS_ENV, JOB_ENV, GROUP_ENV, PARK_ENV, MEMORY_ENV, GPUS_ENV, PRIORITY_ENV, WEIGHT_ENV)


def default_state_dir() -> Path:
    if env := os.environ.get(STATE_DIR_ENV):
        return Path(env)
    if runtime := os.environ.get("XDG_RUNTIME_DIR"):
        return Path(runtime) / "timesliced"
    return Path(tempfile.gettempdir()) / f"timesliced-{os.getuid()}"


def default_socket_path(state_dir: Path | None = None) -> Path:
    """Where local clients find the daemon: ``$TIMESLICED_SOCKET`` or the state dir."""
    if env := os.environ.get(SOCKET_ENV):
        return Path(env)
    return (state_dir or default_state_dir()) / SOCKET_NAME


def default_sim_dir(state_dir: Path) -> Path:
    """Simulated device memory lives on tmpfs, one directory per state dir."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    digest = hashlib.sha1(str(state_dir.resolve()).encode()).hexdigest()[:12]
    return base / f"timesliced-{os.getuid()}-{digest}"


TOKEN_ENV = "TIMESLICED_TOKEN"
TOKEN_FILE_ENV = "TIMESLICED_TOKEN_FILE"
PEER_TOKEN_ENV = "TIMESLICED_PEER_TOKEN"  # the older spelling of $TIMESLICED_TOKEN
MIN_TOKEN_LENGTH = 16


def read_token(path: Path | None = None, *, minimum: int = MIN_TOKEN_LENGTH) -> str | None:
    """The deployment's shared token, or None where none is configured; raises ``ValueError``.

    One token per deployment: peers prove it to each other and TCP clients to
    their daemon. It comes from ``path`` (``--token-file``), else the file named
    by ``$TIMESLICED_TOKEN_FILE``, else ``$TIMESLICED_TOKEN``, else
    ``$TIMESLICED_PEER_TOKEN`` (the older spelling). An unreadable file, a
    token shorter than ``minimum`` characters, or the two variables set to
    different tokens raise ``ValueError``; the message never holds the token.
    """
    if path is None and (named := os.environ.get(TOKEN_FILE_ENV)):
        path = Path(named)
    if path is not None:
        try:
            token, where = path.read_text(), str(path)
        except OSError as exc:
            raise ValueError(f"cannot read the token file {path}: {exc.strerror}") from None
    else:
        current, older = os.environ.get(TOKEN_ENV), os.environ.get(PEER_TOKEN_ENV)
        if current is not None and older is not None and current.strip() != older.strip():
            raise ValueError(f"${TOKEN_ENV} and ${PEER_TOKEN_ENV} hold different tokens; set only ${TOKEN_ENV}")
        if current is None and older is None:
            return None
        token, where = (current, f"${TOKEN_ENV}") if current is not None else (older or "", f"${PEER_TOKEN_ENV}")
    token = token.strip()
    if len(token) < minimum:
        raise ValueError(f"the shared token in {where} must be at least {minimum} characters")
    return token


def read_peer_token(path: Path | None) -> str:
    """The cluster's shared token (see ``read_token``); raises ``ValueError``, also when none is configured."""
    token = read_token(path)
    if token is None:
        raise ValueError(f"a cluster needs a shared token: --token-file PATH or ${TOKEN_ENV}")
    return token


ADMIN_TOKEN_ENV = "TIMESLICED_ADMIN_TOKEN"


def read_admin_token(path: Path | None) -> str | None:
    """The admin token from ``path`` or ``$TIMESLICED_ADMIN_TOKEN``; raises ``ValueError`` if empty or unreadable."""
    if path is None:
        token = os.environ.get(ADMIN_TOKEN_ENV)
        if token is None:
            return None
        where = f"${ADMIN_TOKEN_ENV}"
    else:
        try:
            token = path.read_text()
        except OSError as exc:
            raise ValueError(f"cannot read the admin token file {path}: {exc.strerror}") from None
        where = str(path)
    token = token.strip()
    if len(token) < 16:
        raise ValueError(f"the admin token in {where} must be at least 16 characters")
    return token
