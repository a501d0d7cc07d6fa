"""A hostile pass over `dew train --resume` and the run folder: a resumed run whose options
differ from the run's is refused naming the option and both values, one that asks for fewer
steps than the run has trained is refused rather than doing nothing with exit status 0, a run
folder whose logs were cut short since their checkpoint is refused before anything starts
(they used to be padded with NUL bytes, and the run died drawing its curves), and `--resume`
of a folder that holds no checkpoint says that it trains from the first step.

One tiny run is trained once for the module (in this process, `dew.cli.main`); each test
works on a copy of its folder.
"""

from __future__ import annotations

import json
import shutil

import jax
import pytest

from dew import cli
from dew.train import TrainConfig
from dew.train import _run as train_run

TINY = ["--d-model", "16", "--heads", "2", "--layers", "1", "--d-ff", "32"]
TINY += ["--batch-size", "2", "--groups", "2", "--tasks", "4", "--steps", "2"]
TINY_CONFIG = dict(d_model=16, heads=2, layers=1, d_ff=32, batch_size=2, groups=2, tasks=4, steps=2)


def refusal(capsys, argv: list[str]) -> str:
    """Run `dew train argv`, which must refuse with status 2 before training; its error line."""
    with pytest.raises(SystemExit) as exit_:
        dew_train(argv)  # trains, should the refusal fail to come
    assert exit_.value.code == 2
    captured = capsys.readouterr()
    assert "step 1/" not in captured.out
    lines = captured.err.splitlines()
    assert len(lines) == 2 and lines[0].startswith("dew train: error: "), captured.err
    return lines[0].removeprefix("dew train: error: ")


def dew_train(argv: list[str]) -> int:
    # optax's Adam under strict dtype promotion: as tests/test_train.py runs it.
    with jax.numpy_dtype_promotion("standard"):
        return cli.main(["train", *argv])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A run folder that trained its 2 steps, with a checkpoint at step 2."""
    run = tmp_path_factory.mktemp("trained") / "run"
    assert dew_train(["--run", str(run), *TINY]) == 0
    return run


@pytest.fixture
def run(trained, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(trained, copy)
    return copy


@pytest.mark.parametrize(
    ("options", "named"),
    [
        (["--groups", "4"], "--groups 2, not 4"),
        (["--batch-size", "4"], "--batch-size 2, not 4"),
        (["--d-model", "32"], "--d-model 16, not 32"),
        (["--seed", "7"], "--seed 0, not 7"),
        (["--ahead", "0"], "--ahead 1, not 0"),
        (["--task", "echo"], "--task copy, not echo"),
        (["--model", "some/model"], "--model none, not some/model"),
        (["--filter-uniform"], "--filter-uniform off, not on"),
    ],
)
@pytest.mark.medium
def test_a_resume_with_another_option_names_it_and_both_values(capsys, run, options, named):
    """Failed before: the refusal named the field (`groups`, not `--groups`) and printed the
    whole earlier config, never the value given now."""
    line = refusal(capsys, ["--run", str(run), "--resume", *options])
    assert named in line, line
    assert "TrainConfig(" not in line


def test_a_resume_with_several_other_options_names_each(capsys, run):
    """Failed before (as above)."""
    line = refusal(capsys, ["--run", str(run), "--resume", "--groups", "4", "--seed", "3"])
    assert "--groups 2, not 4" in line and "--seed 0, not 3" in line, line


def test_a_resume_for_fewer_steps_than_trained_is_refused(capsys, run):
    """Failed before: `--steps 1` on a run that trained 2 exited 0 saying `trained 2 steps`,
    having done nothing the user asked for."""
    line = refusal(capsys, ["--run", str(run), "--resume", "--steps", "1"])
    assert "--steps 1" in line and "trained 2 steps" in line, line


@pytest.mark.parametrize("log", ["metrics.jsonl", "samples.jsonl"])
def test_a_log_cut_short_since_its_checkpoint_is_refused_before_anything_starts(capsys, run, log):
    """Failed before: `--resume` padded the log back to its checkpoint's length with NUL bytes
    (thousands of them, mid-line), trained on, and died drawing curves.png with a traceback."""
    path = run / log
    whole = path.read_bytes()
    path.write_bytes(whole[: len(whole) // 2])
    line = refusal(capsys, ["--run", str(run), "--resume", "--steps", "3"])
    assert str(path) in line and f"{len(whole) // 2} bytes" in line, line
    assert f"{len(whole)}" in line
    assert path.read_bytes() == whole[: len(whole) // 2]  # left as it was


def test_a_metrics_log_gone_since_its_checkpoint_is_refused(capsys, run):
    """Failed before: a deleted metrics.jsonl was made again of NUL bytes alone."""
    (run / "metrics.jsonl").unlink()
    line = refusal(capsys, ["--run", str(run), "--resume", "--steps", "3"])
    assert "metrics.jsonl" in line and "0 bytes" in line, line


def test_a_resume_whose_logs_ran_past_the_checkpoint_drops_the_extra_lines_once(run, capsys):
    """Pins docs/checkpoints.md's promise (a crash between a step's metrics line and its
    checkpoint, and a stray temporary file of a killed save): the lines past the checkpoint
    are cut, a step is logged once, and the temporary file is gone after the next commit."""
    metrics = run / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    extra = json.loads(lines[-1]) | {"step": 2, "updates": 3, "position": 2}
    metrics.write_text("\n".join([*lines, json.dumps(extra), '{"step": 3, "upd']))
    stray = run / "checkpoints" / ".checkpoint.json.0badc0de.tmp"
    stray.write_text("{")
    assert dew_train(["--run", str(run), "--resume", "--steps", "3"]) == 0
    logged = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [line["step"] for line in logged] == [0, 1, 2]
    assert not stray.exists()
    assert "resuming at step 2, data position 2" in capsys.readouterr().out


def test_resume_of_a_folder_without_a_checkpoint_says_it_starts_afresh(tmp_path, capsys):
    """Failed before: `--resume` of a folder with no checkpoint (a mistyped --run) trained from
    the first step without a word that it was not resuming."""
    run = tmp_path / "typo"
    argv = ["--run", str(run), "--resume", *TINY, "--steps", "1"]
    assert dew_train(argv) == 0
    out = capsys.readouterr().out
    assert f"no checkpoint in {run / 'checkpoints'}: training from the first step" in out, out


@pytest.mark.medium
def test_a_second_run_into_a_folder_in_use_is_refused_and_writes_nothing(tmp_path, capsys):
    """Failed before: a `--resume` typed while the run still trained (here: from the first
    run's own step callback) trained alongside it into the same folder, its steps logged
    beside the first run's."""
    run = tmp_path / "run"
    seen: list[tuple[int, str]] = []

    def second(line):
        if line["updates"] == 1:
            before = (run / "metrics.jsonl").read_bytes()
            status = dew_train(["--run", str(run), "--resume", "--steps", "4"])
            assert (run / "metrics.jsonl").read_bytes() == before
            seen.append((status, capsys.readouterr().err))

    config = TrainConfig(**TINY_CONFIG)
    with jax.numpy_dtype_promotion("standard"):
        train_run.train(config, run, on_step=second)
    [(status, err)] = seen
    assert status == 1
    assert (
        err == f"dew train: {run} is in use by another dew train that has not ended; "
        "wait for it, or stop it (Ctrl-C saves its checkpoint) and resume then\n"
    )
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in logged] == [0, 1]
    # and once the first run has ended, the folder is free to resume
    assert dew_train(["--run", str(run), "--resume", "--steps", "3"]) == 0
