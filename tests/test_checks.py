"""The shared argument checks: what they take, and messages naming argument, bound and value."""

from __future__ import annotations

import math
import re

import attrs
import numpy as np
import pytest

from dew._checks import (
    at_least,
    check_int,
    check_number,
    finite,
    in_range,
    int_at_least,
    is_callable,
    positive,
    probability,
)


def test_check_int_returns_a_python_int_and_takes_numpy_ints():
    assert check_int("n", 3, low=1) == 3
    value = check_int("n", np.int64(0), low=0)
    assert value == 0 and type(value) is int


@pytest.mark.parametrize("value", [0, -1, True, 1.0, "2", None, np.float32(2)])
def test_check_int_refuses_what_is_not_an_int_at_least_its_bound(value):
    with pytest.raises(
        ValueError, match=f"^slots must be an int >= 1, got {re.escape(repr(value))}$"
    ):
        check_int("slots", value, low=1)


@pytest.mark.parametrize(
    ("bounds", "good", "bad", "wanted"),
    [
        ({"low": 0}, [0, 0.5, np.float32(2), 10**6], [-0.1, math.inf, math.nan, True, "1"],
         "a finite number >= 0"),
        ({"low": 0, "low_open": True}, [1e-9, 3], [0, -1.0, math.inf], "a finite number > 0"),
        ({"low": 0, "high": 1}, [0, 1, 0.5], [-0.1, 1.5, math.nan, None], r"within \[0, 1\]"),
        ({"low": 0, "high": 1, "low_open": True}, [1, 0.1], [0, 0.0], r"within \(0, 1\]"),
        ({"low": 0, "high": 1, "low_open": True, "high_open": True}, [0.2], [0, 1],
         r"within \(0, 1\)"),
        ({"low": -math.inf}, [-1e300, 0.0], [math.inf, -math.inf, math.nan], "a finite number"),
    ],
)  # fmt: skip
def test_check_number_bounds_and_their_wording(bounds, good, bad, wanted):
    for value in good:
        assert check_number("x", value, **bounds) is value
    for value in bad:
        with pytest.raises(ValueError, match=f"^x must be {wanted}, got {re.escape(repr(value))}$"):
            check_number("x", value, **bounds)


@attrs.frozen
class Config:
    count: int = attrs.field(default=1, validator=int_at_least(1))
    sigma: float = attrs.field(default=0.0, validator=at_least(0.0))
    rate: float = attrs.field(default=1.0, validator=positive)
    share: float = attrs.field(default=0.5, validator=probability)
    clip: float = attrs.field(default=0.2, validator=in_range(0, 1, low_open=True, high_open=True))
    reward: float = attrs.field(default=0.0, validator=finite)
    top_k: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(int_at_least(1))
    )
    model: object = attrs.field(default=len, validator=is_callable)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("count", 0, "count must be an int >= 1, got 0"),
        ("sigma", -0.5, "sigma must be a finite number >= 0.0, got -0.5"),
        ("rate", math.inf, "rate must be a finite number > 0, got inf"),
        ("share", 1.5, r"share must be within \[0, 1\], got 1.5"),
        ("clip", 1, r"clip must be within \(0, 1\), got 1"),
        ("reward", math.nan, "reward must be a finite number, got nan"),
        ("top_k", 0, "top_k must be an int >= 1, got 0"),
        ("model", "f", "model must be callable, got str"),
    ],
)
def test_the_validators_name_the_field_the_bound_and_the_value(field, value, message):
    assert Config().top_k is None  # optional() lets None through
    with pytest.raises(ValueError, match=f"^{message}$"):
        Config(**{field: value})
