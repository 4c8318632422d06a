"""What the GPU check needs installed, and installing it: the standard library only.

::

    python3 tests/gpu/install.py                 # install what is missing; one JSON object
    python3 tests/gpu/install.py --requirement   # the cuda-python requirement for this driver
    python3 tests/gpu/install.py --for-cuda 12.8 # the same for a given CUDA version

Runs before anything else of the check, on a machine where only ``python3``
may exist: no ``python`` alias, no ``pip`` script, no virtualenv.

- **The driver's CUDA version** comes from NVML through ``ctypes``
  (``libnvidia-ml.so.1``: ``nvmlSystemGetCudaDriverVersion_v2``, which returns
  what ``cuDriverGetVersion`` would, then ``nvmlSystemGetCudaDriverVersion``),
  and from ``nvidia-smi``'s header ("CUDA Version: 12.8") when NVML cannot say.
  NVML encodes it as ``1000 * major + 10 * minor`` (``NVML_CUDA_DRIVER_VERSION_MAJOR(v) = v / 1000``).
- **cuda-python** must be of the major version the driver supports: the driver
  API is backward compatible, so bindings of an older major work on a newer
  driver, but bindings built for a newer major than the driver's do not start.
  The checkpoint API needs 12.8 or newer. Releases 13.0.0, 13.0.1 and 13.3.0
  lack ``CUcheckpointRestoreArgs`` or usable checkpoint support and are
  excluded, for ``cuda-python`` and for the ``cuda-bindings`` it pulls in.
  Where ``timesliced.backends.cuda_driver`` offers such a rule itself
  (``bindings_requirement(cuda_driver_version)``), that one is used.
- **Where it installs:** ``python3 -m pip install --target DIR`` into a folder of
  the check's own (``tests/gpu/.deps/py3X-cuN``, or ``$TIMESLICED_GPU_CHECK_DEPS``),
  put first on ``PYTHONPATH``. A target folder needs no virtualenv module,
  leaves the system's and the user's site-packages alone, is not refused by a
  distribution's "externally managed" marker (PEP 668; pip checks it only for
  installs into the environment itself), and wins over an installed cuda-python
  of the wrong major. Only binary wheels, so that no build eats the time budget.
  Without network, set pip's own ``PIP_FIND_LINKS`` / ``PIP_NO_INDEX`` to a
  wheel folder.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import importlib.metadata
import importlib.util
import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]

MIN_CUDA = 12080  # the checkpoint driver API arrived with CUDA 12.8 (driver r570)
NEWEST_MAJOR = 13  # the newest cuda-python major known; a newer driver runs it (backward compatible)
KNOWN_BAD = ("13.0.0", "13.0.1", "13.3.0")  # no CUcheckpointRestoreArgs, or no usable checkpoint support
CUDA_DISTRIBUTIONS = ("cuda-python", "cuda-bindings")
# The rule of timesliced.backends.cuda_driver (bindings_requirement: cuda_driver_version -> requirement).
HELPER_NAMES = ("bindings_requirement", "cuda_python_requirement", "pip_requirement")

# What the check imports, by distribution: the package's own dependencies, and the test tools
# of its ``test`` extra that tests/gpu uses (the browser and property-testing tools it does not).
IMPORT_NAMES = {
    "msgpack": "msgpack",
    "aiohttp": "aiohttp",
    "nvidia-ml-py": "pynvml",
    "jinja2": "jinja2",
    "prometheus-client": "prometheus_client",
    "taskgroup": "taskgroup",
    "tomli": "tomli",
    "pytest": "pytest",
    "pytest-timeout": "pytest_timeout",
}
TEST_TOOLS = ("pytest", "pytest-timeout")
PIP_TIMEOUT_S = 10  # pip's own per-connection timeout: an unreachable index must not eat the budget


class NoDriver(Exception):
    """No usable NVIDIA driver: the message says why."""


# --- versions and requirements (pure) ---------------------------------------------------


def cuda_text(version: int) -> str:
    """12080 -> "12.8"."""
    return f"{version // 1000}.{version % 1000 // 10}"


def cuda_number(text: str) -> int:
    """ "12.8" -> 12080; raises ``ValueError`` for anything else."""
    m = re.fullmatch(r"\s*(\d+)(?:\.(\d+))?\s*", text)
    if not m:
        raise ValueError(f"not a CUDA version: {text!r} (expected e.g. 12.8)")
    return int(m.group(1)) * 1000 + int(m.group(2) or 0) * 10


def own_requirements(cuda_version: int) -> list[str]:
    """The ``cuda-python`` and ``cuda-bindings`` requirements for a driver that supports ``cuda_version``.

    Raises ``ValueError`` for a driver older than CUDA 12 (no cuda-python of
    ours supports it).
    """
    major = cuda_version // 1000
    if major < 12:
        raise ValueError(
            f"the NVIDIA driver supports CUDA {cuda_text(cuda_version)}; the check needs CUDA 12.8 or newer "
            "(driver 570 or newer): upgrade the driver"
        )
    major = min(major, NEWEST_MAJOR)
    if major == 12:
        spec = ">=12.8,<13"
    else:
        bad = [v for v in KNOWN_BAD if int(v.split(".")[0]) == major]
        spec = ",".join([f">={major}.0", f"<{major + 1}", *(f"!={v}" for v in bad)])
    return [f"{name}{spec}" for name in CUDA_DISTRIBUTIONS]


def project_rule() -> Callable[[int], Any] | None:
    """The project's own rule, where ``timesliced.backends.cuda_driver`` has one (and imports)."""
    try:
        module = importlib.import_module("timesliced.backends.cuda_driver")
    except Exception:
        return None  # not importable yet (its dependencies are what this installs)
    for name in HELPER_NAMES:
        fn = getattr(module, name, None)
        if callable(fn):
            return fn  # type: ignore[no-any-return]
    return None


