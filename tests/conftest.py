"""Settings for the whole test session.

JAX runs under strict dtype and rank promotion (as equinox's tests do), set globally rather than
per test so that it also holds in the worker threads the engine and the environments use:
library code must never lean on implicit promotion.

Compiled programs go to a persistent compilation cache in a folder of this session's own, which
the processes the tests start (`dew train`, benchmark smoke runs, pools) inherit through the
environment: the same small models are compiled by many tests, and a cache hit loads the
executable XLA built the first time, so results are unchanged while the suite takes about a
third less time. The folder is new each session, so no run depends on an earlier one. It is one
folder for the whole session, xdist's workers included: the process that loads this file first
makes it (and removes it at its end), and the workers it starts inherit it through
DEW_TESTS_JAX_CACHE. The folder's path is part of JAX's cache key, so with a folder each, a
program one worker had compiled was compiled again by the other (7 test files on 2 workers: 547
programs compiled, 492 with one folder).

Every program is compiled without XLA's and LLVM's most expensive optimisation passes
(`jax_disable_most_optimizations`, set here before anything compiles and passed on to every
process a test starts through JAX_DISABLE_MOST_OPTIMIZATIONS). The tests' models are tiny and
run for a handful of steps, so compiling is most of what they do, and those passes are most of
compiling; the programs compute the same values (the suite passes either way, comparisons to
NumPy, transformers and vLLM included), only their machine code is slower, which models this
size never feel. Benchmarks and users' runs keep XLA's defaults. The few tests that train the
default model for tens of steps, where the optimised program's speed pays for its longer compile,
turn the passes back on for themselves (the `xla_optimizations` fixture). The two that train the
real 135M-param model (the README's command and the real-model notebook) keep them off: with
them its update compiled in 74 s against 16, and the README's command (one step) took 182
CPU-s against 93 (tests/test_real_model.py).

Every program is also compiled by XLA's CPU emitters of before its MLIR fusion emitters
(`--xla_cpu_use_fusion_emitters=false` in XLA_FLAGS, set here before JAX's backend starts and
inherited through the environment like the settings above; a test that sets XLA_FLAGS for a
process of its own adds to it). Those emitters are most of the compile time of the tests' tiny
programs: a gradient of a two-layer model compiled in about a third of the time, and
tests/test_train.py took 54 CPU-s against 76, the same tests passing. Users' runs keep XLA's
default.

Each program's machine code is generated in one piece (`--xla_cpu_parallel_codegen_split_count=1`
in XLA_FLAGS, added and inherited as above): by default XLA splits a module into parts that LLVM
compiles on threads of their own, which for the tests' tiny programs costs more CPU than it
saves on two shared cores. The code is the same, only its compile is cheaper: tests/test_grpo.py
with test_remat.py took 30.1 CPU-s against 35.3 and 36.3, test_engine.py, test_models.py and
test_chunked_logprobs.py 51.1 against 62.6 (user + sys, one process each, load 7).

The vLLM servers tests start run their model worker in their engine core's process
(VLLM_ENABLE_V1_MULTIPROCESSING=0, inherited through the environment by every server a test,
a `dew train` or a benchmark smoke run starts): vLLM's CPU build otherwise starts a worker
process of its own beside the engine core, one more Python process importing torch, so each
server was ready about 12-17 s later (42 s against 29-31 s; 57 s against 40 s on a loaded
machine) and held several hundred MB more, over about twenty server starts in the suite. The
tests check what dew asks of a server and sends it, which that layout leaves alike (its pushes
reach the worker through the same `collective_rpc`). One server runs in vLLM's default layout,
as users do: tests/test_vllm.py's refused server, whose refusal stops its three processes (the
fleet's three servers ran so, at 21 more CPU-seconds each).

The vLLM servers tests start also run torch eagerly (TORCHDYNAMO_DISABLE, inherited through the
environment like the settings above). vLLM's sampler compiles its log-prob gathering with
torch.compile even under `--enforce-eager`, and each server process pays for that compile: a
lone server was ready in 42 s without it against 50 s with it (two runs each, idle machine),
drawing the same tokens with the same log-probs to the last bit (a gather and a log-softmax).

Every hypothesis test draws the same examples in every run (the `dew` profile: `derandomize`,
seeded from the test's own code, no example database, no deadline): a property test is as
deterministic as the rest, a failure in CI is the one a developer gets again, and a busy
machine's slow example fails nothing. Four files' properties drew afresh each run
(test_align_starts, test_tokenizer, test_hardening, test_narrow), and the tokenizer's ran under
hypothesis's 200 ms deadline.
"""

