"""The two runs of a real pretrained model, SmolLM2-135M-Instruct (`--model smollm2`): the
README's "Train a real model" command and notebooks/real_model.ipynb, which trains the same
recipe from Python.

One file, so that one worker runs them one after the other: the notebook's kernel then loads
the programs the README's run compiled from the session's persistent compilation cache
(tests/conftest.py) where the two compile alike (the notebook's run took 86 CPU-s after the
README's against 106 alone, when they were in test_readme.py and test_notebooks.py), and the
two runs' peaks (3.7 and 3.8 GB; 5.4 and 6.5 before issue 42's work) never meet, as they
could when their files ran on both workers at once.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from test_notebooks import ROOT, run_notebook

README = ROOT / "README.md"


def real_model_command() -> list[str]:
    """The README's "Train a real model" `dew train` command as argv (its lines joined)."""
    text = README.read_text(encoding="utf-8").split("## Train a real model", 1)[1]
    block = re.search(r"^```bash\n(.*?)^```$", text, re.M | re.S).group(1)
    command = next(line for line in block.replace("\\\n", " ").splitlines() if "dew train" in line)
    return shlex.split(command.split("#")[0])


@pytest.mark.slow
@pytest.mark.timeout(1800)  # a real 135M-param model: minutes to compile on a loaded CPU
def test_the_readme_trains_a_real_model_as_written_in_1_step(tmp_path):
    """The README's command, its steps cut to 1 and its held-out set to 4 tasks (an evaluation
    before the update and one after it), run as a newcomer types it: `dew` in a process of its
    own. Its peak (3.7 GB; 10 GB before issue 42's work) ends with it: run inside a test
    worker, the worker kept that memory for the rest of the suite and the machine swapped.

    One step, where it ran 2: a second proves nothing the first does not (an update, its
    weights pushed to the engine and evaluated) and cost 38 CPU-s (the command alone: 220
    CPU-s against 182). Its programs compile without XLA's most expensive passes, as the
    suite's do (tests/conftest.py): with them, this 135M-param model's update compiled in 74 s
    against 16 and its engine's prefill and decode in 34 s against 7, and the command took 182
    CPU-s against 93. With both changes this file's two tests took 190 CPU-s against 265, the
    notebook 86 against 82 (its step runs unoptimised)."""
    argv = real_model_command()
    assert argv[:4] == ["dew", "train", "--model", "smollm2"]
    pairs = zip(argv, argv[1:], strict=False)
    options = {option: value for option, value in pairs if option.startswith("--")}
    assert int(options["--eval-tasks"]) >= 64 and "--run" in options
    shortened = {"--steps": "1", "--eval-every": "1", "--eval-tasks": "4"}
    argv = [shortened.get(argv[i - 1], arg) if i else arg for i, arg in enumerate(argv)]
    run = tmp_path / "run"
    argv[argv.index("--run") + 1] = str(run)
    done = subprocess.run(
        [sys.executable, "-m", *argv], capture_output=True, text=True, timeout=1700
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "held-out before training: greedy" in done.stdout, done.stdout[-3000:]
    evaluations = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    assert [e["updates"] for e in evaluations] == [0, 1]
    assert (run / "eval_samples.md").exists() and (run / "checkpoints" / "model").is_dir()
    shutil.rmtree(run)  # its checkpoints hold 2.1 GB, which pytest keeps for three sessions


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_the_real_model_notebook_runs_and_draws(monkeypatch, tmp_path):
    """notebooks/real_model.ipynb as test_notebooks.py runs every other notebook, trained for 1
    step on 4 held-out tasks (evaluated before and after it) where it reads 30 steps on 64 (a
    second step took 35 s more). Its kernel compiles as the README's run above does (without
    XLA's most expensive passes), so that it finds that run's programs in the cache.

    The notebook's run folder (`tempfile.mkdtemp()`, a checkpoint of 2.1 GB) goes under the
    test's own folder (the kernel's TMPDIR), removed once the notebook ran: in the system's
    temporary folder, every run of this test left one behind (14 of them, 29 GB, in /tmp)."""
    monkeypatch.setenv("DEW_REAL_MODEL_STEPS", "1")
    monkeypatch.setenv("DEW_REAL_MODEL_EVAL_TASKS", "4")
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    run_notebook(ROOT / "notebooks" / "real_model.ipynb", cell_seconds=1500)
    runs = list(tmp_path.glob("*/smollm2"))
    assert len(runs) == 1, f"the notebook's run is not in the TMPDIR the test gave it: {runs}"
    shutil.rmtree(runs[0].parent)