def cuda_requirements(cuda_version: int, rule: Callable[[int], Any] | None = None) -> tuple[list[str], str]:
    """(requirements, where they came from): the project's rule when given and usable, else :func:`own_requirements`.

    The project's rule may return one requirement or several; a cuda-bindings
    requirement is added from ours when it names only cuda-python, so the
    known-bad bindings stay out either way. Raises ``ValueError`` as
    :func:`own_requirements` does.
    """
    ours = own_requirements(cuda_version)
    if rule is None:
        return ours, "tests/gpu/install.py"
    try:
        got = rule(cuda_version)
    except Exception as exc:
        return ours, f"tests/gpu/install.py (the project's rule failed: {type(exc).__name__}: {exc})"
    theirs = [got] if isinstance(got, str) else [str(r) for r in got]
    names = {parse_requirement(r)[0] for r in theirs}
    if not theirs or not names & set(CUDA_DISTRIBUTIONS):
        return ours, f"tests/gpu/install.py (the project's rule returned {got!r})"
    theirs += [r for r in ours if parse_requirement(r)[0] not in names]
    return theirs, "timesliced.backends.cuda_driver"


_REQ = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*([^;]*?)\s*(?:;(.*))?$")
_CLAUSE = re.compile(r"^\s*(~=|==|!=|<=|>=|<|>)\s*([0-9][0-9A-Za-z.*+!-]*)\s*$")


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_requirement(text: str) -> tuple[str, list[tuple[str, str]], str]:
    """(normalized name, [(operator, version)], marker) of a requirement such as ``cuda-python>=13,<14,!=13.0.0``.

    Raises ``ValueError`` for what this small parser does not read (URLs, ``===``).
    """
    m = _REQ.match(text)
    if not m:
        raise ValueError(f"cannot read the requirement {text!r}")
    clauses: list[tuple[str, str]] = []
    for part in filter(None, (p.strip() for p in m.group(3).split(","))):
        c = _CLAUSE.match(part)
        if not c:
            raise ValueError(f"cannot read {part!r} in the requirement {text!r}")
        clauses.append((c.group(1), c.group(2)))
    return normalize(m.group(1)), clauses, (m.group(4) or "").strip()


