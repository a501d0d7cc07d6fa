"""The CPU the trainer and the engine share: the simulation's rate model on trio's mock clock,
the fit of its factors to recorded spans (synthetic ones, and traces of simulated runs whose
CPU is shared by a known amount), and predictions that hold where ignoring it misses."""

from __future__ import annotations

import functools
import json
import math
import re

import attrs
import jax
import numpy as np
import pytest
import trio
import trio.testing

from dew import calibrate, cli, simulate, tune
from dew.envs.simulated import SimulatedConfig, SimulatedSource
from dew.serve.tokenizer import BYTES
from dew.simulate import Contention, SharedCpu, SharingEngine
from dew.testing import record_run
from dew.train import TrainConfig, _tasks, _timing, step_seconds


def on_mock_clock(function):
    return trio.run(function, clock=trio.testing.MockClock(autojump_threshold=0))


# --- the rate model ---------------------------------------------------------------------------


def test_a_side_alone_runs_at_its_solo_speed_and_slows_only_while_the_other_is_busy():
    """Trainer factor 1 (half speed while the engine runs), engine factor 0.5. The engine works
    3 s solo from t=0; the trainer 2 s solo from t=1. Both run from 1 on: the engine at 2/3,
    the trainer at 1/2. The engine's 2 s left take 3 s (t=4), by which the trainer has done
    1.5 s of its 2; its last 0.5 s runs alone (t=4.5)."""
    cpu = SharedCpu(Contention(trainer=1.0, engine=0.5))
    ends = {}

    async def side(name, start, seconds):
        await trio.sleep(start)
        await cpu.spend(name, seconds)
        ends[name] = trio.current_time()

    async def main():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(side, "engine", 0.0, 3.0)
            nursery.start_soon(side, "trainer", 1.0, 2.0)

    on_mock_clock(main)
    assert ends == pytest.approx({"engine": 4.0, "trainer": 4.5})
    assert cpu.running == {"trainer": 0, "engine": 0}


def test_the_engine_is_busy_while_any_call_runs_and_its_calls_slow_alike():
    """Two engine calls overlapping each other count as one busy engine: a 1 s trainer step
    beside them (factor 1) takes 2 s, and each call (factor 1) runs at half speed alongside."""
    cpu = SharedCpu(Contention(trainer=1.0, engine=1.0))
    ends = {}

    async def side(name, kind, seconds):
        await cpu.spend(kind, seconds)
        ends[name] = trio.current_time()

    async def main():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(side, "call a", "engine", 4.0)
            nursery.start_soon(side, "call b", "engine", 4.0)
            nursery.start_soon(side, "step", "trainer", 1.0)

    on_mock_clock(main)
    # The step: 2 s at half speed. The calls: 1 s of work in those 2 s, then 3 s alone.
    assert ends == pytest.approx({"step": 2.0, "call a": 5.0, "call b": 5.0})


WORKLOAD = simulate.Workload(
    seed=0, steps=12, slots=None, tasks=4, groups=4, duration_mean=3.0, step_time=3.0, warmup=2
)


def test_contention_slows_a_run_that_overlaps_and_leaves_a_synchronous_one_as_it_was():
    shared = attrs.evolve(WORKLOAD, contention=Contention(trainer=1.0, engine=1.0))
    sync = simulate.Setting("sync", ahead=0, max_lag=0)
    ahead = simulate.Setting("ahead=1", ahead=1, max_lag=1)
    # Synchronous: the engine idles while the trainer steps, so nothing overlaps.
    assert simulate.simulate(shared, sync) == simulate.simulate(WORKLOAD, sync)
    alone, both = simulate.simulate(WORKLOAD, ahead), simulate.simulate(shared, ahead)
    assert both.goodput < 0.85 * alone.goodput
    # Deterministic: a pure function of the workload.
    assert simulate.simulate(shared, ahead) == both


# --- the fit ----------------------------------------------------------------------------------


def test_busy_covers_the_union_of_its_spans():
    busy = calibrate.Busy([(5.0, 7.0), (0.0, 2.0), (1.0, 3.0), (4.0, 4.0)])
    assert busy.starts.tolist() == [0.0, 5.0] and busy.ends.tolist() == [3.0, 7.0]
    covered = busy.covered([0.0, 2.5, -1.0, 3.0, 6.0], [10.0, 5.5, 0.5, 5.0, 6.0])
    assert covered == pytest.approx([5.0, 1.0, 0.5, 0.0, 0.0])
    assert calibrate.Busy([]).covered([0.0], [1.0]).tolist() == [0.0]


