"""Module layers: the tools sit on top of the core, and no stealer modules import in a circle.

The tools are the command line and what it runs (cli, top, tune, prometheus, bench/, and
``python -m stealer``); the optional integrations (stealer.joblib: it imports joblib,
stealer.cluster: it imports Ray, stealer.gym: it imports gymnasium, none of which the core
depends on) sit on top too.  Every other module under stealer/ is the core, the
package's own ``__init__`` included.  The core never imports a tool or an integration, not
even lazily inside a function, with one exception (``FACADE``): ``Executor(cluster=...)``
imports the cluster integration lazily, inside ``Executor.__new__``, and only when asked;
the cluster integration in turn never imports the local executor (it is handed the class),
so no circle closes through it.

Read statically with :mod:`ast`, so every import statement counts wherever it stands (module
level, inside functions, methods, ``try`` or ``if``), and so do ``importlib.import_module`` /
``__import__`` calls with a literal name.  ``from stealer import x`` is an edge to the
submodule ``stealer.x`` when there is one, else to the package.  Imports under
``if TYPE_CHECKING:`` count for the layers (a type checker still follows them) but not for
cycles (they never run).  The implicit import of a parent package (``stealer/__init__`` before
any ``stealer.x``) is not an edge: every submodule would otherwise close a circle through it.
"""

from __future__ import annotations

import ast
import itertools
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = "stealer"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE

#: The tools layer: these modules and everything below them.
TOOLS = ("stealer.cli", "stealer.top", "stealer.tune", "stealer.prometheus", "stealer.bench",
         "stealer.dashboard", "stealer.__main__")
#: Optional integrations with third-party packages (extras): leaves on top of the core.
INTEGRATIONS = ("stealer.joblib", "stealer.cluster", "stealer.gym")
#: The one way from the core to an integration: the facade's lazy import of the cluster
#: executor (``Executor(cluster=...)``), inside a function only.
FACADE = {("stealer.client.executor", "stealer.cluster.client")}


def is_tool(module: str) -> bool:
    """A tool or an integration: something the core must never import."""
    return any(module == t or module.startswith(t + ".") for t in TOOLS + INTEGRATIONS)


@dataclass(frozen=True)
class Edge:
    src: str
    dst: str
    line: int
    type_only: bool  # under `if TYPE_CHECKING:`
    lazy: bool = False  # inside a function or method: runs only when that is called


def module_files(root: Path) -> dict[str, Path]:
    """Dotted name -> source file of every Python module in the package at ``root``."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _bound_names(tree: ast.Module) -> set[str]:
    """Names a package's ``__init__`` binds at top level (what ``from pkg import x`` may get)."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
    return names


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


class _Imports(ast.NodeVisitor):
    """Every import in one module, resolved to names of modules of the package."""

    def __init__(self, name: str, is_package: bool, modules: set[str],
                 bound: dict[str, set[str]]) -> None:
        self.name = name
        self.package = name if is_package else name.rpartition(".")[0]
        self.modules = modules
        self.bound = bound
        self.type_only = False
        self.depth = 0  # functions we are inside
        self.edges: list[Edge] = []

    def _add(self, target: str, node: ast.AST) -> None:
        if target == PACKAGE or target.startswith(PACKAGE + "."):
            self.edges.append(Edge(self.name, target, node.lineno, self.type_only,
                                   self.depth > 0))

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_AsyncFunctionDef = visit_FunctionDef

    def _from(self, base: str, names: list[str], node: ast.AST) -> None:
        for n in names:
            sub = f"{base}.{n}"
            if sub in self.modules:
                self._add(sub, node)
            elif base in self.bound and n != "*" and n not in self.bound[base]:
                self._add(sub, node)  # a submodule without Python source (stealer._cqueues)
            else:
                self._add(base, node)  # a name the module (or package) defines

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node.test):
            before, self.type_only = self.type_only, True
            for stmt in node.body:
                self.visit(stmt)
            self.type_only = before
            for stmt in node.orelse:
                self.visit(stmt)
        else:
            self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            self._add(a.name, node)  # binds the first name, runs the whole dotted one

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            base = self.package.split(".")
            base = base[: len(base) - (node.level - 1)]
            module = ".".join(base + ([node.module] if node.module else []))
        else:
            module = node.module or ""
        self._from(module, [a.name for a in node.names], node)

    def visit_Call(self, node: ast.Call) -> None:
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
        if (name in ("import_module", "__import__") and node.args
                and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            self._add(node.args[0].value, node)
        self.generic_visit(node)


def import_edges(root: Path) -> tuple[set[str], list[Edge]]:
    """The modules of the package at ``root`` and every import among them."""
    files = module_files(root)
    trees = {name: ast.parse(path.read_text(), str(path)) for name, path in files.items()}
    packages = {name for name, path in files.items() if path.name == "__init__.py"}
    bound = {name: _bound_names(trees[name]) for name in packages}
    edges = []
    for name, tree in trees.items():
        v = _Imports(name, name in packages, set(files), bound)
        v.visit(tree)
        edges += dict.fromkeys(v.edges)  # one edge per statement and target
    return set(files), edges


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) per strongly connected component that has one."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    sccs: list[set[str]] = []

    def connect(v: str) -> None:  # Tarjan; the graph is a few dozen modules deep at most
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.add(w)
                if w == v:
                    break
            sccs.append(scc)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    cycles = []
    for scc in sccs:
        start = min(scc)
        if len(scc) == 1 and start not in graph.get(start, ()):
            continue
        # shortest way round from `start` back to itself, inside the component
        prev: dict[str, str] = {}
        frontier = [start]
        while frontier and start not in prev:
            nxt = []
            for v in frontier:
                for w in sorted(graph.get(v, ())):
                    if w in scc and w not in prev:
                        prev[w] = v
                        nxt.append(w)
            frontier = nxt
        path = [start]
        v = prev[start]
        while v != start:
            path.append(v)
            v = prev[v]
        cycles.append([start, *reversed(path[1:]), start])
    return sorted(cycles)


