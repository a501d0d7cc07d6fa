"""The documentation: every public name has a docstring, every public module an API page, the
pages cite tests and figures that exist, and the site builds with `mkdocs build --strict`."""

from __future__ import annotations

import ast
import importlib
import inspect
import itertools
import os
import pathlib
import re
import subprocess
import sys

import attrs
import numpy as np
import pytest

from dew import simulate
from dew.objectives.rl.grpo import GRPOObjective
from dew.objectives.rl.scheduler import SchedulerRecord
from dew.objectives.rl.sessions import Call, Session, Status, pack, session_metrics

ROOT = pathlib.Path(__file__).parent.parent
DOCS = ROOT / "docs"


def public_modules() -> list[str]:
    """Every importable module of dew none of whose dotted parts starts with an underscore."""
    source = ROOT / "src"
    names = []
    for path in sorted((source / "dew").rglob("*.py")):
        parts = path.relative_to(source).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if not any(part.startswith("_") for part in parts):
            names.append(".".join(parts))
    return names


def public_names(module) -> list[str]:
    """A module's `__all__`, or else the classes and functions it defines without a leading
    underscore."""
    if hasattr(module, "__all__"):
        return list(module.__all__)
    return [
        name
        for name, value in vars(module).items()
        if not name.startswith("_")
        and (inspect.isclass(value) or inspect.isfunction(value))
        and value.__module__ == module.__name__
    ]


def undocumented(module) -> list[str]:
    """The public classes, functions, methods and properties of a module without a docstring."""
    missing = []
    for name in public_names(module):
        value = getattr(module, name)
        if not (inspect.isclass(value) or inspect.isfunction(value)):
            continue
        if not (value.__doc__ or "").strip():
            missing.append(f"{module.__name__}.{name}")
        if not inspect.isclass(value):
            continue
        for attribute, member in vars(value).items():
            if attribute.startswith("_"):
                continue
            function = member.fget if isinstance(member, property) else member
            function = getattr(function, "__func__", function)
            if inspect.isfunction(function) and not (function.__doc__ or "").strip():
                missing.append(f"{module.__name__}.{name}.{attribute}")
    return missing


def test_every_public_class_and_function_has_a_docstring():
    missing = [
        name
        for module in public_modules()
        for name in undocumented(importlib.import_module(module))
    ]
    assert not missing, f"public names without a docstring: {missing}"


def test_the_docstring_check_finds_a_missing_docstring(tmp_path, monkeypatch):
    (tmp_path / "sample.py").write_text(
        '"""A module."""\n\n'
        "def documented():\n"
        '    """Is documented."""\n\n\n'
        "def bare():\n"
        "    pass\n\n\n"
        "class Thing:\n"
        '    """Is documented."""\n\n'
        "    def method(self):\n"
        "        pass\n\n"
        "    @property\n"
        "    def value(self):\n"
        "        return 1\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert undocumented(importlib.import_module("sample")) == [
        "sample.bare",
        "sample.Thing.method",
        "sample.Thing.value",
    ]


def test_every_public_module_with_public_names_has_an_api_page():
    documented = set()
    for page in (DOCS / "api").glob("*.md"):
        documented |= set(re.findall(r"^::: ([\w.]+)$", page.read_text(), re.MULTILINE))
    with_names = {m for m in public_modules() if public_names(importlib.import_module(m))}
    assert with_names - documented == set(), "modules without an API page"
    assert documented - set(public_modules()) == set(), "API pages of no public module"


def cited_tests(page: pathlib.Path) -> list[tuple[str, str]]:
    return re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", page.read_text())


def test_every_test_the_scheduler_page_cites_exists():
    cited = cited_tests(DOCS / "scheduler.md")
    assert len(cited) > 50
    functions = {
        file: {
            node.name
            for node in ast.walk(ast.parse((ROOT / file).read_text()))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        }
        for file in {file for file, _ in cited}
    }
    missing = [f"{file}::{name}" for file, name in cited if name not in functions[file]]
    assert not missing, f"docs/scheduler.md cites tests that do not exist: {missing}"


