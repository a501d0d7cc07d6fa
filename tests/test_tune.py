"""dew.calibrate and dew.tune: a known workload recovered from its trace, predictions that
match recorded runs, deterministic tables, the brute-force best, and `dew tune`'s options."""

from __future__ import annotations

import collections
import functools
import math
import re

import attrs
import numpy as np
import pytest
import trio
import trio.testing

from dew import calibrate, cli, simulate, tune
from dew.data import Task
from dew.envs.simulated import ObservedRollout, SimulatedConfig, SimulatedEngine, SimulatedSource
from dew.objectives.rl.sessions import Label, Status
from dew.replay import Trace
from dew.testing import run_simulated

# The known workload: lognormal durations of mean 4 s and sigma 0.5, one to three calls, a
# status mix with infrastructure failures; 4 tasks x 4 rollouts a step, a 3 s trainer step.
MEAN, SIGMA, STEP_TIME = 4.0, 0.5, 3.0
MIXED = SimulatedConfig(
    seed=1,
    duration_mean=MEAN,
    duration_sigma=SIGMA,
    calls=(1, 3),
    infra_error=0.1,
    agent_error=0.1,
    truncated=0.2,
)
PLAIN = SimulatedConfig(seed=1, duration_mean=MEAN, duration_sigma=SIGMA)
STEPS = 30


def record(path, config: SimulatedConfig, gap: float = STEP_TIME, **options) -> Trace:
    """Record STEPS trainer calls of a simulated run under a mock clock, the trainer taking
    `gap` seconds a step; the trace read back."""
    options = {"ahead": 1, "max_lag": 1, "width": 512, "rows": 16, "groups": 4, **options}
    run = functools.partial(
        run_simulated,
        path,
        updates=range(STEPS),
        config=config,
        batch_size=4,
        gap=gap,
        **options,
    )
    return trio.run(run, clock=trio.testing.MockClock(autojump_threshold=0))


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    return record(tmp_path_factory.mktemp("mixed") / "run.trace", MIXED)


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return record(tmp_path_factory.mktemp("plain") / "run.trace", PLAIN)


def lognormal_mean(mu: float, sigma: float) -> float:
    return math.exp(mu + sigma**2 / 2)


def test_calibration_recovers_a_known_workload(mixed):
    fitted = calibrate.calibrate([mixed])
    mu, sigma = fitted.lognormal
    # About 450 rollouts: the mean's standard error is about 2.5 %, sigma's about 0.02.
    assert lognormal_mean(mu, sigma) == pytest.approx(MEAN, rel=0.08)
    assert sigma == pytest.approx(SIGMA, abs=0.05)
    assert fitted.statuses["INFRA_ERROR"] == pytest.approx(0.1, abs=0.04)
    assert fitted.statuses["AGENT_ERROR"] == pytest.approx(0.1, abs=0.04)
    assert fitted.statuses["TRUNCATED"] == pytest.approx(0.2, abs=0.05)
    assert fitted.step_times == pytest.approx([STEP_TIME] * (STEPS - 3))
    assert (fitted.tasks, fitted.groups) == (4, 4)
    # One batch running ahead beside the one handed over: two batches of 16 in flight.
    assert fitted.slots == 32
    # An infrastructure failure stops partway through its calls; the others make 1 to 3.
    assert set(fitted.calls) <= {0, 1, 2, 3} and fitted.calls[3] > 0
    for p, observed, lognormal in calibrate.fit_table(fitted):
        assert lognormal == pytest.approx(observed, rel=0.25), p


def test_cancelled_rollouts_are_censored_not_dropped(tmp_path):
    """Oversampling cancels the slowest rollouts: their durations are lower bounds, and the
    Kaplan-Meier weights restore the tail that the finished ones alone lose."""
    trace = record(tmp_path / "oversampled.trace", PLAIN, oversample=2)
    fitted = calibrate.calibrate([trace])
    assert len(fitted.censored) > 100
    finished_only = float(np.mean(fitted.durations))
    assert finished_only < 0.8 * MEAN
    assert fitted.mean_duration == pytest.approx(MEAN, rel=0.1)
    assert lognormal_mean(*fitted.lognormal) == pytest.approx(MEAN, rel=0.1)
    assert sum(r.weight for r in fitted.observed) == pytest.approx(1.0)


