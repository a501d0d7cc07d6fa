"""A verifiers taskset whose `load()` raises ImportError, as one importing a missing optional
dependency lazily does (taskset id `_vf_load_raises`)."""

from collections.abc import Iterator

import verifiers.v1 as vf


class LoadRaisesTaskset(vf.Taskset[vf.Task, vf.TasksetConfig]):
    def load(self) -> Iterator[vf.Task]:
        import dew_tests_missing_scorer  # noqa: F401

        yield from ()


__all__ = ["LoadRaisesTaskset"]
