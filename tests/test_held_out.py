"""A run's held-out evaluation: greedy and mean@k reward, per-class accuracy and distinct
correct answers (a constant answer shows), and the replies beside the base model's."""

from __future__ import annotations

import json

import jax
import pytest

from _checkpoint import tiny_qwen2
from dew.cli import main
from dew.data import Task
from dew.envs import CopyDigits
from dew.train._evaluation import held_out_scores, write_eval_samples


def lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_constant_answer_shows_in_the_classes_not_in_the_mean():
    """A policy that answers "No" to everything scores the share of "No" items; per class it
    scores 1 on "No" and 0 on "Yes", and one distinct correct answer."""
    answers = ["No", "No", "Yes", "No"]
    greedy = [1.0, 1.0, 0.0, 1.0]
    sampled = [[1.0, 0.0], [1.0, 1.0], [0.0, 0.0], [0.5, 0.5]]
    scores = held_out_scores(greedy, sampled, answers)
    assert scores == {
        "greedy": 0.75,
        "mean@2": pytest.approx(0.5),
        "pass@2": 0.5,
        "distinct_correct": 1,
        "majority": 0.75,
        "class/No": 1.0,
        "class/Yes": 0.0,
    }
    # Free answers (more than ten distinct): no classes, the distinct correct ones counted.
    free = [str(n) for n in range(12)]
    scores = held_out_scores([1.0] * 6 + [0.2] * 6, [[]] * 12, free)
    assert scores == {"greedy": 0.6, "distinct_correct": 6}
    assert held_out_scores([0.5, 0.0], [[], []], None) == {"greedy": 0.25}