def version_key(text: str) -> tuple[tuple[int, ...], int]:
    """(release numbers, post-release number or -1) of a version such as ``13.0.1`` or ``12.6.2.post1``.

    Pre- and dev-release tags are dropped (none of the versions this check meets has them).
    """
    m = re.match(r"^\s*v?(\d+(?:\.\d+)*)(?:[.-]?post(\d+))?", text)
    if not m:
        raise ValueError(f"not a version: {text!r}")
    release = tuple(int(x) for x in m.group(1).split("."))
    return release, int(m.group(2)) if m.group(2) is not None else -1


def _padded(a: tuple[int, ...], n: int) -> tuple[int, ...]:
    return a + (0,) * (n - len(a))


def _compare(version: str, other: str) -> int:
    (r1, p1), (r2, p2) = version_key(version), version_key(other)
    n = max(len(r1), len(r2))
    a, b = (_padded(r1, n), p1), (_padded(r2, n), p2)
    return (a > b) - (a < b)


def allows(clauses: Iterable[tuple[str, str]], version: str) -> bool:
    """Whether ``version`` meets every clause (PEP 440 operators, for plain release versions)."""
    for op, want in clauses:
        if want.endswith(".*"):
            prefix = version_key(want[:-2])[0]
            same = version_key(version)[0][: len(prefix)] == prefix
            if (op == "==" and not same) or (op == "!=" and same):
                return False
            continue
        c = _compare(version, want)
        if op == "~=":
            release = version_key(want)[0]
            prefix = release[:-1] if len(release) > 1 else release
            if c < 0 or version_key(version)[0][: len(prefix)] != prefix:
                return False
        elif not {"==": c == 0, "!=": c != 0, "<": c < 0, "<=": c <= 0, ">": c > 0, ">=": c >= 0}[op]:
            return False
    return True


def marker_applies(marker: str, python: Sequence[int] = sys.version_info[:2]) -> bool:
    """Whether an environment marker holds here; only ``python_version`` is read, anything else counts as true."""
    if not marker:
        return True
    m = re.fullmatch(r"\s*python_version\s*(<|<=|>|>=|==|!=)\s*['\"]([\d.]+)['\"]\s*", marker)
    if not m:
        return True
    here = ".".join(str(x) for x in python[:2])
    return allows([(m.group(1), m.group(2))], here)


def bindings_problem(installed: str | None, requirements: Sequence[str]) -> str | None:
    """Why the installed cuda-bindings ``installed`` (None: not installed) does not do; None when it does."""
    clauses = [c for r in requirements for c in _clauses_for(r, "cuda-bindings")]
    wanted = ", ".join(r for r in requirements if parse_requirement(r)[0] == "cuda-bindings") or "cuda-bindings"
    if installed is None:
        return f"cuda-python is not installed (needs {wanted})"
    try:
        ok = allows(clauses, installed)
    except ValueError:
        ok = False
    if not ok:
        return f"cuda-bindings {installed} is installed, but this driver needs {wanted}"
    return None


def _clauses_for(requirement: str, name: str) -> list[tuple[str, str]]:
    got, clauses, _ = parse_requirement(requirement)
    # cuda-python X.Y.Z pins cuda-bindings ~= X.Y.Z: its version rule is the bindings' rule too.
    return clauses if got in (name, "cuda-python") else []


# --- the project's own dependencies ------------------------------------------------------


def project_dependencies(pyproject: Path = REPO / "pyproject.toml") -> dict[str, str]:
    """Normalized name -> requirement, for the package's dependencies and the test tools tests/gpu uses."""
    text = pyproject.read_text()
    try:
        import tomllib
    except ImportError:  # Python 3.10
        runtime, test = _read_lists(text)
    else:
        data = tomllib.loads(text)
        runtime = list(data["project"]["dependencies"])
        test = list(data["project"]["optional-dependencies"].get("test", []))
    out: dict[str, str] = {}
    for req in runtime:
        out[parse_requirement(req)[0]] = req
    for req in test:
        name = parse_requirement(req)[0]
        if name in TEST_TOOLS:
            out[name] = req
    return out


