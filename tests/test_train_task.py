"""`dew train` on a reasoning-gym task, its config files, samples, evaluations and TensorBoard."""

from __future__ import annotations

import json
import math
import struct

import attrs
import jax
import pytest
from tensorboardX.proto import event_pb2

from _bpe import train_bpe
from dew.cli import main
from dew.data import Task
from dew.envs import EchoDigits
from dew.envs.reasoning_gym import ReasoningGym
from dew.serve.tokenizer import HuggingFaceTokenizer
from dew.train import TensorBoard, TrainConfig, train

LETTERS = "reasoning-gym:letter_counting,min_words=1,max_words=1"
TINY = {"d_model": 16, "layers": 1, "heads": 2, "d_ff": 32}


def lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def scalars(logdir) -> dict[str, dict[int, float]]:
    """Every scalar of the event files under `logdir`, read back from their TFRecord framing:
    a little-endian u64 length, its CRC, the serialized `Event`, its CRC."""
    found: dict[str, dict[int, float]] = {}
    for path in logdir.iterdir():
        data = path.read_bytes()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset : offset + 8])
            event = event_pb2.Event.FromString(data[offset + 12 : offset + 12 + length])
            offset += 12 + length + 4
            for value in event.summary.value:
                found.setdefault(value.tag, {})[event.step] = value.simple_value
    return found


@pytest.mark.slow
def test_a_reasoning_gym_task_trains_end_to_end_with_its_scorer(tmp_path):
    """With the user's own tokenizer (`--tokenizer tokenizer.json`, a small BPE trained here):
    it renders the prompts and decodes the replies, and the model is as wide as its
    vocabulary."""
    path = train_bpe(tmp_path / "tokenizer.json")
    tokenizer = HuggingFaceTokenizer.from_file(path)
    assert tokenizer.vocab_size != 260  # not the byte tokenizer's
    config = TrainConfig(
        task=LETTERS,
        steps=2,
        batch_size=2,
        groups=2,
        tasks=6,
        max_tokens=2,
        eval_every=1,
        eval_tasks=3,
        samples=3,
        tensorboard=True,
        tokenizer=str(path),
        **TINY,
    )
    steps = []
    run = tmp_path / "run"
    # optax's Adam under strict promotion: see test_train's learning test.
    with jax.numpy_dtype_promotion("standard"):
        trainer = train(config, run, on_step=steps.append)
    assert trainer.variables["embed"].shape[0] == tokenizer.vocab_size
    metrics = lines(run / "metrics.jsonl")
    assert [line["updates"] for line in metrics] == [1, 2]
    assert all(math.isfinite(line["loss"]) for line in metrics)
    # Every sampled rollout's reward is reasoning-gym's score of its reply against its entry.
    gym = ReasoningGym.parse(LETTERS, size=config.tasks + config.eval_tasks, seed=config.seed)
    samples = lines(run / "samples.jsonl")
    assert {sample["step"] for sample in samples} == {0, 1}
    assert all(1 <= [s["step"] for s in samples].count(step) <= 3 for step in (0, 1))
    for sample in samples:
        assert int(sample["task"]) < config.tasks
        entry = gym.entry(int(sample["task"]))
        user = [{"role": "user", "content": entry["question"]}]
        assert sample["prompt"] == tokenizer.decode(tokenizer.encode_chat(user))
        assert sample["prompt"].startswith("<bos><|im_start|>user\nHow many times does the letter")
        reply = sample["completion"].removesuffix("<|im_end|>")
        assert sample["reward"] == gym._dataset.score_answer(reply, entry)
        assert sample["status"] in ("completed", "truncated")
    # The evaluations run on the held-out ids, before the first update and after each.
    evaluations = lines(run / "eval.jsonl")
    assert [e["updates"] for e in evaluations] == [0, 1, 2]
    assert all(len(e["rewards"]) == 3 and 0 <= e["greedy"] <= 1 for e in evaluations)
    assert [line["eval/greedy"] for line in steps] == [e["greedy"] for e in evaluations[1:]]
    assert all(0 <= e["mean@4"] <= 1 for e in evaluations)
    assert (run / "curves.png").read_bytes().startswith(b"\x89PNG")
    board = scalars(run / "tensorboard")
    assert board["loss"] == {
        1: pytest.approx(metrics[0]["loss"]),
        2: pytest.approx(metrics[1]["loss"]),
    }
    assert set(board["eval/greedy"]) == {0, 1, 2}
    # The run folder's config reads back as the config that ran, the tokenizer's path in it.
    assert TrainConfig.from_file(run / "config.json") == config


