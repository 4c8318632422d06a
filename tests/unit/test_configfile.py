"""The daemon's config file (``daemon/configfile.py``): its keys, every kind of error, flags over the file,
and ``config show`` -> ``config check`` round trips. Files on a temporary directory; no daemon."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import pytest

from timesliced import errors
from timesliced.cli import build_parser, config_from_args, main
from timesliced.core.policy import QueuePolicy
from timesliced.core.registry import declared_gpus
from timesliced.core.slices import SlicePolicy
from timesliced.daemon.config_commands import DAEMON_PARSER, reference_markdown, with_config_file
from timesliced.daemon.configfile import GROUP_KEYS, GroupDecl, Key, check_declared_gpus, dump, keys, read

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

GiB = 1 << 30


def serve_parser() -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = getattr(build_parser().parse_args(["serve"]), DAEMON_PARSER)
    return parser


KEYS = keys(serve_parser())


def parsed(argv: list[str]) -> argparse.Namespace:
    """``argv`` as ``timesliced`` parses it, a ``--config`` file's values under the flags."""
    parser = build_parser()
    return with_config_file(parser, parser.parse_args(argv), argv)


def problems_of(text: str, tmp_path: Path) -> list[str]:
    path = tmp_path / "timesliced.toml"
    path.write_text(text, encoding="utf-8")
    return [str(p) for p in read(path, KEYS)[1]]


# --- the keys -------------------------------------------------------------------------


def test_every_serve_option_is_a_key_named_by_its_long_option() -> None:
    parser = serve_parser()
    dests = {a.dest for a in parser._actions if a.option_strings} - {"help", "config"}
    assert set(KEYS) == dests
    for key in KEYS.values():
        assert key.flag == "--" + key.name.replace("_", "-") and key.help, key
    kinds = {k.name: k.kind for k in KEYS.values()}
    assert kinds["gpu_memory"] == kinds["host_memory_limit"] == kinds["memory_headroom"] == "size"
    names = ("gpus", "op_timeout", "state_dir", "listen", "no_prefetch", "backend", "policy", "web")
    assert [kinds[n] for n in names] == ["int", "float", "path", "address", "bool", "choice", "list", "string"]
    assert "%" not in KEYS["host_memory_margin"].help.replace("5%", "")  # --help's %% is shown as one %


def test_a_serve_option_of_a_type_the_file_does_not_know_fails_the_key_table() -> None:
    parser = serve_parser()
    parser.add_argument("--frobnicate", type=complex)
    with pytest.raises(TypeError, match="--frobnicate"):
        keys(parser)


# --- errors, each with its key path ---------------------------------------------------