def _read_lists(text: str) -> tuple[list[str], list[str]]:
    """The ``dependencies`` and ``test`` arrays of pyproject.toml, without a TOML parser (Python 3.10)."""

    def array(key: str) -> list[str]:
        m = re.search(rf"(?m)^{re.escape(key)}\s*=\s*\[(.*?)\]\s*$", text, re.S)
        return re.findall(r"\"([^\"]*)\"", m.group(1)) if m else []

    return array("dependencies"), array("test")


# --- the driver ---------------------------------------------------------------------------


@dataclass(frozen=True)
class DriverInfo:
    """What NVML (or nvidia-smi) says about the driver."""

    driver: str  # e.g. "570.86.15"
    cuda_version: int  # e.g. 12080
    gpus: int
    source: str  # "nvml" or "nvidia-smi"

    def to_dict(self) -> dict[str, Any]:
        return {"driver": self.driver, "cuda": cuda_text(self.cuda_version), "gpus": self.gpus, "source": self.source}


def _with_timeout(fn: Callable[[], Any], timeout: float, what: str) -> Any:
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=target, name=what, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise NoDriver(f"{what} did not return within {timeout:.0f}s (a hung driver?)")
    if "error" in box:
        raise box["error"]
    return box["value"]


def read_nvml(library: str = "libnvidia-ml.so.1") -> DriverInfo:
    """Driver version, CUDA version and GPU count through NVML's C API; raises :class:`NoDriver`."""
    try:
        lib = ctypes.CDLL(library)
    except OSError as exc:
        raise NoDriver(f"the NVIDIA driver's NVML library ({library}) cannot be loaded: {exc}") from None
    lib.nvmlErrorString.restype = ctypes.c_char_p

    def why(ret: int) -> str:
        text = lib.nvmlErrorString(ret)
        return f"{text.decode(errors='replace') if text else 'error'} (NVML return {ret})"

    ret = lib.nvmlInit_v2()
    if ret != 0:
        raise NoDriver(f"nvmlInit failed: {why(ret)}")
    try:
        buf = ctypes.create_string_buffer(80)  # NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE
        ret = lib.nvmlSystemGetDriverVersion(buf, ctypes.c_uint(len(buf)))
        driver = buf.value.decode(errors="replace") if ret == 0 else ""
        cuda = ctypes.c_int(0)
        for name in ("nvmlSystemGetCudaDriverVersion_v2", "nvmlSystemGetCudaDriverVersion"):
            if hasattr(lib, name) and getattr(lib, name)(ctypes.byref(cuda)) == 0 and cuda.value > 0:
                break
        count = ctypes.c_uint(0)
        ret = lib.nvmlDeviceGetCount_v2(ctypes.byref(count))
        if ret != 0:
            raise NoDriver(f"nvmlDeviceGetCount failed: {why(ret)}")
    finally:
        lib.nvmlShutdown()
    if count.value < 1:
        raise NoDriver("NVML lists no GPU")
    return DriverInfo(driver, int(cuda.value), int(count.value), "nvml")


def parse_nvidia_smi(header: str, listing: str) -> DriverInfo:
    """Driver and CUDA version from ``nvidia-smi``'s header, GPUs from ``nvidia-smi -L``; raises :class:`NoDriver`."""
    driver = re.search(r"Driver Version:\s*([\d.]+)", header)
    cuda = re.search(r"CUDA Version:\s*(\d+\.\d+)", header)
    if not cuda:
        raise NoDriver("nvidia-smi does not report a CUDA version")
    gpus = sum(1 for line in listing.splitlines() if re.match(r"^GPU \d+:", line))
    if gpus < 1:
        raise NoDriver("nvidia-smi lists no GPU")
    return DriverInfo(driver.group(1) if driver else "", cuda_number(cuda.group(1)), gpus, "nvidia-smi")


def read_nvidia_smi(timeout: float = 15.0) -> DriverInfo:
    def run(*args: str) -> str:
        try:
            out = subprocess.run(
                ["nvidia-smi", *args], capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
            )
        except FileNotFoundError:
            raise NoDriver("nvidia-smi is not installed") from None
        except subprocess.TimeoutExpired:
            raise NoDriver(f"nvidia-smi did not answer within {timeout:.0f}s") from None
        if out.returncode != 0:
            raise NoDriver(f"nvidia-smi failed ({out.returncode}): {(out.stdout + out.stderr).strip()[:300]}")
        return out.stdout

    return parse_nvidia_smi(run(), run("-L"))


