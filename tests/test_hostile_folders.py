"""A hostile pass over the run folder's two writers besides training, `dew export` and
`dew train --resume` (issue 48): neither may destroy what it did not write, each reads the
run's state once and from one place, and each refuses what it cannot do in one line.

Each test names the issue's item it pins; each destructive case ends with every file that was
there still there, byte for byte.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import attrs
import jax
import numpy as np
import pytest

from _hf_folders import chat_checkpoint
from dew import cli
from dew.models import hf
from dew.train import TrainConfig, _export
from dew.train import _checkpoint as checkpoint_module
from dew.train._checkpoint import Checkpoint, save_checkpoint

SHAPE = {
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 256,
}


def files(folder: Path) -> dict[str, bytes]:
    """Every file under `folder`, by its path relative to it, with its bytes."""
    return {
        str(path.relative_to(folder)): path.read_bytes()
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


def refusal(capsys, command: str, argv: list[str]) -> str:
    """Run `dew COMMAND argv`, which must refuse with status 2 in one line and the hint; the
    line, without its `dew COMMAND: error: `."""
    with pytest.raises(SystemExit) as exit_:
        cli.main([command, *argv])
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and lines[0].startswith(f"dew {command}: error: "), lines
    return lines[0].removeprefix(f"dew {command}: error: ")


def moved(params, shift: float):
    """`params` with every leaf moved by `shift`: a checkpoint's params told apart by value."""
    return jax.tree.map(lambda leaf: leaf + np.asarray(shift, leaf.dtype), params)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A tiny Qwen2 checkpoint folder with its own tokenizer: the run's `--model`."""
    return chat_checkpoint(tmp_path_factory.mktemp("qwen2") / "base", SHAPE)


@pytest.fixture
def model_run(base, tmp_path) -> Path:
    """A `dew train --model` run folder as the run leaves it after step 2: its config, logs,
    its checkpoint (written by the real checkpoint writer) and the checkpoint folder beside it."""
    run = tmp_path / "run"
    checkpoints = run / "checkpoints"
    checkpoints.mkdir(parents=True)
    config = TrainConfig(model=str(base), steps=2)
    (run / "config.json").write_text(json.dumps(attrs.asdict(config), indent=1))
    (run / "metrics.jsonl").write_text('{"step": 0, "updates": 1}\n{"step": 1, "updates": 2}\n')
    model, params = hf.load(base)
    save_checkpoint(checkpoints, Checkpoint(moved(params, 2.0), (), updates=2, position=2))
    hf.save(checkpoints / "model", model, moved(params, 2.0), tokenizer_from=base)
    return run


def exported_shift(folder: Path, base: Path) -> float:
    """By how much the params written to `folder` were moved from `base`'s."""
    _, written = hf.load(folder)
    _, params = hf.load(base)
    shifts = {
        round(float(np.mean(np.asarray(a, np.float32) - np.asarray(b, np.float32))), 3)
        for a, b in zip(jax.tree.leaves(written), jax.tree.leaves(params), strict=True)
    }
    (shift,) = shifts
    return shift


# Item 1 --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("where", "named"),
    [
        ("run", "is the run folder"),
        ("run/checkpoints", "is inside the run folder"),
        ("elsewhere", "holds files dew export did not write (notes.txt)"),
        (".", "holds the run folder"),
    ],
)
def test_export_refuses_a_folder_it_did_not_write_and_every_file_stays(
    capsys, model_run, tmp_path, where, named
):
    """Item 1. Failed before: `--to RUN` left only the model files (the config, metrics and
    checkpoints gone), `--to RUN/checkpoints` deleted every checkpoint, `--to` a folder with an
    unrelated file deleted it, and a folder above the run deleted the run."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "notes.txt").write_text("mine")
    before = files(tmp_path)
    to = tmp_path / where
    line = refusal(capsys, "export", ["--run", str(model_run), "--to", str(to)])
    assert line.startswith(f"--to {to} ") and named in line, line
    assert files(tmp_path) == before


def test_export_writes_a_new_folder_and_replaces_only_one_it_wrote(capsys, model_run, tmp_path):
    """Item 1: how export knows a folder is its own: the record it writes into it. A folder an
    export wrote is written again; once it holds a file of someone else's, it is refused."""
    to = tmp_path / "exported"
    assert cli.main(["export", "--run", str(model_run), "--to", str(to)]) == 0
    assert json.loads((to / _export.MARKER).read_text())["updates"] == 2
    assert exported_shift(to, Path(json.loads((model_run / "config.json").read_text())["model"]))
    assert cli.main(["export", "--run", str(model_run), "--to", str(to)]) == 0
    (to / "README.md").write_text("my notes on this model")
    before = files(tmp_path)
    line = refusal(capsys, "export", ["--run", str(model_run), "--to", str(to)])
    assert "holds files dew export did not write (README.md)" in line, line
    assert files(tmp_path) == before
    # The run's own checkpoint folder is the run's to write again, named or by default.
    own = model_run / "checkpoints" / "model"
    assert cli.main(["export", "--run", str(model_run), "--to", str(own)]) == 0
    assert not (own / _export.MARKER).exists()


