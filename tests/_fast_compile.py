"""The environment for the processes the tests start to run whole programs (benchmark smoke
runs, notebook kernels): XLA compiles their JAX programs without LLVM's optimisation passes.

Those passes take most of XLA's CPU compile time for small programs, and compiling is most of
what a smoke run or a notebook's few steps of a tiny model do (a 3-step `dew train` of the tests'
tiny model: 19 CPU seconds with them, 10 without). The programs compute the same thing; only
the machine code is slower, which such small models never feel. A smoke's figures mean nothing,
and a notebook's checks are about what its run did, not how fast; the tests' own process keeps
XLA's defaults.
"""

from __future__ import annotations

import os

FLAG = "--xla_backend_optimization_level=0"


def fast_compile_env() -> dict[str, str]:
    """This process's environment (the session's compilation cache included) with FLAG added to
    XLA_FLAGS."""
    return {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {FLAG}".strip()}
