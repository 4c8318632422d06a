"""Process liveness, as the daemon needs it to notice dead jobs."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie waiting to be reaped."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return True  # no procfs: trust kill(0)
    # The state letter follows the parenthesised command name, which may itself hold ')'.
    return stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] != b"Z"