# Items 11 and 19 -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("to", "named"),
    [
        (".", "is the current folder or one holding it"),
        ("..", "is the current folder or one holding it"),
        ("/proc/dew-export", "nothing can be written in /proc"),
        ("a-file/model", "a-file is a file, not a folder"),
        ("a-file", "is a file, not a folder to write"),
    ],
)
def test_export_to_a_place_it_cannot_write_is_one_line(
    capsys, model_run, tmp_path, monkeypatch, to, named
):
    """Items 11 and 19. Failed before: `--to .` said "PosixPath('.') has an empty name"; `..`,
    /proc and a path through a file ended in a traceback."""
    here = tmp_path / "here"
    here.mkdir()
    (here / "a-file").write_text("not a folder")
    monkeypatch.chdir(here)
    before = files(tmp_path)
    line = refusal(capsys, "export", ["--run", str(model_run), "--to", to])
    assert line.startswith(f"--to {to}") and named in line, line
    assert files(tmp_path) == before


# Item 3 ----------------------------------------------------------------------------------------


def test_export_writes_the_checkpoint_it_names_while_the_run_commits_another(
    capsys, model_run, base, monkeypatch
):
    """Item 3. Failed before: export read the commit record (step 2) to say which step it
    wrote, then read it again to load the params: a run committing step 4 in between (here, the
    real checkpoint writer called right after export's read) had export say step 2 and write
    step 4's weights. Now the step said is the step written."""
    checkpoints = model_run / "checkpoints"
    _, params = hf.load(base)
    real = _export.read_commit
    committed = []

    def read_then_commit(directory):
        record = real(directory)
        if not committed:  # the run commits its next checkpoint once, right after the read
            committed.append(save_checkpoint(checkpoints, Checkpoint(moved(params, 4.0), (), 4, 4)))
        return record

    # Where export resolves the name: the probe must fire, or it tests nothing.
    monkeypatch.setattr(_export, "read_commit", read_then_commit)
    to = model_run.parent / "exported"
    assert cli.main(["export", "--run", str(model_run), "--to", str(to)]) == 0
    assert committed
    said = capsys.readouterr().out
    shift = exported_shift(to, base)
    assert f"the checkpoint at step {int(shift)} of" in said, (said, shift)
    assert json.loads((to / _export.MARKER).read_text())["updates"] == int(shift)


# Item 2 ----------------------------------------------------------------------------------------

TINY = ["--d-model", "16", "--heads", "2", "--layers", "1", "--d-ff", "32"]
TINY += ["--batch-size", "2", "--groups", "2", "--tasks", "4", "--steps", "2"]


def dew_train(argv: list[str]) -> int:
    # optax's Adam under strict dtype promotion: as tests/test_train.py runs it.
    with jax.numpy_dtype_promotion("standard"):
        return cli.main(["train", *argv])


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A run of dew's transformer that trained its 2 steps, with a checkpoint at step 2."""
    run = tmp_path_factory.mktemp("trained") / "run"
    assert dew_train(["--run", str(run), *TINY, "--checkpoint-every", "2"]) == 0
    return run


@pytest.fixture
def run(trained, tmp_path) -> Path:
    """A copy of the trained run, for one test to damage."""
    copy = tmp_path / "run"
    shutil.copytree(trained, copy)
    return copy


def train_refusal(capsys, argv: list[str]) -> str:
    """`dew train argv`, which must refuse in one line before it trains: the line."""
    with jax.numpy_dtype_promotion("standard"):
        line = refusal(capsys, "train", argv)
    return line


@pytest.mark.slow
@pytest.mark.parametrize("lost", ["checkpoints/checkpoint.json", "checkpoints"])
def test_resume_without_a_commit_record_refuses_a_folder_with_a_history(capsys, run, lost):
    """Item 2. Failed before: `--resume` of a run whose checkpoint.json (or checkpoints/) was
    gone said "training from the first step", overwrote metrics.jsonl and, at its first
    checkpoint, deleted the arrays still there."""
    gone = run / lost
    shutil.rmtree(gone) if gone.is_dir() else gone.unlink()
    before = files(run)
    line = train_refusal(capsys, ["--run", str(run), "--resume", "--steps", "4"])
    assert line.startswith(f"--resume: {run} holds a run's metrics.jsonl (2 lines)"), line
    assert "no commit record (checkpoints/checkpoint.json)" in line
    assert "start afresh with another --run" in line
    if lost != "checkpoints":  # the arrays the record named are named too
        assert "checkpoints/state-00000002-" in line, line
    assert files(run) == before


