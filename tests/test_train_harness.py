"""`dew train --harness NAME`: a built-in agent harness trained end to end through the recording
gateway, with the run folder every task gets (metrics, samples, evaluations, checkpoints,
curves) and resume."""

from __future__ import annotations

import json

import jax
import pytest

from dew.cli import main
from dew.train import COMMIT

TINY = ["--d-model", "16", "--heads", "2", "--layers", "1", "--d-ff", "32"]
TINY += ["--batch-size", "2", "--groups", "2", "--tasks", "8", "--checkpoint-every", "1"]


def lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_dew_train_harness_trains_evaluates_records_checkpoints_and_resumes(tmp_path, capsys):
    run, trace = tmp_path / "run", tmp_path / "run.trace"
    argv = ["train", "--harness", "lookup", "--run", str(run), *TINY, "--eval-every", "2"]
    argv += ["--eval-tasks", "2"]
    # optax's Adam raises its float decay to its int32 step count, which strict promotion
    # refuses: the trainer's thread steps under standard promotion (the setting is per thread).
    with jax.numpy_dtype_promotion("standard"):
        assert main([*argv, "--steps", "2", "--record", str(trace)]) == 0
        assert main([*argv, "--steps", "3", "--resume"]) == 0
    out = capsys.readouterr().out
    # The gateway's sessions replay like any source's: the scheduler's decisions, bit for bit.
    assert main(["replay", str(trace)]) == 0
    assert "replay matched: 2 steps" in capsys.readouterr().out
    assert "dew train: harness:lookup for 2 steps" in out and "resuming at step 2" in out
    assert json.loads((run / "config.json").read_text())["task"] == "harness:lookup"
    metrics = lines(run / "metrics.jsonl")
    assert [line["updates"] for line in metrics] == [1, 2, 3]
    # Every rollout is the lookup agent's session, scored by its verifier, its calls one chain.
    for line in metrics:
        assert {"reward/lookup", "reward/answer"} <= set(line) and line["groups"] == 2
        assert line["tokens/trained"] > 0
    samples = lines(run / "samples.jsonl")
    assert samples and all(s["prompt"].startswith("<bos><|im_start|>user\n") for s in samples)
    evaluations = lines(run / "eval.jsonl")
    assert [e["updates"] for e in evaluations] == [0, 2] and len(evaluations[1]["rewards"]) == 2
    assert json.loads((run / "checkpoints" / COMMIT).read_text())["updates"] == 3
    assert (run / "curves.png").exists()


@pytest.mark.parametrize(
    ("argv", "culprit"),
    [
        (["--harness", "nope"], "unknown harness 'nope'; the built-in harnesses are: lookup,"),
        (["--harness", "lookup", "--task", "copy"], "give --task or --harness"),
        (["--task", "harness:nope"], "unknown harness 'nope'"),
    ],
)
def test_a_bad_harness_is_refused_naming_the_known_ones(tmp_path, capsys, argv, culprit):
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--run", str(tmp_path / "run"), *argv])
    assert exit_.value.code == 2
    assert culprit in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_a_harness_without_the_gateway_packages_is_refused_naming_them(
    tmp_path, capsys, monkeypatch
):
    from dew.train import _config_fields

    monkeypatch.setattr(_config_fields, "_GATEWAY_PACKAGES", ("hypercorn", "dew_no_such_package"))
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--run", str(tmp_path / "run"), "--harness", "lookup"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "needs dew_no_such_package: pip install 'dew[gateway]'" in err