@pytest.mark.medium
def test_the_echo_task_trains_episodes_of_the_turns_its_tasks_set(tmp_path):
    config = TrainConfig(task="echo", steps=2, batch_size=2, groups=2, tasks=8, samples=2, **TINY)
    run = tmp_path / "run"
    with jax.numpy_dtype_promotion("standard"):
        train(config, run)
    echo = EchoDigits(seed=config.seed)
    samples = lines(run / "samples.jsonl")
    assert len(samples) == 4
    for sample in samples:
        assert sample["status"] == "completed"
        turns = sample["completion"].count("<|im_start|>user") + 1
        assert turns == echo.turns(Task(sample["task"]))
    # Every rollout of a step took its task's turns: the step's two groups are both sampled.
    for line in lines(run / "metrics.jsonl"):
        assert line["status/completed"] == 1.0
        tasks = [Task(s["task"]) for s in samples if s["step"] == line["step"]]
        assert len(tasks) == 2
        mean = sum(echo.turns(task) for task in tasks) / 2
        assert line["bias/turns/started_mean"] == line["bias/turns/admitted_mean"] == mean


def test_tensorboard_writes_the_numbers_of_each_line(tmp_path):
    board = TensorBoard(tmp_path)
    board({"step": 0, "updates": 1, "loss": 0.5, "lag": 2, "cut": None, "note": "x"})
    board({"step": 1, "updates": 2, "loss": float("nan"), "lag": 0, "ok": True})
    board.close()
    assert scalars(tmp_path) == {"loss": {1: 0.5}, "lag": {1: 2.0, 2: 0.0}}


