"""The suite's own arrangement: the files holding slow tests run first (tests/_slow_first.py),
and xdist keeps that order instead of its own (pyproject.toml); xdist's workers share one
compilation cache (tests/conftest.py)."""

from __future__ import annotations

import pathlib
import textwrap

import pytest


def test_files_holding_slow_tests_are_collected_first_and_keep_their_order(pytester):
    quick = "\n".join(f"def test_{i}():\n    pass\n" for i in range(3))
    pytester.makepyfile(
        test_a_quick=quick,
        test_b_one_slow=textwrap.dedent(
            """
            import pytest

            def test_first():
                pass

            @pytest.mark.slow
            def test_second():
                pass

            def test_third():
                pass
            """
        ),
        test_c_two_slow=textwrap.dedent(
            """
            import pytest

            @pytest.mark.slow
            def test_first():
                pass

            @pytest.mark.slow
            def test_second():
                pass
            """
        ),
    )
    # pytest-benchmark, where installed, warns in an xdist worker (the project's addopts too
    # leave it out); the inner run inherits the outer one's warnings as errors.
    result = pytester.runpytest_inprocess(
        "-p", "_slow_first", "-p", "no:cacheprovider", "-p", "no:benchmark", "-n", "0",
        "--collect-only", "-q", "-W", "ignore::pytest.PytestUnknownMarkWarning",
    )  # fmt: skip
    collected = [line for line in result.outlines if "::" in line]
    assert collected == [
        "test_c_two_slow.py::test_first",
        "test_c_two_slow.py::test_second",
        "test_b_one_slow.py::test_first",
        "test_b_one_slow.py::test_second",
        "test_b_one_slow.py::test_third",
        "test_a_quick.py::test_0",
        "test_a_quick.py::test_1",
        "test_a_quick.py::test_2",
    ]


def test_xdist_hands_out_files_in_the_collected_order(pytestconfig):
    """pyproject.toml's `--no-loadscope-reorder`: xdist's own reorder would sort the files by
    their number of tests."""
    assert pytestconfig.getoption("loadscopereorder") is False


@pytest.mark.slow
def test_the_workers_share_one_compilation_cache_removed_at_the_sessions_end(pytester, monkeypatch):
    """tests/conftest.py in a session of two xdist workers, each given one file: both compile
    into one folder, and it is gone after the session. Each worker had a folder of its own,
    and the folder's path is part of JAX's cache key, so a program one worker had compiled was
    compiled again by the other."""
    tests = pathlib.Path(__file__).parent
    for name in ("conftest.py", "_slow_first.py"):
        (pytester.path / name).write_text((tests / name).read_text())
    folders = pytester.mkdir("folders")
    record = textwrap.dedent(
        """
        import os
        import jax

        def test_record(worker_id):
            folder = jax.config.values["jax_compilation_cache_dir"]
            assert os.path.isdir(folder) and os.environ["JAX_COMPILATION_CACHE_DIR"] == folder
            with open(os.path.join(os.environ["FOLDERS"], worker_id), "w") as file:
                file.write(folder)
        """
    )
    pytester.makepyfile(test_one=record, test_two=record)
    # The session under test makes its own folder, as one started from a shell does.
    monkeypatch.delenv("DEW_TESTS_JAX_CACHE", raising=False)
    monkeypatch.setenv("FOLDERS", str(folders))
    # The plugins these two tests do not use stay out of its three processes (each imports them).
    unused = ("cacheprovider", "benchmark", "trio", "anyio", "hypothesispytest", "timeout")
    plugins = [option for name in unused for option in ("-p", f"no:{name}")]
    result = pytester.runpytest_subprocess(*plugins, "-n", "2", "--dist", "loadfile")
    result.assert_outcomes(passed=2)
    recorded = {path.name: path.read_text() for path in folders.iterdir()}
    assert sorted(recorded) == ["gw0", "gw1"]
    assert len(set(recorded.values())) == 1, recorded
    assert not pathlib.Path(recorded["gw0"]).exists()
