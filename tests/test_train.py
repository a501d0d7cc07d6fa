"""The trainer, its checkpoints and `dew train`: round trips, crashes, resumes and learning."""

from __future__ import annotations

import functools
import io
import json
import os
import signal
import subprocess
import sys
import time

import attrs
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import trio

from dew import models, train
from dew.cli import main
from dew.data import ArrayDataset, Task
from dew.envs.tasks import CopyDigits
from dew.objectives.rl.grpo import GRPOObjective
from dew.objectives.rl.scheduler import SchedulerRecord
from dew.objectives.rl.sessions import Label, Session, Status
from dew.train import (
    Checkpoint,
    Progress,
    ServedSource,
    TrainConfig,
    Trainer,
    load_checkpoint,
    save_checkpoint,
)

CONFIG = models.TransformerConfig(d_model=16, heads=2, layers=1, d_ff=32, max_len=16)
ROWS, WIDTH = 2, 8
# A `dew train` small enough to compile and run in seconds.
TINY = ["--d-model", "16", "--heads", "2", "--layers", "1", "--d-ff", "32"]
TINY += ["--batch-size", "2", "--groups", "2", "--tasks", "16"]


@functools.cache
def params() -> dict:
    return models.init(jax.random.key(0), CONFIG)


# One objective for every test, so its rescoring and its step compile once.
OBJECTIVE = GRPOObjective(models.model(CONFIG))


def assert_trees_equal(a, b) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert jnp.result_type(x) == jnp.result_type(y)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def moved_state(shift: int = 1) -> tuple[dict, optax.OptState]:
    """Params and an Adam state with every leaf moved off its initial value by `shift`."""
    variables = params()
    state = optax.adam(1e-2).init(variables)
    return jax.tree.map(lambda leaf: leaf + shift, (variables, state))


# 1. Checkpoints -----------------------------------------------------------------------------------


def test_a_checkpoint_round_trips_without_pickle(tmp_path):
    variables, opt_state = moved_state()
    variables = {**variables, "half": jnp.arange(3, dtype=jnp.bfloat16)}
    saved = Checkpoint(variables, opt_state, 7, 9, {"note": "x", "elapsed": 1.5})
    commit = save_checkpoint(tmp_path, saved)
    record = json.loads(commit.read_text())
    assert record["updates"] == 7 and record["position"] == 9
    assert "variables['half']" in [leaf["path"] for leaf in record["leaves"]]
    with np.load(tmp_path / record["arrays"], allow_pickle=False) as arrays:
        assert len(arrays.files) == len(record["leaves"])

    templates = jax.tree.map(jnp.zeros_like, (variables, opt_state))
    loaded = load_checkpoint(tmp_path, *templates)
    assert (loaded.updates, loaded.position) == (7, 9)
    assert loaded.metadata == {"note": "x", "elapsed": 1.5}
    assert_trees_equal(loaded.variables, variables)
    assert_trees_equal(loaded.opt_state, opt_state)
    assert load_checkpoint(tmp_path / "empty", *templates) is None


def test_a_new_checkpoint_replaces_the_old_and_removes_its_arrays(tmp_path):
    variables, opt_state = moved_state()
    save_checkpoint(tmp_path, Checkpoint(variables, opt_state, 1, 1))
    leftover = tmp_path / ".state-00000002-0000.npz.1234.tmp"  # a write a crash interrupted
    leftover.write_bytes(b"partial")
    save_checkpoint(tmp_path, Checkpoint(variables, opt_state, 2, 2))
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".json", ".npz"]
    assert load_checkpoint(tmp_path, variables, opt_state).updates == 2


def test_loading_into_other_templates_names_the_leaf(tmp_path):
    variables, opt_state = moved_state()
    save_checkpoint(tmp_path, Checkpoint(variables, opt_state, 1, 1))
    wider = models.init(jax.random.key(0), attrs.evolve(CONFIG, d_ff=64))
    with pytest.raises(
        ValueError, match=r"variables\['blocks'\]\[0\]\['down'\].*float32\[32, 16\]"
    ):
        load_checkpoint(tmp_path, wider, optax.adam(1e-2).init(wider))
    with pytest.raises(ValueError, match="leaves"):
        load_checkpoint(tmp_path, variables, optax.sgd(1e-2).init(variables))


