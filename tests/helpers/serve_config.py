"""A config file's keys as ``timesliced serve`` options: what the shipped configs are checked against.

Keys are the long options of ``timesliced serve`` with dashes as underscores; ``as_flags`` turns a
config into the flags that argparse then judges, so a value the daemon would refuse fails too.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from timesliced.cli import build_parser


def load_toml(path: Path) -> dict[str, Any]:
    return load_toml_text(path.read_text())


def load_toml_text(text: str) -> dict[str, Any]:
    return tomllib.loads(text)


def serve_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parser: argparse.ArgumentParser = sub.choices["serve"]
    return parser


def serve_options() -> dict[str, argparse.Action]:
    """``timesliced serve``'s options by config key: the long option, dashes as underscores."""
    return {
        option[2:].replace("-", "_"): action
        for action in serve_parser()._actions
        for option in action.option_strings
        if option.startswith("--") and option != "--help"
    }


def as_flags(config: dict[str, Any]) -> list[str]:
    """The config's keys as ``timesliced serve`` flags; raises ``KeyError`` for a key that is no option."""
    options = serve_options()
    argv: list[str] = []
    for key, value in config.items():
        flag = next(s for s in options[key].option_strings if s.startswith("--"))
        if isinstance(value, bool):
            assert isinstance(options[key], argparse._StoreTrueAction), f"{key} is not a switch"
            argv += [flag] if value else []
        elif isinstance(value, list):
            argv += [flag, ",".join(str(v) for v in value)]
        else:
            argv += [flag, str(value)]
    return argv


def unknown_keys(config: dict[str, Any]) -> list[str]:
    return sorted(set(config) - set(serve_options()))
