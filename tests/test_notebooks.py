"""Every notebook runs top to bottom on a fresh kernel, draws its plots, and is stored without
outputs (what nbmake does, but pytest-trio's trio mode and nbmake's collector do not mix, so the
notebooks run from here).

Each notebook's last cells assert what its reading says, so a notebook whose conclusions no
longer hold fails here. The kernel draws with matplotlib-inline, whose figures are rendered by
the Agg backend: no display is needed. The kernel inherits the session's compilation settings
(tests/conftest.py): together they take about a minute on two cores. real_model.ipynb, which
trains a real 135M-param model, runs in tests/test_real_model.py.
"""

from __future__ import annotations

import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    assert {"long_tail", "train_policy", "own_environment", "replay"} <= {p.stem for p in NOTEBOOKS}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_stored_without_outputs(path):
    notebook = nbformat.read(path, as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert code
    dirty = [i for i, cell in enumerate(code) if cell.outputs or cell.execution_count is not None]
    assert not dirty, f"{path.name}: code cells {dirty} hold outputs; clear them before committing"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_opens_with_what_it_shows_and_how_long_it_takes(path):
    first = nbformat.read(path, as_version=4).cells[0]
    assert first.cell_type == "markdown"
    assert "What this shows" in first.source and "How long it takes" in first.source


def test_the_docs_list_every_notebook():
    listed = (ROOT / "docs" / "notebooks.md").read_text()
    assert not [p.name for p in NOTEBOOKS if f"`notebooks/{p.name}`" not in listed]


def run_notebook(path: pathlib.Path, cell_seconds: int = 300) -> None:
    """Run the notebook at `path` top to bottom on a fresh kernel, in its folder: no cell may
    fail, and it must print something and draw a figure. tests/test_real_model.py runs
    real_model.ipynb with it."""
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(notebook, timeout=cell_seconds, kernel_name="python3")
    client.execute(cwd=str(path.parent))
    outputs = [o for cell in notebook.cells for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    assert any(o.get("output_type") == "stream" for o in outputs)
    assert [o for o in outputs if "image/png" in o.get("data", {})], f"{path.name} drew nothing"


# The notebooks that train, shortened to what their test proves: the loop runs end to end,
# logs, draws and holds the cells' assertions (none of which reads a learned reward). Their own
# lengths (12 and 24 steps) only show more of the same curves.
SHORTENED = {
    "own_environment": {"DEW_OWN_ENVIRONMENT_STEPS": "4"},
    "train_policy": {"DEW_TRAIN_POLICY_STEPS": "2"},
}


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
# real_model.ipynb trains a real 135M-param model: tests/test_real_model.py runs it after the
# README's command, whose compiled programs it then loads.
@pytest.mark.parametrize(
    "path", [path for path in NOTEBOOKS if path.stem != "real_model"], ids=lambda p: p.stem
)
def test_notebook_runs_and_draws(path, monkeypatch):
    for name, value in SHORTENED.get(path.stem, {}).items():
        monkeypatch.setenv(name, value)
    run_notebook(path)


@pytest.mark.parametrize("stem", sorted(SHORTENED))
def test_a_shortened_notebook_reads_the_knob_its_test_sets(stem):
    """A knob the notebook no longer read would leave its test running the whole length."""
    source = (ROOT / "notebooks" / f"{stem}.ipynb").read_text()
    assert all(f'os.environ.get(\\"{name}\\"' in source for name in SHORTENED[stem]), stem
