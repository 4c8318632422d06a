"""Parsing of sizes and addresses given on command lines and in the environment (pure)."""

from __future__ import annotations

import re

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)b?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``"80GiB"``, ``"16G"``, ``"512MiB"``, ``"4096"`` -> bytes (powers of 1024 for both spellings)."""
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"not a size: {text!r} (examples: 80GiB, 512MiB, 1048576)")
    number, unit = float(m.group(1)), m.group(2).lower()
    return int(number * (1 << (10 * " kmgt".index(unit or " "))))


def parse_host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"not HOST:PORT: {text!r}")
    return host.strip("[]") or "127.0.0.1", int(port)