ERRORS = [
    # (file, the problem it must give)
    ('gpu_memry = "1GiB"', "gpu_memry: unknown key (did you mean 'gpu_memory'?)"),
    ("gpu-memory = 1", "gpu-memory: unknown key (did you mean 'gpu_memory'?)"),
    ("prefetch = false", "prefetch: unknown key (did you mean 'no_prefetch'?)"),
    ("zzz = 1", "zzz: unknown key"),
    ("no_prefetch = 1", "no_prefetch: expected true or false, not 1"),
    ("gpus = 1.5", "gpus: expected an integer >= 1, not 1.5"),
    ("gpus = true", "gpus: expected an integer >= 1, not true"),
    ("gpus = 0", "gpus: expected an integer >= 1, not 0"),
    ('op_timeout = "x"', "op_timeout: expected a number > 0, not 'x'"),
    ("op_timeout = 0", "op_timeout: expected a number > 0, not 0"),
    ("lease = -1", "lease: expected a number >= 0, not -1"),
    ("peer_port = 70000", "peer_port: expected an integer >= 1 and <= 65535, not 70000"),
    ('gpu_memory = "banana"', "gpu_memory: expected a number of bytes or a size like 16GiB, 512MiB or 1.5GB"),
    ("gpu_memory = -5", "gpu_memory: expected a number of bytes or a size like 16GiB"),
    ("state_dir = 5", "state_dir: expected a path (a string; relative to the config file's directory), not 5"),
    ('state_dir = ""', "state_dir: expected a path"),
    ('listen = "nowhere"', "listen: expected an address \"HOST:PORT\", not 'nowhere'"),
    ('backend = "cuda"', 'backend: expected one of "auto", "sim", "cuda-checkpoint"'),
    ('web = "nope"', 'web: expected "HOST:PORT", or "off" for no dashboard, not \'nope\''),
    ("node = 7", "node: expected a string, not 7"),
    ("peers = []", "peers: expected the members"),
    ("policy = [1]", 'policy: expected a list of "[GROUP=]NAME" strings'),
    ('policy = ["fair", "weird"]', "policy[1]: not a queue policy: 'weird'"),
    ('max_slice = ["rl=-3"]', "max_slice[0]: not a maximum slice: 'rl=-3'"),
    ("[state_dir]\nx = 1", "state_dir: expected a path (a string; relative to the config file's directory), not a"),
    ('token = "hunter2hunter2hunter2"', "token: secrets are not read from the config file"),
    ('admin_token = "hunter2hunter2hunter2"', "admin_token: secrets are not read from the config file"),
    ("groups = 3", "groups: expected a table of [groups.NAME] tables, not 3"),
    ("[groups]\nrl = 3", "groups.rl: expected a table of the group's settings, not 3"),
    ('[groups.rl]\npolcy = "fair"', "groups.rl.polcy: unknown key (did you mean 'policy'?)"),
    ("[groups.rl]\ngpus = []", "groups.rl.gpus: expected a list of GPU indices (integers >= 0), like [0, 1], not []"),
    ("[groups.rl]\ngpus = 1", "groups.rl.gpus: expected a list of GPU indices"),
    ('[groups.rl]\ngpus = [0, "x"]', "groups.rl.gpus[1]: expected a GPU index (an integer >= 0), not 'x'"),
    ("[groups.rl]\ngpus = [0, -1]", "groups.rl.gpus[1]: expected a GPU index (an integer >= 0), not -1"),
    ("[groups.rl]\ngpus = [1, true]", "groups.rl.gpus[1]: expected a GPU index (an integer >= 0), not true"),
    ("[groups.rl]\ngpus = [2, 2]", "groups.rl.gpus[1]: GPU 2 is listed twice"),
    ('[groups.rl]\npolicy = "lottery"', 'groups.rl.policy: expected one of "fifo", "priority", "fair", not \'lot'),
    ('[groups.rl]\npolicy = "fair"\naging = 0', "groups.rl.aging: expected a number of seconds > 0, not 0"),
    ("[groups.rl]\naging = 5", "groups.rl.aging: aging is the group's policy's: give policy too"),
    ("[groups.rl]\nmax_slice = -1", "groups.rl.max_slice: expected a number of seconds > 0, not -1"),
    ('[groups.rl]\nslice_action = "preempt"', "groups.rl.slice_action: slice_action is the group's maximum slice's"),
    ("[groups.rl]\nmax_slice = 9\npreempt_grace = -1", "groups.rl.preempt_grace: expected a number of seconds >= 0"),
    ('[groups."rl/trainer"]\ngpus = "0"', 'groups."rl/trainer".gpus: expected a list of GPU indices'),
    (f"[groups.{'g' * 257}]\ngpus = [0]", f"groups.{'g' * 257}: a group's name is at most 256 characters"),
    ("gpus = [", "not valid TOML: "),
]


@pytest.mark.parametrize(("text", "problem"), ERRORS, ids=[p.split(":")[0] for _, p in ERRORS])
def test_each_error_names_its_key_path_and_what_is_expected(text: str, problem: str, tmp_path: Path) -> None:
    found = problems_of(text, tmp_path)
    assert len(found) == 1 and found[0].startswith(problem), found


def test_every_error_of_a_file_is_told_at_once(tmp_path: Path) -> None:
    text = "\n".join(["gpus = 0", 'backend = "x"', "zzz = 1", "[groups.a]", 'gpus = ["x", -1]', "polcy = 1"])
    assert [p.split(":")[0] for p in problems_of(text, tmp_path)] == [
        "gpus",
        "backend",
        "zzz",
        "groups.a.gpus[0]",
        "groups.a.gpus[1]",
        "groups.a.polcy",
    ]


def test_a_refused_secret_is_not_repeated(tmp_path: Path) -> None:
    (found,) = problems_of('token = "hunter2hunter2hunter2"', tmp_path)
    assert "hunter2" not in found and "token_file = PATH" in found


