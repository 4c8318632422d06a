"""The node's journal: which jobs it serves, where their state lives, who held or waited.

A daemon writes it before it starts a move (so a restart knows a switch was under
way) and soon after anything else in it changes (grants, queues), and reads it at
start-up to take its jobs up again (see ``ClusterNode.restore``).

Two slot files take turns (``journal.0``, ``journal.1``); each write overwrites the
older one in place with one ``pwrite`` of ``<crc32> <json>\\n``, and the reader takes
the newest slot whose checksum holds. A write cut short by ``kill -9`` fails its
checksum and the other slot is still whole. Nothing is fsynced: the journal has to
outlive the daemon process, not the machine. Parked state lives in host memory
(shared memory, or the job's own process with cuda-checkpoint and offload), which a
reboot loses anyway, and the page cache survives ``kill -9``. The election's term,
which must survive a reboot, is fsynced separately (``daemon/election_file.py``).
"""

from __future__ import annotations

import json
import logging
import os
import zlib
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SLOTS = ("journal.0", "journal.1")
VERSION = 1


class Journal:
    """One node's journal in its state directory."""

    def __init__(self, state_dir: Path) -> None:
        self.paths = [state_dir / name for name in SLOTS]
        self._fds: list[int] = []
        self._seq = 0
        self._last: dict[str, Any] | None = None
        self.writes = 0

    def load(self) -> dict[str, Any] | None:
        """What the last run wrote (the newest whole slot), or None if there is nothing usable."""
        found: list[tuple[int, dict[str, Any]]] = []
        for path in self.paths:
            try:
                found.append(_read_slot(path.read_bytes()))
            except FileNotFoundError:
                continue
            except (OSError, ValueError) as exc:
                log.warning("journal slot %s is not usable (%s); the other one is used", path, exc)
        if not found:
            return None
        self._seq, data = max(found, key=lambda f: f[0])
        self._last = data
        return {k: v for k, v in data.items() if k != "version"}

    def save(self, picture: dict[str, Any]) -> bool:
        """Write ``picture`` into the older slot if it differs from the last one written; True if it did."""
        data = {"version": VERSION, **picture}
        if data == self._last:
            return False
        if not self._fds:
            self._fds = [os.open(p, os.O_WRONLY | os.O_CREAT, 0o600) for p in self.paths]
        self._seq += 1
        body = json.dumps({"seq": self._seq, **data}, separators=(",", ":")).encode()
        record = b"%08x %s\n" % (zlib.crc32(body), body)
        written = os.pwrite(self._fds[self._seq % 2], record, 0)
        if written != len(record):
            raise OSError(f"short write to the journal ({written} of {len(record)} bytes)")
        self._last = data
        self.writes += 1
        return True

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []


def _read_slot(raw: bytes) -> tuple[int, dict[str, Any]]:
    """(seq, data) of one slot's record; raises ``ValueError`` for a torn or foreign one."""
    line, newline, _ = raw.partition(b"\n")  # an older, longer record may follow: it is ignored
    crc, _, body = line.partition(b" ")
    if not newline or len(crc) != 8 or int(crc, 16) != zlib.crc32(body):
        raise ValueError("its checksum does not match (a write was cut short)")
    data = json.loads(body)
    if not isinstance(data, dict) or data.get("version") != VERSION or not isinstance(data.get("seq"), int):
        raise ValueError(f"unknown journal format {data.get('version') if isinstance(data, dict) else data!r}")
    for key, kind in (("jobs", list), ("turns", dict), ("fences", dict), ("park", dict)):
        if not isinstance(data.get(key), kind):
            raise ValueError(f"'{key}' is missing or not a {kind.__name__}")
    seq = data.pop("seq")
    return seq, data
