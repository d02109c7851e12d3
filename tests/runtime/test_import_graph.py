"""dspark_trt (and within it dspark_trt/runtime) imports without circles: every import (module level or inside a function, read with ast)
between its modules forms an acyclic graph, so the model's basic pieces sit below it (runtime/layers.py) and the
native forward never reaches back into the model."""
from __future__ import annotations

import ast
from pathlib import Path

import dspark_trt

ROOT = Path(dspark_trt.__file__).parent.parent
PACKAGE = ROOT / "dspark_trt"
RUNTIME = PACKAGE / "runtime"


def _name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(top: Path = RUNTIME) -> dict[str, set[str]]:
    """module → the modules under `top` it imports (`from a import b` counts a.b when that is a module, else a).
    The Triton model repositories' model.py files are loaded by Triton's stub, not imported: left out."""
    files = {_name(p): p for p in top.rglob("*.py") if not any(part.startswith("model_repo") for part in p.parts)}
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                names = [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                while name and name not in files:  # the innermost runtime module the name lies in
                    name = name.rpartition(".")[0]
                if name and name != mod:
                    deps.add(name)
        graph[mod] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_runtime_has_no_import_cycle() -> None:
    graph = import_graph()
    assert "dspark_trt.runtime.native_forward" in graph and "dspark_trt.runtime.layers" in graph
    assert "dspark_trt.runtime.model" not in graph["dspark_trt.runtime.native_forward"]
    assert cycles(graph) == []


def test_the_package_has_no_import_cycle() -> None:
    graph = import_graph(PACKAGE)
    assert len(graph) > 100 and "dspark_trt.serve.openai.app" in graph and "dspark_trt.serve.openai.server" in graph
    assert cycles(graph) == []


def test_the_check_sees_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