def test_a_config_file_with_options_over_it(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(f'task = "{LETTERS}"\nsteps = 7\ngroups = 4\ntensorboard = true\n')
    config = TrainConfig.from_file(path, groups=8)
    assert (config.task, config.steps, config.groups, config.tensorboard) == (LETTERS, 7, 8, True)
    assert attrs.evolve(config, steps=400, groups=16, task="copy", tensorboard=False) == (
        TrainConfig()
    )
    path.write_text("steps = 7\nwings = 2\n")
    with pytest.raises(
        ValueError, match=r"run.toml has keys that are not TrainConfig fields: \['wings'\]"
    ):
        TrainConfig.from_file(path)
    path.write_text("steps = \n")
    with pytest.raises(ValueError, match="cannot read the config file .*run.toml"):
        TrainConfig.from_file(path)
    with pytest.raises(
        ValueError, match="task must be one of .* reasoning-gym:NAME.* or harness:NAME"
    ):
        TrainConfig(task="arithmetic")


def test_help_shows_the_config_file_and_the_new_options(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--config FILE" in text and "(default: none)" in text
    assert "--tensorboard, --no-tensorboard" in text and "reasoning-gym:NAME" in text
    for option in ("--max-tokens", "--eval-every", "--eval-tasks", "--samples"):
        assert option in text
    assert "--tokenizer TOKENIZER a Hugging Face tokenizer.json" in text
    assert "the model's vocabulary is its size (none: bytes) (default: none)" in text


def test_a_bad_config_file_is_named_on_the_command_line(capsys, tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("groups = 1\n")
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--config", str(path), "--run", str(tmp_path / "run")])
    assert exit_.value.code == 2
    assert f"{path}: groups must be an int within [2, 4096], got 1" in capsys.readouterr().err


@pytest.mark.medium
def test_a_resumed_run_cuts_its_samples_and_evaluations_back_to_the_checkpoint(tmp_path):
    """A run that dies after its last checkpoint has logged samples and evaluations of a step it
    will train again: the resumed run logs each step once, as it does the metrics."""
    config = TrainConfig(
        steps=2,
        batch_size=2,
        groups=2,
        tasks=4,
        checkpoint_every=1,
        eval_every=1,
        eval_tasks=1,
        samples=1,
        **TINY,
    )

    def die_at_the_last_step(line):  # after its logs, before its checkpoint
        if line["step"] == 1:
            raise KeyboardInterrupt("the trainer's process dies")

    with jax.numpy_dtype_promotion("standard"):  # optax's Adam, as above
        with pytest.raises(KeyboardInterrupt):
            train(config, tmp_path, on_step=die_at_the_last_step)
        assert [s["step"] for s in lines(tmp_path / "samples.jsonl")] == [0, 1]
        assert [e["updates"] for e in lines(tmp_path / "eval.jsonl")] == [0, 1, 2]
        train(config, tmp_path, resume=True)  # from the checkpoint at 1 update
    assert [s["step"] for s in lines(tmp_path / "samples.jsonl")] == [0, 1]
    assert [e["updates"] for e in lines(tmp_path / "eval.jsonl")] == [0, 1, 2]
    assert [e["updates"] for e in lines(tmp_path / "eval_samples.jsonl")] == [0, 1, 2]
    assert [m["step"] for m in lines(tmp_path / "metrics.jsonl")] == [0, 1]


@pytest.mark.parametrize(
    ("make", "culprit"),
    [
        (lambda path: path, "there is no such file"),
        (lambda path: path.write_text("{not json") and path, ""),
        (
            lambda path: train_bpe(path, specials=["<bos>"]),
            "HuggingFaceTokenizer: the chat template needs '<|im_start|>', which the",
        ),
    ],
    ids=["missing", "not-json", "no-chat-tokens"],
)
def test_a_bad_tokenizer_is_refused_naming_it(tmp_path, capsys, make, culprit):
    path = make(tmp_path / "tokenizer.json")
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--tokenizer", str(path), "--run", str(tmp_path / "run")])
    assert exit_.value.code == 2
    error = capsys.readouterr().err
    assert f"--tokenizer {path}: {culprit}" in error
    assert not (tmp_path / "run").exists()
    for bad in (3, ""):
        with pytest.raises(
            ValueError, match=f"tokenizer must be a file's path or None, got {bad!r}"
        ):
            TrainConfig(tokenizer=bad)


def test_every_metrics_line_has_the_push_and_the_summary_the_wall_time(tmp_path, capsys):
    """Each line names the version the engine serves and its push's seconds (push times were
    in no line), and the last line gives the command's wall time, not the steps' alone (a
    vLLM run said "trained 6 steps in 36s" after 255 s)."""
    run = tmp_path / "run"
    tiny = [f"--{name.replace('_', '-')}={value}" for name, value in TINY.items()]
    options = ["--steps=2", "--batch-size=2", "--groups=2", "--tasks=4", "--max-tokens=2"]
    with jax.numpy_dtype_promotion("standard"):
        assert main(["train", *options, *tiny, "--run", str(run)]) == 0
    metrics = lines(run / "metrics.jsonl")
    assert [line["push/version"] for line in metrics] == [0, 1]
    assert all(line["push/seconds"] >= 0 for line in metrics)
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert summary.startswith("trained 2 steps in ") and "s of wall time (" in summary


@pytest.mark.medium
def test_the_copy_task_replies_up_to_max_tokens_when_given(tmp_path):
    """`--max-tokens` sizes a copy reply (a BPE model such as SmolLM2 says more than a digit
    and a stop token: every reply was cut at 2 tokens whatever it asked); left out, the reply
    is the digits and a stop token, as a byte tokenizer counts them."""
    from dew.serve.tokenizer import BYTES
    from dew.train._tasks import _task

    for given, reply in ((None, 2), (6, 6)):
        config = TrainConfig(task="copy", max_tokens=given, **TINY)
        task = _task(config, BYTES)
        prompt = BYTES.encode_chat([{"role": "user", "content": "0" * 8}])
        assert task.shape.max_len == len(prompt) + reply
    # A run's rollouts reach it: a tiny model seldom stops, so its replies fill it.
    config = TrainConfig(
        task="copy", steps=1, batch_size=2, groups=2, tasks=2, max_tokens=6, samples=0, **TINY
    )
    run = tmp_path / "run"
    with jax.numpy_dtype_promotion("standard"):  # optax's Adam, as above
        train(config, run)
    (line,) = lines(run / "metrics.jsonl")
    assert line["status/truncated"] > 0 and line["length/max"] == 6


@pytest.mark.parametrize("task", ["guess", "echo", "harness:lookup"])
def test_max_tokens_is_refused_for_a_task_of_its_own_turns(task):
    with pytest.raises(ValueError, match=f"max_tokens sizes a reply; task '{task}' sets its"):
        TrainConfig(task=task, max_tokens=8)
