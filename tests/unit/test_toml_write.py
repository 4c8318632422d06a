"""The small TOML writer (``util/toml_write.py``): what it writes, ``tomllib`` reads back the same."""

from __future__ import annotations

import sys
from typing import Any

import pytest

from timesliced.util import toml_write

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

STRINGS = ["plain", 'q"uote', "back\\slash", "ctl\x00\x1f\x7f", "tab\tnew\nline\r\f\b", "ünï ☃", "", "'single'"]


@pytest.mark.parametrize("text", STRINGS)
def test_strings_and_keys_read_back(text: str) -> None:
    doc = tomllib.loads(f"{toml_write.key(text)} = {toml_write.value(text)}\n")
    assert doc == {text: text}


@pytest.mark.parametrize(
    "v",
    [True, False, 0, -7, 2**62, 1.5, 1e-3, 1e300, -0.25, ["a", "b"], [1, 2], [], [True, "x", 2.0], ("t", 1)],
)
def test_values_read_back(v: Any) -> None:
    expected = list(v) if isinstance(v, tuple) else v
    assert tomllib.loads(f"v = {toml_write.value(v)}\n") == {"v": expected}


def test_bare_keys_stay_bare() -> None:
    assert toml_write.key("gpu_memory") == "gpu_memory" and toml_write.key("rl-1") == "rl-1"
    assert toml_write.key("rl/trainer") == '"rl/trainer"' and toml_write.key("") == '""'


@pytest.mark.parametrize(("v", "error"), [(float("inf"), ValueError), (float("nan"), ValueError), (None, TypeError)])
def test_what_has_no_toml_form_is_refused(v: Any, error: type[Exception]) -> None:
    with pytest.raises(error):
        toml_write.value(v)
