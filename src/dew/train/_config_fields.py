"""The checks of `TrainConfig`'s fields, one small validator or converter each, and `_option`,
which makes a field that is also a `dew train` option.

Each validator names the field (its attrs attribute) and the value it refuses, so that a bad
value is refused in one line wherever it comes from: the command line, a `--config` file or a
run folder's `config.json` (`_fields_of` runs them on a file's keys alone). The task names a
run accepts (`TASKS`, `HARNESS`, `ENVIRONMENTS`) are here, where `task`'s check reads them. Kept
apart from `_config`, whose `TrainConfig` declares the fields with them, so that each reads in one
sitting.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

import attrs

from dew._checks import int_within
from dew.envs.lookup import HARNESSES
from dew.envs.reasoning_gym import PREFIX
from dew.models.hf.lora import LoRAConfig

TASKS = ("copy", "guess", "echo")
"""The built-in tasks `dew train --task` runs: CopyDigits, GuessDigit and EchoDigits."""
HARNESS = "harness:"
"""The prefix of a task that is a built-in agent harness (`--harness NAME` is this plus NAME)."""
ENVIRONMENTS = {
    "verifiers:": ("verifiers", "textarena", "hypercorn", "openai", "orjson"),
    "textarena:": ("textarena", "nltk"),
}
"""The prefixes of a task that is an environment of another package (`--env SPEC`), and the
packages each needs: a verifiers environment through the recording gateway, a TextArena game."""
# What a harness run needs installed: the gateway extra.
_GATEWAY_PACKAGES = ("hypercorn", "openai", "orjson")


def _task_name(instance, attribute, value):
    if isinstance(value, str) and value.startswith(HARNESS):
        _check_harness(value.removeprefix(HARNESS))
    elif isinstance(value, str) and value.startswith(tuple(ENVIRONMENTS)):
        _check_environment(value)
    elif not isinstance(value, str) or not (value in TASKS or value.startswith(PREFIX)):
        raise ValueError(
            f"{attribute.name} must be one of {TASKS}, {PREFIX}NAME[,key=value...], "
            f"verifiers:NAME[,key=value...], textarena:GAME[,key=value...] or {HARNESS}NAME, "
            f"got {value!r}"
        )


def _check_harness(name: str) -> None:
    """Raises: ValueError naming the built-in harnesses when `name` is not one, or the packages
    of the recording gateway that are not installed."""
    if name not in HARNESSES:
        raise ValueError(
            f"unknown harness {name!r}; the built-in harnesses are: {', '.join(HARNESSES)}"
        )
    missing = [package for package in _GATEWAY_PACKAGES if not importlib.util.find_spec(package)]
    if missing:
        raise ValueError(
            f"a harness trains through the recording gateway, which needs {', '.join(missing)}: "
            "pip install 'dew[gateway]'"
        )


def _flag(instance, attribute, value):
    # A config file's "yes" or 1 is a mistake to name, not a truth to guess.
    if not isinstance(value, bool):
        raise ValueError(f"{attribute.name} must be true or false, got {value!r}")


def _check_environment(spec: str) -> None:
    """Raises: ValueError naming the packages an environment task needs and lacks, or a spec
    without a name."""
    prefix = next(prefix for prefix in ENVIRONMENTS if spec.startswith(prefix))
    if not spec.removeprefix(prefix).split(",")[0].strip():
        raise ValueError(f"{spec!r} names no environment: {prefix}NAME[,key=value...]")
    missing = [p for p in ENVIRONMENTS[prefix] if not importlib.util.find_spec(p)]
    if missing:
        raise ValueError(f"{spec} needs {', '.join(missing)}: pip install 'dew[verifiers]'")


def _path_or_none(instance, attribute, value):
    if value is not None and not (isinstance(value, str) and value):
        raise ValueError(f"{attribute.name} must be a file's path or None, got {value!r}")


def _project_or_none(instance, attribute, value):
    if value is not None and not (isinstance(value, str) and value.strip() and "/" not in value):
        raise ValueError(
            f"{attribute.name} must be a W&B project's name (no '/') or None, got {value!r}"
        )


def _dtype_or_none(instance, attribute, value):
    if value not in (None, "float32", "bfloat16"):
        raise ValueError(f"{attribute.name} must be float32, bfloat16 or None, got {value!r}")


def _mesh_or_none(instance, attribute, value):
    if value is None:
        return
    sizes = value.split("x") if isinstance(value, str) else []
    if len(sizes) != 3 or not all(size.isdigit() and int(size) >= 1 for size in sizes):
        raise ValueError(
            f"{attribute.name} must be DATAxFSDPxTENSOR, three sizes >= 1 (1x2x2), got {value!r}"
        )


def _lora_targets(instance, attribute, value):
    """Module names, comma-separated, each one an adapter can target (`LoRAConfig`'s check;
    `TrainConfig` checks them against dew's transformer for a run without a --model)."""
    if value is None:
        return
    if not isinstance(value, str):
        raise ValueError(f"{attribute.name} must be module names, comma-separated, got {value!r}")
    try:
        LoRAConfig(targets=tuple(name.strip() for name in value.split(",")))
    except ValueError as error:
        raise ValueError(str(error).replace("targets", attribute.name, 1)) from None


_WORDS = ("auto", "none")
"""admit's values other than a number of groups."""


def _admit_value(text: str) -> int | str:
    """--admit's value: "auto", "none" (every task's group trains: the default) or a number of
    groups."""
    return text if text in _WORDS else int(text)


_admit_value.__name__ = "admit"


def _admit(instance, attribute, value) -> None:
    if value not in _WORDS:
        int_within(1, 4096)(instance, attribute, value)


def _no_cut(value: Any) -> Any:
    """admit "none", as the option's help and a config file spell the default, is None."""
    return None if value == "none" else value


def _server_urls(instance, attribute, value) -> None:
    """Refuse URLs that cannot be vLLM servers' (a bare `localhost:8000`) or that name one server
    twice (in a pool, two processes would push to it), before anything starts."""
    if value is None:
        return
    from dew.serve._vllm_process import server_urls  # as VLLMEngine.attach reads them

    try:
        server_urls((value,) if isinstance(value, str) else value)
    except ValueError as error:
        raise ValueError(f"{attribute.name}: {error}") from None


def _optional_tuple(values: Any) -> tuple | None:
    return None if values is None else tuple(values)


def _option(
    default: Any,
    validator: Callable,
    help: str,
    *,
    kind: type | None = None,
    converter: Callable | None = None,
) -> Any:
    """A TrainConfig field that is also a `dew train` option, with its help text and, where
    the default (None) does not tell it, the type of its values (and a converter of the value
    given, where another spelling means the same)."""
    kind = type(default) if kind is None else kind
    return attrs.field(
        default=default,
        validator=validator,
        converter=converter,
        metadata={"help": help, "type": kind},
    )
