"""The package's layers, read from its source (ast): every import must go the allowed way.

The table is the one in docs/architecture.md ("Layers"). Imports under ``if TYPE_CHECKING:`` load
nothing and are not counted; imports inside functions are (they load when called).
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2] / "timesliced"

# layer -> the module prefixes it holds (longest prefix wins)
LAYERS: dict[str, tuple[str, ...]] = {
    "foundation": ("errors", "version", "env", "util", "wire"),
    "core": ("core",),
    "sim": ("sim",),
    "client": ("client", ""),  # "": the package root, which re-exports the client
    "backends": ("backends", "nvml"),
    "cluster": ("cluster",),
    "observation": ("telemetry", "metrics", "dashboard"),
    "daemon": ("daemon", "config"),
    "apps": ("cli", "bench", "__main__", "docs_reference"),
}
# layer -> the layers it may import (besides itself)
ALLOWED: dict[str, set[str]] = {
    "foundation": set(),
    "core": {"foundation"},
    "sim": {"foundation"},
    "client": {"foundation", "sim"},
    "backends": {"foundation", "sim"},
    "cluster": {"foundation", "core"},
    "observation": {"foundation", "core", "backends"},
    "daemon": {"foundation", "core", "sim", "backends", "cluster", "observation"},
    "apps": {"foundation", "core", "sim", "client", "backends", "cluster", "observation", "daemon"},
}
# Pure cores: no I/O, no clock, no threads, and nothing that is not pure itself.
PURE = ("core", "wire", "errors", "version", "util.stats", "util.parse", "cluster", "client.session", "client.codec")
IMPURE_IN_PURE_PACKAGES = ("cluster.transport", "cluster.discovery")  # the cluster's asyncio shells
FORBIDDEN_IN_PURE = {
    "asyncio",
    "socket",
    "threading",
    "subprocess",
    "time",
    "os",
    "logging",
    "selectors",
    "signal",
    "multiprocessing",
    "concurrent",
    "aiohttp",
    "secrets",  # entropy is the shell's to draw (a pure core takes a random.Random it is given)
}
# What ``import timesliced`` may load: the client and the wire, and the foundation they stand on.
ROOT_LOADS = ("", "client", "wire", "errors", "version", "env", "util.parse")


@dataclass(frozen=True)
class Edge:
    source: str  # module, relative to the package ("" is the package itself)
    target: str  # a module of the package (relative) or a top-level outside module name
    line: int
    inside: bool  # the target is in the package
    top_level: bool  # at module level (loaded with the module), not inside a function


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = modules()


def is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports(module: str, text: str | None = None) -> Iterator[Edge]:
    """The imports of ``module`` (its source, or ``text`` in its place)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]

    def inside(name: str) -> str | None:
        """``name`` relative to the package, or None when it is outside it."""
        if name == "timesliced":
            return ""
        return name[len("timesliced.") :] if name.startswith("timesliced.") else None

    def visit(node: ast.AST, top: bool) -> Iterator[Edge]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and is_type_checking(child):
                for other in child.orelse:
                    yield from visit(other, top)
                continue
            if isinstance(child, ast.Import):
                for alias in child.names:
                    rel = inside(alias.name)
                    target = rel if rel is not None else alias.name.split(".")[0]
                    yield Edge(module, target, child.lineno, rel is not None, top)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".") if package else []
                    base = base[: len(base) - (child.level - 1)] if child.level > 1 else base
                    rel: str | None = ".".join([*base, *([child.module] if child.module else [])])
                else:
                    rel = inside(child.module or "")
                if rel is None:
                    yield Edge(module, (child.module or "").split(".")[0], child.lineno, False, top)
                    continue
                for alias in child.names:  # ``from pkg import mod`` imports the module pkg.mod
                    sub = f"{rel}.{alias.name}" if rel else alias.name
                    yield Edge(module, sub if sub in MODULES else rel, child.lineno, True, top)
            else:
                nested = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                yield from visit(child, top and not nested)

    yield from visit(ast.parse(path.read_text() if text is None else text, str(path)), True)


def owner(module: str, table: dict[str, tuple[str, ...]]) -> str | None:
    """The entry whose prefix is the longest that ``module`` falls under."""
    best: tuple[int, str] | None = None
    for name, prefixes in table.items():
        for prefix in prefixes:
            inside = module == prefix or (prefix and module.startswith(prefix + "."))
            if inside and (best is None or len(prefix) > best[0]):
                best = (len(prefix), name)
    return best[1] if best else None


