"""What user code reaches from ``import timesliced``: every error class, and one version."""

from __future__ import annotations

import contextlib
import io
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import timesliced
from timesliced import errors
from timesliced.version import __version__

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]


def exception_tree() -> list[type]:
    """Every class of the tree in errors.py, the ``StateIntact`` marker included."""
    out: list[type] = []
    todo: list[type] = [errors.TimeslicedError]
    while todo:
        cls = todo.pop()
        if cls.__module__ == errors.__name__ and cls not in out:
            out.append(cls)
            todo.extend(cls.__subclasses__())
    return [*out, errors.StateIntact]


def missing_exports(classes: list[type], package: object) -> list[str]:
    """The classes that ``package`` does not export as themselves, in ``__all__`` too."""
    exported = set(getattr(package, "__all__", ()))
    wrong = [c for c in classes if getattr(package, c.__name__, None) is not c or c.__name__ not in exported]
    return sorted(c.__name__ for c in wrong)


def test_every_error_class_is_importable_from_timesliced() -> None:
    classes = exception_tree()
    assert len(classes) == len(errors.ERRORS_BY_CODE) + 1  # the tree, and the marker without a code
    assert missing_exports(classes, timesliced) == []


def test_the_export_check_finds_a_missing_or_shadowed_class() -> None:
    classes = [errors.GroupDraining, errors.UnknownRegion, errors.StateIntact]
    package = SimpleNamespace(
        __all__=["GroupDraining", "StateIntact"],
        GroupDraining=errors.GroupDraining,
        UnknownRegion=errors.UnknownRegion,  # present but not in __all__
        StateIntact=errors.ParkRefused,  # the name, but another class
    )
    assert missing_exports(classes, package) == ["StateIntact", "UnknownRegion"]


def test_the_cli_says_the_package_version() -> None:
    from timesliced.cli import build_parser

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        build_parser().parse_args(["--version"])
    assert out.getvalue().strip() == f"timesliced {__version__}"
    assert timesliced.__version__ == __version__


def test_the_version_is_written_in_one_place() -> None:
    """pyproject reads timesliced/version.py; no other module of the package spells the version."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "version" in project["project"]["dynamic"] and "version" not in project["project"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "timesliced.version.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", __version__)
    spelled = [
        str(p.relative_to(REPO))
        for p in sorted((REPO / "timesliced").rglob("*.py"))
        if p.name != "version.py" and re.search(rf"['\"]{re.escape(__version__)}['\"]", p.read_text())
    ]
    assert spelled == [], "import __version__ from timesliced.version instead"


def test_the_changelog_has_a_section_for_the_version() -> None:
    text = (REPO / "CHANGELOG.md").read_text()
    assert re.search(rf"^## \[{re.escape(__version__)}\]", text, re.M), "add the release to CHANGELOG.md"
