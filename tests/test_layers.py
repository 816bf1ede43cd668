"""Layers import one way (docs/architecture.md): runtime <- drafters <- engine <- front ends, and no two modules
import each other (directly or around a loop). Every `import` in forerun/ counts, function-local ones included:
a lazy import still ties the modules together."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "forerun"

# the lowest layer a module may belong to; a module imports only modules of its layer or below
FRONT, ENGINE, DRAFTERS, RUNTIME = 3, 2, 1, 0
LAYER_OF_PREFIX = [  # first match wins
    ("forerun.drafters", DRAFTERS),
    ("forerun.engine", ENGINE),
    ("forerun.server", FRONT), ("forerun.eagle", FRONT), ("forerun.cli", FRONT), ("forerun.bench", FRONT),
    ("forerun.bench_prompts", RUNTIME),  # a list of prompts, shared by bench and eagle
    ("forerun", RUNTIME),  # models, attention, kvcache, kernels, verify, runtime and the shared leaves
]


def layer(module: str) -> int:
    if module == "forerun":  # the package's lazy exports (LLM, Engine, AsyncEngine) are a front end
        return FRONT
    for prefix, rank in LAYER_OF_PREFIX:
        if module == prefix or module.startswith(prefix + "."):
            return rank
    raise AssertionError(module)


def modules() -> dict[str, Path]:
    out = {}
    for p in ROOT.rglob("*.py"):
        parts = p.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = p
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The forerun modules that ``name`` imports anywhere in its source (``__main__`` blocks too)."""
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for a in node.names:  # `from pkg import submodule` imports the submodule
                found.add(f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod)
    return {m for m in found if m in known and m != name}


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def test_the_import_graph_is_read():
    g = graph()
    assert len(g) > 60
    # a few edges the code is known to have, so a parser that reads nothing fails here
    assert "forerun.engine.engine" in g["forerun.engine.llm"]
    assert "forerun.runtime.runner" in g["forerun.engine.round"]
    assert "forerun.usage" in g["forerun.models.hub"]  # function-local
    assert "forerun.eagle.data" in g["forerun.eagle.train"]  # `from . import data`


def test_layers_import_one_way():
    bad = [f"{a} (layer {layer(a)}) imports {b} (layer {layer(b)})"
           for a, deps in sorted(graph().items()) for b in sorted(deps) if layer(b) > layer(a)]
    assert not bad, "\n".join(bad)


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    assert cycles(graph()) == []


def test_no_cycles_between_packages_and_kernels_at_the_bottom():
    """Inside the runtime layer too, packages import one way: no loop between forerun.models, forerun.kernels,
    forerun.attention, ... (the models wire the kernels in: FusedLayerOps and CpuLayerOps live in forerun/models),
    and forerun.kernels (functions on tensors) imports no other forerun package, only leaf modules (forerun.paths:
    modules that import nothing of forerun)."""
    g = graph()

    def package(m: str) -> str:
        return ".".join(m.split(".")[:2])

    pg: dict[str, set[str]] = {}
    for a, deps in g.items():
        pg.setdefault(package(a), set()).update(package(b) for b in deps if package(b) != package(a))
    assert cycles(pg) == []
    leaves = {m for m in pg["forerun.kernels"] if m in g and not g[m]}
    assert pg["forerun.kernels"] - leaves == set(), pg["forerun.kernels"]
    assert "forerun.kernels" in pg["forerun.models"]  # (the graph is read: models do use the kernels)


@pytest.mark.parametrize("edges, expect", [
    ({"a": {"b"}, "b": {"a"}}, [["a", "b"]]),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
    ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
])
def test_the_cycle_finder_finds_cycles(edges, expect):
    assert cycles(edges) == expect


def test_a_wrong_way_import_is_caught():
    assert layer("forerun.runtime.runner") < layer("forerun.drafters.base") < layer("forerun.engine.engine") \
        < layer("forerun.cli")
    assert layer("forerun.models.hub") == RUNTIME and layer("forerun") == FRONT
