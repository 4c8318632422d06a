"""The daemon's config file (``timesliced serve --config FILE``): its keys, reading and checking it, writing
the effective config back, and what it adds to ``DaemonConfig`` (declared groups, limits).

A TOML file whose top-level keys are the long options of ``timesliced serve`` with dashes as
underscores (``state_dir``, ``gpu_memory``, ``token_file``, ...), and one ``[groups.NAME]`` table per
declared group. The keys, their types, defaults and help are read from the ``serve`` parser itself
(``keys``), so the file, the flags and the reference (``timesliced config keys``, the guide's table)
cannot drift apart. ``config_commands`` wires it to the command line, where flags override the file.

Secrets are never in the file: tokens are read from the files ``token_file`` and ``admin_token_file``
name, so ``timesliced config show`` can print the whole effective config without leaking one.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib

from .. import errors
from ..config import DaemonConfig, parse_queue_policy, parse_slice_policy
from ..core.policy import POLICY_NAMES, QueuePolicy
from ..core.slices import SlicePolicy
from ..util import toml_write
from ..util.parse import SIZE_FORMS, parse_host_port, parse_size, size_value

# The options of ``serve`` that are not config keys: the file itself.
NOT_KEYS = ("help", "config")
# Keys that would hold a secret; refused with where the secret goes instead.
SECRETS = {"token": "token_file", "admin_token": "admin_token_file", "peer_token": "token_file"}
SLICE_ACTIONS = ("warn", "preempt")


def size_arg(text: str) -> int:
    """``type=`` of a size option: ``parse_size`` with the project's own message when it refuses one."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


@dataclass(frozen=True)
class Key:
    """One config key: a long option of ``timesliced serve``."""

    name: str  # the option's dest: its long name with underscores
    flag: str  # ``--gpu-memory``
    kind: str  # bool, int, float, size, path, address, choice, string, list
    default: Any  # as the parser has it (a size as written, ``16GiB``); None: unset
    help: str
    choices: tuple[str, ...] = ()

    @property
    def expects(self) -> str:
        """What a value of this key must be, for messages and the reference."""
        if self.kind == "choice":
            return "one of " + ", ".join(f'"{c}"' for c in self.choices)
        return EXPECTS.get(self.name, KIND_EXPECTS[self.kind])


KIND_EXPECTS = {
    "bool": "true or false",
    "int": "an integer",
    "float": "a number",
    "size": SIZE_FORMS,
    "path": "a path (a string; relative to the config file's directory)",
    "address": 'an address "HOST:PORT"',
    "string": "a string",
    "list": "a list of strings",
}
EXPECTS = {
    "web": '"HOST:PORT", or "off" for no dashboard',
    "peers": 'the members, "[ID=]HOST:PORT,..." or a list of "[ID=]HOST:PORT" strings',
    "max_slice": 'a list of "[GROUP=]SECONDS[:ACTION]" strings, like ["300", "trainers=600:preempt"]',
    "policy": 'a list of "[GROUP=]NAME" strings, like ["fair", "trainers=priority"]',
}


def _kind(action: argparse.Action) -> str:
    if isinstance(action, argparse._StoreTrueAction):
        return "bool"
    if isinstance(action, argparse._AppendAction):
        return "list"
    if action.type is None:
        return "choice" if action.choices else "string"
    kinds: dict[Any, str] = {int: "int", float: "float", size_arg: "size", Path: "path", parse_host_port: "address"}
    kind = kinds.get(action.type)
    if kind is None:
        # A new option whose type this table does not know: the test of every key fails until it does.
        raise TypeError(f"the config file does not know the type of {action.option_strings[0]}: {action.type!r}")
    return kind


def help_text(action: argparse.Action, prog: str) -> str:
    """The option's help as ``--help`` shows it (``%(default)s`` filled in, ``%%`` as ``%``), on one line."""
    if not action.help or action.help == argparse.SUPPRESS:
        return ""
    text = action.help
    params = {k: v for k, v in vars(action).items() if v is not argparse.SUPPRESS}
    params["prog"] = prog
    for name, value in list(params.items()):
        if hasattr(value, "__name__"):
            params[name] = value.__name__
    if params.get("choices") is not None:
        params["choices"] = ", ".join(map(str, params["choices"]))
    return " ".join((text % params).split())