@pytest.mark.medium
@pytest.mark.parametrize("kept", ["metrics.jsonl", "samples.jsonl", "checkpoints/state"])
def test_a_fresh_run_into_a_folder_with_a_history_is_refused(capsys, run, kept):
    """Item 2. Failed before for the samples log and for arrays without their record: a fresh
    `dew train --run DIR` into a folder holding only those trained over them (the samples log
    cut to the new run's, the arrays removed at its first checkpoint)."""
    for path in [run / "checkpoints" / "checkpoint.json", *run.glob("*.jsonl")]:
        if not path.name.startswith(kept):
            path.unlink()
    for path in (run / "checkpoints").iterdir():
        if not f"checkpoints/{path.name}".startswith(kept):
            path.unlink()
    before = files(run)
    assert before  # what the run keeps is there to be overwritten
    line = train_refusal(capsys, ["--run", str(run), *TINY])
    assert line.startswith(f"{run} already holds a run ({kept}"), line
    assert "continue it with --resume, or start afresh with another --run" in line
    assert files(run) == before


# Item 4, build point 4, item 21 and item 13 ----------------------------------------------------


@pytest.mark.parametrize(
    ("field", "edited", "named"),
    [("groups", 4, "groups 4, not 2 as trained"), ("task", "echo", "task echo, not copy")],
)
def test_resume_refuses_an_edited_config_json_as_it_refuses_an_edited_option(
    capsys, run, field, edited, named
):
    """Items 4 and 13. Failed before: `groups` edited in config.json from 2 to 4 was taken on
    `--resume` without a word, while `--groups 4` was refused; so was an edited task."""
    saved = run / "config.json"
    saved.write_text(json.dumps(json.loads(saved.read_text()) | {field: edited}))
    before = files(run)
    line = train_refusal(capsys, ["--run", str(run), "--resume", "--steps", "3"])
    assert line.startswith(f"{saved} was edited since its checkpoint"), line
    assert named in line and "restore it" in line, line
    assert files(run) == before


@pytest.mark.parametrize("arrays_too", [False, True])
def test_resume_refuses_a_commit_record_whose_updates_was_edited(capsys, run, arrays_too):
    """Item 4. Failed before: `updates` edited in checkpoint.json from 2 to 1 resumed "at step
    1, data position 2" and logged step 1 twice. Refused by the arrays the record names, and,
    with those renamed to match, by the metrics line the record keeps."""
    commit = run / "checkpoints" / "checkpoint.json"
    record = json.loads(commit.read_text())
    if arrays_too:
        renamed = record["arrays"].replace("state-00000002-", "state-00000001-")
        (run / "checkpoints" / record["arrays"]).rename(run / "checkpoints" / renamed)
        record["arrays"] = renamed
    commit.write_text(json.dumps(record | {"updates": 1}))
    before = files(run)
    line = train_refusal(capsys, ["--run", str(run), "--resume", "--steps", "3"])
    assert line.startswith(f"{commit} says updates 1, but the "), line
    culprit = "the last line of" if arrays_too else "the arrays it names, state-00000002-"
    assert culprit in line and "updates 2" in line, line
    assert files(run) == before


@pytest.mark.medium
def test_resume_names_the_values_the_run_had_with_its_config_json_gone(capsys, run):
    """Items 21 and 13. Failed before: with config.json gone, `--resume` built the run from
    the defaults (ending in a traceback as the checkpoint did not fit, having written the
    defaults into config.json), so an option was then compared with a default the run never
    had (`--groups 16, not 4`). The run's config is its checkpoint's now."""
    (run / "config.json").unlink()
    line = train_refusal(capsys, ["--run", str(run), "--resume", "--groups", "4"])
    assert "--groups 2, not 4" in line, line
    assert not (run / "config.json").exists()
    assert dew_train(["--run", str(run), "--resume", "--steps", "3"]) == 0
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in logged] == [0, 1, 2]
    assert json.loads((run / "config.json").read_text())["groups"] == 2


def test_resume_with_config_json_gone_and_no_config_in_its_checkpoint_is_one_line(capsys, run):
    """Item 13, for a checkpoint written before checkpoints kept the run's config. Failed
    before: the run was built from the defaults, which its checkpoint did not fit (a
    traceback; then a line blaming the model folder or the task), after config.json had been
    written with the defaults."""
    commit = run / "checkpoints" / "checkpoint.json"
    record = json.loads(commit.read_text())
    del record["metadata"]["config"]
    commit.write_text(json.dumps(record))
    (run / "config.json").unlink()
    before = files(run)
    line = train_refusal(capsys, ["--run", str(run), "--resume", "--steps", "3"])
    assert line == (
        f"{run / 'config.json'} is gone, and {commit} keeps no config to resume the run with "
        "(it was written before checkpoints kept one, or is damaged); restore config.json"
    )
    assert files(run) == before