import os
import shutil
import signal
import tempfile
import threading

# Before JAX's backend starts (see the module's docstring); xdist's workers inherit it.
for _flag in ("--xla_cpu_use_fusion_emitters=false", "--xla_cpu_parallel_codegen_split_count=1"):
    if _flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_flag}".strip()

import hypothesis  # noqa: E402
import jax  # noqa: E402
import pytest  # noqa: E402

from dew import _gc  # noqa: E402

hypothesis.settings.register_profile("dew", derandomize=True, database=None, deadline=None)
hypothesis.settings.load_profile("dew")

# Files holding slow tests go to xdist's workers first (tests/_slow_first.py); pytester runs
# the small suites that test it.
pytest_plugins = ["_slow_first", "pytester"]

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")

_OWNS_CACHE = "DEW_TESTS_JAX_CACHE" not in os.environ
if _OWNS_CACHE:
    os.environ["DEW_TESTS_JAX_CACHE"] = tempfile.mkdtemp(prefix="dew-tests-jax-cache-")
_CACHE = {
    "JAX_DISABLE_MOST_OPTIMIZATIONS": "1",
    "JAX_COMPILATION_CACHE_DIR": os.environ["DEW_TESTS_JAX_CACHE"],
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
}
os.environ.update(_CACHE)
os.environ["TORCHDYNAMO_DISABLE"] = "1"
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
jax.config.update("jax_disable_most_optimizations", True)
jax.config.update("jax_compilation_cache_dir", _CACHE["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

# A suite started in the background by a shell without job control (`nohup pytest &` in a
# script) inherits an ignored SIGINT, and so would every process a test starts: the Ctrl-C
# tests' processes would then train to their last step. The tests run as from a terminal.
if (
    threading.current_thread() is threading.main_thread()
    and signal.getsignal(signal.SIGINT) is signal.SIG_IGN
):
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture
def xla_optimizations(monkeypatch):
    """XLA's optimisation passes back on for one test, in its process and in the processes it
    starts, whose environment it gives (to add to theirs). For a test that trains the default
    model for tens of steps: there the unoptimised program runs about twice as slow per step,
    more than the optimisations cost to compile (the default task's learning test took 33 s
    without them and 23 s with them, to the same rewards)."""
    added = {"JAX_DISABLE_MOST_OPTIMIZATIONS": "0"}
    for name, value in added.items():
        monkeypatch.setenv(name, value)
    disabled = jax.config.values["jax_disable_most_optimizations"]
    jax.config.update("jax_disable_most_optimizations", False)
    yield added
    jax.config.update("jax_disable_most_optimizations", disabled)


@pytest.fixture(autouse=True, scope="module")
def _compiled_programs_freed():
    """Each test file's compiled programs are dropped after it (`jax.clear_caches`): a worker
    runs dozens of files, and kept, their executables and what they hold grew one worker of a
    two-worker suite run to 12 GB of a 24 GB machine, which then swapped. A later file that
    compiles the same program loads it from the persistent cache above.

    The garbage cycles a file leaves are freed as it ends (their finalizers' warnings are its
    own), by a collection that walks only the objects made while it ran (`dew._gc.collected`:
    what was alive as it began is frozen meanwhile). A full collection walked every object of
    a worker that had imported torch, transformers and vLLM, 0.5 CPU-s each file, and so did
    every automatic full collection while the file ran."""
    with _gc.collected():
        yield
        jax.clear_caches()


@pytest.fixture(autouse=True)
def _sigint_as_it_was():
    """Each test leaves SIGINT's handler as it found it. The `dew` command ignores SIGINT once a
    Ctrl-C has ended it; a test that calls it in-process and left that behind made every process
    a later test of the same worker started ignore Ctrl-C too (the pool's Ctrl-C test then ran
    to its last step)."""
    handler = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, handler)


def pytest_configure(config):
    """A compilation cache entry read while another process writes it is a miss, not an error.

    JAX writes an entry in place, not by a rename, so a worker that looks a program up while
    the other worker (or a process a test started) is writing it reads a cut file; JAX then
    warns and compiles the program itself, as without the cache, and the suite's warnings as
    errors would fail that test for it."""
    config.addinivalue_line(
        "filterwarnings", "ignore:Error reading persistent compilation cache entry:UserWarning"
    )


def pytest_unconfigure(config):
    """Remove the session's compilation cache, in the process that made it (xdist's workers
    end before the process that started them)."""
    if _OWNS_CACHE:
        shutil.rmtree(_CACHE["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