def read_driver(timeout: float = 15.0) -> DriverInfo:
    """The driver as NVML reports it (nvidia-smi where NVML cannot tell the CUDA version); raises :class:`NoDriver`."""
    try:
        info: DriverInfo = _with_timeout(read_nvml, timeout, "NVML (nvmlInit)")
    except NoDriver as exc:
        first = str(exc)
        try:
            return read_nvidia_smi(timeout)
        except NoDriver as second:
            raise NoDriver(f"{first}; {second}") from None
    if info.cuda_version > 0:
        return info
    try:
        fallback = read_nvidia_smi(timeout)
    except NoDriver as exc:
        raise NoDriver(f"NVML does not report the driver's CUDA version, and {exc}") from None
    return DriverInfo(info.driver or fallback.driver, fallback.cuda_version, info.gpus, "nvml+nvidia-smi")


# --- what is missing, and installing it ----------------------------------------------------


def deps_dir(cuda_version: int) -> Path:
    """The check's own package folder for this Python and CUDA major."""
    base = os.environ.get("TIMESLICED_GPU_CHECK_DEPS")
    root = Path(base) if base else REPO / "tests" / "gpu" / ".deps"
    return root / f"py{sys.version_info[0]}{sys.version_info[1]}-cu{min(cuda_version // 1000, NEWEST_MAJOR)}"


def activate(target: Path) -> None:
    """Put ``target`` first on this process's import path and on ``PYTHONPATH`` for its children."""
    text = str(target)
    if text not in sys.path:
        sys.path.insert(0, text)
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != text]
    os.environ["PYTHONPATH"] = os.pathsep.join([text, *parts])
    importlib.invalidate_caches()


def installed_version(distribution: str) -> str | None:
    """The version of ``distribution`` first on the import path, or None."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


@dataclass
class Needs:
    """What to install and why (empty ``install``: nothing)."""

    cuda: list[str]
    cuda_source: str
    install: list[str] = field(default_factory=list)
    why: list[str] = field(default_factory=list)


def needs(
    cuda_version: int,
    *,
    deps: dict[str, str],
    version_of: Callable[[str], str | None] | None = None,
    can_import: Callable[[str], bool] | None = None,
    rule: Callable[[int], Any] | None = None,
    python: Sequence[int] = sys.version_info[:2],
) -> Needs:
    """What the check lacks here for a driver of ``cuda_version``; raises ``ValueError`` for a driver too old."""
    version_of = version_of or installed_version
    can_import = can_import or importable
    cuda, source = cuda_requirements(cuda_version, rule)
    out = Needs(cuda, source)
    problem = bindings_problem(version_of("cuda-bindings"), cuda)
    if problem is not None:
        out.install += cuda
        out.why.append(problem)
    for name, req in deps.items():
        module = IMPORT_NAMES.get(name)
        if module is None or not marker_applies(parse_requirement(req)[2], python):
            continue
        if not can_import(module):
            out.install.append(req)
            out.why.append(f"{name} is not installed")
    return out


def pip_argv(python: str, target: Path, requirements: Sequence[str]) -> list[str]:
    """``python -m pip install`` of ``requirements`` into ``target``; pip's own PIP_* settings (index, wheels) apply."""
    return [
        python,
        "-m",
        "pip",
        "install",
        "--target",
        str(target),
        "--upgrade",
        "--no-input",
        "--disable-pip-version-check",
        "--only-binary",
        ":all:",
        "--retries",
        "1",
        "--timeout",
        str(PIP_TIMEOUT_S),
        "--progress-bar",
        "off",
        *requirements,
    ]


Runner = Callable[[list[str], float], "tuple[int, str]"]  # (argv, timeout) -> (exit status, output)


def run_plain(argv: list[str], timeout: float) -> tuple[int, str]:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return 124, f"timed out after {timeout:.0f}s"
    return out.returncode, out.stdout + out.stderr


