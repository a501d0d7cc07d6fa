"""dew's modules import each other in one direction: the import graph of `src/dew` has no circle.

The graph is read from the source with `ast`, not by importing: a node per module (a package is
its `__init__.py`), an edge from a module to each dew module it imports. Every `import` and
`from ... import` counts wherever it stands, at module level or inside a function (an import
deferred into a function that closes a circle is the same circle, only hidden), except under
`if TYPE_CHECKING:`, which never runs. `from package import name` is an edge to the submodule
`package.name` when that is a module, else to the package. Importing a submodule also runs its
parent packages' `__init__`, but that is how a package re-exports its private modules, not a
circle of the code's, so those implicit edges are left out.
"""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

import dew

ROOT = Path(dew.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(ROOT.rglob("*.py"))}


def type_checking_only(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imported(tree: ast.AST, name: str, is_package: bool, known: set[str]) -> set[str]:
    """The dew modules a module's code imports."""
    found: set[str] = set()
    package = name if is_package else name.rpartition(".")[0]

    def visit(node: ast.AST) -> None:
        if type_checking_only(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                found.add(submodule if submodule in known else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return {module for module in found if module in known and module != name}


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {
        name: imported(ast.parse(path.read_text()), name, path.name == "__init__.py", set(known))
        for name, path in known.items()
    }


def circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of the graph, as the modules along it, or None when it has none."""
    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as error:
        return error.args[1]
    return None


def test_the_circle_finder_finds_a_circle_and_reads_relative_and_deferred_imports():
    found = circle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}})
    assert found is not None and found[0] == found[-1] and set(found) == {"a", "b", "c"}
    assert circle({"a": {"b"}, "b": set()}) is None
    source = (
        "from . import _b\n"
        "from ..x import y\n"
        "def f():\n    import p.c\n"
        "if TYPE_CHECKING:\n    import p.d\n"
    )
    known = {"p", "p._b", "p.c", "p.d", "x", "x.y", "p.a"}
    assert imported(ast.parse(source), "p.a", False, known) == {"p._b", "p.c", "x.y"}


def test_the_graph_is_read_from_every_module():
    graph = import_graph()
    assert "dew.objectives.rl.sessions" in graph
    # The public sessions module re-exports pack from the packing module, which builds on the
    # private session values alone.
    assert "dew.objectives.rl._packing" in graph["dew.objectives.rl.sessions"]
    assert "dew.objectives.rl._session" in graph["dew.objectives.rl._packing"]
    assert "dew.objectives.rl.sessions" not in graph["dew.objectives.rl._packing"]
    assert "dew.replay._format" in graph["dew.replay._record"]


def test_dews_import_graph_has_no_circle():
    found = circle(import_graph())
    if found is not None:
        pytest.fail(f"dew's modules import each other in a circle: {' -> '.join(found)}")
