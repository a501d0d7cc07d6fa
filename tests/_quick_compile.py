"""What the processes a test starts add to their environment so that XLA compiles quickly.

Their models are a few thousand params run for a handful of steps, so nearly all of such a
process's time is XLA compiling its programs, and most of that is LLVM's optimization passes:
`JAX_DISABLE_MOST_OPTIMIZATIONS` skips them (about a third less compile time, measured on
test_model_protocol), and the programs still compute what the tests compare to 1e-5. The
settings of the pytest process itself are left alone: JAX keeps the flag out of its jit
caches' keys, so it must not change within one process.
"""

QUICK_COMPILE = {"JAX_DISABLE_MOST_OPTIMIZATIONS": "1"}
