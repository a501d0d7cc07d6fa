"""The suite's own arrangement: the files holding slow tests run first (tests/_slow_first.py),
and xdist keeps that order instead of its own (pyproject.toml)."""

from __future__ import annotations

import textwrap


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
