"""The floor plan of docs/architecture.md, checked against every import in the code.

The layer table between the ``layers:begin`` / ``layers:end`` markers says which
modules form each layer and which layers they may import. Every ``import`` and
``from ... import`` of every module in the five packages is checked, including
lazy ones inside functions and ``TYPE_CHECKING`` blocks, and
``importlib.import_module("...")`` calls with a literal name. No two files may
import each other, directly or round a longer circle.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("tokentrace", "instrument", "analyzers", "dashboard", "reference_server")
DOC = REPO / "docs" / "architecture.md"


@dataclass(frozen=True)
class Layer:
    name: str
    modules: tuple[str, ...]
    may_import: frozenset[str]


def read_layers(text: str) -> list[Layer]:
    """The layer table of docs/architecture.md."""
    block = text.split("<!-- layers:begin -->", 1)[1].split("<!-- layers:end -->", 1)[0]
    rows = [line for line in block.strip().splitlines() if line.startswith("|")][2:]  # skip header, rule
    layers = []
    for row in rows:
        name, modules, may = (cell.strip() for cell in row.strip().strip("|").split("|"))
        mods = tuple(re.findall(r"`([\w.]+)`", modules))
        allowed = frozenset(x.strip() for x in may.split(",") if x.strip())
        layers.append(Layer(name, mods, allowed))
    return layers


LAYERS = read_layers(DOC.read_text())
LAYER_NAMES = {layer.name for layer in LAYERS}


SPLIT_PACKAGES = frozenset({"tokentrace"})
"""Packages whose folder holds more than one layer: their name in the table covers the package's
``__init__`` only, so every module under them must sit under a name the table lists."""


def layer_of(module: str) -> Layer | None:
    """The layer whose module list names ``module`` or its longest listed parent."""
    best: tuple[int, Layer] | None = None
    for layer in LAYERS:
        for m in layer.modules:
            if module == m or (m not in SPLIT_PACKAGES and module.startswith(m + ".")):
                if best is None or len(m) > best[0]:
                    best = (len(m), layer)
    return None if best is None else best[1]


def source_files() -> dict[str, Path]:
    """Module name -> file, for every module of the five packages."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            rel = path.relative_to(REPO).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            if "sitecustomize" in parts:  # a file copied onto children's sys.path, not a module of ours
                continue
            out[".".join(parts)] = path
    return out


MODULES = source_files()


def imports_of(module: str, path: Path) -> list[tuple[int, str]]:
    """(line, imported module) for every import in ``path``, resolved to a module name."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_pkg = path.name == "__init__.py"
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base if is_pkg else base[:-1]
                base = base[: len(base) - (node.level - 1)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            for alias in node.names:
                candidate = f"{prefix}.{alias.name}"
                found.append((node.lineno, candidate if candidate in MODULES else prefix))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            found.append((node.lineno, node.args[0].value))
    return found


def ours(name: str) -> bool:
    return name.split(".")[0] in PACKAGES


def test_the_layer_table_is_well_formed():
    assert [layer.name for layer in LAYERS][:5] == ["schema", "clock", "recorder", "store", "core API"]
    for layer in LAYERS:
        assert layer.modules, f"layer {layer.name!r} lists no modules"
        assert layer.may_import <= LAYER_NAMES, f"layer {layer.name!r} names unknown layers"
        assert layer.name not in layer.may_import


def test_every_module_belongs_to_a_layer():
    unplaced = sorted(m for m in MODULES if layer_of(m) is None)
    assert not unplaced, f"modules in no layer of docs/architecture.md: {unplaced}"


def test_every_import_follows_the_layers():
    wrong = []
    for module, path in MODULES.items():
        mine = layer_of(module)
        for line, target in imports_of(module, path):
            if not ours(target):
                continue
            theirs = layer_of(target)
            if theirs is None or theirs.name == mine.name or theirs.name in mine.may_import:
                continue
            wrong.append(f"{path.relative_to(REPO)}:{line}: {mine.name} -> {theirs.name} ({target})")
    assert not wrong, "imports against docs/architecture.md:\n" + "\n".join(wrong)


def test_the_core_of_tokentrace_imports_nothing_above_it():
    """Every ``tokentrace`` module outside the application folder (``tokentrace/app/``) and the
    facade imports nothing of ``instrument``, ``analyzers``, ``dashboard`` or ``reference_server``."""
    upward = []
    for module, path in MODULES.items():
        if module == "tokentrace" or module == "tokentrace.app" or module.startswith("tokentrace.app.") \
                or not module.startswith("tokentrace."):
            continue
        for line, target in imports_of(module, path):
            if target.split(".")[0] in {"instrument", "analyzers", "dashboard", "reference_server"}:
                upward.append(f"{path.relative_to(REPO)}:{line}: {target}")
    assert not upward, "core modules importing upward:\n" + "\n".join(upward)


def test_a_module_outside_the_table_fails():
    """An unlisted module under a split package is in no layer (no catch-all row)."""
    assert layer_of("tokentrace.not_listed_anywhere") is None
    assert layer_of("tokentrace").name == "facade"
    assert layer_of("tokentrace.app.cli.commands.report").name == "application"


def test_the_facade_imports_only_the_core_eagerly():
    """``import tokentrace`` runs the facade; what it imports at module level is core only."""
    tree = ast.parse(MODULES["tokentrace"].read_text())
    core = {"schema", "clock", "recorder", "store", "core API"}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module and ours(node.module):
            assert layer_of(node.module).name in core, node.module


def test_no_import_circle_between_files():
    graph = {m: sorted({t for _, t in imports_of(m, p) if t in MODULES and t != m}) for m, p in MODULES.items()}
    circles = [c for c in strongly_connected(graph) if len(c) > 1]
    assert not circles, f"import circles: {circles}"


def strongly_connected(graph: dict[str, list[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components, iteratively."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    comp.append(top)
                    if top == node:
                        break
                out.append(sorted(comp))
    return out


@pytest.mark.parametrize("graph, circles", [
    ({"a": ["b"], "b": ["a"], "c": []}, [["a", "b"]]),
    ({"a": ["b"], "b": ["c"], "c": ["a"]}, [["a", "b", "c"]]),
    ({"a": ["b"], "b": [], "c": ["a"]}, []),
])
def test_the_circle_finder_finds_circles(graph, circles):
    assert [c for c in strongly_connected(graph) if len(c) > 1] == circles


def test_the_checker_sees_lazy_and_relative_imports(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from analyzers.latency import x\n    import importlib\n"
                 "    importlib.import_module('dashboard.app')\n")
    found = [t for _, t in imports_of("tokentrace.store.m", f)]
    assert "analyzers.latency" in found and "dashboard.app" in found
    assert layer_of("tokentrace.store.reader").name == "store"
    assert layer_of("tokentrace.app.cli.commands.run").name == "application"
    assert layer_of("analyzers.latency").name not in layer_of("tokentrace.store.reader").may_import
