"""Sampling: how a source asks an engine to sample, the one engine setting every source shares.

It lives with the engines, whose call options it writes, rather than with any one kind of
source: in-process environments, prompt sets and the recording gateway all pass it on, and the
gateway must not import the environments (they build their harness source on it). Public as
`dew.serve.Sampling`, and as `dew.envs.Sampling` where sources are built.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
from attrs.validators import optional

from dew._checks import at_least, in_range, int_at_least
from dew.objectives.rl.sessions import Label


@attrs.frozen
class Sampling:
    """How a source asks the engine to sample.

    Args:
        temperature: softmax temperature, >= 0 (0 draws the likeliest token, for evaluation).
        top_k: keep the k likeliest tokens (the engine then reports the support).
        top_p: keep the smallest set of tokens of mass >= top_p.
        seed: where given, each call's sampling key is a function of it, the rollout's label and
            the call's index, so a replayed rollout draws the same tokens; None leaves the key to
            the engine.
    """

    temperature: float = attrs.field(default=1.0, validator=at_least(0))
    top_k: int | None = attrs.field(default=None, validator=optional(int_at_least(1)))
    top_p: float | None = attrs.field(
        default=None, validator=optional(in_range(0, 1, low_open=True))
    )
    seed: int | None = attrs.field(default=None, validator=optional(int_at_least(0)))

    def options(self, label: Label, index: int) -> dict[str, Any]:
        """The engine's keyword arguments for call `index` of the rollout labelled `label`."""
        key = None
        if self.seed is not None:
            entropy = [self.seed, label.group, label.sample, label.attempt, index]
            key = int(np.random.SeedSequence(entropy).generate_state(1, np.uint32)[0])
        return {
            "temperature": self.temperature,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "key": key,
        }
