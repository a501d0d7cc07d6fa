"""One process of a real `jax.distributed` pool that breaks, for tests/test_pool_guard.py.

Run as `python tests/_pool_guard_worker.py PORT PROCESS PROCESSES CASE`: it joins the pool, agrees
once with the others, and then plays CASE, in which process 1 breaks (raises, or hangs)
while the others wait for it in the pool's next agreement. Whatever a process's run raises goes
to `_pool_guard.stop`, whose line it prints before it exits with status 1, as `dew train` does.
A process past 60 seconds exits, so nothing here outlives its test.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time

from dew import _pool_guard
from dew.parallel import DistributedPool


def main() -> None:
    port, index, processes, case = sys.argv[1:5]
    index, processes = int(index), int(processes)
    faulthandler.dump_traceback_later(60, exit=True)
    _pool_guard.join(f"127.0.0.1:{port}", processes, index)
    pool = DistributedPool()
    pool.agree(None)
    deadline = _pool_guard.Deadline(3.0) if case == "hang" else None
    try:
        with deadline.step(0) if deadline else _nothing():
            if index == 1 and case == "raise":
                raise LookupError("the environment of task 9 is gone")
            if index == 1 and case == "hang":
                time.sleep(60)
            if index == 0 and case == "kill0":  # the coordinator dies without a word
                os.kill(os.getpid(), signal.SIGKILL)
            pool.agree(None)
    except Exception as error:
        print(_pool_guard.stop(error), flush=True)
        os._exit(1)
    print("the pool agreed again", flush=True)


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    main()