def test_every_rule_of_the_scheduler_page_names_its_proof():
    text = (DOCS / "scheduler.md").read_text()
    rules = re.findall(r"^- (.*?)(?=^- |^#|\Z)", text, re.MULTILINE | re.DOTALL)
    assert len(rules) > 40
    unproven = [rule.split("\n")[0] for rule in rules if not re.search(r"Proof:\s+`tests/", rule)]
    assert not unproven, f"rules without a test: {unproven}"


def test_no_test_cites_a_file_outside_the_project():
    outside = [
        path.name
        for path in (ROOT / "tests").glob("*.py")
        if path.name != pathlib.Path(__file__).name
        and re.search(r"reference page|SPEC\.md|SPEC:|seed/scheduler", path.read_text())
    ]
    assert not outside


def record_and_metric_keys() -> set[str]:
    """The record's fields and every metric key a step reports: the scheduler's session
    metrics (of a step with one stamped session, which has them all but the reward components)
    and the loss's."""
    keys = {field.name for field in attrs.fields(SchedulerRecord)}
    ones = np.ones(2, np.int32)
    call = Call(ones, ones, np.zeros(2, np.float32), 0)
    finished = Session(
        calls=(call,), status=Status.COMPLETED, reward=1.0, submitted=0.0, finished=1.0
    )
    keys |= set(session_metrics([finished], pack([[finished]], width=4, rows=1), version=0))

    def model(variables, tokens, positions, segment_ids):
        return np.zeros((*tokens.shape, 8), np.float32)

    zeros = np.zeros((1, 4), np.float32)
    batch = {
        "tokens": np.zeros((1, 4), np.int32),
        "positions": np.arange(4, dtype=np.int32)[None],
        "segment_ids": np.ones((1, 4), np.int32),
        "loss_mask": np.array([[0, 1, 1, 1]], np.float32),
        "advantages": zeros,
        "behavior_logprobs": zeros,
        "proximal_logprobs": zeros,
    }
    keys |= set(GRPOObjective(model).loss(None, batch)[1])
    return keys | {"grad_norm"}


def test_concepts_explains_every_record_field_and_metric_key():
    text = (DOCS / "concepts.md").read_text()
    keys = record_and_metric_keys()
    assert {"lag", "waited", "fill", "latency/p99", "kl/behavior_proximal"} <= keys
    unexplained = sorted(key for key in keys if f"`{key}`" not in text)
    assert not unexplained, f"docs/concepts.md does not explain {unexplained}"


def test_concepts_explains_every_column_of_dew_simulate():
    header = simulate.report(simulate.Workload.smoke(), []).splitlines()[1]
    columns = re.split(r"\s{2,}", header.strip())
    assert "admitted/mean" in columns and "of bound" in columns
    text = (DOCS / "concepts.md").read_text()
    unexplained = [c for c in columns if c != "setting" and f"`{c}`" not in text]
    assert not unexplained, f"docs/concepts.md does not explain {unexplained}"


@pytest.mark.medium
def test_the_site_builds_strictly(tmp_path):
    """`mkdocs build --strict`: every page in the nav, every link and anchor resolves, every
    `::: module` renders (about 7 s on two cores)."""
    env = os.environ | {"NO_MKDOCS_2_WARNING": "1"}
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert build.returncode == 0, build.stderr
    assert_served_from_the_site(tmp_path)
    anchors = set()
    for page in (tmp_path / "api").rglob("index.html"):
        anchors |= set(re.findall(r'id="(dew[\w.]*)"', page.read_text()))
    missing = []
    for module in public_modules():
        for name in public_names(importlib.import_module(module)):
            value = getattr(importlib.import_module(module), name)
            # Shown where it is defined, under the module that re-exports it, or under the
            # public package of the private module that defines it (dew.envs.Sampling is
            # dew.serve._sampling's, shown as dew.serve.Sampling).
            defined = getattr(value, "__module__", module)
            public = ".".join(
                itertools.takewhile(lambda p: not p.startswith("_"), defined.split("."))
            )
            homes = {f"{module}.{name}", f"{defined}.{name}", f"{public}.{name}"}
            if inspect.ismodule(value):
                homes.add(value.__name__)
            beneath = any(a.startswith(f"{module}.") and a.endswith(f".{name}") for a in anchors)
            if not (homes & anchors or beneath):
                missing.append(f"{module}.{name}")
    assert not missing, f"the API reference does not show {missing}"