def test_a_simulation_predicts_a_recorded_simulated_run_exactly(plain):
    """`observe` measures a recording as `simulate` measures itself: the same run, the same
    figures."""
    recorded = calibrate.observe(plain)
    workload = simulate.Workload(
        seed=1,
        steps=STEPS - 1,
        slots=None,
        tasks=4,
        groups=4,
        duration_mean=MEAN,
        duration_sigma=SIGMA,
        step_time=STEP_TIME,
        warmup=2,
    )
    predicted = simulate.simulate(workload, simulate.Setting("ahead=1", ahead=1, max_lag=1))
    assert predicted.goodput == pytest.approx(recorded.goodput, rel=1e-9)
    assert predicted.idle == pytest.approx(recorded.idle, rel=1e-9)
    assert predicted.lags == recorded.lags


def test_a_calibrated_prediction_of_another_setting_is_within_ten_percent(plain, tmp_path):
    """Calibrated from a run one batch ahead, the simulation predicts a synchronous run of
    other draws of the same workload (another seed)."""
    fitted = calibrate.calibrate([plain])
    workload = fitted.workload(steps=STEPS - 1, slots=None)
    predicted = simulate.simulate(workload, simulate.Setting("sync", ahead=0, max_lag=0))
    other = attrs.evolve(PLAIN, seed=2)
    sync = calibrate.observe(record(tmp_path / "sync.trace", other, ahead=0, max_lag=0))
    assert predicted.goodput == pytest.approx(sync.goodput, rel=0.1)
    assert predicted.idle == pytest.approx(sync.idle, rel=0.1)
    # The setting matters: one batch ahead the trainer idles far less.
    assert calibrate.observe(plain).idle < 0.8 * sync.idle


def test_a_workload_that_drifts_over_training_is_predicted_group_by_group(tmp_path):
    """Rollouts that grow longer as training goes on (a policy learning to take more turns):
    each recorded group is resampled for the same group of the simulation, so the simulated
    run meets the drift when the recorded run did; pooled together they would not."""
    drifting = SimulatedConfig(
        seed=1,
        observed=[
            ObservedRollout((0.5 + 0.06 * g,), Status.COMPLETED, pool=g)
            for g in range(4 * (STEPS + 1))
        ],
    )
    trace = record(tmp_path / "drift.trace", drifting)
    recorded = calibrate.observe(trace)
    fitted = calibrate.calibrate([trace])
    setting = simulate.Setting("ahead=1", ahead=1, max_lag=1)
    predicted = simulate.simulate(fitted.workload(steps=STEPS - 1, slots=None), setting)
    assert predicted.goodput == pytest.approx(recorded.goodput, rel=1e-6)
    assert predicted.idle == pytest.approx(recorded.idle, abs=1e-6)
    pooled = attrs.evolve(fitted, observed=[attrs.evolve(r, pool=0) for r in fitted.observed])
    blind = simulate.simulate(pooled.workload(steps=STEPS - 1, slots=None), setting)
    assert abs(blind.idle - recorded.idle) > 0.05


def test_a_slowed_calibration_is_the_same_run_on_a_slower_clock(plain):
    """Twice every duration and step time: half the goodput, the same idle share and lags."""
    fitted = calibrate.calibrate([plain])
    slowed = fitted.slowed(2.0)
    assert slowed.step_time == pytest.approx(2 * fitted.step_time)
    assert slowed.mean_duration == pytest.approx(2 * fitted.mean_duration)
    assert slowed.lognormal[1] == fitted.lognormal[1]
    setting = simulate.Setting("ahead=1", ahead=1, max_lag=1)
    fast = simulate.simulate(fitted.workload(steps=12, slots=None), setting)
    slow = simulate.simulate(slowed.workload(steps=12, slots=None), setting)
    assert slow.goodput == pytest.approx(fast.goodput / 2)
    assert slow.idle == pytest.approx(fast.idle)
    assert slow.lags == fast.lags
    with pytest.raises(ValueError, match="engine factor must be a finite number > 0, got nan"):
        fitted.slowed(float("nan"))
    with pytest.raises(ValueError, match="trainer factor must be a finite number > 0, got 0"):
        fitted.scaled(trainer=0)
    halved = fitted.scaled(engine=0.5)
    assert halved.mean_duration == pytest.approx(fitted.mean_duration / 2)
    assert halved.step_times == fitted.step_times