def keys(parser: argparse.ArgumentParser) -> dict[str, Key]:
    """Every config key of ``parser`` (``timesliced serve``'s), by name, in the order of ``--help``."""
    out: dict[str, Key] = {}
    for action in parser._actions:
        if action.dest in NOT_KEYS or not action.option_strings:
            continue
        flag = next(s for s in action.option_strings if s.startswith("--"))
        kind = _kind(action)
        choices = tuple(map(str, action.choices)) if action.choices else ()
        out[action.dest] = Key(action.dest, flag, kind, action.default, help_text(action, parser.prog), choices)
    return out


# --- groups ---------------------------------------------------------------------------


@dataclass(frozen=True)
class GroupDecl:
    """A ``[groups.NAME]`` table: the group's GPUs on this node, and its queue and slice policies."""

    gpus: tuple[int, ...] | None = None
    policy: str | None = None
    aging: float | None = None
    max_slice: float | None = None
    slice_action: str | None = None
    preempt_grace: float | None = None


GROUP_KEYS: dict[str, tuple[str, str]] = {  # key -> (what it must be, what it does)
    "gpus": (
        "a list of GPU indices (integers >= 0), like [0, 1]",
        "the group's GPUs on this node: a client that names no GPUs gets these, one that names others is refused",
    ),
    "policy": (
        "one of " + ", ".join(f'"{p}"' for p in POLICY_NAMES),
        "who of the group's waiters goes next (as --policy GROUP=NAME)",
    ),
    "aging": ("a number of seconds > 0", "the policy's aging for this group (as --aging; needs policy)"),
    "max_slice": (
        "a number of seconds > 0",
        "how long a holder may keep the group while others wait (as --max-slice GROUP=S)",
    ),
    "slice_action": (
        'one of "warn", "preempt"',
        "past the maximum slice: warn, or also preempt (as --slice-action; needs max_slice)",
    ),
    "preempt_grace": (
        "a number of seconds >= 0",
        "from the warning to the preemption (as --preempt-grace; needs max_slice)",
    ),
}


# --- loading --------------------------------------------------------------------------