def assert_served_from_the_site(site: pathlib.Path) -> None:
    """The built site loads no script from elsewhere, carries the MathJax its pages load, shows
    its formulas to it, and every image a page shows is in the site."""
    pages = {page: page.read_text() for page in site.rglob("*.html")}
    remote = sorted(
        str(page.relative_to(site))
        for page, html in pages.items()
        if re.search(r'<script[^>]+src="(https?:)?//', html)
    )
    assert not remote, f"pages load scripts from elsewhere: {remote}"
    concepts = site / "concepts" / "index.html"
    sources = re.findall(r'<script src="([^"?]*mathjax[^"?]*)', pages[concepts], re.IGNORECASE)
    assert any(s.endswith("MathJax.js") for s in sources), sources
    for source in sources:
        assert (concepts.parent / source).resolve().is_file(), source
    # The TeX input and the fonts MathJax loads on its own, by name, beside MathJax.js.
    served = site / "assets" / "mathjax"
    assert (served / "config" / "TeX-AMS-MML_HTMLorMML-full.js").is_file()
    assert (served / "jax" / "input" / "TeX" / "config.js").is_file()
    assert list((served / "fonts" / "HTML-CSS" / "STIX-Web" / "woff").rglob("*.woff"))
    assert '"STIX-Web"' in (site / "javascripts" / "mathjax.js").read_text()
    formulas = re.findall(r'class="arithmatex">(.*?)</', pages[concepts], re.DOTALL)
    assert len(formulas) > 40 and all(f.startswith(("\\(", "\\[")) for f in formulas)
    missing = [
        f"{page.relative_to(site)}: {image}"
        for page, html in pages.items()
        for image in re.findall(r'<img[^>]+src="([^"]+)"', html)
        if "://" not in image and not (page.parent / image).resolve().is_file()
    ]
    assert not missing, f"pages show images the site lacks: {missing}"
    shown = re.findall(r'<img[^>]+src="([^"]+)"', pages[concepts])
    assert {pathlib.Path(image).name for image in shown} >= set(CONCEPT_FIGURES)


CONCEPT_FIGURES = ("long_tail_goodput.png", "long_tail_cost.png")
"""The figures docs/figures/concepts.py draws and docs/concepts.md shows."""


@pytest.mark.medium
def test_the_concepts_figures_are_drawn_by_their_script_and_shown(tmp_path):
    """docs/figures/concepts.py draws every figure the concepts page shows (from
    `Workload.smoke()` here; the checked-in ones from the defaults), and the page shows each
    checked-in one."""
    script = DOCS / "figures" / "concepts.py"
    drawn = subprocess.run(
        [sys.executable, str(script), "--smoke", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert drawn.returncode == 0, drawn.stderr
    for name in CONCEPT_FIGURES:
        assert (tmp_path / name).read_bytes().startswith(b"\x89PNG"), name
        assert (DOCS / "figures" / name).read_bytes().startswith(b"\x89PNG"), name
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(CONCEPT_FIGURES)
    text = (DOCS / "concepts.md").read_text()
    shown = re.findall(r"!\[[^\]]*\]\((figures/[^)]+)\)", text)
    assert sorted(pathlib.Path(path).name for path in shown) == sorted(CONCEPT_FIGURES)


def test_every_page_says_the_same_of_how_long_dew_train_takes():
    # The README said ~2 min and docs/index.md ~3 min for the same command.
    claims = {
        line.strip()
        for path in [ROOT / "README.md", *DOCS.rglob("*.md")]
        for line in path.read_text().splitlines()
        if "&& dew train " in line and "#" in line
    }
    assert len(claims) == 1, claims