@pytest.mark.medium
def test_a_trainer_beside_another_runs_rollouts_predicts_the_run_that_had_both(plain, tmp_path):
    """Rollouts of half the mean (a policy that learned to take fewer turns) recorded beside a
    trainer three times as slow: the plain run's trainer with those rollouts predicts the run
    that had both, where either calibration alone misses it."""
    shorter = attrs.evolve(PLAIN, duration_mean=MEAN / 2)
    slow = functools.partial(
        run_simulated,
        tmp_path / "slow.trace",
        updates=range(STEPS),
        config=shorter,
        batch_size=4,
        gap=3 * STEP_TIME,
        ahead=1,
        max_lag=1,
        width=512,
        rows=16,
        groups=4,
    )
    slow = trio.run(slow, clock=trio.testing.MockClock(autojump_threshold=0))
    both = calibrate.observe(record(tmp_path / "both.trace", shorter))
    setting = simulate.Setting("ahead=1", ahead=1, max_lag=1)

    def predict(fitted):
        return simulate.simulate(fitted.workload(steps=STEPS - 1, slots=None), setting)

    trainer, rollouts = calibrate.calibrate([plain]), calibrate.calibrate([slow])
    mixed = trainer.rollouts_from(rollouts)
    assert mixed.step_times == trainer.step_times and mixed.observed == rollouts.observed
    assert mixed.traces == (plain.path, slow.path)
    predicted = predict(mixed)
    assert predicted.goodput == pytest.approx(both.goodput, rel=0.05)
    assert predicted.idle == pytest.approx(both.idle, abs=0.02)
    for alone in (trainer, rollouts):
        assert abs(predict(alone).goodput / both.goodput - 1) > 0.3
    narrow = record(tmp_path / "narrow.trace", PLAIN, groups=2, rows=8)
    with pytest.raises(calibrate.CalibrationError, match=r"\(tasks, groups\) \(4, 2\) differ"):
        trainer.rollouts_from(calibrate.calibrate([narrow]))


def test_calibration_refuses_too_short_a_trace(plain):
    with pytest.raises(calibrate.CalibrationError, match="needs at least warmup \\+ 2 = 40"):
        calibrate.calibrate([plain], warmup=38)
    with pytest.raises(ValueError, match="warmup must be an int >= 0, got -1"):
        calibrate.calibrate([plain], warmup=-1)
    with pytest.raises(ValueError, match="at least one trace"):
        calibrate.calibrate([])


def test_calibration_refuses_traces_of_two_batch_shapes(plain, tmp_path):
    other = record(tmp_path / "other.trace", PLAIN, groups=2, rows=8)
    with pytest.raises(calibrate.CalibrationError, match=r"\(groups, tasks per batch\) \(2, 4\)"):
        calibrate.calibrate([plain, other])


def resampled(config: SimulatedConfig, n: int) -> list[float]:
    source = SimulatedSource(SimulatedEngine(), config)
    return [source.model_time(Task(str(i)), Label(0, 0, 0)) for i in range(n)]


def test_observed_rollouts_are_resampled_by_weight_and_seed():
    observed = (
        ObservedRollout((1.0,), Status.COMPLETED, weight=3.0),
        ObservedRollout((2.0, 3.0), Status.TRUNCATED, truncation="turns", weight=1.0),
    )
    config = SimulatedConfig(seed=4, observed=observed)
    times = resampled(config, 2000)
    assert set(times) == {1.0, 5.0}
    assert times.count(1.0) / len(times) == pytest.approx(0.75, abs=0.03)
    assert resampled(config, 50) == times[:50]
    assert resampled(SimulatedConfig(seed=5, observed=observed), 50) != times[:50]


def test_traces_pooled_keep_each_traces_groups_apart(plain):
    """A label names a rollout within its own trace: pooled, the n-th recorded group of each
    trace shares pool n, each trace's rollouts marked as its run's, so a trace pooled with
    itself is the workload it is alone, and predicts the same run."""
    alone = calibrate.calibrate([plain])
    twice = calibrate.calibrate([plain, plain])
    assert max(r.pool for r in alone.observed) > 0
    assert {r.run for r in alone.observed} == {0}
    assert [(r.pool, r.run) for r in twice.observed] == [
        (r.pool, run) for run in (0, 1) for r in alone.observed
    ]
    assert [r.seconds for r in twice.observed] == [r.seconds for r in alone.observed] * 2
    setting = simulate.Setting("a", ahead=2, max_lag=2)
    runs = [simulate.simulate(f.workload(steps=STEPS, slots=None), setting) for f in (alone, twice)]
    assert runs[0].goodput == runs[1].goodput
    assert runs[0].idle == runs[1].idle