def spans(share: float, seed: int = 0, n: int = 400):
    """Spans of the rate model with a known share (factor share / (1 - share)), whose solo
    work is noisy, and whose overlap grows with the noise as a real span's does: a span that
    runs long overlaps more of what the other side did meanwhile."""
    rng = np.random.default_rng(seed)
    instrument = rng.uniform(0.0, 1.0, n)  # the other side's busy share from the span's start
    solo = rng.lognormal(0.0, 0.3, n)
    # Overlap: the instrument's share of the span, and half of any excess of solo work.
    overlap = instrument * solo + 0.5 * np.clip(solo - 1.0, 0.0, None)
    seconds = solo + share * overlap
    return seconds, overlap, instrument


@pytest.mark.parametrize("factor", [0.0, 0.5, 1.0])
def test_the_factor_fitted_to_spans_is_the_one_that_made_them(factor):
    seconds, overlap, instrument = spans(factor / (1 + factor))
    fitted = calibrate.contention_factor(seconds, overlap, instrument)
    assert fitted == pytest.approx(factor, abs=0.1)
    # Plain least squares finds a slowdown where there is none: long spans overlap more.
    if factor == 0.0:
        plain = np.polyfit(overlap, seconds, 1)[0]
        assert plain > 0.3


def test_spans_per_unit_of_work_fit_alike():
    seconds, overlap, instrument = spans(0.5)
    units = np.arange(len(seconds)) % 3 + 1
    fitted = calibrate.contention_factor(seconds * units, overlap * units, instrument, units)
    assert fitted == pytest.approx(1.0, abs=0.1)


def test_spans_that_cannot_tell_say_no_slowdown():
    seconds, overlap, _ = spans(0.5)
    # The other side always busy (or never): nothing to compare.
    assert calibrate.contention_factor(seconds, overlap, np.ones(len(seconds))) == 0.0
    assert calibrate.contention_factor([1.0, 2.0], [0.5, 1.0], [0.2, 0.8]) == 0.0
    # Faster while overlapped: no negative slowdown.
    assert calibrate.contention_factor(seconds, -overlap, spans(0.5)[2]) == 0.0
    # A share near 1 says one side stops while the other runs: clipped.
    share = calibrate.MAX_OVERLAP_SHARE
    seconds, overlap, instrument = spans(0.99)
    assert calibrate.contention_factor(seconds, overlap, instrument) == pytest.approx(
        share / (1 - share)
    )


def test_the_fit_refuses_spans_of_different_lengths():
    with pytest.raises(ValueError, match="must have one length, got 3, 2, 3 and 3"):
        calibrate.contention_factor([1, 2, 3], [1, 2], [0, 1, 0])
    with pytest.raises(ValueError, match="units must be > 0"):
        calibrate.contention_factor([1, 2, 3], [1, 2, 3], [0, 1, 0], [1, 0, 1])


# --- traces of runs on a shared CPU -----------------------------------------------------------

TRUE = Contention(trainer=0.6, engine=0.8)
CONFIG = SimulatedConfig(seed=3, duration_mean=2.0, duration_sigma=0.3, calls=(1, 3))
STEPS = 30


def record_shared(path, contention: Contention | None, config=CONFIG, **options):
    """A recorded run whose trainer steps 2 s of solo work a call beside an engine that
    decodes on the same SharedCpu (none: each at its own speed)."""
    options = {"ahead": 1, "max_lag": 1, "width": 512, "rows": 16, "groups": 4, **options}

    async def run():
        cpu = SharedCpu(contention or Contention())
        engine = SharingEngine(cpu=cpu)
        return await record_run(
            SimulatedSource(engine, config),
            engine,
            path,
            updates=range(STEPS),
            batch_size=4,
            gap=2.0,
            spend=functools.partial(cpu.spend, "trainer"),
            **options,
        )

    return on_mock_clock(run)


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    folder = tmp_path_factory.mktemp("shared")
    return {
        "ahead=1": record_shared(folder / "ahead1.trace", TRUE),
        "sync": record_shared(folder / "sync.trace", TRUE, ahead=0, max_lag=0),
        "ahead=2": record_shared(folder / "ahead2.trace", TRUE, ahead=2, max_lag=2),
    }