def test_pass_at_k_is_the_share_of_tasks_a_sampled_reply_solved():
    """Issue 44 item 7: pass@k counts a task once however many of its k replies are correct,
    and a reply at partial credit (a closest guess, part of an answer) solves nothing."""
    sampled = [[0.0, 1.0, 1.0], [0.99, 0.5, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    scores = held_out_scores([0.0] * 4, sampled, None)
    assert scores == {"greedy": 0.0, "mean@3": pytest.approx(4.49 / 12), "pass@3": 0.5}
    assert "pass@1" not in held_out_scores([0.0], [[]], None)


def test_the_samples_file_sets_each_reply_beside_the_base_models(tmp_path):
    def record(updates, task, reply, reward):
        prompt = f"<|im_start|>user\nwhat is {task}|?<|im_end|>\n<|im_start|>assistant\n"
        return {"updates": updates, "task": task, "answer": "7", "prompt": prompt,
                "completion": reply, "reward": reward}  # fmt: skip

    jsonl, markdown = tmp_path / "eval_samples.jsonl", tmp_path / "eval_samples.md"
    shown = [record(0, "9", "seven\nor so", 0.0), record(3, "9", "7", 1.0)]
    jsonl.write_text("".join(json.dumps(line) + "\n" for line in shown))
    write_eval_samples(jsonl, markdown)
    text = markdown.read_text()
    assert "## After 0 updates" in text and "## After 3 updates" in text
    after = text.split("## After 3 updates")[1]
    assert "| 9 | what is 9\\|? | 7 | seven<br>or so (0.00) | 7 (1.00) |" in after


@pytest.mark.medium
def test_a_run_evaluates_held_out_tasks_before_and_after_with_classes_and_replies(tmp_path):
    """On a tiny checkpoint, the copy task (a digit's answer: ten classes): an evaluation before
    the first update and every --eval-every, on the tasks past --tasks."""
    folder = tiny_qwen2(tmp_path / "tiny")
    run = tmp_path / "run"
    argv = ["train", "--model", str(folder), "--run", str(run), "--steps", "2"]
    argv += ["--batch-size", "2", "--groups", "2", "--tasks", "4", "--max-tokens", "3"]
    argv += ["--eval-every", "2", "--eval-tasks", "12", "--eval-samples", "2", "--samples", "0"]
    with jax.numpy_dtype_promotion("standard"):  # optax's Adam
        assert main(argv) == 0
    copy = CopyDigits(seed=0)
    answers = [copy.answer(Task(str(index))) for index in range(4, 16)]
    evaluations = lines(run / "eval.jsonl")
    assert [e["updates"] for e in evaluations] == [0, 2]
    for evaluation in evaluations:
        assert len(evaluation["rewards"]) == 12
        assert evaluation["greedy"] == pytest.approx(sum(evaluation["rewards"]) / 12)
        assert 0 <= evaluation["mean@2"] <= 1
        assert {key for key in evaluation if key.startswith("class/")} == {
            f"class/{answer}" for answer in answers
        }
        assert evaluation["majority"] == max(answers.count(a) for a in answers) / 12
    # The replies of the first held-out tasks at each evaluation, the base model's at 0.
    shown = lines(run / "eval_samples.jsonl")
    assert [(s["updates"], s["task"]) for s in shown] == [
        (updates, str(index)) for updates in (0, 2) for index in range(4, 12)
    ]
    assert all(s["answer"] == copy.answer(Task(s["task"])) for s in shown)
    assert all(copy.prompt(Task(s["task"])) in s["prompt"] for s in shown)
    text = (run / "eval_samples.md").read_text()
    base = {s["task"]: s for s in shown if s["updates"] == 0}
    after = text.split("## After 2 updates")[1]
    for record in shown[8:]:
        before = base[record["task"]]
        cell = f"{before['completion']} ({before['reward']:.2f})"
        assert cell.replace("|", "\\|").replace("\n", "<br>") in after


@pytest.mark.medium
def test_an_evaluations_keys_are_in_the_metrics_line_of_its_update_and_on_tensorboard(tmp_path):
    """Issue 41: the held-out evaluation's figures (greedy, mean@k, per class, majority) are in
    `metrics.jsonl` at the update they were measured after, as in TensorBoard, not in
    `eval.jsonl` alone; dew's own default model on the copy task."""
    from test_train_task import scalars

    run = tmp_path / "run"
    argv = ["train", "--run", str(run), "--steps", "3", "--batch-size", "2", "--groups", "2"]
    argv += ["--tasks", "4", "--eval-every", "2", "--eval-tasks", "12", "--eval-samples", "2"]
    argv += ["--samples", "0", "--tensorboard"]
    with jax.numpy_dtype_promotion("standard"):  # optax's Adam
        assert main(argv) == 0
    evaluations = lines(run / "eval.jsonl")
    assert [e["updates"] for e in evaluations] == [0, 2]
    metrics = lines(run / "metrics.jsonl")
    assert [line["updates"] for line in metrics] == [1, 2, 3]
    measured = {key: value for key, value in evaluations[1].items() if key != "rewards"}
    assert {"greedy", "mean@2", "pass@2", "majority"} <= measured.keys()
    assert any(key.startswith("class/") for key in measured)
    assert {f"eval/{key}": value for key, value in measured.items()} == {
        key: value for key, value in metrics[1].items() if key.startswith("eval/")
    }
    assert not [key for line in (metrics[0], metrics[2]) for key in line if key.startswith("eval/")]
    board = scalars(run / "tensorboard")
    # (TensorBoard's tags take no '@': tensorboardX writes mean@2 as eval/mean_2.)
    for key in ("greedy", "majority", next(key for key in measured if key.startswith("class/"))):
        assert board[f"eval/{key}"] == {
            0: pytest.approx(evaluations[0][key]),
            2: pytest.approx(evaluations[1][key]),
        }


def byte_task_and_engine():
    """`dew train`'s default task over the byte tokenizer, its model's initial variables and a
    RolloutServer of 4 slots on them: what an evaluation of the default run is built from."""
    from dew import models
    from dew.serve import RolloutServer
    from dew.serve.tokenizer import BYTES
    from dew.train import TrainConfig
    from dew.train._tasks import _task

    config = TrainConfig(eval_tasks=2)
    task = _task(config, BYTES)
    model_config = config.model_config(task.shape.max_len, vocab=BYTES.vocab_size)
    variables = models.init(jax.random.key(0), model_config)
    model = models.model(model_config)
    server = RolloutServer(model, variables, slots=4, max_len=task.shape.max_len)
    return task, variables, server


@pytest.mark.medium
def test_an_evaluations_engine_serves_the_weights_it_evaluates_without_a_copy():
    """Issue 42: the evaluation's engine ran on a copy of the trainer's weights, a fifth copy
    of them beside the trainer's params, Adam's two moments and the rollout engine's
    (SmolLM2-135M: 0.5 GiB more while it ran). It runs between the trainer's updates, on the
    trainer's thread, so it serves the trainer's own arrays."""
    import numpy as np

    from dew.train._evaluation import Evaluation

    task, variables, server = byte_task_and_engine()
    served = []

    class Watched:
        """The run's task, noting the engine each rollout source is made for."""

        def __getattr__(self, name):
            return getattr(task, name)

        def source(self, engine, sampling):
            served.append(engine)
            return task.source(engine, sampling)

    evaluation = Evaluation(
        Watched(), np.arange(8, 10), server, 4, samples=1, temperature=1.0, seed=0
    )
    line, _ = evaluation(variables, 0)
    assert len(line["rewards"]) == 2 and len(served) == 2
    own = [id(leaf) for leaf in jax.tree.leaves(variables)]
    for engine in served:
        assert [id(leaf) for leaf in jax.tree.leaves(engine._params)] == own


def test_an_evaluation_holds_no_weights_between_its_runs():
    """Issue 42 (a real model's memory): the held-out evaluation's engine lives for one
    evaluation. Building the evaluation allocates no array, and once an evaluation is over no
    array of its remains: it drew random placeholder weights at the start and then held each
    evaluation's copy of the weights and its cache through every update (SmolLM2-135M's 0.5 GiB
    of float32 params at the update's peak). Freed at once, not by the cyclic collector's next
    run, which it waits for in the cycles of its trio runs (the collector is off here)."""
    import gc

    import numpy as np

    from dew.train._evaluation import Evaluation

    task, variables, server = byte_task_and_engine()

    def new_bytes(before: set[int]) -> int:
        return sum(a.nbytes for a in jax.live_arrays() if id(a) not in before)

    held = {id(array) for array in jax.live_arrays()}
    evaluation = Evaluation(task, np.arange(8, 10), server, 4, samples=1, temperature=1.0, seed=0)
    assert new_bytes(held) == 0
    held = {id(array) for array in jax.live_arrays()}
    gc.disable()
    try:
        line, _ = evaluation(variables, 0)
        assert len(line["rewards"]) == 2
        assert new_bytes(held) == 0
    finally:
        gc.enable()
