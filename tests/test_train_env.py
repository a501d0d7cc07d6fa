"""`dew train --env SPEC`: a verifiers environment (built in the tests, `_vf_copy`) trained end
to end through the recording gateway with its held-out tasks evaluated, and bad environments
refused in one line naming the culprit before anything starts."""

from __future__ import annotations

import json

import jax
import pytest

from _bpe import train_bpe
from dew.cli import main
from dew.data import Task
from dew.envs.lookup import LookupTask
from dew.envs.verifiers import Verifiers
from dew.serve.tokenizer import HuggingFaceTokenizer

TINY = ["--d-model", "16", "--heads", "2", "--layers", "1", "--d-ff", "32"]
TINY += ["--batch-size", "2", "--groups", "2", "--tasks", "4", "--checkpoint-every", "5"]


def lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.medium
def test_dew_train_env_trains_a_verifiers_environment_and_evaluates_its_held_out_tasks(
    tmp_path, capsys
):
    run = tmp_path / "run"
    argv = ["train", "--env", "verifiers:_vf_copy,digits=3", "--run", str(run), *TINY]
    argv += ["--steps", "2", "--max-tokens", "4", "--eval-every", "2", "--eval-tasks", "2"]
    with jax.numpy_dtype_promotion("standard"):  # as in test_train_harness
        assert main(argv) == 0
    assert "dew train: verifiers:_vf_copy,digits=3 for 2 steps" in capsys.readouterr().out
    metrics = lines(run / "metrics.jsonl")
    assert [line["updates"] for line in metrics] == [1, 2]
    # The environment's rubric: each reward and metric a component of the step's reward.
    for line in metrics:
        assert {"reward/copied", "reward/length", "reward/metric/reply_length"} <= set(line)
        assert line["status/completed"] + line["status/truncated"] == 1.0
    evaluations = lines(run / "eval.jsonl")
    assert [e["updates"] for e in evaluations] == [0, 2] and len(evaluations[1]["rewards"]) == 2


@pytest.mark.parametrize(
    ("argv", "culprit"),
    [
        (["--env", "gsm8k"], "--env gsm8k: name verifiers:NAME"),
        (["--env", "verifiers:_vf_copy", "--task", "copy"], "give one of --task, --harness"),
        (["--env", "verifiers:no-such-env"], "'no-such-env' is not installed"),
        (["--env", "verifiers:_vf_copy,digitz=3"], "refuses {'digitz': 3}"),
        (["--env", "textarena:Chess-v0"], "dew plays TextArena games Wordle-v0"),
        (["--task", "copy", "--max-context", "64"], "max_context sizes an environment's"),
    ],
)
def test_a_bad_environment_is_refused_in_one_line(tmp_path, capsys, argv, culprit):
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--run", str(tmp_path / "run"), *argv])
    assert exit_.value.code == 2
    assert culprit in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("task", "kind"),
    [
        (["--env", "verifiers:_vf_copy,digits=3", "--max-tokens", "4"], "verifiers"),
        (["--harness", "lookup"], "harness"),  # its turns size their own replies
    ],
)
@pytest.mark.medium
def test_the_runs_tokenizer_and_evaluations_reach_a_gateway_run(tmp_path, task, kind):
    """`--tokenizer` renders what the environment's or harness's agents send through the
    gateway (a small BPE trained here, not the byte tokenizer), and `--eval-every` evaluates its
    held-out tasks."""
    path = train_bpe(tmp_path / "tokenizer.json")
    tokenizer = HuggingFaceTokenizer.from_file(path)
    run = tmp_path / "run"
    argv = ["train", *task, "--run", str(run), *TINY, "--tokenizer", str(path), "--steps", "1"]
    argv += ["--eval-every", "1", "--eval-tasks", "2", "--samples", "2"]
    with jax.numpy_dtype_promotion("standard"):
        assert main(argv) == 0
    if kind == "verifiers":
        env = Verifiers.parse("_vf_copy,digits=3", size=6)
        asked = lambda task_id: env.task(task_id).payload.data.digits  # noqa: E731
    else:
        asked = lambda task_id: LookupTask().question(Task(str(task_id)))  # noqa: E731
    samples = lines(run / "samples.jsonl")
    assert samples
    for sample in samples:
        user = [{"role": "user", "content": asked(int(sample["task"]))}]
        assert sample["prompt"] == tokenizer.decode(tokenizer.encode_chat(user))
    evaluations = lines(run / "eval.jsonl")
    assert [e["updates"] for e in evaluations] == [0, 1] and len(evaluations[1]["rewards"]) == 2