@pytest.mark.slow
def test_a_run_on_its_own_cpu_fits_no_contention(tmp_path):
    fitted = calibrate.calibrate([record_shared(tmp_path / "alone.trace", None)])
    assert fitted.contention == Contention()


@pytest.mark.slow
def test_the_fit_recovers_the_contention_of_a_recorded_run(shared):
    fitted = calibrate.calibrate([shared["ahead=1"]])
    assert fitted.contention.trainer == pytest.approx(TRUE.trainer, abs=0.25)
    assert fitted.contention.engine == pytest.approx(TRUE.engine, abs=0.3)
    # The solo step is 2 s; what the record holds is longer by the overlap's share.
    solo, _ = fitted.solo(TRUE)
    assert solo == pytest.approx([2.0] * len(solo), abs=1e-6)
    assert np.mean(fitted.step_times) > 2.2
    # Pooled with a synchronous run, which never overlaps, the factors come closer.
    pooled = calibrate.calibrate([shared["ahead=1"], shared["sync"]]).contention
    assert pooled.trainer == pytest.approx(TRUE.trainer, abs=0.15)


def predicted(fitted, setting, contention, measured):
    workload = fitted.workload(steps=measured.steps + fitted.warmup + 1, slots=None,
                               contention=contention)  # fmt: skip
    outcomes = [simulate.simulate(attrs.evolve(workload, seed=seed), setting) for seed in range(2)]
    return float(np.mean([o.goodput for o in outcomes])), float(np.mean([o.idle for o in outcomes]))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("target", "setting"),
    [
        ("sync", simulate.Setting("sync", ahead=0, max_lag=0)),
        ("ahead=2", simulate.Setting("ahead=2", ahead=2, max_lag=2)),
    ],
)
def test_modelled_contention_predicts_other_settings_where_ignoring_it_misses(
    shared, target, setting
):
    """Calibrated from the run one batch ahead, the synchronous run (no overlap: each side
    at its solo speed) and the run two batches ahead are predicted within 10 % of goodput and
    5 points of idle share with the fitted contention; as recorded, the synchronous one is not."""
    fitted = calibrate.calibrate([shared["ahead=1"]])
    measured = calibrate.observe(shared[target], warmup=fitted.warmup)
    goodput, idle = predicted(fitted, setting, True, measured)
    assert goodput == pytest.approx(measured.goodput, rel=0.1)
    assert idle == pytest.approx(measured.idle, abs=0.05)
    plain, _ = predicted(fitted, setting, False, measured)
    if target == "sync":
        assert abs(plain / measured.goodput - 1) > 0.15


@pytest.mark.medium
def test_a_contention_of_ones_own_and_the_report(shared):
    fitted = calibrate.calibrate([shared["ahead=1"]])
    mine = Contention(trainer=0.1, engine=0.2)
    workload = fitted.workload(steps=10, contention=mine)
    assert workload.contention == mine
    assert fitted.workload(steps=10).contention is None
    assert "fitted slowdown while overlapped: trainer +" in calibrate.report(fitted)
    with pytest.raises(ValueError, match="contention must be a bool or a Contention"):
        fitted.workload(steps=10, contention="fit")
    # Scaling a calibration scales the overlaps with their side's seconds.
    slowed = fitted.scaled(engine=2.0, trainer=3.0)
    assert slowed.overlaps == pytest.approx([2 * o for o in fitted.overlaps])
    assert slowed.step_overlaps == pytest.approx([3 * o for o in fitted.step_overlaps])


