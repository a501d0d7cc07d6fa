"""Sessions: what a source returns for one rollout, checked, and cut into chains to train on.

A `Session` is one rollout of one task: its status, the model calls it made, and the verifier's
reward. The scheduler stamps it with its task and `Label` (group, sample, attempt). A call whose
prompt extends a chain's tokens so far merges into that *chain*, a single token sequence to
train on; only completion tokens are trained, prompt and environment tokens are context.

Truncation policies (`TRUNCATION`), for a TRUNCATED session:
- `mask`: zero loss weight, and it leaves its group's baseline (agentic context, turn and
  wall-clock limits);
- `score`: trains on its verifier reward (single-turn RLVR); one without a reward is resubmitted
  by the scheduler as `unscored`;
- `zero`: trains with reward 0 (a length penalty).
"""

from dew.objectives.rl._chains import Chain, chains, merge_ratio
from dew.objectives.rl._packing import CUT_REASONS, PACKABLE, Cut, Packed, pack
from dew.objectives.rl._session import (
    ESTIMATORS,
    TRUNCATION,
    TRUNCATION_REASONS,
    Call,
    Label,
    Session,
    SessionError,
    SessionSource,
    Status,
    check_session,
    note_progress,
)
from dew.objectives.rl._session_metrics import session_metrics

__all__ = [
    "CUT_REASONS",
    "ESTIMATORS",
    "PACKABLE",
    "TRUNCATION",
    "TRUNCATION_REASONS",
    "Call",
    "Chain",
    "Cut",
    "Label",
    "Packed",
    "Session",
    "SessionError",
    "SessionSource",
    "Status",
    "chains",
    "check_session",
    "merge_ratio",
    "note_progress",
    "pack",
    "session_metrics",
]
