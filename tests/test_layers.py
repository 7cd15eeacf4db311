"""Layers: each folder imports only the layers before it.

The layer order is the list in ``docs/design.rst``, read by these tests. ``tracking/`` collects;
the heatmap and the TensorBoard export in ``analysis/`` present the monitor's table. They share
``MonitorError`` through :mod:`unitscale.errors`, so no module of ``analysis/`` imports
``tracking/monitor.py``, and no module of ``tracking/`` imports ``analysis/``. No two modules
import each other, directly or through others.
"""

from __future__ import annotations

import ast
from pathlib import Path

import unitscale
import unitscale.analysis
import unitscale.errors
import unitscale.tracking
import unitscale.tracking.monitor

ANALYSIS = Path(unitscale.analysis.__file__).parent


def _runtime_imports(path: Path) -> set[str]:
    """Modules ``path`` imports when it runs (not those under ``if TYPE_CHECKING:``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped |= {id(child) for child in ast.walk(node)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add("." * node.level + node.module)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return found


def test_no_analysis_module_imports_the_monitor() -> None:
    for path in sorted(ANALYSIS.glob("*.py")):
        imports = _runtime_imports(path)
        assert not {m for m in imports if m.endswith("tracking.monitor")}, path.name


def test_monitor_error_lives_with_the_other_errors_and_is_re_exported() -> None:
    error = unitscale.errors.MonitorError
    assert issubclass(error, unitscale.errors.UnitScaleError)
    assert unitscale.tracking.MonitorError is error
    assert unitscale.tracking.monitor.MonitorError is error


# -- every package against the documented layer order (docs/design.rst) ----------------------
SRC = Path(unitscale.__file__).parent
DESIGN = SRC.parents[1] / "docs" / "design.rst"

#: Imports that go up a layer on purpose: (file, enclosing function, module). None.
ALLOWED_UPWARD: set[tuple[str, str, str]] = set()


def documented_layers() -> dict[str, int]:
    """The layer of each top-level name of ``src/unitscale`` (``"functional"``, ``"errors"``),
    from the list under "Layers" in docs/design.rst: one layer per line, a list that ends with
    a comma going on at the next line."""
    text = DESIGN.read_text(encoding="utf-8")
    block = text.split("Layers\n------\n", 1)[1].split(".. code-block:: text\n", 1)[1]
    layers: dict[str, int] = {}
    index, continued = -1, False
    for line in block.split("\n")[1:]:
        if line and not line.startswith("   "):
            break  # the end of the code block
        names = line.strip().split("  ", 1)[0] if line.strip() else ""
        if not names or line.startswith("    "):
            continue  # a description going on, or a blank line
        if not continued:
            index += 1
        for name in filter(None, (n.strip() for n in names.split(","))):
            layers[name.removesuffix("/").removesuffix(".py")] = index
        continued = names.endswith(",")
    return layers


def _imports_with_scope(path: Path) -> list[tuple[str, str]]:
    """``(imported unitscale module, enclosing top-level function or "")`` of each import in
    ``path``, lazy ones (inside functions) and ``TYPE_CHECKING`` ones included."""
    package = ".".join(path.relative_to(SRC.parent).with_suffix("").parts)
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    else:
        package = package.removesuffix(".__init__")
    found: list[tuple[str, str]] = []

    def visit(node: ast.AST, scope: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = scope
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) and not scope:
                inner = child.name
            if isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")[: len(package.split(".")) - child.level + 1]
                    module = ".".join([*base, child.module] if child.module else base)
                else:
                    module = child.module or ""
                found.extend((f"{module}.{alias.name}", inner) for alias in child.names)
            elif isinstance(child, ast.Import):
                found.extend((alias.name, inner) for alias in child.names)
            visit(child, inner)

    visit(ast.parse(path.read_text(encoding="utf-8")), "")
    return [(name, scope) for name, scope in found if name.startswith("unitscale.")]


def _layer_of(name: str, layers: dict[str, int]) -> int | None:
    """The layer of ``unitscale.<top>...``; None for names that are not a module of a layer
    (``from unitscale import x``: the facade)."""
    return layers.get(name.split(".")[1])


def test_the_documented_layers_cover_every_module_of_the_package() -> None:
    layers = documented_layers()
    tops = {p.name.removesuffix(".py") for p in SRC.iterdir() if p.suffix == ".py" or p.is_dir()}
    tops -= {"__init__", "__main__", "__pycache__"}
    assert tops - set(layers) == set(), "add these to the layer list of docs/design.rst"
    assert layers["errors"] < layers["functional"] < layers["tracking"] < layers["analysis"]
    assert layers["experiments"] == layers["models"] == layers["training"]


def test_each_module_imports_only_its_own_and_earlier_layers() -> None:
    """README and docs/design.rst: "a layer imports only the layers listed before it"."""
    layers = documented_layers()
    offenders = []
    for path in sorted(SRC.rglob("*.py")):
        relative = path.relative_to(SRC).as_posix()
        own = layers.get(relative.split("/")[0].removesuffix(".py"))
        if own is None:  # __init__.py and __main__.py of the package: above every layer
            continue
        for name, scope in _imports_with_scope(path):
            other = _layer_of(name, layers)
            if other is None and name.rpartition(".")[0] == "unitscale":
                other = max(layers.values())  # ``from unitscale import x``: the facade
            allowed = any(
                relative == f and scope == s and (name == m or name.startswith(m + "."))
                for f, s, m in ALLOWED_UPWARD
            )
            if other is not None and other > own and not allowed:
                offenders.append(f"{relative} imports {name}")
    assert offenders == []


def test_no_tracking_module_imports_analysis() -> None:
    imports = {
        (path.relative_to(SRC).as_posix(), scope, name)
        for path in sorted((SRC / "tracking").glob("*.py"))
        for name, scope in _imports_with_scope(path)
        if name == "unitscale.analysis" or name.startswith("unitscale.analysis.")
    }
    assert imports == set()


# -- no circles of imports between unitscale's modules -----------------------------------------
#: Circles left on purpose: frozenset of the modules on the circle -> the reason.
ALLOWED_CIRCLES: dict[frozenset[str], str] = {}


def _module_name(path: Path) -> str:
    name = ".".join(path.relative_to(SRC.parent).with_suffix("").parts)
    return name.removesuffix(".__init__")


def import_graph() -> dict[str, set[str]]:
    """Each module of unitscale -> the unitscale modules it imports, at module level, inside
    functions and under ``TYPE_CHECKING`` alike. ``from package import name`` goes to the
    module ``name`` if there is one, else to the package's ``__init__.py``."""
    modules = {_module_name(path): path for path in SRC.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        targets = set()
        for name, _ in _imports_with_scope(path):
            while name not in modules:
                name = name.rpartition(".")[0]
            if name != module:
                targets.add(name)
        graph[module] = targets
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph.get(node, ())):
            if other not in index:
                connect(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return circles


def test_import_circles_are_found() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_circles(graph) == [["a", "b", "c"]]
    assert import_circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles_between_unitscale_modules() -> None:
    circles = {frozenset(c) for c in import_circles(import_graph())}
    assert circles - set(ALLOWED_CIRCLES) == set(), "make each one direction (move what they share)"
    assert set(ALLOWED_CIRCLES) - circles == set(), "gone: delete from ALLOWED_CIRCLES"