def test_a_trainer_sized_to_admit_steps_in_proportion_to_its_rows():
    rows = tune.sized_to_rows(4, 1.0)
    assert rows(simulate.Setting("a", ahead=1, max_lag=1, admit=3)) == pytest.approx(0.75)
    assert rows(simulate.Setting("a", ahead=1, max_lag=1)) == 1.0
    carried = simulate.Setting("a", ahead=1, max_lag=3, admit=3, carry_over=True)
    assert rows(carried) == 1.0
    assert rows(simulate.Setting("a", ahead=1, max_lag=3, admit="auto")) == 1.0
    with pytest.raises(ValueError, match="tasks must be an int >= 1, got 0"):
        tune.sized_to_rows(0)
    with pytest.raises(ValueError, match="exponent must be a finite number >= 0"):
        tune.sized_to_rows(4, -1.0)
    with pytest.raises(ValueError, match=r"recorded must be an int within \[1, 4\], got 5"):
        tune.sized_to_rows(4, 1.0, 5)
    # From a run that trained 2 groups a step, the whole batch steps twice as long.
    assert tune.sized_to_rows(4, 1.0, 2)(simulate.Setting("a", ahead=1, max_lag=1)) == 2.0
    grid = tune.Grid(ahead=(1,), sync_every=(1,), admit=(3,))
    (row,) = tune.tune(WORKLOAD, grid, seeds=1, trainer=rows)
    expected = simulate.simulate(
        WORKLOAD.trainer_scaled(0.75), simulate.Setting("x", ahead=1, max_lag=1, admit=3)
    )
    assert row.outcomes[0].goodput == expected.goodput


def test_a_trainer_timed_at_each_count_steps_as_its_seconds_say():
    """A setting's step is the recorded one's times the ratio of their timed seconds: no power
    of the rows, which a CPU's step does not follow (docs/tuning.md)."""
    rows = tune.timed_rows({3: 0.06, 4: 0.1}, 4)
    assert rows(simulate.Setting("a", ahead=1, max_lag=1, admit=3)) == pytest.approx(0.6)
    assert rows(simulate.Setting("a", ahead=1, max_lag=1)) == 1.0
    carried = simulate.Setting("a", ahead=1, max_lag=3, admit=3, carry_over=True)
    assert rows(carried) == 1.0  # carry-over may admit a whole batch: dew train's rows hold one
    assert tune.timed_rows({3: 0.06, 4: 0.1}, 4, recorded=3)(
        simulate.Setting("a", ahead=1, max_lag=1)
    ) == pytest.approx(0.1 / 0.06)
    with pytest.raises(ValueError, match="seconds has no step timed at the recorded 4 groups"):
        tune.timed_rows({3: 0.06}, 4)
    with pytest.raises(ValueError, match=r"seconds\[3\] must be a finite number > 0, got 0"):
        tune.timed_rows({3: 0, 4: 0.1}, 4)
    with pytest.raises(ValueError, match="seconds has no step timed at b's 2 groups"):
        rows(simulate.Setting("b", ahead=1, max_lag=1, admit=2))
    grid = tune.Grid(ahead=(1,), sync_every=(1,), admit=(3,))
    (row,) = tune.tune(WORKLOAD, grid, seeds=1, trainer=rows)
    expected = simulate.simulate(
        WORKLOAD.trainer_scaled(0.6), simulate.Setting("x", ahead=1, max_lag=1, admit=3)
    )
    assert row.outcomes[0].goodput == expected.goodput


def write_run(folder, **fields):
    """A dew train run folder holding only its config: a small model on the copy task."""
    small = {"task": "copy", "batch_size": 4, "groups": 4, "d_model": 16, "layers": 1}
    config = TrainConfig(**small | {"heads": 2, "d_ff": 32} | fields)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(attrs.asdict(config)))
    return folder


@pytest.mark.slow
def test_step_seconds_times_the_runs_own_step_at_the_rows_each_count_trains(tmp_path, monkeypatch):
    run = write_run(tmp_path / "run")
    built, steps = [], []
    rows, rescored = _timing._rows, _timing._rescored
    monkeypatch.setattr(_timing, "_rows", lambda *a, **k: built.append(a) or rows(*a, **k))
    monkeypatch.setattr(
        _timing,
        "_rescored",
        lambda o, v, batch: steps.append(batch["tokens"].shape) or rescored(o, v, batch),
    )
    with jax.numpy_dtype_promotion("standard"):  # optax's Adam
        seconds = step_seconds(run, [3, 1, 3], repeats=2)
    assert list(seconds) == [3, 1]
    assert all(0 < s < math.inf for s in seconds.values())
    # The copy task packs two chains a row: 3 groups of 4 rollouts fill 6 rows of its width.
    config = TrainConfig.from_file(run / "config.json")
    width = _tasks._task(config, BYTES).shape.width
    assert built == [(6, width, 2, BYTES.vocab_size), (2, width, 2, BYTES.vocab_size)]
    # One step to compile each, then the counts in turn.
    assert steps == [(6, width), (2, width)] + [(6, width), (2, width)] * 2