def crash_in_savez(monkeypatch):
    def partial_then_crash(file, **arrays):
        file.write(b"PK\x03\x04 half an archive")
        raise KeyboardInterrupt("crash while writing the arrays")

    monkeypatch.setattr(np, "savez", partial_then_crash)


def crash_at_commit_rename(monkeypatch):
    real = os.replace

    def replace(source, target):
        if str(target).endswith(train.COMMIT):
            raise KeyboardInterrupt("crash between writing the commit record and renaming it")
        real(source, target)

    monkeypatch.setattr(os, "replace", replace)


def crash_writing_the_commit_record(monkeypatch):
    real = json.dumps

    def dumps(value, **options):
        if isinstance(value, dict) and value.get("format") == train.CHECKPOINT_FORMAT:
            raise KeyboardInterrupt("crash while encoding the commit record")
        return real(value, **options)

    monkeypatch.setattr(json, "dumps", dumps)


@pytest.mark.parametrize(
    "crash", [crash_in_savez, crash_at_commit_rename, crash_writing_the_commit_record]
)
def test_a_crash_mid_save_leaves_the_previous_checkpoint_whole(tmp_path, monkeypatch, crash):
    old_variables, old_state = moved_state(1)
    save_checkpoint(tmp_path, Checkpoint(old_variables, old_state, 1, 1, {"n": 1}))
    new_variables, new_state = moved_state(3)
    with monkeypatch.context() as patch:
        crash(patch)
        with pytest.raises(KeyboardInterrupt, match="crash"):
            save_checkpoint(tmp_path, Checkpoint(new_variables, new_state, 3, 3, {"n": 3}))
    loaded = load_checkpoint(tmp_path, old_variables, old_state)
    assert (loaded.updates, loaded.position, loaded.metadata) == (1, 1, {"n": 1})
    assert_trees_equal(loaded.variables, old_variables)
    assert_trees_equal(loaded.opt_state, old_state)
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


# 2. The trainer, on a fake rollout ----------------------------------------------------------------


@attrs.define(eq=False)
class FakeRollout:
    """Packs a fixed token pattern per task id (rescored like the scheduler does), remembers
    what it was handed, and reports a record."""

    objective: GRPOObjective
    read: list[int]
    crash_at: int | None = None
    calls: list[tuple[list[int], int, int]] = attrs.Factory(list)
    last_record: SchedulerRecord | None = None

    def __call__(self, batch, variables, updates):
        if updates == self.crash_at:
            raise KeyboardInterrupt("the trainer's process dies")
        ids = [int(i) for i in batch["task_id"]]
        self.calls.append((ids, updates, len(self.read)))
        rng = np.random.default_rng(ids)
        packed = {
            "tokens": rng.integers(0, CONFIG.vocab, (ROWS, WIDTH)).astype(np.int32),
            "positions": np.tile(np.arange(WIDTH, dtype=np.int32), (ROWS, 1)),
            "segment_ids": np.ones((ROWS, WIDTH), np.int32),
            "loss_mask": np.tile((np.arange(WIDTH) >= 3).astype(np.float32), (ROWS, 1)),
            "advantages": np.repeat(rng.choice([-1.0, 1.0], (ROWS, 1)), WIDTH, 1).astype(
                np.float32
            ),
        }
        packed["proximal_logprobs"] = np.asarray(
            self.objective.packed_log_probs(variables, packed), np.float32
        )
        packed["behavior_logprobs"] = packed["proximal_logprobs"] - np.float32(0.1)
        self.last_record = SchedulerRecord(
            updates=updates,
            version=updates,
            lag=0,
            groups=2,
            resubmitted={"stale": 1},
            cancelled=0,
            abandoned=0,
            cut=0,
            waited=0.5,
            metrics={"reward/mean": float(updates), "latency/p50": float("nan")},
        )
        return packed


