"""Tasks, batches and datasets: what the trainer reads and the scheduler turns into rollouts.

A `Batch` is a mapping from name to a numpy array whose leading axis is rows. A `Dataset` opens a
training stream from a batch index, so a resumed trainer re-reads from its checkpointed position.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Protocol, runtime_checkable

import attrs
import numpy as np

from dew._checks import check_int, int_at_least

Batch = Mapping[str, np.ndarray]


@attrs.frozen
class Task:
    """One unit of work a session source knows how to run.

    Args:
        name: what the task is called in logs, traces and errors.
        payload: whatever the source needs to run it (a prompt, an environment seed, ...).
    """

    name: str = attrs.field(validator=attrs.validators.instance_of(str))
    payload: Any = attrs.field(default=None, eq=False)


@runtime_checkable
class Dataset(Protocol):
    """A source of training batches that can be reopened at any batch index."""

    def stream(self, start: int = 0) -> Iterator[Batch]:
        """Yield batches from batch index `start` on, in the same order every time."""
        ...


@attrs.frozen
class ArrayDataset:
    """Fixed-size batches cut from equal-length arrays, in a deterministic order.

    Each epoch is a permutation of the rows (identity without `shuffle_seed`, else seeded by
    `(shuffle_seed, epoch)`); the trailing rows that do not fill a batch are dropped, so every
    batch has `batch_size` rows. `stream(start)` yields exactly the batches a stream from 0
    yields from its `start`-th on.

    Args:
        arrays: name -> array, all with the same leading length.
        batch_size: rows per batch.
        shuffle_seed: seed of the per-epoch permutation; None keeps the rows' order.
        epochs: how many passes over the rows the stream makes.

    Raises:
        ValueError: naming the array or argument that is bad.
    """

    arrays: Mapping[str, np.ndarray] = attrs.field(
        converter=lambda a: {k: np.asarray(v) for k, v in a.items()}
    )
    batch_size: int = attrs.field(validator=int_at_least(1))
    shuffle_seed: int | None = None
    epochs: int = attrs.field(default=1, validator=int_at_least(1))

    def __attrs_post_init__(self):
        if not self.arrays:
            raise ValueError("arrays must hold at least one array")
        lengths = {name: len(array) for name, array in self.arrays.items()}
        if len(set(lengths.values())) != 1:
            raise ValueError(f"arrays must share their leading length, got {lengths}")
        if self.rows < self.batch_size:
            raise ValueError(f"batch_size {self.batch_size} exceeds the {self.rows} rows of arrays")

    @property
    def rows(self) -> int:
        """Rows in each array: the dataset's examples in one epoch."""
        return len(next(iter(self.arrays.values())))

    @property
    def batches_per_epoch(self) -> int:
        """Whole batches in one epoch; the remainder rows are left out."""
        return self.rows // self.batch_size

    def __len__(self) -> int:
        return self.batches_per_epoch * self.epochs

    def _order(self, epoch: int) -> np.ndarray:
        if self.shuffle_seed is None:
            return np.arange(self.rows)
        return np.random.default_rng([self.shuffle_seed, epoch]).permutation(self.rows)

    def stream(self, start: int = 0) -> Iterator[dict[str, np.ndarray]]:
        """Yield batches from batch index `start` on, in the same order every time.

        Raises:
            ValueError: for a negative `start`.
        """
        check_int("start", start, low=0)
        for index in range(start, len(self)):
            epoch, within = divmod(index, self.batches_per_epoch)
            rows = self._order(epoch)[within * self.batch_size : (within + 1) * self.batch_size]
            yield {name: array[rows] for name, array in self.arrays.items()}
