"""The long tail, simulated: what ahead, max_lag, oversample and admit buy a trainer.

A trainer that waits for every rollout of a step waits on the slowest: with heavy-tailed
rollout durations most of the engine idles while a few long rollouts finish, and the engine
idles again while the trainer trains. `long_tail` runs the RolloutScheduler under trio's mock
clock against a SimulatedEngine of `slots` decode slots serving SimulatedSource rollouts whose
model time is lognormal, beside a fake trainer that spends `step_time` seconds of trio's clock on
each step, once per scheduler setting (synchronous, one or two batches ahead, oversampling, a
partial admit), and `report` tabulates what each delivered. The runs are deterministic: a pure
function of the workload.

No model is involved: `BehaviorObjective` hands the simulated engine's behaviour log-probs back
as the trainer's proximal rescoring, which would cost no time on the mock clock in any case.

The package is split by what each part does: `_workload` the values (`Workload`, `Setting`,
`settings`, `Outcome`, `Contention`), `_run` the simulation under the mock clock (`simulate`,
`long_tail`, `estimated_seconds`, `BehaviorObjective`, the `SharedCpu` the trainer and engine
contend on) and `_report` the table (`describe`, `percent`, `report`). This module only
re-exports.
"""

# The constants stay where simulate.py kept them, as plain names of the module.
from dew.simulate._report import describe, percent, report
from dew.simulate._run import (  # noqa: F401
    CALL_SECONDS,
    GROUP_SECONDS,
    ROLLOUT_SECONDS,
    WASTED,
    WIDTH,
    BehaviorObjective,
    SharedCpu,
    SharingEngine,
    estimated_seconds,
    long_tail,
    simulate,
)
from dew.simulate._workload import (  # noqa: F401
    WASTE_BUDGET,
    Contention,
    Outcome,
    Setting,
    Workload,
    settings,
)

# In the order the API page shows them (`members_order: __all__`): the values, the run, the table.
__all__ = [
    "Contention",
    "Workload",
    "Setting",
    "settings",
    "Outcome",
    "BehaviorObjective",
    "SharedCpu",
    "SharingEngine",
    "simulate",
    "long_tail",
    "estimated_seconds",
    "describe",
    "percent",
    "report",
]