def ensure(
    driver: DriverInfo,
    *,
    timeout: float,
    run: Runner = run_plain,
    allow_install: bool = True,
    python: str = sys.executable,
) -> dict[str, Any]:
    """Make everything the check imports importable here (and in children, through ``PYTHONPATH``).

    Returns the install stage's report: ``ok``, ``error``, the ``cuda_python``
    requirement and where the rule came from, what was ``installed`` and why,
    the ``target`` folder and the cuda-bindings version found afterwards.
    """
    target = deps_dir(driver.cuda_version)
    if target.is_dir():
        activate(target)  # an earlier run's packages count as installed
    report: dict[str, Any] = {"ok": False, "error": None, "driver": driver.to_dict(), "target": str(target)}
    deps = project_dependencies()
    try:
        plan = needs(driver.cuda_version, deps=deps, rule=project_rule())
    except ValueError as exc:
        report["error"] = str(exc)
        return report
    report.update(cuda_python=plan.cuda, rule=plan.cuda_source, installed=[], why=plan.why)
    if plan.install:
        if not allow_install:
            report["error"] = "; ".join(plan.why) + f": install them ({' '.join(plan.install)}) or drop --no-install"
            return report
        rc, out = run([python, "-m", "pip", "--version"], min(timeout, 30.0))
        if rc != 0:
            report["error"] = (
                f"{'; '.join(plan.why)}, and {python} has no pip ({_last_line(out)}): install pip "
                "(apt-get install python3-pip) or these packages: " + " ".join(plan.install)
            )
            return report
        target.mkdir(parents=True, exist_ok=True)
        rc, out = run(pip_argv(python, target, plan.install), timeout)
        if rc != 0:
            tail = "\n".join(out.strip().splitlines()[-6:])
            report["error"] = (
                f"pip could not install {' '.join(plan.install)} into {target} (exit status {rc}): {tail}. "
                "Without network, point PIP_FIND_LINKS (with PIP_NO_INDEX=1) at a folder of wheels"
            )
            return report
        activate(target)
        report["installed"] = plan.install
    found = installed_version("cuda-bindings")
    report["cuda_bindings"] = found
    problem = bindings_problem(found, plan.cuda)
    if problem is None:
        problem = _shadowed(found)
    if problem is not None:
        report["error"] = problem
        return report
    missing = [
        name
        for name, req in deps.items()
        if name in IMPORT_NAMES and marker_applies(parse_requirement(req)[2]) and not importable(IMPORT_NAMES[name])
    ]
    if missing:
        report["error"] = f"still not importable after the install: {', '.join(missing)}"
        return report
    report["ok"] = True
    return report


def _shadowed(expected: str | None) -> str | None:
    """Why ``import cuda.bindings`` would not load the version the metadata names (None: it does)."""
    try:
        module = importlib.import_module("cuda.bindings")
    except Exception as exc:
        return f"cuda.bindings does not import: {type(exc).__name__}: {exc}"
    got = getattr(module, "__version__", None)
    if expected and got and version_key(got)[0][:2] != version_key(expected)[0][:2]:
        return (
            f"import cuda.bindings loads {got} from {getattr(module, '__file__', '?')}, not {expected}: "
            "an old cuda-python with a cuda/__init__.py shadows it; uninstall that one"
        )
    return None


def _last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else "no output"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Install what the timesliced GPU check needs (see tests/gpu/README.md).")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--requirement", action="store_true", help="print the cuda-python requirements for this driver")
    g.add_argument("--for-cuda", metavar="X.Y", help="print the cuda-python requirements for CUDA X.Y")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds for pip at most (default 120)")
    args = p.parse_args(argv)
    try:
        if args.for_cuda:
            version = cuda_number(args.for_cuda)
        else:
            driver = read_driver()
            version = driver.cuda_version
        if args.for_cuda or args.requirement:
            print("\n".join(cuda_requirements(version, project_rule())[0]))
            return 0
    except (NoDriver, ValueError) as exc:
        print(json.dumps({"ok": False, "error": str(exc)}))
        return 2
    report = ensure(driver, timeout=args.timeout)
    print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