def test_a_valid_file_has_no_problems_and_its_values_are_as_the_flags_give_them(tmp_path: Path) -> None:
    text = """
        backend = "sim"
        gpus = 3
        gpu_memory = "1.5GiB"
        host_memory_limit = 1073741824
        state_dir = "state"
        sim_dir = "/dev/shm/ts"
        listen = "127.0.0.1:7714"
        web = "off"
        no_prefetch = true
        op_timeout = 30
        peers = ["a=h1:7713", "b=h2:7713"]
        policy = "fair"

        [groups.rl]
        gpus = [2, 0]
        policy = "priority"
        aging = 5
        max_slice = 300
        slice_action = "preempt"
        preempt_grace = 0
        [groups.sft]
    """
    path = tmp_path / "ts.toml"
    path.write_text(text, encoding="utf-8")
    loaded, problems = read(path, KEYS)
    assert problems == []
    assert loaded.values == {
        "backend": "sim",
        "gpus": 3,
        "gpu_memory": 3 * GiB // 2,
        "host_memory_limit": GiB,
        "state_dir": tmp_path / "state",  # relative to the file's directory
        "sim_dir": Path("/dev/shm/ts"),
        "listen": ("127.0.0.1", 7714),
        "web": "off",
        "no_prefetch": True,
        "op_timeout": 30.0,
        "peers": "a=h1:7713,b=h2:7713",
        "policy": ["fair"],
    }
    assert isinstance(loaded.values["op_timeout"], float)
    assert loaded.groups == {
        "rl": GroupDecl(
            gpus=(0, 2), policy="priority", aging=5.0, max_slice=300.0, slice_action="preempt", preempt_grace=0.0
        ),
        "sft": GroupDecl(),
    }


# --- flags over the file ---------------------------------------------------------------


def test_flags_override_the_file_and_the_file_overrides_the_defaults(tmp_path: Path) -> None:
    path = tmp_path / "ts.toml"
    path.write_text('gpus = 3\ngpu_memory = "1GiB"\npolicy = ["fair"]\nno_prefetch = true\n', encoding="utf-8")
    args = parsed(["serve", "--config", str(path), "--gpus", "5", "--policy", "rl=priority"])
    assert args.gpus == 5  # the flag
    assert args.gpu_memory == GiB and args.no_prefetch is True  # the file
    assert args.memory_headroom == GiB and args.op_timeout == 600.0  # neither: the defaults
    assert args.policy == ["fair", "rl=priority"]  # a repeatable flag adds to the file's list
    assert parsed(["serve", "--gpus", "5"]).gpu_memory == 16 * GiB  # no file: the defaults
    # the flag before --config wins too (the file is read first, whatever the order)
    assert parsed(["serve", "--gpus", "7", "--config", str(path)]).gpus == 7


