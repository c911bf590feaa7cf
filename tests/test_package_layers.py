"""The package's folders are its layers: imports go one way (lazy imports inside functions
included), nothing imports in a circle, and ``import ringseq`` stays light.

The import graph is read from the source (every ``import`` / ``from ... import`` statement of
every module, at any depth), so a lazy import that would close a circle is caught too.
"""
from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1] / "ringseq"

# Lowest first: a module may import its own layer and the layers before it, never a later one.
LAYERS = [
    ("base", ["ringseq._C", "ringseq._hash", "ringseq._dist", "ringseq.kernels"]),
    ("spec", ["ringseq._args", "ringseq.masks", "ringseq.layouts", "ringseq.spec"]),
    ("engine", ["ringseq.engine"]),
    ("api", ["ringseq.ops", "ringseq.nn", "ringseq.compat", "ringseq.data", "ringseq.loss",
             "ringseq.gathering"]),
    ("parallel", ["ringseq.parallel"]),
    ("integrations", ["ringseq.integrations", "ringseq.kvcache"]),
    ("plugin", ["ringseq.plugin", "ringseq.memory"]),
    ("package", ["ringseq", "ringseq.comm", "ringseq.commstats", "ringseq.hybrid",
                 "ringseq.ulysses", "ringseq.double_ring"]),
]


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: pathlib.Path):
    """Every ringseq module ``path`` imports (resolved to module names)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "ringseq"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] != "ringseq":
                continue
            for a in node.names:  # `from .x import y`: y may be a submodule
                sub = f"{mod}.{a.name}"
                out.add(sub if _exists(sub) else mod)
    return out


def _exists(mod: str) -> bool:
    p = ROOT.parent.joinpath(*mod.split("."))
    return p.with_suffix(".py").exists() or (p / "__init__.py").exists() or mod == "ringseq._C"


def _graph():
    return {_module_name(p): _imports(p) for p in ROOT.rglob("*.py")}


def _layer(mod: str) -> int:
    best, rank = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (mod == prefix or mod.startswith(prefix + ".")) and len(prefix) > best:
                best, rank = len(prefix), i
    assert rank is not None, f"{mod} belongs to no layer: add it to LAYERS"
    return rank


def test_no_import_circle():
    graph = _graph()
    state, stack = {}, []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if n == m or n not in graph:
                continue
            if state.get(n) == 1:
                cycle = stack[stack.index(n):] + [n]
                raise AssertionError("import circle: " + " -> ".join(cycle))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_imports_go_down_the_layers():
    bad = []
    for mod, deps in _graph().items():
        if mod == "ringseq":  # the package re-exports the public names of every layer
            continue
        for dep in deps:
            if dep == "ringseq":
                bad.append(f"{mod} imports the package root")
            elif _layer(dep) > _layer(mod):
                bad.append(f"{mod} ({LAYERS[_layer(mod)][0]}) imports {dep} "
                           f"({LAYERS[_layer(dep)][0]})")
    assert not bad, "\n".join(sorted(bad))


def test_import_ringseq_is_light():
    code = ("import sys, ringseq; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('transformers',) or m in ('ringseq.plugin', 'ringseq.memory', "
            "'ringseq.integrations.transformers')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]", out
