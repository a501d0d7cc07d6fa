"""README.md's Python blocks run as written, in order, each in a namespace of its own."""

from __future__ import annotations

import re
from pathlib import Path

import jax
import pytest

README = Path(__file__).parents[1] / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```$", README.read_text(encoding="utf-8"), re.M | re.S)


def test_the_readme_has_python_blocks():
    assert len(BLOCKS) >= 2


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_a_readme_block_runs(index, capsys):
    # optax's Adam raises its float decay to its int32 step count, which the tests' strict
    # promotion refuses; a reader's Python runs under JAX's standard promotion.
    with jax.numpy_dtype_promotion("standard"):
        exec(compile(BLOCKS[index], f"README.md block {index}", "exec"), {"__name__": "readme"})
    # Each block shows what it did, and in lines of its own: the trainer's first wait (the
    # engine compiling) is one line, not a dump of every rollout.
    out, err = capsys.readouterr()
    assert out.strip(), f"README.md block {index} prints nothing"
    assert "running(attempt" not in err, err
