"""Running a trio program with its ready-task order shuffled by a seed of our choosing.

trio runs the tasks that are ready at once in an order it draws at random, to flush out code that
depends on it. Seeding that draw lets a test run one program under several orders and check that
nothing observable changes: the scheduler's determinism promise.
"""

from __future__ import annotations

import trio
import trio.testing


def under_scheduling_seed(main, seed: int):
    """Run `main` on a mock autojump clock with trio's ready-task order shuffled by `seed`.

    The seed goes to trio's private random generator (the only handle on that order), which is
    restored afterwards.
    """
    generator = trio._core._run._r
    state = generator.getstate()
    generator.seed(seed)
    try:
        return trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    finally:
        generator.setstate(state)
