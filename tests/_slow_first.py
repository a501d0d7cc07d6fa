"""A pytest plugin (tests/conftest.py loads it) that runs the files holding slow tests first.

xdist hands whole files to its two workers in collection order (`--dist loadfile` with
`--no-loadscope-reorder`, pyproject.toml), each worker taking the next file as it runs out. With
the long files (vLLM servers, process pools, notebooks, benchmark smoke runs) started first, the
many short files fill in behind them and both workers end together. In the order xdist chose by
itself, most tests first, a file of two tests that starts two vLLM servers came near the end and
ran on alone after the other worker had finished everything else.
"""

from __future__ import annotations


def pytest_collection_modifyitems(config, items):
    """Files by how many `slow` tests they hold, most first; the rest as collected. The order
    within a file is kept: some files end with the test that kills their shared server."""
    slow: dict = {}
    for item in items:
        slow[item.path] = slow.get(item.path, 0) + (item.get_closest_marker("slow") is not None)
    items.sort(key=lambda item: -slow[item.path])
