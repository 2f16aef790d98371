"""Layers run one way: shared/ (bottom) -> verifier_node/, drafter_node/, weights/ -> runtime/ -> http_server/ ->
benchmarks/ -> the commands (top).

Every ``.py`` under the layered packages is parsed with ``ast`` and every import, including those inside functions
(a lazy import still ties the modules together), becomes an edge of the module graph. The tests assert that no edge
goes from a lower layer to a higher one, that packages of one layer do not import each other (the verifier node and
the drafter node meet only in shared/), and that the graph has no cycle, naming the offending modules.

The commands (:data:`COMMANDS`: ``pipespec``, ``python -m runtime.launch``, ``python -m runtime.config_doc``) are
the composition root: they may start the HTTP server and the benchmarks, and nothing in the packages imports them.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent

#: Layer of each top-level package; an import may only go to the same package or a lower layer. weights/ (the named
#: models' installer) sits beside the nodes: the launcher installs, the nodes and shared/ only look a folder up.
#: http_server/ is a client of runtime/ (runtime.client), and the benchmarks drive both.
LAYERS: dict[str, int] = {
    "shared": 0,
    "verifier_node": 1,
    "drafter_node": 1,
    "weights": 1,
    "runtime": 2,
    "http_server": 3,
    "benchmarks": 4,
}
#: The command modules: the top layer (they compose every package; nothing but another command imports them).
COMMANDS: frozenset[str] = frozenset({"runtime.cli", "runtime.launch", "runtime.config_doc"})
TOP = max(LAYERS.values()) + 1


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imported(node: ast.AST, module: str, is_package: bool, known: set[str]) -> Iterable[str]:
    """Names of the known modules that one import statement loads."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield alias.name
        return
    if not isinstance(node, ast.ImportFrom):
        return
    base = node.module or ""
    if node.level:
        package = module.split(".") if is_package else module.split(".")[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join([*package, base] if base else package)
    yield base
    for alias in node.names:  # ``from shared import models`` loads shared.models
        if f"{base}.{alias.name}" in known:
            yield f"{base}.{alias.name}"


def import_graph(root: Path = ROOT, packages: Iterable[str] = LAYERS) -> dict[str, set[str]]:
    """Module -> the modules of ``packages`` it imports anywhere in its source."""
    files = {_module_name(p, root): p for pkg in packages for p in sorted((root / pkg).rglob("*.py"))}
    known = set(files)
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        edges: set[str] = set()
        for node in ast.walk(tree):
            for name in _imported(node, module, is_package, known):
                # The deepest known module the name names (``import shared.kv`` -> shared.kv).
                parts = name.split(".")
                while parts and ".".join(parts) not in known:
                    parts.pop()
                if parts and ".".join(parts) != module:
                    edges.add(".".join(parts))
        graph[module] = edges
    return graph


def upward_edges(graph: Mapping[str, Iterable[str]], layers: Mapping[str, int] = LAYERS,
                 commands: frozenset[str] = COMMANDS) -> list[tuple[str, str]]:
    """Imports from a module to one in a higher layer, or to another package of its own layer."""
    def layer(module: str) -> int:
        return TOP if module in commands else layers[module.split(".")[0]]

    def package(module: str) -> str:
        return module.split(".")[0]

    def wrong(a: str, b: str) -> bool:
        return layer(b) > layer(a) or (layer(b) == layer(a) < TOP and package(a) != package(b))

    return sorted((a, b) for a, targets in graph.items() for b in targets if wrong(a, b))


def cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return sorted(out)


@functools.cache
def _repo_graph() -> dict[str, set[str]]:
    """The repository's graph, parsed once for the tests that read it (every source file's AST: seconds)."""
    return import_graph()


def test_no_upward_import() -> None:
    graph = _repo_graph()
    assert set(graph) >= COMMANDS, f"a command module was renamed: {sorted(COMMANDS - set(graph))}"
    bad = upward_edges(graph)
    assert not bad, "imports from a lower layer to a higher one:\n" + "\n".join(f"  {a} -> {b}" for a, b in bad)


def test_no_import_cycle() -> None:
    found = cycles(_repo_graph())
    assert not found, "import cycles (lazy imports included):\n" + "\n".join("  " + " <-> ".join(c) for c in found)


def test_graph_sees_lazy_and_relative_imports(tmp_path: Path) -> None:
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "__init__.py").write_text("")
    (tmp_path / "shared" / "a.py").write_text("def f():\n    from shared import b\n")
    (tmp_path / "shared" / "b.py").write_text("from . import a\nimport runtime.c\n")
    (tmp_path / "runtime").mkdir()
    (tmp_path / "runtime" / "c.py").write_text("from shared.a import f\n")
    graph = import_graph(tmp_path, ["shared", "runtime"])
    assert graph["shared.a"] == {"shared", "shared.b"}
    assert graph["shared.b"] == {"shared", "shared.a", "runtime.c"}
    assert upward_edges(graph) == [("shared.b", "runtime.c")]
    assert cycles(graph) == [["runtime.c", "shared.a", "shared.b"]]


def test_checker_fails_on_a_cycle_and_an_upward_edge() -> None:
    graph = {"shared.x": {"shared.y"}, "shared.y": {"shared.x"}, "verifier_node.v": {"runtime.r"}, "runtime.r": set()}
    assert cycles(graph) == [["shared.x", "shared.y"]]
    assert upward_edges(graph) == [("verifier_node.v", "runtime.r")]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    assert upward_edges({"http_server.h": {"runtime.r", "shared.s"}, "runtime.r": set(), "shared.s": set()}) == []


@pytest.mark.parametrize(("edge", "why"), [
    (("runtime.launchers", "http_server.serve"), "the runtime library starts no HTTP server"),
    (("runtime.ray_launch", "benchmarks.bench"), "the runtime library runs no benchmark"),
    (("verifier_node.server", "drafter_node.settings"), "the nodes meet in shared/ only"),
    (("drafter_node.node", "verifier_node.rounds"), "the nodes meet in shared/ only"),
    (("http_server.app", "benchmarks.load"), "the HTTP server runs no benchmark"),
    (("benchmarks.sweep", "runtime.launch"), "nothing in the packages imports a command"),
])
def test_checker_catches_each_stray_edge(edge, why) -> None:
    a, b = edge
    assert upward_edges({a: {b}, b: set()}) == [edge], why


def test_commands_compose_everything() -> None:
    """A command may import any layer; another command too (the docs generator reads the CLI's flags)."""
    graph = {"runtime.launch": {"http_server.serve", "runtime.launchers"}, "runtime.cli": {"benchmarks.bench",
             "runtime.launch"}, "runtime.config_doc": {"runtime.cli"}, "http_server.serve": set(),
             "runtime.launchers": set(), "benchmarks.bench": set()}
    assert upward_edges(graph) == []