def layer_of(module: str) -> str:
    layer = owner(module, LAYERS)
    assert layer is not None, f"timesliced.{module} is in no layer: add it to LAYERS here and in docs/architecture.md"
    return layer


def is_pure(module: str) -> bool:
    if any(module == m or module.startswith(m + ".") for m in IMPURE_IN_PURE_PACKAGES):
        return False
    return any(module == p or module.startswith(p + ".") for p in PURE)


def shown(edge: Edge) -> str:
    return f"timesliced/{MODULES[edge.source].relative_to(ROOT)}:{edge.line}: imports {edge.target or 'timesliced'}"


ALL_EDGES = [edge for module in MODULES for edge in imports(module)]


def test_every_module_is_in_a_layer() -> None:
    for module in MODULES:
        layer_of(module)


def test_every_package_ships_in_the_wheel() -> None:
    """pyproject.toml lists the packages one by one (web/ and static/ are mapped into the package)."""
    listed = set(tomllib.loads((ROOT.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    packages = {"timesliced" + (f".{m}" if m else "") for m, path in MODULES.items() if path.name == "__init__.py"}
    assert packages - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"


def test_imports_go_the_allowed_way() -> None:
    wrong = [
        f"{shown(e)} ({layer_of(e.source)} may not import {layer_of(e.target)})"
        for e in ALL_EDGES
        if e.inside
        and layer_of(e.target) != layer_of(e.source)
        and layer_of(e.target) not in ALLOWED[layer_of(e.source)]
    ]
    assert not wrong, "\n".join(wrong)


def test_pure_cores_do_no_io_and_import_only_pure_modules() -> None:
    wrong = []
    for e in ALL_EDGES:
        if not is_pure(e.source):
            continue
        if not e.inside and e.target in FORBIDDEN_IN_PURE:
            wrong.append(f"{shown(e)} (a pure core does no I/O, keeps no clock and starts no thread)")
        elif e.inside and e.target and not is_pure(e.target):
            wrong.append(f"{shown(e)} (not a pure module)")
    assert not wrong, "\n".join(wrong)


def test_pure_cores_draw_no_random_numbers_of_their_own() -> None:
    """``random`` may name the type of an ``rng`` a core is given; its module-level functions are global state."""
    wrong = []
    for module, path in MODULES.items():
        if not is_pure(module):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            named = isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "random"
            if named and node.attr != "Random":  # type: ignore[attr-defined]
                wrong.append(f"timesliced/{path.relative_to(ROOT)}:{node.lineno}: random.{node.attr}")
    assert not wrong, "\n".join(wrong)


def test_import_timesliced_loads_only_the_client_and_the_wire() -> None:
    loaded, todo = set(), [""]
    while todo:
        module = todo.pop()
        if module in loaded:
            continue
        loaded.add(module)
        todo += [e.target for e in imports(module) if e.inside and e.top_level]
        parent = module.rpartition(".")[0]
        if module and parent not in loaded:
            todo.append(parent)  # importing a submodule runs its package's __init__ first
    parents = {m.rpartition(".")[0] for m in ROOT_LOADS}  # a package whose module may load runs its __init__
    extra = sorted(m for m in loaded if owner(m, {"ok": ROOT_LOADS}) is None and m not in parents)
    assert not extra, f"import timesliced loads {extra}: import them lazily (see timesliced/__init__.py)"


# --- the checker itself can fail ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("from ..daemon.root import Daemon\n", ["daemon.root"]),
        ("from timesliced.core import scheduler\n", ["core.scheduler"]),
        ("from .. import errors\n", ["errors"]),
        ("from . import protocol\n", ["client.protocol"]),
        ("import timesliced.cluster.node as n\n", ["cluster.node"]),
        ("if TYPE_CHECKING:\n    from ..daemon.root import Daemon\n", []),
        ("def f():\n    from ..sim.region import SimRegion\n", ["sim.region"]),
    ],
)
def test_the_walker_resolves_imports(source: str, expected: list[str]) -> None:
    assert [e.target for e in imports("client.sync", source) if e.inside] == expected


def test_the_walker_sees_a_wrong_import() -> None:
    """What the layer test would refuse, shown on sources written for it."""
    edges = list(imports("client.sync", "import time\nfrom ..daemon.root import Daemon\n"))
    assert [layer_of(e.target) for e in edges if e.inside] == ["daemon"] and "daemon" not in ALLOWED["client"]
    pure = list(imports("core.scheduler", "import time\nfrom ..daemon import journal\n"))
    assert [e.target for e in pure] == ["time", "daemon.journal"]
    assert is_pure("core.scheduler") and not is_pure("daemon.journal") and "time" in FORBIDDEN_IN_PURE
