"""``packaging/systemd``: the unit runs ``timesliced serve --config FILE``; the example file names real options.

The unit's ExecStart and the example TOML are read against ``timesliced.cli.build_parser()``: every
option the unit passes must be one of ``serve``'s, every key of the TOML the long name of one (with
underscores), and the TOML spelled out as flags must parse. ``systemd-analyze verify`` checks the
unit's directives where it is installed (Debian's ``systemd``); with
``TIMESLICED_REQUIRE_SYSTEMD_ANALYZE=1`` a missing one fails the test instead of skipping it.
"""

from __future__ import annotations

import argparse
import configparser
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from timesliced.cli import build_parser

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover (Python 3.10)
    import tomli as tomllib

from ..helpers.processes import REPO
from ..helpers.tools import required_tool

SYSTEMD = REPO / "packaging" / "systemd"
UNIT = SYSTEMD / "timesliced.service"
EXAMPLE = SYSTEMD / "timesliced.toml"
CONFIG_PATH = "/etc/timesliced/timesliced.toml"


def serve_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parser: argparse.ArgumentParser = sub.choices["serve"]
    return parser


def serve_options() -> dict[str, argparse.Action]:
    """Every option string of ``serve`` -> its action."""
    return {s: a for a in serve_parser()._actions for s in a.option_strings}


def exec_start() -> list[str]:
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # type: ignore[assignment,method-assign]  # systemd keys are case-sensitive
    unit.read_string(UNIT.read_text())
    return shlex.split(unit["Service"]["ExecStart"])


def options_of(argv: list[str]) -> list[str]:
    return [word.partition("=")[0] for word in argv if word.startswith("--")]


def test_the_unit_runs_serve_with_the_config_file() -> None:
    argv = exec_start()
    assert Path(argv[0]).name == "timesliced" and argv[1] == "serve"
    assert argv[argv.index("--config") + 1] == CONFIG_PATH


def test_every_other_option_of_the_unit_is_a_serve_option() -> None:
    known = serve_options()
    assert [o for o in options_of(exec_start()[2:]) if o != "--config" and o not in known] == []


def test_the_config_option_is_a_serve_option() -> None:
    assert "--config" in serve_options()


@pytest.mark.slow
@pytest.mark.parametrize("commented", [False, True], ids=["as-shipped", "commented-keys-too"])
def test_the_example_passes_config_check(tmp_path: Path, commented: bool) -> None:
    """``timesliced config check`` accepts the example, and with its commented-out settings turned on."""
    text = EXAMPLE.read_text()
    if commented:
        text = re.sub(r"^# ([a-z_]+ = )", r"\1", text, flags=re.M)
        assert text.count("\n") == EXAMPLE.read_text().count("\n") and "\ntoken_file = " in text
    config = tmp_path / "timesliced.toml"
    config.write_text(text)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, "-m", "timesliced", "config", "check", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def example() -> dict[str, Any]:
    with EXAMPLE.open("rb") as f:
        return tomllib.load(f)


def as_flags(settings: dict[str, Any]) -> list[str]:
    """The settings as ``serve`` flags: ``state_dir = "x"`` -> ``--state-dir x``, ``true`` -> the bare flag."""
    known = serve_options()
    argv: list[str] = []
    for key, value in settings.items():
        flag = "--" + key.replace("_", "-")
        assert flag in known, f"{EXAMPLE.name}: {key} is not a `timesliced serve` option ({flag})"
        if value is True:
            argv.append(flag)
        elif value is not False:
            for item in value if isinstance(value, list) else [value]:
                argv += [flag, str(item)]
    return argv


def test_every_key_of_the_example_is_a_serve_option_and_the_values_parse() -> None:
    settings = example()
    assert {"state_dir", "socket", "web"} <= settings.keys()
    args = serve_parser().parse_args(as_flags(settings))
    assert str(args.state_dir) == settings["state_dir"] == "/run/timesliced"
    assert str(args.socket) == settings["socket"]
    assert args.web == settings["web"]


def test_the_example_keeps_the_settings_the_unit_had() -> None:
    """The state dir and socket the unit used to pass as flags, and the dir systemd makes for them."""
    settings = example()
    text = UNIT.read_text()
    assert "RuntimeDirectory=timesliced" in text and "RuntimeDirectoryPreserve=yes" in text
    assert Path(settings["socket"]).parent == Path(settings["state_dir"]) == Path("/run/timesliced")


def test_the_example_check_would_catch_a_wrong_key() -> None:
    with pytest.raises(AssertionError, match="statedir is not a `timesliced serve` option"):
        as_flags({"statedir": "/run/timesliced"})
    with pytest.raises(SystemExit):
        serve_parser().parse_args(as_flags({"gpus": "two"}))


def systemd_analyze() -> str:
    return required_tool("systemd-analyze", "TIMESLICED_REQUIRE_SYSTEMD_ANALYZE", "apt-get install systemd")


def verify(tmp_path: Path, text: str) -> subprocess.CompletedProcess[str]:
    """``systemd-analyze verify`` on ``text``, its ExecStart pointed at an executable that exists here."""
    unit = tmp_path / "timesliced.service"
    unit.write_text(text.replace(exec_start()[0], sys.executable, 1))
    return subprocess.run(
        [systemd_analyze(), "verify", str(unit)], capture_output=True, text=True, timeout=60, check=False
    )


def test_systemd_accepts_the_unit(tmp_path: Path) -> None:
    result = verify(tmp_path, UNIT.read_text())
    assert (result.returncode, result.stdout + result.stderr) == (0, "")


def test_systemd_analyze_would_catch_a_misspelled_directive(tmp_path: Path) -> None:
    result = verify(tmp_path, UNIT.read_text().replace("OOMScoreAdjust=", "OOMScoreAdjustt="))
    assert "Unknown key" in result.stdout + result.stderr
