"""The election's durable state: term and vote, written and fsynced before any message depends on it."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..core.election import Persisted

ELECTION_FILE = "election.json"


def load_election(state_dir: Path) -> Persisted:
    """The last durable term and vote, or a fresh start; raises ``ValueError`` if the file is corrupt."""
    path = state_dir / ELECTION_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return Persisted()
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read the election state {path}: {exc}") from None
    return Persisted.from_wire(data)


def save_election(state_dir: Path, state: Persisted) -> None:
    """Replace the file atomically and durably (write, fsync, rename, fsync the directory)."""
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = state_dir / ELECTION_FILE
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, json.dumps(state.to_wire()).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dir_fd = os.open(state_dir, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
