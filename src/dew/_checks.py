"""Argument checks shared by dew's modules: one wording for one kind of bad value.

attrs classes validate their fields with the validators here (`int_at_least(1)`, `positive`,
`probability`, ...; wrap one in `attrs.validators.optional` where None is allowed); plain
functions and `__init__`s check their arguments with `check_int` and `check_number`. Every
message names the argument, what it must be (its kind and bound) and the value it got, e.g.
`slots must be an int >= 1, got 0`. A bool is refused where a number is wanted: `True` as a
count is a mistake, not a 1.
"""

from __future__ import annotations

import argparse
import math
import numbers
from collections.abc import Callable
from typing import Any

import numpy as np

Validator = Callable[[Any, Any, Any], None]


def is_number(value: Any) -> bool:
    """Whether `value` is a real number (numpy's included), and not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool | np.bool_)


def check_int(name: str, value: Any, *, low: int, high: int | None = None) -> int:
    """`value` as a Python int, checked to be an int (numpy's included) of at least `low` (and
    at most `high`, when given).

    Raises:
        ValueError: `{name} must be an int >= {low}, got {value!r}`, or with `high`
            `{name} must be an int within [{low}, {high}], got {value!r}`.
    """
    wanted = f">= {low}" if high is None else f"within [{low}, {high}]"
    if (
        isinstance(value, bool)
        or not isinstance(value, int | np.integer)
        or value < low
        or (high is not None and value > high)
    ):
        raise ValueError(f"{name} must be an int {wanted}, got {value!r}")
    return int(value)


def _number_problem(
    value: Any, low: float, high: float, *, low_open: bool, high_open: bool
) -> str | None:
    """What `value` must be, when it is not a number within the bounds; None when it is."""
    if math.isinf(high):
        wanted = "a finite number"
        if math.isfinite(low):
            wanted += f" {'>' if low_open else '>='} {low}"
        fits = is_number(value) and math.isfinite(value)
    else:
        wanted = f"within {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        fits = is_number(value)
    if fits:
        fits = (value > low if low_open else value >= low) and (
            value < high if high_open else value <= high
        )
    return None if fits else wanted


def check_number(
    name: str,
    value: Any,
    *,
    low: float,
    high: float = math.inf,
    low_open: bool = False,
    high_open: bool = False,
) -> float:
    """`value`, checked to be a real number within its bounds (and finite when unbounded above).

    Args:
        name: the argument, as the message names it.
        value: what was given.
        low, high: the bounds; `high` infinite means only `low` bounds it.
        low_open, high_open: whether the bound itself is excluded.

    Returns:
        `value` unchanged.

    Raises:
        ValueError: `{name} must be a finite number >= {low}, got {value!r}`, or for two
            bounds `{name} must be within [low, high], got {value!r}` (brackets open or
            closed as the bounds are).
    """
    wanted = _number_problem(value, low, high, low_open=low_open, high_open=high_open)
    if wanted is not None:
        raise ValueError(f"{name} must be {wanted}, got {value!r}")
    return value


def int_at_least(low: int) -> Validator:
    """An attrs validator: the field is an int of at least `low` (see check_int)."""

    def validate(instance: Any, attribute: Any, value: Any) -> None:
        check_int(attribute.name, value, low=low)

    return validate


def int_within(low: int, high: int) -> Validator:
    """An attrs validator: the field is an int within [low, high] (see check_int); the upper
    bound keeps a count or size a typo made huge from allocating for minutes first."""

    def validate(instance: Any, attribute: Any, value: Any) -> None:
        check_int(attribute.name, value, low=low, high=high)

    return validate


def one_of(choices: tuple[str, ...]) -> Validator:
    """An attrs validator: the field is one of `choices`, named in the message."""

    def validate(instance: Any, attribute: Any, value: Any) -> None:
        if value not in choices:
            raise ValueError(f"{attribute.name} must be one of {choices}, got {value!r}")

    return validate


def in_range(
    low: float, high: float = math.inf, *, low_open: bool = False, high_open: bool = False
) -> Validator:
    """An attrs validator: the field is a number within the bounds (see check_number)."""

    def validate(instance: Any, attribute: Any, value: Any) -> None:
        check_number(
            attribute.name, value, low=low, high=high, low_open=low_open, high_open=high_open
        )

    return validate


def at_least(low: float) -> Validator:
    """An attrs validator: the field is a finite number of at least `low`."""
    return in_range(low)


positive = in_range(0, low_open=True)
"""An attrs validator: the field is a finite number > 0."""

finite = in_range(-math.inf)
"""An attrs validator: the field is a finite number."""

probability = in_range(0, 1)
"""An attrs validator: the field is a number in [0, 1]."""


def as_tuple(value: Any) -> Any:
    """An attrs converter: a list or tuple as a tuple, anything else as given, for the field's
    validator to name (a bare `tuple` converter fails on an int with a TypeError that names no
    field)."""
    return tuple(value) if isinstance(value, list | tuple) else value


def is_callable(instance: Any, attribute: Any, value: Any) -> None:
    """An attrs validator: the field is callable.

    Raises:
        ValueError: `{name} must be callable, got {type name}`.
    """
    if not callable(value):
        raise ValueError(f"{attribute.name} must be callable, got {type(value).__name__}")


def int_option(low: int, high: int) -> Callable[[str], int]:
    """An argparse `type`: the option's text as an int within [low, high]. Every count and size
    a command takes has an upper bound, past which it would allocate or run for hours before
    anything failed; argparse puts the option's name before the message.

    Raises:
        argparse.ArgumentTypeError: `must be an int within [low, high], got 'text'`.
    """

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be an int within [{low}, {high}], got {text!r}")
        return value

    return parse


def number_option(low: float, high: float) -> Callable[[str], float]:
    """An argparse `type`: the option's text as a finite number within [low, high].

    Raises:
        argparse.ArgumentTypeError: `must be a finite number within [low, high], got 'text'`.
    """

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
        if not (math.isfinite(value) and low <= value <= high):
            raise argparse.ArgumentTypeError(
                f"must be a finite number within [{low:g}, {high:g}], got {text!r}"
            )
        return value

    parse.__name__ = "number"
    return parse


def span_option(low: int, high: int) -> Callable[[str], tuple[int, int]]:
    """An argparse `type`: `N` or `LOW-HIGH` as a (low, high) pair of ints within [low, high],
    low first.

    Raises:
        argparse.ArgumentTypeError: `must be N or LOW-HIGH, ints within [low, high] with LOW <=
            HIGH, got 'text'`.
    """
    single = int_option(low, high)

    def parse(text: str) -> tuple[int, int]:
        parts = text.split("-")
        try:
            if len(parts) not in (1, 2):
                raise argparse.ArgumentTypeError
            first, last = single(parts[0]), single(parts[-1])
            if first > last:
                raise argparse.ArgumentTypeError
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(
                f"must be N or LOW-HIGH, ints within [{low}, {high}] with LOW <= HIGH, got {text!r}"
            ) from None
        return first, last

    return parse