@attrs.frozen
class CountingDataset:
    """Task-id batches of 2; `read` counts the batches the stream yielded."""

    read: list[int]
    batches: int = 12

    def stream(self, start: int = 0):
        dataset = ArrayDataset({"task_id": np.arange(2 * self.batches)}, 2)
        for index, batch in enumerate(dataset.stream(start), start):
            self.read.append(index)
            yield batch


# A stateful optimizer that is clean under strict promotion, so a resume must restore its state.
MOMENTUM = optax.sgd(1e-2, momentum=0.9)


def fake_run(directory, steps, *, ahead=1, resume=False, every=2, crash_at=None):
    read: list[int] = []
    trainer = Trainer(OBJECTIVE, MOMENTUM, params(), directory=directory, checkpoint_every=every)
    if resume:
        trainer.resume()
    rollout = FakeRollout(OBJECTIVE, read, crash_at)
    trainer.run(rollout, CountingDataset(read), steps=steps, ahead=ahead)
    return trainer, rollout, read


def metrics_lines(directory) -> list[dict]:
    return [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("ahead", [0, 2])
def test_the_trainer_reads_ahead_of_the_batch_it_hands_over(tmp_path, ahead):
    trainer, rollout, read = fake_run(tmp_path, 5, ahead=ahead)
    assert (trainer.updates, trainer.position) == (5, 5)
    assert [updates for _, updates, _ in rollout.calls] == [0, 1, 2, 3, 4]
    assert [ids for ids, _, _ in rollout.calls] == [[2 * i, 2 * i + 1] for i in range(5)]
    # Batch i is handed over once i + ahead batches are read, never past the last step's.
    assert [seen for _, _, seen in rollout.calls] == [min(i + 1 + ahead, 5) for i in range(5)]
    assert read == [0, 1, 2, 3, 4]


def test_the_trainer_logs_one_flat_line_per_step(tmp_path):
    fake_run(tmp_path, 3)
    lines = metrics_lines(tmp_path)
    assert [(x["step"], x["updates"], x["position"]) for x in lines] == [
        (0, 1, 0),
        (1, 2, 1),
        (2, 3, 2),
    ]
    assert all(isinstance(v, int | float | None) for line in lines for v in line.values())
    assert [x["reward/mean"] for x in lines] == [0.0, 1.0, 2.0]
    assert lines[0]["resubmitted/stale"] == 1 and lines[0]["waited"] == 0.5
    assert lines[0]["latency/p50"] is None  # NaN is no JSON
    assert {"loss", "grad_norm", "kl/behavior_proximal", "seconds/update"} <= lines[0].keys()


def test_the_stream_ending_ends_the_run_and_its_state_is_saved(tmp_path):
    trainer, _, _ = fake_run(tmp_path, 100, every=5)
    assert trainer.updates == 12
    saved = load_checkpoint(trainer.checkpoints, trainer.variables, trainer.opt_state)
    assert (saved.updates, saved.position) == (12, 12)


def test_a_resumed_trainer_continues_where_the_checkpoint_left_off(tmp_path):
    straight, _, _ = fake_run(tmp_path / "straight", 7, every=3)
    with pytest.raises(KeyboardInterrupt):
        fake_run(tmp_path / "resumed", 7, every=3, crash_at=5)
    assert len(metrics_lines(tmp_path / "resumed")) == 5
    resumed, rollout, read = fake_run(tmp_path / "resumed", 7, every=3, resume=True)
    # The checkpoint at 3 updates: batches 3.. are re-read and handed over again.
    assert read[0] == 3
    assert [updates for _, updates, _ in rollout.calls] == [3, 4, 5, 6]
    assert_trees_equal(resumed.variables, straight.variables)
    assert_trees_equal(resumed.opt_state, straight.opt_state)
    ours, theirs = metrics_lines(tmp_path / "resumed"), metrics_lines(tmp_path / "straight")
    assert [x["step"] for x in ours] == list(range(7))
    assert [x["loss"] for x in ours] == pytest.approx([x["loss"] for x in theirs])


def test_a_resumed_trainer_cuts_its_other_logs_back_to_the_checkpoint(tmp_path):
    """What on_step appended past the checkpoint goes, as the metrics log's lines do: a resumed
    run's log holds each step once, in order."""

    def run(steps, *, resume=False, crash_at=None):
        def append(line):
            with open(tmp_path / "side.jsonl", "a") as log:
                log.write(json.dumps({"step": line["step"]}) + "\n")

        trainer = Trainer(
            OBJECTIVE,
            MOMENTUM,
            params(),
            directory=tmp_path,
            checkpoint_every=3,
            on_step=append,
            logs=["side.jsonl", "never.jsonl"],
        )
        if resume:
            trainer.resume()
        trainer.run(FakeRollout(OBJECTIVE, [], crash_at), CountingDataset([]), steps=steps)

    with pytest.raises(KeyboardInterrupt):
        run(7, crash_at=5)
    side = [json.loads(line)["step"] for line in (tmp_path / "side.jsonl").read_text().splitlines()]
    assert side == [0, 1, 2, 3, 4]
    run(7, resume=True)  # from the checkpoint at 3 updates
    side = [json.loads(line)["step"] for line in (tmp_path / "side.jsonl").read_text().splitlines()]
    assert side == list(range(7))
    assert not (tmp_path / "never.jsonl").exists()
    saved = json.loads((tmp_path / "checkpoints" / train.COMMIT).read_text())["metadata"]
    assert saved["log_bytes"] == {
        "side.jsonl": (tmp_path / "side.jsonl").stat().st_size,
        "never.jsonl": 0,
    }


def test_a_step_count_starts_where_the_variables_are_and_the_step_compiles_once():
    """optax makes a step count (here the schedule's) on the default device, placed nowhere in
    particular, while the variables are placed on a device: the trainer puts the count beside
    them, as the step hands it back, so its second step is the first one's program."""
    variables = jax.device_put(params(), jax.devices()[0])
    scheduled = optax.sgd(optax.constant_schedule(1e-2))
    trainer = Trainer(GRPOObjective(models.model(CONFIG)), scheduled, variables)
    count = jax.tree.leaves(trainer.opt_state)[0]
    assert count.committed and count.sharding == variables["embed"].sharding, count.sharding
    trainer.run(FakeRollout(trainer.objective, []), CountingDataset([]), steps=2)
    assert trainer._update._cache_size() == 1


def test_a_resumed_trainer_keeps_its_variables_where_they_were_placed(tmp_path):
    """A checkpoint read back into a trainer whose variables are placed on a device lands there
    too, step count and all: the resumed run's steps are one program, not a second one compiled
    for state that the default device holds uncommitted."""
    variables = jax.device_put(params(), jax.devices()[0])
    sgd = optax.sgd(optax.constant_schedule(1e-2))
    first = Trainer(OBJECTIVE, sgd, variables, directory=tmp_path, checkpoint_every=1)
    first.run(FakeRollout(first.objective, []), CountingDataset([]), steps=1)
    resumed = Trainer(OBJECTIVE, sgd, variables, directory=tmp_path)
    assert resumed.resume() is not None
    for leaf in jax.tree.leaves((resumed.variables, resumed.opt_state)):
        assert leaf.committed and leaf.sharding == variables["embed"].sharding, leaf.sharding
    resumed.run(FakeRollout(resumed.objective, []), CountingDataset([]), steps=3)
    assert resumed._update._cache_size() == 1


def test_trainer_arguments_are_checked(tmp_path):
    with pytest.raises(ValueError, match="checkpoint_every must be an int >= 1, got 0"):
        Trainer(OBJECTIVE, MOMENTUM, params(), directory=tmp_path, checkpoint_every=0)
    with pytest.raises(ValueError, match="needs a directory"):
        Trainer(OBJECTIVE, MOMENTUM, params(), checkpoint_every=2)
    trainer = Trainer(OBJECTIVE, MOMENTUM, params())
    with pytest.raises(ValueError, match="ahead must be an int >= 0, got -1"):
        trainer.run(FakeRollout(OBJECTIVE, []), CountingDataset([]), steps=1, ahead=-1)
    with pytest.raises(ValueError, match="no directory"):
        trainer.save()
    with pytest.raises(ValueError, match="logs needs a directory"):
        Trainer(OBJECTIVE, MOMENTUM, params(), logs=["samples.jsonl"])
    with pytest.raises(ValueError, match="logs must be a sequence of file names, got 'samples"):
        Trainer(OBJECTIVE, MOMENTUM, params(), directory=tmp_path, logs="samples.jsonl")
    with pytest.raises(ValueError, match="measure must be a callable .* got 'eval'"):
        Trainer(OBJECTIVE, MOMENTUM, params(), measure="eval")
    for measure, problem in [
        (lambda updates: 0.5, "measure must return a mapping of str keys to metrics, got 0.5"),
        (lambda updates: {"loss": 0.0}, r"measure returned \['loss'\], keys the trainer's line"),
    ]:
        trainer = Trainer(OBJECTIVE, MOMENTUM, params(), measure=measure)
        with pytest.raises(ValueError, match=problem):
            trainer.run(FakeRollout(OBJECTIVE, []), CountingDataset([]), steps=1)


# 3. ServedSource ----------------------------------------------------------------------------------


@attrs.define(eq=False)
class FakeServer:
    fail: bool = False
    entered: int = 0
    running: bool = False

    async def __aenter__(self):
        if self.fail:
            raise OSError("no accelerator")
        self.entered += 1
        self.running = True
        return self

    async def __aexit__(self, *exc_info):
        self.running = False


@attrs.frozen
class NeedsServer:
    server: FakeServer

    async def run(self, task, label):
        assert self.server.running
        return Session(Status.COMPLETED, (), reward=1.0)


async def test_served_source_runs_the_server_once_in_the_callers_run():
    server = FakeServer()
    source = ServedSource(NeedsServer(server), server)
    sessions = []

    async def one(sample):
        sessions.append(await source.run(Task("1"), Label(0, sample, 0)))

    async with trio.open_nursery() as nursery:
        for sample in range(3):
            nursery.start_soon(one, sample)
    assert server.entered == 1 and len(sessions) == 3
    with pytest.raises(RuntimeError, match="first called"):
        await trio.to_thread.run_sync(trio.run, source.run, Task("1"), Label(0, 0, 0))


async def test_served_source_reports_a_server_that_failed():
    server = FakeServer(fail=True)
    source = ServedSource(NeedsServer(server), server)
    with pytest.raises(RuntimeError, match="rollout server stopped") as caught:
        await source.run(Task("1"), Label(0, 0, 0))
    assert isinstance(caught.value.__cause__, OSError)


# 4. Progress and the plot -------------------------------------------------------------------------


def test_progress_redraws_a_bar_on_a_terminal_and_prints_lines_otherwise():
    line = {"updates": 2, "reward/mean": 0.5, "lag": 1, "waited": 0.25, "resubmitted/stale": 3}
    plain, tty = io.StringIO(), io.StringIO()
    Progress(4, out=plain, tty=False, lines=2)(line)
    Progress(4, out=tty, tty=True)(line)
    assert plain.getvalue().startswith(
        "step 2/4  reward 0.500  lag 1  waited 0.250s  resubmitted 3"
    )
    assert plain.getvalue().endswith("\n")
    assert tty.getvalue().startswith("\r[##########..........] step 2/4")
    quiet = io.StringIO()
    Progress(4, out=quiet, tty=False, lines=2)({**line, "updates": 1})
    assert quiet.getvalue() == ""


# 5. dew train -------------------------------------------------------------------------------------


def test_help_lists_every_option_with_its_default(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    default = TrainConfig()
    for field in attrs.fields(TrainConfig):
        option = "--" + field.name.replace("_", "-")
        assert option in text
        value = getattr(default, field.name)
        assert f"(default: {'none' if value is None else value})" in text
    assert "--resume" in text and "--run" in text


@pytest.mark.parametrize(
    ("argv", "culprit"),
    [
        (["--groups", "1"], "argument --groups: groups must be an int within [2, 4096], got 1"),
        (["--ahead", "2"], "max_lag must be >= ahead + sync_every - 1 = 2, got 1"),
        (
            ["--learning-rate", "0"],
            "argument --learning-rate: learning_rate must be within (0, 1], got 0",
        ),
        (
            ["--temperature", "0"],
            "argument --temperature: temperature must be within [0.01, 100], got 0",
        ),
        (
            ["--oversample", "-1"],
            "argument --oversample: oversample must be an int within [0, 4096], got -1",
        ),
        (["--admit", "0"], "argument --admit: admit must be an int within [1, 4096], got 0"),
        (["--admit", "9"], "admit must be <= batch_size 8, got 9"),
        (["--carry-over"], "carry_over needs admit"),
        (["--no-hedge"], "hedge backs up carried groups' stragglers: give carry_over too"),
        (["--resume"], "--resume needs --run"),
    ],
)
def test_bad_options_name_the_culprit(capsys, tmp_path, argv, culprit):
    with pytest.raises(SystemExit) as exit_:
        main(
            ["train", "--run", str(tmp_path / "run"), *argv]
            if argv != ["--resume"]
            else ["train", *argv]
        )
    assert exit_.value.code == 2
    assert culprit in capsys.readouterr().err


@pytest.mark.slow
def test_a_resumed_run_draws_the_rollouts_the_uninterrupted_one_draws(tmp_path):
    """A run stopped after 2 steps and resumed to 4 trains on the rollouts of a run never
    stopped: its checkpoint keeps the scheduler's next group id, so the resumed scheduler
    numbers its groups, and `Sampling(seed=)` keys each call from its label, as the
    uninterrupted run did. (A resumed scheduler numbered its groups from 0 again, and `dew
    train` seeded a resumed process afresh to keep from drawing its first steps' keys: from its
    first step on, it trained other rollouts than the uninterrupted run.) One batch in flight
    at a time (`--ahead 0`), so the batches' versions are the same in both runs."""
    argv = ["train", *TINY, "--task", "guess", "--batch-size", "4", "--ahead", "0"]
    with jax.numpy_dtype_promotion("standard"):  # optax's Adam, as in the learning test
        assert main([*argv, "--run", str(tmp_path / "straight"), "--steps", "4"]) == 0
        assert main([*argv, "--run", str(tmp_path / "resumed"), "--steps", "2"]) == 0
        checkpoint = json.loads((tmp_path / "resumed/checkpoints/checkpoint.json").read_text())
        assert checkpoint["metadata"]["rollout"]["next_group"] == 2 * 4
        resumed = ["--run", str(tmp_path / "resumed"), "--steps", "4", "--resume"]
        assert main([*argv, *resumed]) == 0
    straight, again = metrics_lines(tmp_path / "straight"), metrics_lines(tmp_path / "resumed")
    assert [line["step"] for line in again] == [0, 1, 2, 3]
    for name in ("reward/mean", "length/mean", "tokens"):
        assert [line[name] for line in again] == [line[name] for line in straight], name
    assert [line["loss"] for line in again] == pytest.approx(
        [line["loss"] for line in straight], abs=1e-5
    )


@pytest.mark.slow
def test_oversample_and_admit_train_the_first_groups_to_complete(tmp_path, capsys):
    # The long-tail knobs `dew tune` weighs, as `dew train` options: 4 tasks a batch, 2 trained,
    # each group's first 2 of 4 rollouts; the rest are cancelled, counted and never trained.
    run = tmp_path / "run"
    argv = ["train", "--run", str(run), *TINY, "--batch-size", "4", "--steps", "3"]
    argv += ["--groups", "2", "--oversample", "2", "--admit", "2"]
    with jax.numpy_dtype_promotion("standard"):  # optax's Adam, as in the learning test
        assert main(argv) == 0
    lines = metrics_lines(run)
    assert [line["groups"] for line in lines] == [2, 2, 2]
    # Surplus rollouts still running when their group or batch is done are cancelled.
    assert sum(line["cancelled"] for line in lines) > 0
    assert all(line["cut"] == 0 for line in lines)
    config = json.loads((run / "config.json").read_text())
    assert (config["oversample"], config["admit"]) == (2, 2)
    # What trains is part of the run: a resume may not change it.
    with pytest.raises(SystemExit):
        main([*argv[:-2], "--admit", "3", "--resume"])
    assert "admit" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("hedge", [True, False])
def test_carry_over_trains_the_groups_admit_cut_at_later_steps(tmp_path, hedge):
    # 4 tasks a batch, the first 2 groups to complete train and the other 2 keep running, to
    # train at a later step within max_lag: a step is answered once 2 of its own groups are
    # complete or complete groups fill it, and trains every complete one, carried first, up to
    # the whole batch (a third of its own, when the machine's load let it complete by then);
    # what it took from earlier steps its record counts; with --no-hedge no straggler is
    # backed up.
    run = tmp_path / "run"
    argv = ["train", "--run", str(run), *TINY, "--batch-size", "4", "--steps", "4"]
    argv += ["--groups", "2", "--admit", "2", "--carry-over", "--max-lag", "3"]
    argv += [] if hedge else ["--no-hedge"]
    with jax.numpy_dtype_promotion("standard"):
        assert main(argv) == 0
    lines = metrics_lines(run)
    assert all("carry/admitted" in line and "carry/in_play" in line for line in lines)
    assert lines[0]["carry/admitted"] == 0 and lines[0]["groups"] >= 2
    for line in lines:
        own = line["groups"] - line["carry/admitted"]
        assert line["groups"] <= 4 and (own >= 2 or line["groups"] == 4), line
    assert sum(line["carry/admitted"] for line in lines) >= 1
    assert all(line["cut"] == 0 and line["lag"] <= 3 for line in lines)
    if not hedge:
        assert all(line["carry/hedged"] == 0 for line in lines)
    config = json.loads((run / "config.json").read_text())
    assert (config["carry_over"], config["hedge"]) == (True, hedge)


@pytest.mark.slow
def test_admit_auto_chooses_each_steps_cut_and_its_record_says_why(tmp_path):
    # The scheduler chooses each step's admit from the run's own durations: the first step,
    # before any group has completed, takes the whole batch; each line of metrics.jsonl holds
    # the choice and the estimate behind it.
    run = tmp_path / "run"
    argv = ["train", "--run", str(run), *TINY, "--batch-size", "4", "--steps", "4"]
    argv += ["--groups", "2", "--admit", "auto", "--waste-budget", "0.5", "--max-lag", "2"]
    with jax.numpy_dtype_promotion("standard"):
        assert main(argv) == 0
    lines = metrics_lines(run)
    assert [line["auto/admit"] for line in lines][0] == 4
    assert all(1 <= line["auto/admit"] <= 4 for line in lines)
    assert all(line["groups"] >= line["auto/admit"] or line["cut"] for line in lines)
    estimated = [line for line in lines if "auto/wait" in line]
    assert estimated, "after a batch's worth of groups, each step's choice has its estimate"
    assert all(line["auto/observed"] >= 4 and line["auto/step"] > 0 for line in estimated)
    config = json.loads((run / "config.json").read_text())
    assert (config["admit"], config["waste_budget"]) == ("auto", 0.5)


def test_a_run_folder_is_never_mixed(tmp_path, capsys):
    # A run that trained a step (a folder that trained none is free: see test_hostile_cli.py).
    (tmp_path / "config.json").write_text(json.dumps(attrs.asdict(TrainConfig())))
    (tmp_path / "metrics.jsonl").write_text('{"updates": 1}\n')
    with pytest.raises(SystemExit):
        main(["train", "--run", str(tmp_path)])
    assert "already holds a run" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "--run", str(tmp_path), "--resume", "--groups", "4"])
    assert "other groups" in capsys.readouterr().err