def test_a_task_draws_from_its_own_pool():
    """Task n draws from pool n mod the pools' count; a pool without rollouts from them all."""
    observed = (
        ObservedRollout((1.0,), Status.COMPLETED, pool=0),
        ObservedRollout((2.0,), Status.COMPLETED, pool=1),
        ObservedRollout((4.0,), Status.COMPLETED, pool=3),
    )
    source = SimulatedSource(SimulatedEngine(), SimulatedConfig(observed=observed))
    drawn = {
        name: {source.model_time(Task(name), Label(0, s, 0)) for s in range(40)}
        for name in ("0", "1", "2", "3", "4", "9")
    }
    assert drawn == {
        "0": {1.0}, "1": {2.0}, "2": {1.0, 2.0, 4.0}, "3": {4.0}, "4": {1.0}, "9": {2.0},
    }  # fmt: skip


def test_a_task_draws_its_group_whole_from_one_of_the_runs_its_pool_holds():
    """Where a pool holds several recorded runs' groups, each task draws every rollout from one
    run's, the run picked per task by the seed: the group's kinship holds, and over the tasks
    each run is met about equally, so pooling runs of one setting averages them."""
    observed = tuple(
        ObservedRollout((seconds,), Status.COMPLETED, pool=pool, run=run)
        for pool in range(4)
        for run, seconds in enumerate((1.0, 2.0, 3.0))
    )
    source = SimulatedSource(SimulatedEngine(), SimulatedConfig(seed=5, observed=observed))
    drawn = [
        {source.model_time(Task(str(n)), Label(n, s, 0)) for s in range(8)} for n in range(300)
    ]
    assert all(len(group) == 1 for group in drawn)
    counts = collections.Counter(group.pop() for group in drawn)
    assert set(counts) == {1.0, 2.0, 3.0} and min(counts.values()) > 75, counts
    # Another seed picks other runs for the same tasks.
    other = SimulatedSource(SimulatedEngine(), SimulatedConfig(seed=6, observed=observed))
    picks = [other.model_time(Task(str(n)), Label(n, 0, 0)) for n in range(300)]
    assert picks != [source.model_time(Task(str(n)), Label(n, 0, 0)) for n in range(300)]


