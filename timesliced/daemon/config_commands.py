"""``timesliced serve --config FILE`` and the ``timesliced config check|show|keys`` commands.

The schema and the loading are ``configfile``'s; this module wires them to the command line: the file's
values become the ``serve`` parser's defaults and the command line is parsed again, so flags win.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..env import STATE_DIR_ENV, default_state_dir
from ..util import toml_write
from .configfile import (
    GROUP_KEYS,
    Key,
    add_limit_options,
    dump,
    expects_text,
    file_value,
    keys,
    load,
    problems_text,
    read,
    size_text,
)

# --- the command line -----------------------------------------------------------------

DAEMON_PARSER = "_daemon_parser"  # the namespace's link to the parser whose defaults a file replaces


def add_config_commands(sub: Any, serve: argparse.ArgumentParser) -> None:
    """``serve --config FILE``, the daemon's limits, and ``timesliced config check|show|keys`` (``sub``: the
    subcommands)."""
    add_limit_options(serve)
    serve.add_argument(
        "--config",
        type=Path,
        default=None,
        metavar="FILE",
        help="a TOML file of these options (keys: the long option names with underscores) and [groups.NAME] "
        "tables; flags override it (timesliced config keys lists them)",
    )
    serve.set_defaults(**{DAEMON_PARSER: serve})
    config = sub.add_parser("config", help="check, show and list the daemon's config file")
    config_sub = config.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    check = config_sub.add_parser(
        "check", help="validate a config file: each error with its key path and what is expected (exit 1)"
    )
    check.add_argument("file", type=Path, metavar="FILE")
    check.set_defaults(run=cmd_config_check, **{DAEMON_PARSER: serve})
    show = config_sub.add_parser(
        "show",
        parents=[serve],
        add_help=False,
        help="print the effective config (the file, then the flags) as TOML; never a token",
        description="Takes every option of timesliced serve. Prints the config it would run with.",
    )
    show.set_defaults(run=cmd_config_show, **{DAEMON_PARSER: show})
    listing = config_sub.add_parser("keys", help="list every config key: type, default and what it does")
    listing.add_argument("--markdown", action="store_true", help="as the Markdown table of the user guide")
    listing.set_defaults(run=cmd_config_keys, **{DAEMON_PARSER: serve})


def with_config_file(
    parser: argparse.ArgumentParser, args: argparse.Namespace, argv: Sequence[str] | None
) -> argparse.Namespace:
    """``args`` again with the config file's values under the flags (none given: ``args`` itself).

    Exits (``SystemExit``, as for a bad flag) listing every problem of the file.
    """
    path = getattr(args, "config", None)
    daemon: argparse.ArgumentParser | None = getattr(args, DAEMON_PARSER, None)
    if path is None or daemon is None:
        return args
    try:
        loaded = load(path, keys(daemon))
    except ValueError as exc:
        raise SystemExit(f"timesliced: {exc}") from None
    daemon.set_defaults(**loaded.values, groups=loaded.groups)
    return parser.parse_args(argv)


def cmd_config_check(args: argparse.Namespace) -> int:
    known = keys(getattr(args, DAEMON_PARSER))
    try:
        loaded, problems = read(args.file, known)
    except ValueError as exc:
        raise SystemExit(f"timesliced: {exc}") from None
    if problems:
        print(problems_text(args.file, problems), file=sys.stderr)
        return 1
    n, g = len(loaded.values), len(loaded.groups)
    print(f"{args.file}: valid ({n} key{'s' if n != 1 else ''}, {g} group{'s' if g != 1 else ''})")
    return 0


def cmd_config_show(args: argparse.Namespace) -> int:
    sys.stdout.write(dump(args, keys(getattr(args, DAEMON_PARSER))))
    return 0


def cmd_config_keys(args: argparse.Namespace) -> int:
    known = keys(getattr(args, DAEMON_PARSER))
    if args.markdown:
        sys.stdout.write(reference_markdown(known))
        return 0
    for key in known.values():
        default = "" if key.default is None else f" (default {_shown_default(key)})"
        print(f"{key.name}: {expects_text(key)}{default}\n    {key.help}")
    print("[groups.NAME]:")
    for k, (expects, does) in GROUP_KEYS.items():
        print(f"  {k}: {expects}\n      {does}")
    return 0


def _shown_default(key: Key) -> str:
    if key.kind == "bool":
        return "false"
    value = key.default
    if key.kind in ("list",) and value == []:
        return "[]"
    if key.kind == "address":
        return toml_write.value(file_value(key, value))
    if key.kind == "size" and isinstance(value, int):
        return toml_write.value(size_text(value))
    return toml_write.value(value if not isinstance(value, Path) else str(value))


def reference_markdown(known: Mapping[str, Key]) -> str:
    """The guide's table of every key (``docs/guide/configuration.md``; a test keeps it current)."""
    rows = [
        "| key | flag | value | default | what it does |",
        "|---|---|---|---|---|",
    ]
    for key in known.values():
        default = "-" if key.default is None else f"`{_shown_default(key)}`"
        rows.append(f"| `{key.name}` | `{key.flag}` | {_md(expects_text(key))} | {default} | {_md(key.help)} |")
    rows += [
        "",
        "| `[groups.NAME]` key | value | what it does |",
        "|---|---|---|",
    ]
    for k, (expects, does) in GROUP_KEYS.items():
        rows.append(f"| `{k}` | {_md(expects)} | {_md(does)} |")
    return "\n".join(rows) + "\n"


def _md(text: str) -> str:
    return _portable(text).replace("|", "\\|")


def _portable(text: str) -> str:
    """``text`` without what is this machine's own: the default state directory, which a help text names."""
    here = str(default_state_dir())
    return text.replace(here, f"${STATE_DIR_ENV}, else $XDG_RUNTIME_DIR/timesliced, else /tmp/timesliced-UID")
