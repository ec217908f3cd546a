"""spmd's modules import each other without a circle, counting the imports inside functions too (a lazy import
hides a circle from Python, not from a reader: each module should be readable after the ones it imports)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "spmd"


def module_names() -> dict[str, Path]:
    names = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The spmd modules `path` imports anywhere in it (`from spmd.model import llama` is spmd.model.llama)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("spmd"):
            for alias in node.names:
                inner = f"{node.module}.{alias.name}"
                found.add(inner if inner in modules else node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
    return found & set(modules)


def a_circle(graph: dict[str, set[str]]) -> list[str]:
    """One circle of the graph (a -> b -> ... -> a), or [] (depth-first, the path kept while it is walked)."""
    state: dict[str, str] = {}
    path: list[str] = []

    def walk(node: str) -> list[str]:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (circle := walk(nxt)):
                return circle
        state[node] = "done"
        path.pop()
        return []

    for start in sorted(graph):
        if start not in state and (circle := walk(start)):
            return circle
    return []


def test_the_finder_finds_a_circle():
    assert a_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert a_circle({"a": {"b"}, "b": set()}) == []


def test_no_module_of_spmd_imports_itself_through_others():
    modules = module_names()
    graph = {name: imports(path, modules) - {name} for name, path in modules.items()}
    assert len(graph) > 100 and sum(map(len, graph.values())) > 300  # the graph is read, not empty
    assert a_circle(graph) == []