@pytest.mark.medium
def test_runs_of_one_setting_pooled_predict_between_them(tmp_path):
    """A slow recorded run and a fast one of the same setting, calibrated together, predict a
    run between the two each predicts alone: each simulated group is one of theirs, and the
    simulated trainer's steps are theirs in turn."""
    slow_config = SimulatedConfig(seed=1, duration_mean=2 * MEAN)
    slow = record(tmp_path / "slow.trace", slow_config, gap=2 * STEP_TIME)
    fast = record(tmp_path / "fast.trace", SimulatedConfig(seed=2, duration_mean=MEAN / 2))
    both = calibrate.calibrate([slow, fast])
    assert both.step_times == pytest.approx(([2 * STEP_TIME, STEP_TIME] * STEPS)[: STEPS - 3])
    setting = simulate.Setting("a", ahead=1, max_lag=1)
    goodput = {
        name: simulate.simulate(
            calibrate.calibrate(traces).workload(steps=STEPS, slots=None), setting
        ).goodput
        for name, traces in (("slow", [slow]), ("fast", [fast]), ("both", [slow, fast]))
    }
    assert goodput["slow"] < goodput["both"] < goodput["fast"], goodput


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"seconds": (1.0,), "status": Status.COMPLETED, "run": -1}, "run must be an int >= 0"),
        ({"seconds": (1.0,), "status": Status.CANCELLED}, "status must be how a rollout ends"),
        ({"seconds": (-1.0,), "status": Status.COMPLETED}, "seconds must be finite numbers >= 0"),
        ({"seconds": (1.0,), "status": Status.TRUNCATED}, "truncation must be given exactly"),
        ({"seconds": (1.0,), "status": Status.INFRA_ERROR}, "failing must be given exactly"),
        ({"seconds": (), "status": Status.COMPLETED}, "makes at least one call"),
        ({"seconds": (1.0,), "status": Status.COMPLETED, "weight": 0.0}, "weight must be a"),
        ({"seconds": (1.0,), "status": Status.COMPLETED, "pool": -1}, "pool must be an int >= 0"),
    ],
)
def test_a_bad_observed_rollout_names_its_field(fields, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        ObservedRollout(**fields)


# --- tune --------------------------------------------------------------------------------------

SMALL = simulate.Workload(seed=0, steps=6, slots=16, tasks=4, groups=4, step_time=10.0)
GRID = tune.Grid(ahead=(0, 1), oversample=(0, 2), admit=(None, 3), sync_every=(1,))


@pytest.fixture(scope="module")
def rows():
    return tune.tune(SMALL, GRID, seeds=2)


def test_the_grid_keeps_within_max_lags_bound():
    grid = tune.Grid(ahead=(0, 2), sync_every=(1, 2), max_lag=(1, 2, None))
    settings = grid.settings(tasks=4)
    assert all(s.max_lag >= s.ahead + s.sync_every - 1 for s in settings)
    assert {(s.ahead, s.sync_every, s.max_lag) for s in settings} == {
        (0, 1, 1), (0, 1, 2), (0, 1, 0), (0, 2, 1), (0, 2, 2), (2, 1, 2), (2, 2, 3),
    }  # fmt: skip
    with pytest.raises(ValueError, match="no setting of the grid"):
        tune.Grid(ahead=(3,), max_lag=(1,)).settings(tasks=4)
    with pytest.raises(ValueError, match="admit must be <= the workload's 4 tasks, got 5"):
        tune.Grid(admit=(5,)).settings(tasks=4)
    with pytest.raises(ValueError, match="ahead values must be ints >= 0, got -1"):
        tune.Grid(ahead=(-1,))


def test_the_grid_crosses_carry_over_with_the_admit_values_only():
    grid = tune.Grid(ahead=(1,), admit=(None, 3), sync_every=(1,), carry_over=(False, True))
    names = [s.name for s in grid.settings(tasks=4)]
    assert names == [
        "ahead=1 sync=1 lag=1",
        "ahead=1 sync=1 lag=1 admit=3",
        "ahead=1 sync=1 lag=1 admit=3 carry",
    ]
    assert [s.carry_over for s in grid.settings(tasks=4)] == [False, False, True]


def test_the_grid_crosses_the_hedge_with_the_carry_over_settings_only():
    grid = tune.Grid(
        ahead=(1,), admit=(None, 3), sync_every=(1,), carry_over=(False, True), hedge=(True, False)
    )
    settings = grid.settings(tasks=4)
    assert [s.name for s in settings] == [
        "ahead=1 sync=1 lag=1",
        "ahead=1 sync=1 lag=1 admit=3",
        "ahead=1 sync=1 lag=1 admit=3 carry",
        "ahead=1 sync=1 lag=1 admit=3 carry no-hedge",
    ]
    assert [s.hedge for s in settings] == [True, True, True, False]
    with pytest.raises(ValueError, match="hedge values must be bools, got 'off'"):
        tune.Grid(hedge=("off",))
    with pytest.raises(ValueError, match="hedge must hold at least one value"):
        tune.Grid(hedge=())
    with pytest.raises(ValueError, match="carry_over must hold at least one value"):
        tune.Grid(carry_over=())


def test_the_grid_takes_auto_among_the_admit_values():
    grid = tune.Grid(ahead=(1,), admit=("auto", 2), sync_every=(1,), carry_over=(True,))
    settings = grid.settings(tasks=4)
    assert [s.name for s in settings] == [
        "ahead=1 sync=1 lag=1 admit=auto budget=0.2 carry",
        "ahead=1 sync=1 lag=1 admit=2 carry",
    ]
    assert settings[0].admit == "auto"
    with pytest.raises(ValueError, match="admit values must be ints >= 1, got 'most'"):
        tune.Grid(admit=("most",))
    parse = tune._cli._int_list(1, 4096, "all", "auto")
    assert parse("all,auto,3") == (None, "auto", 3)


@pytest.mark.medium
def test_tune_is_deterministic_for_a_seed(rows):
    """A grid's rows are a pure function of the workload and its seed: a second tune of part
    of the grid repeats those rows exactly, and another seed changes them."""
    grid = attrs.evolve(GRID, oversample=(2,), admit=(None,))
    again = tune.tune(SMALL, grid, seeds=2)
    assert [r.setting.name for r in again] == [
        "ahead=0 sync=1 lag=0 over=2",
        "ahead=1 sync=1 lag=1 over=2",
    ]
    assert again == [r for r in rows if r.setting in {a.setting for a in again}]
    other = tune.tune(attrs.evolve(SMALL, seed=7), grid, seeds=2)
    assert [r.goodput for r in other] != [r.goodput for r in again]


@pytest.mark.slow
def test_tune_in_processes_gives_the_same_rows(rows):
    grid = tune.Grid(ahead=(1,), oversample=(2,), sync_every=(1,))
    assert tune.tune(SMALL, grid, seeds=2, jobs=2) == [
        r for r in rows if r.setting.name == "ahead=1 sync=1 lag=1 over=2"
    ]


def test_an_engine_sized_to_ahead_decodes_each_settings_rollouts_at_its_own_speed(rows):
    """Recorded at ahead=1 on an engine whose step costs its slots: at ahead=0 the engine has
    half the slots and every rollout takes half as long."""
    engine = tune.sized_to_ahead(1, 1.0)
    sync, ahead = GRID.settings(SMALL.tasks)[0], GRID.settings(SMALL.tasks)[4]
    assert (sync.ahead, ahead.ahead, engine(sync), engine(ahead)) == (0, 1, 0.5, 1.0)
    grid = tune.Grid(ahead=(0, 1), sync_every=(1,))
    sized = tune.tune(SMALL, grid, seeds=1, engine=engine)
    assert sized[0].outcomes[0] == simulate.simulate(SMALL.engine_scaled(0.5), sync)
    assert sized[1].outcomes[0] == rows[4].outcomes[0]
    assert tune.sized_to_ahead(1, 0.0)(sync) == 1.0
    with pytest.raises(ValueError, match="exponent must be a finite number >= 0, got -1"):
        tune.sized_to_ahead(1, -1)


@pytest.fixture(scope="module")
def brute_force():
    """Each setting of the grid simulated alone, per seed, as tune's rows are not."""
    return {
        setting: [simulate.simulate(attrs.evolve(SMALL, seed=k), setting) for k in range(2)]
        for setting in GRID.settings(SMALL.tasks)
    }


@pytest.mark.parametrize("max_waste", [1.0, 0.0])
def test_the_best_setting_matches_brute_force(rows, brute_force, max_waste):
    """The best by mean goodput over the seeds within the waste limit, ties to the lower lag."""
    scored = [
        (-np.mean([o.goodput for o in outcomes]), np.mean([g for o in outcomes for g in o.lags]), s)
        for s, outcomes in brute_force.items()
        if np.mean([o.wasted for o in outcomes]) <= max_waste
    ]
    expected = min(scored, key=lambda item: item[:2])[2]
    assert tune.best(rows, max_waste=max_waste).setting == expected
    # Cutting the tail wins when waste is free; without waste the best runs ahead plainly.
    assert (expected.oversample > 0 or expected.admit is not None) == (max_waste == 1.0)


def test_the_front_is_the_undominated_feasible_rows(rows):
    on = tune.front(rows, max_bias=0.1)
    assert on and all(r.bias <= 0.1 for r in on)
    for r in on:
        assert not any(
            o.goodput > r.goodput and o.lag_mean <= r.lag_mean
            for o in rows
            if tune.feasible(o, max_bias=0.1)
        )
    feasible = [r for r in rows if tune.feasible(r, max_bias=0.1)]
    for r in feasible:
        if r not in on:
            assert any(o.goodput >= r.goodput and o.lag_mean <= r.lag_mean for o in on)
    assert on[0] == tune.best(rows, max_bias=0.1)


# --- dew tune ----------------------------------------------------------------------------------


def test_dew_tune_prints_the_fit_the_table_and_draws_the_front(plain, tmp_path, capsys):
    picture = tmp_path / "front.png"
    argv = ["tune", plain.path, "--steps", "8", "--seeds", "1", "--ahead", "0,1"]
    assert cli.main([*argv, "--sync-every", "1,2", "--plot", str(picture)]) == 0
    out = capsys.readouterr().out
    assert "calibrated from 1 trace(s)" in out and "lognormal fit" in out
    names = re.findall(r"^[* -] (ahead=\d sync=\d lag=\d)", out, re.MULTILINE)
    assert names == ["ahead=0 sync=1 lag=0", "ahead=0 sync=2 lag=1", "ahead=1 sync=1 lag=1",
                     "ahead=1 sync=2 lag=2"]  # fmt: skip
    assert re.search(r"best goodput: ahead=1 sync=\d lag=\d", out)
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_dew_tune_simulates_carry_over_with_and_without_the_hedge(plain, capsys):
    argv = ["tune", plain.path, "--steps", "8", "--seeds", "1", "--ahead", "1", "--sync-every"]
    assert cli.main([*argv, "1", "--admit", "3", "--carry-over", "--hedge", "on,off"]) == 0
    names = re.findall(r"^[* -] (ahead=1 \S.*?)\s{2}", capsys.readouterr().out, re.MULTILINE)
    assert names == ["ahead=1 sync=1 lag=1 admit=3", "ahead=1 sync=1 lag=1 admit=3 carry",
                     "ahead=1 sync=1 lag=1 admit=3 carry no-hedge"]  # fmt: skip


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--ahead", "1,x"], "argument --ahead: must be an int within [0, 64], got 'x'"),
        (["--ahead", "1,,2"], "argument --ahead: must be a comma-separated list"),
        (["--sync-every", "0"], "argument --sync-every: must be an int within [1, 1000], got '0'"),
        (["--admit", "9"], "argument --admit: admit must be <= the workload's 4 tasks, got 9"),
        (["--max-lag", "0", "--ahead", "1"], "argument --max-lag: no setting of the grid"),
        (["--seeds", "0"], "argument --seeds: must be an int within [1, 1000], got '0'"),
        (["--steps", "3", "--warmup", "3"], "argument --warmup: must be < --steps 3, got 3"),
        (["--slots", "0"], "argument --slots: must be an int within [1, 1048576], 'observed' or"),
        (["--max-waste", "nan"], "argument --max-waste: must be a finite number within [0, 1]"),
        (["--max-waste", "1.5"], "argument --max-waste: must be a finite number within [0, 1]"),
        (
            ["--max-bias", "inf"],
            "argument --max-bias: must be a finite number within [0, 1e+06], got 'inf'",
        ),
        (["--step-time", "-1"], "argument --step-time: must be a finite number within [0, 86400]"),
        (["--hedge", "maybe"], "argument --hedge: must be on, off or on,off, got 'maybe'"),
        (["--hedge", "on,on"], "argument --hedge: must be on, off or on,off, got 'on,on'"),
        (["--hedge", "off"], "argument --hedge: 'off' backs up no carried group's stragglers"),
        (
            ["--engine-scaling", "nan"],
            "argument --engine-scaling: must be a finite number within [0, 10]",
        ),
        (
            ["--admit", "3", "--waste-budget", "0.1"],
            "argument --waste-budget: it bounds the cut of --admit auto: give --admit auto "
            "too, got --admit 3",
        ),
        (["--waste-budget", "0.2"], "give --admit auto too, got --admit all"),
        (["--admit", "auto", "--waste-budget", "1"], "must be a number within [0, 1), got '1'"),
        (["--admit", "auto", "--waste-budget", "0.1,-0.1"], "within [0, 1), got '-0.1'"),
        (["--admit", "auto", "--waste-budget", "nan"], "within [0, 1), got 'nan'"),
        (["--admit", "auto", "--waste-budget", "tight"], "within [0, 1), got 'tight'"),
        (["--admit", "auto", "--waste-budget", "0.1,"], "must be a comma-separated list"),
        (
            ["--admit", "auto", "--waste-budget", "0.1,0.10"],
            "argument --waste-budget: must list each value once, got '0.10' again in '0.1,0.10'",
        ),
    ],
)
def test_dew_tune_rejects_a_bad_option_by_name(plain, capsys, options, message):
    with pytest.raises(SystemExit) as exit:
        cli.main(["tune", plain.path, *options])
    assert exit.value.code == 2
    assert message in " ".join(capsys.readouterr().err.split())