def runtime_graph(modules: set[str], edges: list[Edge]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for e in edges:
        if not e.type_only and e.dst in modules:
            graph[e.src].add(e.dst)
    return graph


def describe(cycle: list[str], edges: list[Edge]) -> str:
    lines = {(e.src, e.dst): e.line for e in edges if not e.type_only}
    return " -> ".join(
        f"{a} (line {lines[a, b]})" for a, b in itertools.pairwise(cycle)) + f" -> {cycle[-1]}"


# -- the package ------------------------------------------------------------------


@pytest.fixture(scope="module")
def graph() -> tuple[set[str], list[Edge]]:
    return import_edges(ROOT)


def test_every_tool_named_exists(graph):
    modules, _ = graph
    assert {t for t in TOOLS if t in modules} == set(TOOLS), "a tool was renamed: update TOOLS"
    assert {t for t in INTEGRATIONS if t in modules} == set(INTEGRATIONS), (
        "an integration was renamed: update INTEGRATIONS")
    assert PACKAGE in modules and not is_tool(PACKAGE) and not is_tool("stealer.client.executor")


def test_the_graph_sees_the_package(graph):
    _, edges = graph
    pairs = {(e.src, e.dst) for e in edges}
    assert ("stealer", "stealer.client.executor") in pairs  # the facade the package exports
    assert ("stealer.cli", "stealer.top") in pairs  # `from stealer.top import main` in a function
    assert {e.src for e in edges} >= {"stealer.client.executor", "stealer.top", "stealer.bench.cli"}


def test_core_never_imports_a_tool(graph):
    _, edges = graph
    bad = [f"{e.src} (line {e.line}) imports {e.dst}"
           + (" (at module level: the facade may import it only inside a function)"
              if (e.src, e.dst) in FACADE else "")
           for e in edges if not is_tool(e.src) and is_tool(e.dst)
           and not (e.lazy and (e.src, e.dst) in FACADE)]
    assert not bad, ("the core must not import the tools layer (cli, top, tune, prometheus, "
                     "bench, dashboard) or an integration (joblib, cluster); move the code the "
                     "core needs into the core:\n" + "\n".join(bad))


def test_the_facade_reaches_the_cluster_lazily_and_the_cluster_never_imports_it(graph):
    _, edges = graph
    pairs = {(e.src, e.dst): e for e in edges}
    assert all(pairs[f].lazy for f in FACADE)  # the exception exists, and is lazy
    back = [f"{e.src} (line {e.line}) imports {e.dst}" for e in edges
            if e.src.startswith("stealer.cluster") and part(e.dst) == "client"]
    assert not back, ("the cluster integration must not import the client side (the facade "
                      "hands it the executor class):\n" + "\n".join(back))


def test_no_import_cycles(graph):
    modules, edges = graph
    cycles = find_cycles(runtime_graph(modules, edges))
    assert not cycles, "stealer modules import each other in a circle:\n" + "\n".join(
        describe(c, edges) for c in cycles)


# -- the three parts: client side, worker side, shared structures ---------------------

#: The parts of the core (README "How it works"): a module belongs to the first prefix
#: it starts with; the rest of the core (errors, forkjoin, affinity, the package) is "base",
#: which any part may import (test_no_import_cycles keeps it from importing back in a circle).
PARTS = (("stealer.client", "client"), ("stealer.worker", "worker"),
         ("stealer.shared", "shared"), ("stealer.agents", "agents"))
#: What each part may import, besides itself and the base modules below everything.
MAY_IMPORT = {
    "client": {"shared", "agents"},
    "worker": {"shared", "agents"},
    "agents": {"shared"},
    "shared": set(),
}
#: The one crossing allowed: the client starts worker processes with the worker's entry
#: point (``main``) and its typed arguments (``WorkerArgs``).
ENTRY = {("stealer.client.pool", "stealer.worker.loop")}


def part(module: str) -> str:
    for prefix, name in PARTS:
        if module == prefix or module.startswith(prefix + "."):
            return name
    return "tools" if is_tool(module) else "base"


def test_every_part_exists(graph):
    modules, _ = graph
    assert {part(m) for m in modules} >= {"client", "worker", "shared", "agents", "base"}


def test_the_client_and_worker_sides_never_import_each_other(graph):
    """Type-only imports included: the shared structures are what both sides know."""
    _, edges = graph
    bad = []
    for e in edges:
        a, b = part(e.src), part(e.dst)
        if (a in MAY_IMPORT and b != a and b not in MAY_IMPORT[a] | {"base"}
                and (e.src, e.dst) not in ENTRY and not (e.lazy and (e.src, e.dst) in FACADE)):
            bad.append(f"{e.src} (line {e.line}) imports {e.dst}"
                       + (" (for type checking)" if e.type_only else ""))
    assert not bad, ("a part imports one it must not (client and worker: only shared/ and "
                     "agents/; agents/: only shared/; shared/: no part):\n" + "\n".join(bad))


def test_no_import_cycles_counting_type_only_imports(graph):
    modules, edges = graph
    g: dict[str, set[str]] = {m: set() for m in modules}
    for e in edges:
        if e.dst in modules:
            g[e.src].add(e.dst)
    cycles = find_cycles(g)
    assert not cycles, "stealer modules import each other in a circle (type-only imports " \
        "counted):\n" + "\n".join(" -> ".join(c) for c in cycles)


# -- the checker itself, on a made-up package ----------------------------------------


def test_checker_finds_every_kind_of_import_and_the_cycles(tmp_path):
    pkg = tmp_path / PACKAGE
    (pkg / "bench").mkdir(parents=True)
    files = {
        "__init__.py": "from stealer.core import Thing\nVERSION = 1\n",
        "core.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                    "    from stealer import top\n\nclass Thing:\n    def go(self):\n"
                    "        from stealer import prometheus\n        return prometheus\n"),
        "helper.py": "from . import core\nfrom stealer import VERSION, _native\n",
        "top.py": "import importlib\nM = importlib.import_module('stealer.prometheus')\n",
        "prometheus.py": "def f():\n    import stealer.top\n",
        "cli.py": "from stealer.bench import runner as r\n",
        "bench/__init__.py": "",
        "bench/runner.py": "from ..top import M\nimport stealer\n",
    }
    for rel, text in files.items():
        (pkg / rel).write_text(text)
    modules, edges = import_edges(pkg)
    assert modules == {"stealer", "stealer.core", "stealer.helper", "stealer.top",
                       "stealer.prometheus", "stealer.cli", "stealer.bench",
                       "stealer.bench.runner"}
    got = {(e.src, e.dst, e.type_only) for e in edges}
    assert {(e.src, e.dst) for e in edges if e.lazy} == {
        ("stealer.core", "stealer.prometheus"), ("stealer.prometheus", "stealer.top")}
    assert got == {
        ("stealer", "stealer.core", False),
        ("stealer.core", "stealer.top", True),
        ("stealer.core", "stealer.prometheus", False),
        ("stealer.helper", "stealer.core", False),
        ("stealer.helper", "stealer", False),  # VERSION: bound in the package's __init__
        ("stealer.helper", "stealer._native", False),  # a submodule without Python source
        ("stealer.top", "stealer.prometheus", False),
        ("stealer.prometheus", "stealer.top", False),
        ("stealer.cli", "stealer.bench.runner", False),
        ("stealer.bench.runner", "stealer.top", False),
        ("stealer.bench.runner", "stealer", False),
    }
    assert sorted((e.src, e.dst) for e in edges
                  if not is_tool(e.src) and is_tool(e.dst)) == [
        ("stealer.core", "stealer.prometheus"), ("stealer.core", "stealer.top")]
    cycles = find_cycles(runtime_graph(modules, edges))
    assert cycles == [["stealer.prometheus", "stealer.top", "stealer.prometheus"]]
    assert describe(cycles[0], edges) == (
        "stealer.prometheus (line 2) -> stealer.top (line 2) -> stealer.prometheus")


def test_cycle_finder():
    g = {"a": {"b"}, "b": {"c", "d"}, "c": {"a"}, "d": set(), "e": {"e"}, "f": {"a"}}
    assert find_cycles(g) == [["a", "b", "c", "a"], ["e", "e"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []
