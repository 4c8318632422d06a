"""Tools a test needs from the machine: present, skipped without, or failed without where CI requires them."""

from __future__ import annotations

import os
import shutil

import pytest


def missing(variable: str, problem: str) -> None:
    """A test cannot run (``problem``): it fails where ``$variable`` is 1 (CI sets it), else it skips."""
    if os.environ.get(variable) == "1":
        pytest.fail(f"{variable}=1 but {problem}", pytrace=False)
    pytest.skip(problem)


def required_tool(command: str, variable: str, install: str) -> str:
    """The path of ``command``; without it the test skips, or fails where ``$variable`` is 1."""
    found = shutil.which(command)
    if found is None:
        missing(variable, f"{command} is not on the PATH ({install})")
    assert found is not None
    return found