def test_dew_tune_names_a_trace_it_cannot_read(tmp_path, capsys):
    missing = tmp_path / "missing.trace"
    with pytest.raises(SystemExit) as exit:
        cli.main(["tune", str(missing)])
    assert exit.value.code == 2
    assert f"argument TRACE: [Errno 2] No such file or directory: '{missing}'" in (
        capsys.readouterr().err
    )


# --- dew tune --waste-budget -------------------------------------------------------------------

# A heavy tail (sigma 1.5) that admit="auto" cuts: the budget bounds how much of it is thrown away.
HEAVY = SimulatedConfig(seed=1, duration_mean=MEAN, duration_sigma=1.5)


@pytest.fixture(scope="module")
def auto_traces(tmp_path_factory):
    """Two short runs with admit="auto" on the heavy tail, at waste budgets 0.1 and 0.3."""
    folder = tmp_path_factory.mktemp("auto")
    return {
        budget: record(folder / f"auto{budget}.trace", HEAVY, admit="auto", waste_budget=budget)
        for budget in (0.1, 0.3)
    }


def tune_rows(capsys, argv) -> tuple[dict[str, list[str]], str]:
    """`dew tune`'s table rows, by setting name (the figures after the name, as printed), and
    all it printed."""
    assert cli.main(["tune", *argv, "--steps", "12", "--seeds", "1", "--ahead", "1"]) == 0
    out = capsys.readouterr().out
    found = re.findall(r"^[* -] (ahead=\S+(?: \S+)*?)  +(\S.*)$", out, re.MULTILINE)
    return {name: figures.split() for name, figures in found}, out


