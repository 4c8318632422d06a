"""What the GPU check installs (tests/gpu/install.py): the cuda-python for the driver, and what else lacks."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from tests.gpu import install
from tests.gpu.install import (
    allows,
    bindings_problem,
    cuda_requirements,
    marker_applies,
    needs,
    own_requirements,
    parse_requirement,
)

REPO = Path(__file__).resolve().parents[2]

# Every cuda-bindings release on PyPI from 12.8 on (``pip index versions cuda-bindings``).
RELEASES = [
    "12.8.0",
    "12.9.0",
    "12.9.1",
    "12.9.2",
    "12.9.3",
    "12.9.4",
    "12.9.5",
    "12.9.6",
    "12.9.7",
    "12.9.8",
    "12.9.9",
    "12.9.10",
    "13.0.0",
    "13.0.1",
    "13.0.2",
    "13.0.3",
    "13.1.0",
    "13.1.1",
    "13.2.0",
    "13.3.0",
    "13.3.1",
    "13.4.1",
    "13.4.2",
    "13.4.3",
    "13.4.4",
    "13.5.0",
]
BAD = {"13.0.0", "13.0.1", "13.3.0"}


def accepted(requirements: list[str], name: str = "cuda-bindings") -> set[str]:
    clauses = [c for r in requirements if parse_requirement(r)[0] == name for c in parse_requirement(r)[1]]
    return {v for v in RELEASES if allows(clauses, v)}


# --- the rule ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cuda", "major"),
    [(12080, 12), (12090, 12), (13000, 13), (13010, 13), (13020, 13), (14000, 13)],
)
def test_the_major_matches_the_driver_and_no_known_bad_release_is_accepted(cuda: int, major: int) -> None:
    reqs = own_requirements(cuda)
    assert [parse_requirement(r)[0] for r in reqs] == ["cuda-python", "cuda-bindings"]
    for name in ("cuda-python", "cuda-bindings"):
        ok = accepted(reqs, name)
        assert ok, reqs
        assert {int(v.split(".")[0]) for v in ok} == {major}
        assert not ok & BAD
    if major == 13:
        assert "13.0.2" in accepted(reqs) and "13.3.1" in accepted(reqs)


def test_a_cuda_12_driver_below_12_8_still_gets_bindings_with_the_checkpoint_api() -> None:
    # The bindings load on an older 12.x driver; the preflight then says the driver lacks the API.
    assert min(accepted(own_requirements(12040)), key=install.version_key) == "12.8.0"


@pytest.mark.parametrize("cuda", [11080, 10020])
def test_a_driver_older_than_cuda_12_is_refused_with_what_to_do(cuda: int) -> None:
    with pytest.raises(ValueError, match="upgrade the driver"):
        own_requirements(cuda)


def test_the_projects_rule_wins_and_known_bad_bindings_stay_out() -> None:
    def rule(cuda: int) -> str:
        return "cuda-python>=13.1,<14"

    reqs, source = cuda_requirements(13000, rule)
    assert source == "timesliced.backends.cuda_driver"
    assert reqs[0] == "cuda-python>=13.1,<14"
    assert not accepted(reqs) & BAD  # our cuda-bindings clause was added


@pytest.mark.parametrize("answer", [ValueError("no"), [], ["numpy>=1"]])
def test_a_broken_project_rule_falls_back_to_ours(answer: Any) -> None:
    def rule(cuda: int) -> Any:
        if isinstance(answer, Exception):
            raise answer
        return answer

    reqs, source = cuda_requirements(13000, rule)
    assert reqs == own_requirements(13000)
    assert source.startswith("tests/gpu/install.py (the project's rule")


def disagreements(rule: Any) -> list[tuple[int, str]]:
    """(CUDA version, distribution) where ``rule`` accepts other releases than ours."""
    out = []
    for cuda in (12080, 12090, 13000, 13010, 13020):
        got = rule(cuda)
        theirs = [got] if isinstance(got, str) else list(got)
        for name in sorted({parse_requirement(r)[0] for r in theirs} & {"cuda-python", "cuda-bindings"}):
            if accepted(theirs, name) != accepted(own_requirements(cuda), name):
                out.append((cuda, name))
    return out


def test_a_rule_that_lets_a_known_bad_release_in_disagrees() -> None:
    def lax(cuda: int) -> str:
        return "cuda-python>=12.8,<13" if cuda < 13000 else "cuda-python>=13,<14"

    assert disagreements(lax) == [(13000, "cuda-python"), (13010, "cuda-python"), (13020, "cuda-python")]
    assert disagreements(own_requirements) == []


def test_the_projects_rule_where_it_exists_agrees_with_ours() -> None:
    rule = install.project_rule()
    if rule is None:
        # No rule in timesliced.backends.cuda_driver yet: ours is the one used, as the install stage says.
        assert cuda_requirements(12080)[1] == "tests/gpu/install.py"
        return
    assert disagreements(rule) == []


# --- versions and requirements -----------------------------------------------------------


@pytest.mark.parametrize(
    ("version", "clauses", "ok"),
    [
        ("13.4.4", [(">=", "13.0"), ("<", "14")], True),
        ("14.0.0", [(">=", "13.0"), ("<", "14")], False),
        ("13.0.1", [("!=", "13.0.1")], False),
        ("13.0.1.post1", [("!=", "13.0.1")], True),
        ("12.9.10", [(">=", "12.9.2")], True),  # numbers, not strings: 10 > 2
        ("12.10", [("<", "12.9")], False),
        ("12.8.0", [("==", "12.8")], True),
        ("12.8.5", [("~=", "12.8.0")], True),
        ("12.9.0", [("~=", "12.8.0")], False),
        ("13.2.0", [("==", "13.*")], True),
        ("12.9.0", [("==", "13.*")], False),
        ("13.2.0", [("!=", "13.*")], False),
    ],
)
def test_allows(version: str, clauses: list[tuple[str, str]], ok: bool) -> None:
    assert allows(clauses, version) is ok


def test_parse_requirement() -> None:
    assert parse_requirement("cuda-python>=13,<14,!=13.0.0") == (
        "cuda-python",
        [(">=", "13"), ("<", "14"), ("!=", "13.0.0")],
        "",
    )
    assert parse_requirement("taskgroup>=0.2; python_version < '3.11'") == (
        "taskgroup",
        [(">=", "0.2")],
        "python_version < '3.11'",
    )
    assert parse_requirement("Prometheus_Client")[0] == "prometheus-client"
    with pytest.raises(ValueError):
        parse_requirement("pkg @ https://example.invalid/pkg.whl")


@pytest.mark.parametrize(
    ("marker", "python", "ok"),
    [("", (3, 10), True), ("python_version < '3.11'", (3, 10), True), ("python_version < '3.11'", (3, 12), False)],
)
def test_marker_applies(marker: str, python: tuple[int, int], ok: bool) -> None:
    assert marker_applies(marker, python) is ok


@pytest.mark.parametrize(
    ("installed", "cuda", "problem"),
    [
        ("13.4.4", 13000, None),
        ("12.9.10", 12080, None),
        ("13.0.1", 13000, "13.0.1 is installed, but this driver needs"),
        ("13.3.0", 13020, "13.3.0 is installed"),
        ("13.4.4", 12080, "13.4.4 is installed, but this driver needs cuda-bindings>=12.8,<13"),
        ("12.9.10", 13000, "12.9.10 is installed"),  # works on a 13 driver, but not the matching major
        (None, 12080, "cuda-python is not installed"),
    ],
)
def test_bindings_problem(installed: str | None, cuda: int, problem: str | None) -> None:
    got = bindings_problem(installed, own_requirements(cuda))
    if problem is None:
        assert got is None
    else:
        assert got is not None and problem in got


def test_needs_lists_what_to_install_and_why() -> None:
    deps = {"msgpack": "msgpack>=1.0", "taskgroup": "taskgroup>=0.2; python_version < '3.11'", "pytest": "pytest>=8"}
    got = needs(
        13000,
        deps=deps,
        version_of=lambda name: "13.0.1",
        can_import=lambda module: module == "msgpack",
        python=(3, 12),
    )
    assert got.install == [*own_requirements(13000), "pytest>=8"]  # taskgroup: not on 3.12
    assert got.why[0].startswith("cuda-bindings 13.0.1 is installed") and got.why[1] == "pytest is not installed"

    nothing = needs(12080, deps=deps, version_of=lambda name: "12.9.0", can_import=lambda m: True, python=(3, 10))
    assert nothing.install == [] and nothing.why == []


def test_pip_installs_binary_wheels_into_the_target_folder(tmp_path: Path) -> None:
    argv = install.pip_argv("python3", tmp_path / "deps", ["cuda-python>=12.8,<13"])
    assert argv[:4] == ["python3", "-m", "pip", "install"]
    assert argv[argv.index("--target") + 1] == str(tmp_path / "deps")
    assert argv[argv.index("--only-binary") + 1] == ":all:"
    assert "--user" not in argv and argv[-1] == "cuda-python>=12.8,<13"


def test_the_deps_folder_is_per_python_and_cuda_major(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TIMESLICED_GPU_CHECK_DEPS", str(tmp_path))
    tag = f"py{sys.version_info[0]}{sys.version_info[1]}"
    assert install.deps_dir(12080) == tmp_path / f"{tag}-cu12"
    assert install.deps_dir(14000) == tmp_path / f"{tag}-cu13"


# --- the project's dependencies -------------------------------------------------------------


def test_the_project_dependencies_come_from_pyproject_with_or_without_tomllib() -> None:
    got = install.project_dependencies(REPO / "pyproject.toml")
    assert {"msgpack", "aiohttp", "nvidia-ml-py", "pytest", "pytest-timeout"} <= set(got)
    assert "playwright" not in got and "hypothesis" not in got and "timesliced" not in got
    assert set(got) <= set(install.IMPORT_NAMES)  # every dependency has the module to look for
    runtime, test = install._read_lists((REPO / "pyproject.toml").read_text())  # the Python 3.10 reader
    import tomllib

    data = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert runtime == data["project"]["dependencies"]
    assert test == data["project"]["optional-dependencies"]["test"]


# --- the driver ---------------------------------------------------------------------------

SMI_HEADER = """\
+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI 570.86.15              Driver Version: 570.86.15      CUDA Version: 12.8     |
|-----------------------------------------+------------------------+----------------------+
"""
SMI_LIST = "GPU 0: NVIDIA H200 (UUID: GPU-0a1b)\nGPU 1: NVIDIA H200 (UUID: GPU-2c3d)\n"


def test_nvidia_smi_is_read_for_driver_cuda_and_gpus() -> None:
    info = install.parse_nvidia_smi(SMI_HEADER, SMI_LIST)
    assert (info.driver, info.cuda_version, info.gpus, info.source) == ("570.86.15", 12080, 2, "nvidia-smi")
    assert info.to_dict()["cuda"] == "12.8"


@pytest.mark.parametrize(
    ("header", "listing", "why"),
    [("NVIDIA-SMI has failed", SMI_LIST, "CUDA version"), (SMI_HEADER, "No devices were found", "no GPU")],
)
def test_nvidia_smi_without_what_is_needed_says_so(header: str, listing: str, why: str) -> None:
    with pytest.raises(install.NoDriver, match=why):
        install.parse_nvidia_smi(header, listing)


def test_cuda_numbers() -> None:
    assert install.cuda_number("12.8") == 12080 and install.cuda_number("13") == 13000
    assert install.cuda_text(13020) == "13.2"
    with pytest.raises(ValueError):
        install.cuda_number("twelve")


def test_no_nvml_library_is_no_driver() -> None:
    with pytest.raises(install.NoDriver, match="cannot be loaded"):
        install.read_nvml("libnvidia-ml-that-does-not-exist.so.1")


# --- ensure: the install stage ----------------------------------------------------------------


@pytest.fixture
def sandbox(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """The deps folder under tmp_path; this process's import path and PYTHONPATH restored afterwards."""
    monkeypatch.setenv("TIMESLICED_GPU_CHECK_DEPS", str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(install, "project_rule", lambda: None)
    return tmp_path


def driver(cuda: int) -> install.DriverInfo:
    return install.DriverInfo("580.65.06", cuda, 1, "nvml")


class Pip:
    """A runner that records what it is asked and answers as told."""

    def __init__(self, *answers: tuple[int, str]) -> None:
        self.answers = list(answers)
        self.calls: list[list[str]] = []

    def __call__(self, argv: list[str], timeout: float) -> tuple[int, str]:
        self.calls.append(argv)
        return self.answers.pop(0)


def test_nothing_to_install_is_ok_and_runs_no_pip(sandbox: Path) -> None:
    pip = Pip()
    installed = install.installed_version("cuda-bindings")
    assert installed is not None
    got = install.ensure(driver(int(installed.split(".")[0]) * 1000), timeout=10, run=pip)
    assert got["ok"], got
    assert pip.calls == [] and got["installed"] == [] and got["cuda_bindings"] == installed


def test_a_wrong_major_is_installed_into_the_target_and_put_first(
    sandbox: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    versions = iter(["13.4.4", "12.9.10"])  # before the install, then after it
    monkeypatch.setattr(install, "installed_version", lambda name: next(versions))
    monkeypatch.setattr(install, "_shadowed", lambda expected: None)
    pip = Pip((0, "pip 26"), (0, "Successfully installed cuda-python"))
    got = install.ensure(driver(12080), timeout=10, run=pip, python="python3")
    assert got["ok"], got
    target = sandbox / f"py{sys.version_info[0]}{sys.version_info[1]}-cu12"
    assert pip.calls[0] == ["python3", "-m", "pip", "--version"]
    assert pip.calls[1] == install.pip_argv("python3", target, own_requirements(12080))
    assert got["installed"] == own_requirements(12080)
    assert sys.path[0] == str(target)
    assert install.os.environ["PYTHONPATH"] == f"{target}{install.os.pathsep}/somewhere"


def test_a_failed_pip_says_what_to_do_offline(sandbox: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(install, "installed_version", lambda name: "13.0.1")
    pip = Pip((0, "pip 26"), (1, "ERROR: Could not find a version (from versions: none)"))
    got = install.ensure(driver(13000), timeout=10, run=pip)
    assert not got["ok"]
    assert "pip could not install cuda-python>=13.0" in got["error"] and "PIP_FIND_LINKS" in got["error"]
    assert "Could not find a version" in got["error"]


def test_no_pip_says_how_to_get_one(sandbox: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(install, "installed_version", lambda name: None)
    got = install.ensure(driver(13000), timeout=10, run=Pip((1, "No module named pip")))
    assert not got["ok"]
    assert "has no pip (No module named pip)" in got["error"] and "python3-pip" in got["error"]


def test_no_install_reports_what_lacks(sandbox: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(install, "installed_version", lambda name: "13.3.0")
    pip = Pip()
    got = install.ensure(driver(13020), timeout=10, run=pip, allow_install=False)
    assert not got["ok"] and pip.calls == []
    assert "13.3.0 is installed" in got["error"] and "--no-install" in got["error"]


def test_an_install_that_does_not_take_is_an_error(sandbox: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(install, "installed_version", lambda name: "13.0.0")  # before and after
    got = install.ensure(driver(13000), timeout=10, run=Pip((0, ""), (0, "")))
    assert not got["ok"] and "13.0.0 is installed" in got["error"]
