"""The package's shape, checked from its source (docs/architecture.md; nothing imported).

* no import cycles among minipaged's modules, counting imports inside functions and under
  TYPE_CHECKING: a capability imports the core, never the other way round;
* no module reads another module's private names (`x._name` where `_name` is defined elsewhere
  in the package); lessons/ and exercises/ may poke inside on purpose;
* nothing replaces methods on an engine instance (`engine.step = ...`): a capability attaches
  through a seam chosen when the engine is built (engine/step_loop.py, engine/extensions.py);
* no module of the package is longer than 450 lines (a longer one has two jobs).
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "minipaged"
MAX_LINES = 450


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        name = ".".join(path.relative_to(PKG.parent).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


MODULES = modules()
TREES = {m: ast.parse(p.read_text(encoding="utf-8")) for m, p in MODULES.items()}


def resolve(name: str):
    """The longest prefix of `name` that is a module of the package."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in MODULES:
            return ".".join(parts[:i])
    return None


def import_graph() -> dict[str, set[str]]:
    graph = {m: set() for m in MODULES}
    for m, tree in TREES.items():
        pkg = m if MODULES[m].name == "__init__.py" else m.rsplit(".", 1)[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            graph[m].update(r for r in map(resolve, targets) if r and r != m)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
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

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def own_private_names(tree: ast.AST) -> set[str]:
    own = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            own.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            own.add(node.id)
    return {n for n in own if n.startswith("_")}


def test_no_private_names_read_across_modules():
    owned = {m: own_private_names(t) for m, t in TREES.items()}
    anywhere = set().union(*owned.values())
    hits = []
    for m, tree in TREES.items():
        if ".lessons" in m or ".exercises" in m:
            continue
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                continue
            v = node.value
            if isinstance(v, ast.Name) and v.id in ("self", "cls"):
                continue
            if isinstance(v, ast.Call) and getattr(v.func, "id", None) == "super":
                continue
            if node.attr in anywhere and node.attr not in owned[m]:
                hits.append(f"{m}:{node.lineno} reads .{node.attr}")
    assert hits == []


def test_nothing_replaces_methods_on_an_engine_instance():
    pattern = re.compile(r"^\s*(?:self\.)?engine\.(\w+)\s*=(?!=)")
    hits = [f"{m}:{n}" for m, p in MODULES.items()
            for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
            if pattern.match(line)]
    assert hits == []


def test_no_module_is_longer_than_450_lines():
    long = {str(p.relative_to(PKG.parent)): n for p in MODULES.values()
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert long == {}, "each of these has two jobs: make it two files"