def wasted(figures: list[str]) -> float:
    """The slot waste of a row's figures, the third from the end: the share auto's budget
    holds."""
    return float(figures[-3].rstrip("%")) / 100


@pytest.mark.medium
def test_dew_tune_predicts_each_waste_budget_and_a_tight_one_holds(auto_traces, capsys):
    """The run wastes as much as its budget lets it: a tight budget's prediction wastes no more
    than the budget, where a loose one's wastes more, and the rows name their budgets."""
    trace = auto_traces[0.1].path
    rows, _ = tune_rows(
        capsys, [trace, "--sync-every", "1", "--admit", "auto,3", "--waste-budget", "0.02,0.5"]
    )
    assert list(rows) == [
        "ahead=1 sync=1 lag=1 admit=auto budget=0.02",
        "ahead=1 sync=1 lag=1 admit=auto budget=0.5",
        "ahead=1 sync=1 lag=1 admit=3",
    ]
    auto = "ahead=1 sync=1 lag=1 admit=auto budget="
    tight, loose = rows[auto + "0.02"], rows[auto + "0.5"]
    assert wasted(tight) <= 0.02 < 0.1 < wasted(loose), (tight, loose)
    assert tight != loose


@pytest.mark.medium
def test_dew_tune_predicts_at_the_budget_the_trace_recorded(auto_traces, plain, capsys):
    """A trace of `dew train --admit auto --waste-budget 0.1` is predicted at 0.1 unless told
    otherwise; one of a run without auto at the scheduler's default; traces of two budgets at
    each."""
    argv = ["--sync-every", "1", "--admit", "auto"]
    recorded, out = tune_rows(capsys, [auto_traces[0.1].path, *argv])
    assert list(recorded) == ["ahead=1 sync=1 lag=1 admit=auto budget=0.1"]
    assert "admit auto at the waste budget the traces recorded: 0.1 (--waste-budget)" in out
    told, _ = tune_rows(capsys, [auto_traces[0.1].path, *argv, "--waste-budget", "0.1"])
    assert told == recorded
    default, out = tune_rows(capsys, [plain.path, *argv])
    assert list(default) == ["ahead=1 sync=1 lag=1 admit=auto budget=0.2"]
    assert "the traces recorded" not in out
    both, _ = tune_rows(capsys, [auto_traces[0.1].path, auto_traces[0.3].path, *argv])
    assert list(both) == [
        "ahead=1 sync=1 lag=1 admit=auto budget=0.1",
        "ahead=1 sync=1 lag=1 admit=auto budget=0.3",
    ]