def test_step_seconds_names_what_it_cannot_time(tmp_path):
    with pytest.raises(ValueError, match="cannot read the config file"):
        step_seconds(tmp_path / "missing", [1])
    with pytest.raises(ValueError, match=r"admitted must be an int within \[1, 4\], got 5"):
        step_seconds(write_run(tmp_path / "run"), [4, 5])
    meshed = write_run(tmp_path / "meshed")
    fields = json.loads((meshed / "config.json").read_text())
    fields |= {"mesh": "1x1x1", "model": str(tmp_path / "checkpoint")}  # read, never loaded
    (meshed / "config.json").write_text(json.dumps(fields))
    with pytest.raises(ValueError, match="its run trained on --mesh 1x1x1; step_seconds times"):
        step_seconds(meshed, [1])


@pytest.mark.slow
def test_dew_tune_times_the_recorded_runs_trainer(shared, tmp_path, capsys):
    run = write_run(tmp_path / "run")
    argv = ["tune", shared["ahead=1"].path, "--steps", "8", "--seeds", "1", "--ahead", "1"]
    argv += ["--sync-every", "1", "--admit", "3,all", "--time-trainer", str(run)]
    with jax.numpy_dtype_promotion("standard"):  # optax's Adam
        assert cli.main(argv) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert re.search(r"the trainer's step timed alone on this machine: 3 groups \d+\.\d+ s, "
                     r"4 groups \d+\.\d+ s", out)  # fmt: skip
    assert "ahead=1 sync=1 lag=1 admit=3" in out
    for extra, message in [
        (["--trainer-scaling", "1"], "argument --time-trainer: not with --trainer-scaling"),
    ]:
        with pytest.raises(SystemExit):
            cli.main([*argv, *extra])
        assert message in " ".join(capsys.readouterr().err.split())
    missing = write_run(tmp_path / "missing", task="verifiers:no_such_environment")
    with pytest.raises(SystemExit):
        cli.main([*argv[:-1], str(missing)])
    message = "argument --time-trainer: verifiers environment 'no_such_environment' is not"
    assert message in " ".join(capsys.readouterr().err.split())
    other = write_run(tmp_path / "other", groups=2)
    with pytest.raises(SystemExit):
        cli.main([*argv[:-1], str(other)])
    message = (
        f"argument --time-trainer: {other} trained 4 tasks x 2 rollouts a batch, the traces 4 x 4"
    )
    assert message in " ".join(capsys.readouterr().err.split())


def test_dew_tune_takes_the_contention_fitted_or_given(shared, capsys):
    argv = ["tune", shared["ahead=1"].path, "--steps", "8", "--seeds", "1", "--ahead", "0,1"]
    assert cli.main([*argv, "--sync-every", "1", "--contention", "fit"]) == 0
    out = capsys.readouterr().out
    assert "sharing a CPU (trainer +" in out
    assert cli.main([*argv, "--sync-every", "1", "--contention", "0.5,1"]) == 0
    assert "sharing a CPU (trainer +50%, engine +100% while both run)" in capsys.readouterr().out
    for bad, message in [
        ("1", "must be 'off', 'fit' or TRAINER,ENGINE"),
        ("1,x", "must be a number, got 'x'"),
        ("-1,1", "must be a finite number within [0, 1000]"),
    ]:
        with pytest.raises(SystemExit) as exit:
            cli.main([*argv, f"--contention={bad}"])
        assert exit.value.code == 2
        err = " ".join(capsys.readouterr().err.split())
        assert f"argument --contention: {message}" in err
    with pytest.raises(SystemExit):
        cli.main([*argv, "--trainer-scaling", "nan"])
    assert "argument --trainer-scaling: must be a finite number" in capsys.readouterr().err


@pytest.mark.medium
def test_the_calibration_knows_the_groups_each_recorded_step_trained(shared, tmp_path, capsys):
    cut = record_shared(tmp_path / "admit.trace", TRUE, admit=3)
    assert calibrate.calibrate([cut]).admitted == (3,)
    assert calibrate.calibrate([shared["ahead=1"]]).admitted == (4,)
    argv = ["tune", cut.path, shared["ahead=1"].path, "--steps", "8", "--trainer-scaling", "1"]
    with pytest.raises(SystemExit):
        cli.main(argv)
    message = "argument --trainer-scaling: the traces trained different groups a step (3, 4)"
    assert message in " ".join(capsys.readouterr().err.split())
