"""dew's modules import each other in one direction: the import graph of `src/dew` has no circle.

The graph is read from the source with `ast`, not by importing: a node per module (a package is
its `__init__.py`), an edge from a module to each dew module it imports. Every `import` and
`from ... import` counts wherever it stands, at module level or inside a function (an import
deferred into a function that closes a circle is the same circle, only hidden), except under
`if TYPE_CHECKING:`, which never runs (one test counts those too: a circle of type hints is
still two modules that each need the other to be read). `from package import name` is an edge
to the submodule `package.name` when that is a module, else to the package. Importing a
submodule also runs its parent packages' `__init__`, but that is how a package re-exports its
private modules, not a circle of the code's, so those implicit edges are left out.
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


def imported(
    tree: ast.AST, name: str, is_package: bool, known: set[str], *, hints: bool = False
) -> set[str]:
    """The dew modules a module's code imports; with `hints`, also those it imports only for
    its type hints (under `if TYPE_CHECKING:`)."""
    found: set[str] = set()
    package = name if is_package else name.rpartition(".")[0]

    def visit(node: ast.AST) -> None:
        if not hints and type_checking_only(node):
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


def import_graph(*, hints: bool = False) -> dict[str, set[str]]:
    known = modules()
    return {
        name: imported(
            ast.parse(path.read_text()), name, path.name == "__init__.py", set(known), hints=hints
        )
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


def test_no_circle_even_through_type_hints():
    # models/hf/sharding.py once imported HFModel for its hints while _modeling imported it to
    # lay out the cache: two modules neither of which could be read without the other.
    found = circle(import_graph(hints=True))
    if found is not None:
        pytest.fail(f"dew's modules import each other in a circle: {' -> '.join(found)}")


def reached(graph: dict[str, set[str]], start: str) -> set[str]:
    """`start` and every module it imports, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(graph[module])
    return seen


def schedulers_rooms(graph: dict[str, set[str]]) -> set[str]:
    """The modules of `dew.objectives.rl` that only the scheduler builds on: what its public
    module reaches there, less what the sessions' and the objective's public modules reach."""
    rl = "dew.objectives.rl"
    shared = reached(graph, f"{rl}.sessions") | reached(graph, f"{rl}.grpo")
    return {
        module
        for module in reached(graph, f"{rl}.scheduler")
        if module.startswith(f"{rl}.") and module not in shared
    }


SOURCES_ROOMS = ("dew.envs", "dew.gateway", "dew.serve")
"""Where sources, the gateway and engines live: none knows it is scheduled (the
scheduler talks to engines only through `Publisher`, and sources only through `run`)."""


def test_the_schedulers_rooms_are_found():
    rooms = schedulers_rooms(import_graph())
    assert {
        "dew.objectives.rl.scheduler",
        "dew.objectives.rl._admission",
        "dew.objectives.rl._reports",
    } <= rooms
    assert "dew.objectives.rl._session" not in rooms
    assert "dew.objectives.rl.grpo" not in rooms


def test_a_source_never_imports_the_schedulers_rooms():
    graph = import_graph(hints=True)
    rooms = schedulers_rooms(graph)
    broken = sorted(
        f"{module} imports {', '.join(sorted(graph[module] & rooms))}"
        for module in graph
        if module.startswith(SOURCES_ROOMS) and graph[module] & rooms
    )
    assert not broken, broken


def test_the_simulations_values_and_table_reach_none_of_the_schedulers_rooms():
    # dew.simulate is split so: a Workload, its settings and outcomes are built, fitted
    # (dew.calibrate) and tabulated without the scheduler, which only the run (_run) drives.
    graph = import_graph(hints=True)
    rooms = schedulers_rooms(graph)
    parts = ("dew.simulate._workload", "dew.simulate._report")
    assert set(parts) <= set(graph) and "dew.simulate._run" in graph
    assert rooms & reached(graph, "dew.simulate._run")
    broken = {part: sorted(reached(graph, part) & rooms) for part in parts}
    assert not any(broken.values()), broken


@pytest.mark.medium
def test_the_gateway_takes_nothing_from_the_environments():
    # dew.envs builds its HarnessSource on the gateway; the gateway's engine settings (Sampling)
    # come from the engines' room, which both share.
    graph = import_graph(hints=True)
    broken = sorted(
        f"{module} imports {name}"
        for module in graph
        if module.startswith("dew.gateway")
        for name in graph[module]
        if name.startswith("dew.envs")
    )
    assert not broken, broken


def test_sampling_is_the_engines_setting_under_each_public_name():
    import dew.envs
    import dew.envs.environment
    import dew.serve

    assert dew.serve.Sampling.__module__.startswith("dew.serve.")
    assert dew.envs.Sampling is dew.serve.Sampling
    assert dew.envs.environment.Sampling is dew.serve.Sampling


def readme_layout() -> str:
    """The README's Layout section: the table of where each thing lives."""
    text = (ROOT.parents[1] / "README.md").read_text()
    return text.split("## Layout", 1)[1].split("\n## ", 1)[0]


@pytest.mark.medium
def test_what_nothing_imports_and_each_work_around_says_where_it_lives():
    # A package of its own beside dew (the verifiers harness plugin), a module only another
    # program runs (the sitecustomize every vLLM server process imports) and the media
    # work-around are found by no import a reader could follow: the layout names them.
    layout = readme_layout()
    graph = import_graph(hints=True)
    imported_somewhere = set().union(*graph.values())
    entries = [
        path.name
        for path in ROOT.parent.iterdir()
        if path.is_dir() and (path / "__init__.py").exists() and path != ROOT
    ]
    entries += [
        f"dew/{modules()[name].parent.relative_to(ROOT).as_posix()}/"
        for name in graph
        if name not in imported_somewhere
        and not (ROOT / modules()[name].parent / "__init__.py").exists()
    ]
    entries.append("dew._torch_media")
    assert "dew_chat" in entries and "dew/serve/_vllm_site/" in entries
    missing = [entry for entry in entries if f"`{entry}`" not in layout]
    assert not missing, f"README's Layout names none of {missing}"