@dataclass(frozen=True)
class Problem:
    """One error in a config file: where (``groups.rl.gpus[1]``; empty for the whole file) and what."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


@dataclass(frozen=True)
class Loaded:
    """A valid config file: option values as the parser holds them, and the declared groups."""

    values: dict[str, Any]
    groups: dict[str, GroupDecl]


class _Invalid(Exception):
    """One value refused (internal: becomes a ``Problem`` at its key path, ``[index]`` added for an item)."""

    def __init__(self, message: str = "", index: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.index = index


def _shown(value: Any) -> str:
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, bool):
        return "true" if value else "false"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _number(value: Any, minimum: float | None = None, *, above: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _Invalid
    if minimum is not None and (value <= minimum if above else value < minimum):
        raise _Invalid
    return float(value)


def _string(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise _Invalid
    return value


# key -> (lowest value, whether it must be above it), beyond the key's type
RANGES: dict[str, tuple[float, bool]] = {
    "gpus": (1, False),
    "bandwidth": (0, False),
    "lock_timeout": (0, True),
    "op_timeout": (0, True),
    "engine_timeout": (0, True),
    "aging": (0, True),
    "preempt_grace": (0, False),
    "lease": (0, False),
    "recovery_grace": (0, False),
    "peer_port": (1, False),
    "election_timeout": (0, True),
}
RANGE_TEXT: dict[tuple[float, bool], str] = {(0, True): "> 0", (0, False): ">= 0", (1, False): ">= 1"}


def _convert(key: Key, value: Any, base: Path) -> Any:
    """``value`` from the file as the parser would hold it after parsing the flag; raises ``_Invalid``."""
    kind = key.kind
    if kind == "bool":
        if not isinstance(value, bool):
            raise _Invalid
        return value
    if kind in ("int", "float"):
        if kind == "int" and (isinstance(value, bool) or not isinstance(value, int)):
            raise _Invalid
        lowest, above = RANGES.get(key.name, (None, False))
        number = _number(value, lowest, above=above)
        if key.name == "peer_port" and number > 65535:
            raise _Invalid
        return int(number) if kind == "int" else number
    if kind == "size":
        try:
            n = size_value(value)
        except ValueError:
            raise _Invalid from None
        if key.name in RANGES and n < RANGES[key.name][0]:
            raise _Invalid
        return n
    if kind == "path":
        path = Path(_string(value)).expanduser()
        return path if path.is_absolute() else base / path
    if kind == "address":
        try:
            return parse_host_port(_string(value))
        except ValueError:
            raise _Invalid from None
    if kind == "choice":
        if value not in key.choices:
            raise _Invalid
        return value
    if kind == "list":
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(v, str) and v for v in items):
            raise _Invalid
        check = LIST_CHECKS.get(key.name)
        for i, item in enumerate(items):
            if check is not None:
                try:
                    check(item)
                except ValueError as exc:
                    raise _Invalid(str(exc), i) from None
        return list(items)
    if key.name == "peers" and isinstance(value, list):
        if not value or not all(isinstance(v, str) and v for v in value):
            raise _Invalid
        value = ",".join(value)
    text = _string(value)
    if key.name == "web" and text != "off":
        try:
            parse_host_port(text)
        except ValueError:
            raise _Invalid from None
    return text


LIST_CHECKS: dict[str, Callable[[str], object]] = {
    "max_slice": parse_slice_policy,
    "policy": parse_queue_policy,
}


def expects_text(key: Key) -> str:
    lowest = RANGES.get(key.name)
    if lowest is None or key.kind not in ("int", "float"):
        return key.expects if lowest is None else f"{key.expects} (at least {lowest[0]:g} byte)"
    bound = RANGE_TEXT[lowest] + (" and <= 65535" if key.name == "peer_port" else "")
    return f"{key.expects} {bound}"


def _unknown(name: str, known: Sequence[str]) -> str:
    close = difflib.get_close_matches(name.replace("-", "_"), known, n=1, cutoff=0.6)
    return "unknown key" + (f" (did you mean {close[0]!r}?)" if close else "")


def _group(name: str, table: Any, problems: list[Problem]) -> GroupDecl | None:
    where = f"groups.{toml_write.key(name)}"
    if not isinstance(table, dict):
        problems.append(Problem(where, f"expected a table of the group's settings, not {_shown(table)}"))
        return None
    found = len(problems)
    if len(name) > 256:
        problems.append(Problem(where, "a group's name is at most 256 characters"))
    values: dict[str, Any] = {}
    for k, value in table.items():
        path = f"{where}.{toml_write.key(k)}"
        if k not in GROUP_KEYS:
            problems.append(Problem(path, _unknown(k, list(GROUP_KEYS))))
            continue
        expects = GROUP_KEYS[k][0]
        try:
            values[k] = _group_value(k, value, path, problems)
        except _Invalid:
            problems.append(Problem(path, f"expected {expects}, not {_shown(value)}"))
    if "aging" in values and "policy" not in values:
        problems.append(Problem(f"{where}.aging", "aging is the group's policy's: give policy too"))
    for k in ("slice_action", "preempt_grace"):
        if k in values and "max_slice" not in values:
            problems.append(Problem(f"{where}.{k}", f"{k} is the group's maximum slice's: give max_slice too"))
    return GroupDecl(**values) if len(problems) == found else None


def _group_value(k: str, value: Any, path: str, problems: list[Problem]) -> Any:
    if k == "gpus":
        if not isinstance(value, list) or not value:
            raise _Invalid
        gpus: list[int] = []
        for i, gpu in enumerate(value):
            if isinstance(gpu, bool) or not isinstance(gpu, int) or gpu < 0:
                problems.append(Problem(f"{path}[{i}]", f"expected a GPU index (an integer >= 0), not {_shown(gpu)}"))
            elif gpu in gpus:
                problems.append(Problem(f"{path}[{i}]", f"GPU {gpu} is listed twice"))
            else:
                gpus.append(gpu)
        return tuple(sorted(gpus))
    if k == "policy":
        if value not in POLICY_NAMES:
            raise _Invalid
        return value
    if k == "slice_action":
        if value not in SLICE_ACTIONS:
            raise _Invalid
        return value
    if k == "preempt_grace":
        return _number(value, 0)
    return _number(value, 0, above=True)  # aging, max_slice


def parse(doc: Mapping[str, Any], known: Mapping[str, Key], base: Path) -> tuple[Loaded, list[Problem]]:
    """A parsed TOML document -> its values and groups, and every problem found (empty: valid).

    Relative paths are taken relative to ``base`` (the file's directory).
    """
    problems: list[Problem] = []
    values: dict[str, Any] = {}
    groups: dict[str, GroupDecl] = {}
    names = [*known, "groups"]
    for name, value in doc.items():
        if name == "groups":
            if not isinstance(value, dict):
                problems.append(Problem("groups", f"expected a table of [groups.NAME] tables, not {_shown(value)}"))
                continue
            for group, table in value.items():
                decl = _group(group, table, problems)
                if decl is not None:
                    groups[group] = decl
            continue
        if name in SECRETS:
            problems.append(
                Problem(
                    toml_write.key(name),
                    "secrets are not read from the config file, so that it can be shown and shared: put the "
                    f"token in a file only the daemon's user can read, and give {SECRETS[name]} = PATH",
                )
            )
            continue
        key = known.get(name)
        if key is None:
            problems.append(Problem(toml_write.key(name), _unknown(name, names)))
            continue
        try:
            values[name] = _convert(key, value, base)
        except _Invalid as exc:
            if exc.index is None:
                problems.append(Problem(toml_write.key(name), f"expected {expects_text(key)}, not {_shown(value)}"))
            else:
                problems.append(Problem(f"{toml_write.key(name)}[{exc.index}]", exc.message))
    return Loaded(values, groups), problems


def read(path: Path, known: Mapping[str, Key]) -> tuple[Loaded, list[Problem]]:
    """The config file at ``path``, and its problems (not TOML is one); raises ``ValueError`` if it cannot be read."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ValueError(f"cannot read the config file {path}: {why}; give the path of a TOML file") from None
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        return Loaded({}, {}), [Problem("", f"not valid TOML: {exc}")]
    return parse(doc, known, path.absolute().parent)


def load(path: Path, known: Mapping[str, Key]) -> Loaded:
    """``read`` that raises ``ValueError`` listing every problem, each with its key path."""
    loaded, problems = read(path, known)
    if problems:
        raise ValueError(problems_text(path, problems))
    return loaded


def problems_text(path: Path, problems: Sequence[Problem]) -> str:
    lines = [f"{path}: {p}" for p in problems]
    lines.append(f"fix the config file ({len(problems)} error{'s' if len(problems) != 1 else ''}), then try again")
    return "\n".join(lines)


# --- limits ---------------------------------------------------------------------------

# The daemon's limits, as options of ``serve`` (and so keys of the file): (flag, type, metavar, help, lowest,
# above it). The defaults are ``DaemonConfig``'s, so the two cannot differ.
LIMITS: tuple[tuple[str, Callable[[str], Any], str, str, float, bool], ...] = (
    ("--max-connections", int, "N", "client connections served at once; a new one past this is refused", 1, False),
    (
        "--max-connections-per-client",
        int,
        "N",
        "connections from one process (Unix socket) or one host (TCP) at once",
        1,
        False,
    ),
    ("--max-waiters", int, "N", "jobs waiting in one group's queue; an acquire past this is refused", 1, False),
    ("--handshake-timeout", float, "S", "a new connection must say hello within this", 0, True),
    ("--stall-timeout", float, "S", "a frame begun must arrive whole within this", 0, True),
    ("--max-write-buffer", size_arg, "SIZE", "a client that stops reading is disconnected past this", 1, False),
    ("--telemetry-interval", float, "S", "time between GPU samples", 0, True),
    ("--host-memory-interval", float, "S", "time between readings of host memory (also after every move)", 0, True),
)
RANGES.update({flag[2:].replace("-", "_"): (lowest, above) for flag, _, _, _, lowest, above in LIMITS})


def add_limit_options(p: argparse.ArgumentParser) -> None:
    """The daemon's limits as ``serve`` options (``--max-connections``, ...)."""
    defaults: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(DaemonConfig)}
    group = p.add_argument_group("limits")
    for flag, kind, metavar, text, *_ in LIMITS:
        name = flag[2:].replace("-", "_")
        default = defaults[name]
        shown = size_text(default) if kind is size_arg else f"{default:g}"
        group.add_argument(flag, type=kind, default=default, metavar=metavar, help=f"{text} (default {shown})")