def test_serve_with_a_bad_file_exits_with_every_problem(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "ts.toml"
    path.write_text("gpus = 0\nzzz = 1\n", encoding="utf-8")
    with pytest.raises(SystemExit) as caught:
        parsed(["serve", "--config", str(path)])
    message = str(caught.value.code)
    assert message.startswith("timesliced: ") and f"{path}: gpus: expected an integer >= 1, not 0" in message
    assert f"{path}: zzz: unknown key" in message and "fix the config file (2 errors)" in message
    with pytest.raises(SystemExit, match=r"cannot read the config file .*missing\.toml"):
        parsed(["serve", "--config", str(tmp_path / "missing.toml")])


def test_a_file_s_groups_reach_the_daemon_config_under_the_flags(tmp_path: Path) -> None:
    path = tmp_path / "ts.toml"
    path.write_text(
        """
        backend = "sim"
        web = "off"
        aging = 7
        slice_action = "preempt"
        [groups.rl]
        gpus = [1]
        policy = "fair"
        max_slice = 30
        [groups.sft]
        gpus = [0]
        policy = "priority"
        aging = 2
        max_slice = 60
        slice_action = "warn"
        preempt_grace = 1
        [groups.eval]
        policy = "fair"
        """,
        encoding="utf-8",
    )
    config = config_from_args(parsed(["serve", "--config", str(path), "--policy", "eval=fifo"]))
    assert config.groups == {"rl": (1,), "sft": (0,)}
    assert config.queue_policies == {
        "rl": QueuePolicy("fair", 7.0),  # the file's top-level aging
        "sft": QueuePolicy("priority", 2.0),
        "eval": QueuePolicy("fifo", 7.0),  # the flag wins over the group's table
    }
    assert config.slice_policies == {"rl": SlicePolicy(30.0, "preempt", 10.0), "sft": SlicePolicy(60.0, "warn", 1.0)}
    assert config_from_args(parsed(["serve", "--web", "off"])).groups == {}


def test_a_flag_out_of_range_for_the_file_s_groups_is_a_one_line_refusal(tmp_path: Path) -> None:
    path = tmp_path / "ts.toml"
    path.write_text('[groups.rl]\npolicy = "fair"\n[groups.sft]\nmax_slice = 60\n', encoding="utf-8")
    with pytest.raises(SystemExit, match=r"^timesliced: a queue policy's aging must be > 0"):
        config_from_args(parsed(["serve", "--config", str(path), "--aging", "0"]))
    with pytest.raises(SystemExit, match=r"^timesliced: .*grace"):
        config_from_args(parsed(["serve", "--config", str(path), "--preempt-grace", "-1"]))


def test_the_daemon_s_limits_are_options_and_keys(tmp_path: Path) -> None:
    path = tmp_path / "ts.toml"
    path.write_text('max_waiters = 8\nmax_write_buffer = "1MiB"\nstall_timeout = 2\n', encoding="utf-8")
    config = config_from_args(parsed(["serve", "--config", str(path), "--max-connections", "64", "--web", "off"]))
    assert (config.max_waiters, config.max_write_buffer, config.stall_timeout) == (8, 1 << 20, 2.0)
    assert config.max_connections == 64 and config.max_connections_per_client == 256  # the flag; the default
    assert config_from_args(parsed(["serve", "--web", "off"])).max_waiters == 1024
    with pytest.raises(SystemExit, match="--max-waiters must be >= 1, not 0"):
        config_from_args(parsed(["serve", "--max-waiters", "0"]))
    with pytest.raises(SystemExit, match="--telemetry-interval must be > 0, not 0"):
        config_from_args(parsed(["serve", "--telemetry-interval", "0"]))
    assert problems_of("max_write_buffer = 0\nhandshake_timeout = 0", tmp_path) == [
        "max_write_buffer: expected a number of bytes or a size like 16GiB, 512MiB or 1.5GB; K, M, G and T are "
        "powers of 1024 (at least 1 byte), not 0",
        "handshake_timeout: expected a number > 0, not 0",
    ]


# --- declared groups -------------------------------------------------------------------

DECLARED = {"rl": (1, 2)}


@pytest.mark.parametrize(
    ("group", "asked", "gets"),
    [
        ("rl", None, (1, 2)),  # names none: the group's
        ("rl", (2, 1), (1, 2)),  # the same GPUs in another order
        ("rl", (1, 2, 2), (1, 2)),
        ("other", None, None),  # not declared: as asked
        ("other", (0,), (0,)),
    ],
)
def test_a_declared_group_gives_its_gpus(group: str, asked: tuple[int, ...] | None, gets: Any) -> None:
    assert declared_gpus(DECLARED, group, asked) == gets


@pytest.mark.parametrize("asked", [(0,), (1,), (1, 2, 3)])
def test_a_declared_group_refuses_other_gpus(asked: tuple[int, ...]) -> None:
    with pytest.raises(errors.GroupMismatch, match=r"group 'rl' is declared on GPUs \[1, 2\] by the daemon's config"):
        declared_gpus(DECLARED, "rl", asked)


def test_a_group_declared_on_a_gpu_the_node_lacks_is_refused_at_start() -> None:
    check_declared_gpus({"rl": (0, 1)}, [0, 1, 2])
    with pytest.raises(errors.UnknownDevice, match=r"groups.rl.gpus: this node has no GPU \[3\] \(it has \[0, 1\]\)"):
        check_declared_gpus({"rl": (1, 3)}, [0, 1])


# --- config show -> config check -------------------------------------------------------


def test_show_prints_what_check_accepts_and_what_loads_back_the_same(tmp_path: Path) -> None:
    (tmp_path / "tok").write_text("x" * 32, encoding="utf-8")
    first = tmp_path / "first.toml"
    first.write_text(
        f"""
        token_file = "tok"
        listen = "[::1]:7714"
        node = "a \\"quoted\\" \\\\ name\\u007f\\t"
        host_memory_limit = 1536
        gpu_memory = "1.5GiB"
        max_slice = ["rl=300:preempt"]
        peers = "a=h1:7713,b=h2:7713"
        [groups."rl/trainer"]
        gpus = [0, 1]
        policy = "fair"
        aging = 2.5
        [groups.{"x" * 3}]
        max_slice = 1e-3
        """,
        encoding="utf-8",
    )
    args = parsed(["serve", "--config", str(first), "--gpus", "4", "--web", "127.0.0.1:0"])
    text = dump(args, KEYS)
    assert "x" * 32 not in text and f'token_file = "{tmp_path / "tok"}"' in text
    shown = tmp_path / "shown.toml"
    shown.write_text(text, encoding="utf-8")
    assert read(shown, KEYS)[1] == []
    again = parsed(["serve", "--config", str(shown)])
    assert {k: getattr(again, k) for k in KEYS} == {k: getattr(args, k) for k in KEYS}
    assert again.groups == args.groups and set(again.groups) == {"rl/trainer", "xxx"}
    assert again.node == 'a "quoted" \\ name\x7f\t' and again.listen == ("::1", 7714)


def test_show_without_a_file_is_the_defaults_and_the_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "show", "--gpus", "6", "--gpu-memory", "512MiB"]) == 0
    doc = tomllib.loads(capsys.readouterr().out)
    assert doc["gpus"] == 6 and doc["gpu_memory"] == "512MiB" and doc["memory_headroom"] == "1GiB"
    assert doc["backend"] == "auto" and "groups" not in doc and "token_file" not in doc