def test_the_grid_crosses_the_waste_budget_with_the_auto_settings_only():
    grid = tune.Grid(ahead=(1,), admit=(None, "auto", 3), sync_every=(1,), waste_budget=(0.1, 0.3))
    settings = grid.settings(tasks=4)
    assert [(s.name, s.waste_budget) for s in settings] == [
        ("ahead=1 sync=1 lag=1", simulate.WASTE_BUDGET),
        ("ahead=1 sync=1 lag=1 admit=auto budget=0.1", 0.1),
        ("ahead=1 sync=1 lag=1 admit=auto budget=0.3", 0.3),
        ("ahead=1 sync=1 lag=1 admit=3", simulate.WASTE_BUDGET),
    ]
    with pytest.raises(ValueError, match=re.escape("waste_budget bounds the cut of admit 'auto'")):
        tune.Grid(admit=(None, 3), waste_budget=(0.1,))
    for bad in (1.0, -0.1, float("nan"), True, "0.1"):
        with pytest.raises(
            ValueError, match=r"waste_budget values must be numbers within \[0, 1\)"
        ):
            tune.Grid(admit=("auto",), waste_budget=(bad,))
    with pytest.raises(ValueError, match="waste_budget must hold at least one value"):
        tune.Grid(admit=("auto",), waste_budget=())


def test_a_rows_slot_waste_is_its_seeds_and_the_table_shows_it(rows):
    """Slot waste beside rollout waste: a row's is the mean of its seeds' (each counted from a
    rollout's start on a slot: see tests/test_simulate.py), none where nothing is cut."""
    for r in rows:
        assert r.slot_wasted == pytest.approx(np.mean([o.slot_wasted for o in r.outcomes]))
        if r.wasted == 0:
            assert r.slot_wasted == 0, r.setting.name
        if "over=" in r.setting.name:
            assert r.slot_wasted > 0, r.setting.name
    header = tune.table(rows).splitlines()[0]
    assert "wasted" in header and "slot waste" in header
