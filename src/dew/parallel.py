"""The process pool a multi-process trainer runs on, over `jax.distributed`.

Every process runs its own scheduler on its own rows. The pool meets twice a call: processes
agree that every admission succeeded (a failure raises on every process at that point, rather
than leave the others waiting in the rescoring), and the proximal rescoring runs once over the
pool's global batch, each process reading its own rows back.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np


class Pool(Protocol):
    """Where the processes of one trainer meet, once per call for each method."""

    def agree(self, error: BaseException | None) -> None:
        """Raise on every process if any process's admission failed: the failed process
        raises its own error, the others an error naming the failed process."""
        ...

    def rescore(self, objective: Any, variables: Any, rows: Mapping[str, np.ndarray]) -> np.ndarray:
        """This process's proximal log-probs, float32[rows, width], computed once over the
        pool's batch."""
        ...


class LocalPool:
    """The pool of a single-process trainer."""

    def agree(self, error: BaseException | None) -> None:
        if error is not None:
            raise error

    def rescore(self, objective: Any, variables: Any, rows: Mapping[str, np.ndarray]) -> np.ndarray:
        return np.asarray(objective.packed_log_probs(variables, rows), np.float32)


def default_pool() -> Pool:
    """The pool of the running trainer: every `jax.distributed` process, or this one alone."""
    return LocalPool()
