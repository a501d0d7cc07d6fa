"""`dew train` with the objective's levers, for real: the built-in copy task on a tiny model,
its server and its scheduler, each run a few steps.

- with uniform-group filtering on, the metrics report the uniform groups and no admitted group
  of the recorded run scored alike;
- a synchronous step's tokens were all sampled at the trainer's version: `mismatch/engine` is
  float noise and there is no stale token; a run one batch ahead shows `staleness/kl`;
- a KL run keeps the initial weights as its reference, and resumes with the same one;
- `--proximal current` trains step for step as the rescored run, without its rescoring;
- bad objective options are refused naming them.
"""

from __future__ import annotations

import collections
import json

import attrs
import jax
import pytest

from dew import replay, train
from dew.cli import main
from dew.train import NothingTrained, TrainConfig

TINY = {"d_model": 16, "heads": 2, "layers": 1, "d_ff": 32, "tasks": 16, "samples": 0}


def metrics_lines(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.medium
def test_a_filtered_run_reports_its_uniform_groups_and_trains_on_none(tmp_path):
    """Groups of 4 copy rollouts from a random tiny model mostly score alike (all 0)."""
    config = TrainConfig(steps=4, batch_size=4, groups=4, filter_uniform=True, **TINY)
    trace = tmp_path / "run.trace"
    with jax.numpy_dtype_promotion("standard"):  # optax's Adam, as in test_train
        try:
            train.train(config, tmp_path / "run", record=trace)
        except NothingTrained as nothing:  # every group scored alike: said at the end
            assert "discarded as uniform" in str(nothing)
    lines = metrics_lines(tmp_path / "run")
    # (Left out of a step that completed no group.)
    assert sum(line.get("groups/uniform", 0) for line in lines) > 0
    assert all(line.get("groups/uniform_trained", 0) == 0 for line in lines)
    # The recorded run, read independently: every admitted group's rewards differ, and each
    # group discarded as uniform scored alike.
    recorded = replay.read_trace(trace)
    rewards = collections.defaultdict(dict)
    ended = collections.defaultdict(set)
    for call in recorded.calls:
        for event in call.events:
            if event.kind in ("admitted", "discarded") and event.reason in (None, "uniform"):
                session = recorded.sessions[event.label].session
                rewards[event.group][event.label] = session.reward
                ended[event.group].add(event.kind)
    assert any(kinds == {"discarded"} for kinds in ended.values())
    for group, scored in rewards.items():
        alike = len(set(scored.values())) == 1
        assert alike == (ended[group] == {"discarded"}), (group, scored)
    assert recorded.config["filter_uniform"] is True
    assert replay.replay(trace).matched


@pytest.mark.slow
def test_a_synchronous_step_has_no_engine_mismatch_and_a_lagged_one_has_staleness(tmp_path):
    config = TrainConfig(steps=3, batch_size=2, groups=2, ahead=0, max_lag=0, **TINY)
    with jax.numpy_dtype_promotion("standard"):
        train.train(config, tmp_path / "sync")
        lagged = attrs.evolve(config, ahead=1, max_lag=1)
        train.train(lagged, tmp_path / "lagged")
    for line in metrics_lines(tmp_path / "sync"):
        # The engine and the trainer compute the same weights' log-probs by other kernels.
        assert line["mismatch/engine"] <= 1e-6, line["mismatch/engine"]
        assert "staleness/kl" not in line and line["lag/token_max"] == 0
    stale = [line["staleness/kl"] for line in metrics_lines(tmp_path / "lagged")[1:]]
    assert stale and all(kl > 0 for kl in stale), stale


@pytest.mark.slow
def test_a_kl_run_keeps_the_initial_weights_as_its_reference_across_a_resume(tmp_path):
    run = tmp_path / "run"
    # The default model, whose first rollouts already differ in reward (a tiny one's all
    # score 0: no advantage moves it, and with no move there is no KL to see).
    options = ["--batch-size", "4", "--groups", "8", "--tasks", "16", "--samples", "0"]
    argv = ["train", "--run", str(run), *options, "--kl-coef", "0.05"]
    with jax.numpy_dtype_promotion("standard"):
        assert main([*argv, "--steps", "2", "--checkpoint-every", "1"]) == 0
        assert main([*argv, "--steps", "4", "--resume"]) == 0
    lines = metrics_lines(run)
    assert [line["step"] for line in lines] == [0, 1, 2, 3]
    # At step 0 the policy is the reference: the KL to it is 0 up to rounding. The resumed run
    # derives the reference from the config again, the initial weights, not the restored ones:
    # at its first step the KL is that of two updates already.
    assert lines[0]["kl/reference"] < 1e-6 < lines[2]["kl/reference"]
    config = TrainConfig.from_json(json.loads((run / "config.json").read_text()))
    assert config.kl_coef == 0.05


@pytest.mark.slow
def test_a_run_taking_the_updates_own_proximal_trains_as_the_rescored_one(tmp_path):
    """Each batch trains one update at the weights it would be rescored under, so the loss's
    own log-probs are the proximal ones: the same steps, one forward pass less each."""
    # The default model, whose rollouts differ in reward, so the weights move; synchronous,
    # so both runs sample the same rollouts under the same weights.
    options = ["--batch-size", "4", "--groups", "8", "--tasks", "16", "--samples", "0"]
    options += ["--steps", "4", "--ahead", "0", "--max-lag", "0", "--kl-coef", "0.05"]
    with jax.numpy_dtype_promotion("standard"):
        for proximal in ("rescore", "current"):
            run = tmp_path / proximal
            argv = ["train", "--run", str(run), *options, "--proximal", proximal]
            assert main([*argv, "--record", str(tmp_path / f"{proximal}.trace")]) == 0
    rescored, current = metrics_lines(tmp_path / "rescore"), metrics_lines(tmp_path / "current")
    assert len(rescored) == len(current) == 4
    assert rescored[-1]["kl/reference"] > 1e-6  # the weights moved
    for line, line_c in zip(rescored, current, strict=True):
        for name in ("reward/mean", "loss", "grad_norm", "kl/behavior_proximal", "kl/reference"):
            assert line_c[name] == pytest.approx(line[name], rel=1e-3, abs=1e-6), name
        # Made from the rescoring, which the current run skips; the loss counts what it masks.
        assert {"mismatch/engine", "importance/p50"} <= line.keys()
        assert not {"mismatch/engine", "importance/p50"} & line_c.keys()
        assert line_c["importance/masked"] == 0.0
    config = TrainConfig.from_json(json.loads((tmp_path / "current" / "config.json").read_text()))
    assert config.proximal == "current"
    # Replay never rescores: a run without its rescoring replays as well.
    assert replay.replay(tmp_path / "current.trace").matched
    # Where the proximal log-probs come from is not what the run trains: a resume may switch.
    resumed = ["train", "--run", str(tmp_path / "rescore"), *options, "--resume"]
    with jax.numpy_dtype_promotion("standard"):
        assert main([*resumed, "--steps", "5", "--proximal", "current"]) == 0
    assert [line["step"] for line in metrics_lines(tmp_path / "rescore")] == [0, 1, 2, 3, 4]


@pytest.mark.parametrize(
    "options, culprit",
    [
        (["--aggregation", "mean"], "aggregation must be one of"),
        (["--correction", "clip"], "correction must be one of"),
        (["--importance-floor", "0.5"], "importance_floor bounds masking only"),
        (["--kl-coef", "-1"], "kl_coef must be within [0, 100]"),
        (["--proximal", "approximate"], "proximal must be one of"),
    ],
)
def test_bad_objective_options_are_refused_naming_them(tmp_path, capsys, options, culprit):
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--run", str(tmp_path / "run"), *options])
    assert exit_.value.code == 2
    assert culprit in capsys.readouterr().err