@pytest.mark.slow
def test_resume_after_the_model_folder_was_replaced_names_what_changed(capsys, base, tmp_path):
    """Item 13. Failed before: `--resume` of a `--model` run whose folder now holds another
    model ended in a traceback (a leaf of another shape)."""
    folder = tmp_path / "model"
    shutil.copytree(base, folder)
    run = tmp_path / "run"
    argv = ["--model", str(folder), "--run", str(run), "--batch-size", "2", "--groups", "2"]
    argv += ["--tasks", "4", "--checkpoint-every", "1"]
    assert dew_train([*argv, "--steps", "1"]) == 0
    shutil.rmtree(folder)
    chat_checkpoint(folder, SHAPE | {"intermediate_size": 48})
    before = files(run)
    capsys.readouterr()
    assert dew_train(["--run", str(run), "--resume", "--steps", "2"]) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"dew train: --resume: the checkpoint in {run / 'checkpoints'} "), line
    assert "its --model folder's config.json changed (intermediate_size 32 then, 48 now)" in line
    assert before.keys() <= files(run).keys()
    assert {name: files(run)[name] for name in before if name != "config.json"} == {
        name: data for name, data in before.items() if name != "config.json"
    }


# Build point 9 ---------------------------------------------------------------------------------


def full_disk_at(monkeypatch, *, step: int) -> list[Path]:
    """Fill the disk as the checkpoint writer writes the arrays of the checkpoint at `step`,
    injected where its call really resolves; the paths it refused, as it refuses them."""
    real = checkpoint_module._write_atomically
    fired = []

    def full(path, write):
        if path.name.startswith(f"state-{step:08d}-"):
            fired.append(path)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real(path, write)

    monkeypatch.setattr(checkpoint_module, "_write_atomically", full)
    return fired


@pytest.mark.medium
def test_a_fault_injected_into_the_checkpoint_writer_fires_and_the_run_resumes(
    capsys, tmp_path, monkeypatch
):
    """Build point 9: the crash-injection probe in reach again. The fault is injected where the
    checkpoint writer's call really resolves, `dew.train._checkpoint._write_atomically` (what
    `save_checkpoint` calls), and the test checks that it fired: a probe that patched a name
    re-exported elsewhere (`dew.train._run._write_atomically`, through which only config.json
    is written) let every checkpoint through and tested nothing. The disk fills while the
    step-4 checkpoint's arrays are written: one line, status 1, the step-2 checkpoint stands,
    and the resumed run logs each step once."""
    fired = full_disk_at(monkeypatch, step=4)
    run = tmp_path / "run"
    argv = ["--run", str(run), *TINY, "--checkpoint-every", "2"]
    assert dew_train([*argv, "--steps", "6"]) == 1
    assert fired, "the fault never fired: it was injected where the writer does not look"
    (line,) = capsys.readouterr().err.splitlines()
    assert line == (
        f"dew train: cannot write {fired[0]}: No space left on device; the last checkpoint "
        f"stands: continue with `dew train --run {run} --resume` once it can be written"
    )
    assert json.loads((run / "checkpoints" / "checkpoint.json").read_text())["updates"] == 2
    monkeypatch.undo()
    assert dew_train(["--run", str(run), "--resume", "--steps", "6"]) == 0
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in logged] == [0, 1, 2, 3, 4, 5]


@pytest.mark.medium
def test_a_full_disk_at_the_first_checkpoint_does_not_advise_a_resume_it_would_refuse(
    capsys, tmp_path, monkeypatch
):
    """Build point 9 with item 2: a run whose first checkpoint could not be written has logged
    steps that no checkpoint holds, which `--resume` refuses to train over. Failed before: the
    line said "the last checkpoint stands: continue with ... --resume", which was refused."""
    fired = full_disk_at(monkeypatch, step=2)
    run = tmp_path / "run"
    assert dew_train(["--run", str(run), *TINY, "--checkpoint-every", "2", "--steps", "4"]) == 1
    assert fired
    (line,) = capsys.readouterr().err.splitlines()
    assert line == (
        f"dew train: cannot write {fired[0]}: No space left on device; its steps were logged "
        "but none checkpointed, so there is nothing to resume: start afresh with another --run "
        "once it can be written"
    )
    monkeypatch.undo()
    line = train_refusal(capsys, ["--run", str(run), "--resume", "--steps", "4"])
    assert "no commit record" in line