DEW = [sys.executable, "-c", "import sys; from dew.cli import main; sys.exit(main(sys.argv[1:]))"]


def dew_train(run, *options) -> list[str]:
    return [*DEW, "train", "--run", str(run), *TINY, *options]


@pytest.mark.slow
def test_a_killed_run_resumes_from_its_checkpoint_and_trains_nothing_twice(tmp_path):
    run, steps = tmp_path / "run", 40
    options = ["--steps", str(steps), "--checkpoint-every", "4"]
    # Both processes share the session's compilation cache (tests/conftest.py), so the resumed
    # one need not compile again.
    env = dict(os.environ)
    process = subprocess.Popen(
        dew_train(run, *options), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env
    )
    commit = run / "checkpoints" / train.COMMIT
    deadline = time.monotonic() + 120
    while not commit.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    output = process.communicate()[0].decode()
    assert process.returncode == -signal.SIGKILL, output  # killed mid-run, not finished
    record = json.loads(commit.read_text())
    killed_at, position = record["updates"], record["position"]
    assert 4 <= killed_at < steps and killed_at % 4 == 0 and position == killed_at
    before = (run / "metrics.jsonl").read_bytes()

    resumed = subprocess.run(
        dew_train(run, *options, "--resume"), capture_output=True, text=True, timeout=180, env=env
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"resuming at step {killed_at}, data position {position}" in resumed.stdout
    after = (run / "metrics.jsonl").read_bytes()
    kept = record["metadata"]["metrics_bytes"]
    assert after[:kept] == before[:kept]  # the checkpointed steps' lines, untouched
    lines = [json.loads(line) for line in after.decode().splitlines()]
    assert [x["step"] for x in lines] == list(range(steps))
    assert [x["updates"] for x in lines] == list(range(1, steps + 1))
    assert [x["position"] for x in lines] == list(range(steps))
    # The positions are the stream's batches: no task repeats within an epoch.
    config = TrainConfig.from_json(json.loads((run / "config.json").read_text()))
    dataset = CopyDigits().dataset(
        config.tasks, config.batch_size, shuffle_seed=config.seed, epochs=10
    )
    trained = [
        list(batch["task_id"]) for _, batch in zip(range(steps), dataset.stream(), strict=False)
    ]
    per_epoch = config.tasks // config.batch_size
    for epoch in range(0, steps, per_epoch):
        ids = [i for batch in trained[epoch : epoch + per_epoch] for i in batch]
        assert len(ids) == len(set(ids))
    final = json.loads(commit.read_text())
    assert (final["updates"], final["position"]) == (steps, steps)
    assert (run / "curves.png").exists()


@pytest.mark.slow
def test_the_default_task_learns(tmp_path, xla_optimizations):
    # The default run, cut short and synchronous. With `ahead` 1 the version each rollout is
    # sampled at depends on the threads' timing, and at 60 steps the reward's rise varies from
    # run to run (0.09 to 0.20 over the last ten steps, two runs side by side); with `ahead` 0
    # every run is the same run, and its reward goes from 0.002 to 0.146 (Adam at the default
    # 3e-4).
    config = TrainConfig(steps=60, ahead=0)
    # optax's Adam raises its float decay to its int32 step count, which strict promotion
    # refuses: the trainer's thread steps under standard promotion (the setting is per thread).
    with jax.numpy_dtype_promotion("standard"):
        train.train(config, tmp_path)
    rewards = [x["reward/mean"] for x in metrics_lines(tmp_path)]
    start, end = np.mean(rewards[:10]), np.mean(rewards[-10:])
    assert end > start + 0.1, (start, end)


@pytest.mark.slow
def test_a_recorded_training_run_replays_without_the_engine(tmp_path):
    from dew import replay

    trace = tmp_path / "trace.jsonl"
    config = train.TrainConfig(steps=4, batch_size=2, groups=2)
    with jax.numpy_dtype_promotion("standard"):  # optax's Adam, as in the learning test
        train.train(config, tmp_path / "run", record=trace)
    result = replay.replay(trace)
    assert result.matched, result.divergence
    assert result.steps == 4 and result.groups == 8
    # and a change of configuration parts the run where it first makes a difference
    parted = replay.replay(trace, ahead=0, max_lag=0)
    assert not parted.matched and parted.divergence.step == 0


def test_no_hedge_without_carry_over_is_refused_by_name():
    with pytest.raises(ValueError, match="hedge backs up carried groups' stragglers"):
        TrainConfig(hedge=False)
    assert TrainConfig(admit=2, carry_over=True, hedge=False).hedge is False


def test_a_waste_budget_without_admit_auto_is_refused_by_name():
    with pytest.raises(ValueError, match="waste_budget bounds the cuts of admit auto"):
        TrainConfig(waste_budget=0.3)
    assert TrainConfig(admit="auto", waste_budget=0.3).waste_budget == 0.3