def test_config_check_exits_0_for_a_valid_file_and_1_with_each_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good, bad = tmp_path / "good.toml", tmp_path / "bad.toml"
    good.write_text("gpus = 2\n[groups.rl]\ngpus = [0]\n", encoding="utf-8")
    bad.write_text('gpus = 2\n[groups.rl]\ngpus = [0, "one"]\n', encoding="utf-8")
    assert main(["config", "check", str(good)]) == 0
    assert capsys.readouterr().out == f"{good}: valid (1 key, 1 group)\n"
    assert main(["config", "check", str(bad)]) == 1
    err = capsys.readouterr().err
    assert f"{bad}: groups.rl.gpus[1]: expected a GPU index (an integer >= 0), not 'one'" in err
    with pytest.raises(SystemExit, match="cannot read the config file"):
        main(["config", "check", str(tmp_path / "missing.toml")])


def test_a_size_flag_refuses_with_what_it_accepts(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--gpu-memory", "banana"])
    err = capsys.readouterr().err
    assert "argument --gpu-memory: not a size: 'banana' (expected a number of bytes or a size like 16GiB" in err
    assert "invalid" not in err
    assert build_parser().parse_args(["serve", "--host-memory-limit", "1.5GB"]).host_memory_limit == 3 * GiB // 2


# --- the reference ---------------------------------------------------------------------

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guide" / "configuration.md"
BEGIN, END = "<!-- config-keys:begin (timesliced config keys --markdown) -->", "<!-- config-keys:end -->"


def test_the_guide_lists_every_key_as_the_parser_has_it() -> None:
    text = GUIDE.read_text(encoding="utf-8")
    table = text.split(BEGIN, 1)[1].split(END, 1)[0]
    expected = reference_markdown(KEYS)
    assert table.strip() == expected.strip(), (
        "docs/guide/configuration.md's key table is stale: replace it with the output of "
        "`timesliced config keys --markdown`"
    )
    for key in [*KEYS, *GROUP_KEYS]:
        assert f"| `{key}` |" in table


def test_the_reference_check_can_fail() -> None:
    parser = serve_parser()
    parser.add_argument("--brand-new", type=int, default=1, help="something new")
    assert "`brand_new`" in reference_markdown(keys(parser)) and "`brand_new`" not in GUIDE.read_text()


def test_keys_lists_every_key(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "keys"]) == 0
    out = capsys.readouterr().out
    for key in KEYS.values():
        assert f"\n{key.name}: " in "\n" + out
    assert "[groups.NAME]:" in out and all(f"  {k}: " in out for k in GROUP_KEYS)


def test_key_is_frozen() -> None:
    key = KEYS["gpus"]
    assert isinstance(key, Key) and key.default == 2 and key.expects == "an integer"
    with pytest.raises(AttributeError):
        key.name = "x"  # type: ignore[misc]