def apply_limits(config: DaemonConfig, args: argparse.Namespace) -> None:
    """Put the limit options of ``args`` into ``config``; exits (as for a bad flag) for one out of range."""
    for flag, _, _, _, lowest, above in LIMITS:
        name = flag[2:].replace("-", "_")
        value = getattr(args, name, None)
        if value is None:
            continue
        if value <= lowest if above else value < lowest:
            raise SystemExit(f"timesliced: {flag} must be {RANGE_TEXT[(lowest, above)]}, not {value:g}")
        setattr(config, name, value)


# --- the daemon's side ----------------------------------------------------------------


def apply_groups(config: DaemonConfig, args: argparse.Namespace) -> None:
    """Put the declared groups of ``args`` (from the file) into ``config``, and its limits (``apply_limits``).

    The groups' policies go under those of ``--policy`` and ``--max-slice`` (flags, or the file's
    top-level lists), which name groups too and win. Raises ``ValueError`` for a policy the core refuses.
    """
    groups: dict[str, GroupDecl] = getattr(args, "groups", None) or {}
    config.groups = {name: g.gpus for name, g in groups.items() if g.gpus is not None}
    queue = {
        name: QueuePolicy(g.policy, g.aging if g.aging is not None else args.aging)
        for name, g in groups.items()
        if g.policy is not None
    }
    slices = {
        name: SlicePolicy(
            g.max_slice,
            g.slice_action or args.slice_action,
            g.preempt_grace if g.preempt_grace is not None else args.preempt_grace,
        )
        for name, g in groups.items()
        if g.max_slice is not None
    }
    config.queue_policies = {**queue, **config.queue_policies}
    config.slice_policies = {**slices, **config.slice_policies}
    apply_limits(config, args)


def check_declared_gpus(groups: Mapping[str, tuple[int, ...]], gpus: Sequence[int]) -> None:
    """Raises ``UnknownDevice`` for a declared group with a GPU this node does not have."""
    for name, declared in sorted(groups.items()):
        missing = sorted(set(declared) - set(gpus))
        if missing:
            raise errors.UnknownDevice(
                f"the config file's groups.{toml_write.key(name)}.gpus: this node has no GPU {missing} (it has "
                f"{sorted(gpus)}); "
                "declare the group on GPUs this node has"
            )


def size_text(n: int) -> str:
    """A size as the file would say it: ``16GiB`` where it is a whole number of a unit, else bytes."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


def file_value(key: Key, value: Any) -> Any:
    """A value as the parser holds it -> what the file says (the inverse of ``_convert``)."""
    if key.kind == "size":
        return size_text(value)
    if key.kind == "path":
        return str(Path(value).absolute())
    if key.kind == "address":
        host, port = value
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return value


def dump(args: argparse.Namespace, known: Mapping[str, Key]) -> str:
    """The effective config of ``args`` as TOML that ``parse`` accepts. Tokens are never in it: token
    files are paths, and the file has no key for a secret."""
    lines = [
        "# The effective config of timesliced serve (timesliced config show).",
        "# Keys without a value are commented out with what they do.",
        "",
    ]
    for key in known.values():
        value = getattr(args, key.name, None)
        if value is None:
            lines.append(f"# {key.name}: not set; {key.help}")
            continue
        lines.append(f"{key.name} = {toml_write.value(file_value(key, value))}")
    groups: dict[str, GroupDecl] = getattr(args, "groups", None) or {}
    for name, g in groups.items():
        lines += ["", f"[groups.{toml_write.key(name)}]"]
        for k in GROUP_KEYS:
            v = getattr(g, k)
            if v is not None:
                lines.append(f"{k} = {toml_write.value(list(v) if k == 'gpus' else v)}")
    return "\n".join(lines) + "\n"
