"""LoRAServer: dew's engine for a LoRA run, serving base + adapter as one set of weights.

`LoRAModel`'s own functions merge the adapter into the base's weights inside each call, which
training needs (the gradient reaches the adapter through the merge) but an engine pays at every
prefill and decode step: a B @ A product of each targeted matrix per token drawn, which made a
LoRA run's rollouts about 1.7 times as slow as full fine-tuning's. The engine instead merges once
per push and serves the merged weights with the base model.
"""

from __future__ import annotations

import jax

from dew.models.hf.lora import LoRAModel
from dew.serve._engine import RolloutServer


class LoRAServer(RolloutServer):
    """A `RolloutServer` of a `LoRAModel` that merges each pushed adapter into the base once.

    It takes and loads the LoRA model's variables (`{"adapter": ..., "base": ...}`) as a
    `RolloutServer` of that model would, and draws the same tokens with the same log-probs;
    each `load` merges them (`LoRAModel.params`) and serves the result with the base model.

    Args:
        model: the LoRA model whose variables it takes.
        variables: its variables.
        **options: `RolloutServer`'s.

    Raises:
        ValueError: naming the leaf of `variables` whose shape or dtype is not the model's.
    """

    def __init__(self, model: LoRAModel, variables, **options):
        self._lora = model
        self._expected = jax.tree.structure(jax.eval_shape(model.init, jax.random.key(0)))
        self._merge = jax.jit(model.params)
        super().__init__(model.base, self._merged("params", variables), **options)

    @property
    def model(self) -> LoRAModel:
        """The LoRA model whose variables the server takes."""
        return self._lora

    def load(self, variables, version: int) -> None:
        """Serve base + adapter of `variables` under `version` from the next step on."""
        super().load(self._merged("variables", variables), version)

    def _merged(self, name: str, variables):
        if jax.tree.structure(variables) != self._expected:
            raise ValueError(f"{name} must have the tree layout of the LoRA model's init")
        return self._merge(variables)


def serving(model) -> type[RolloutServer]:
    """The engine class that serves `model`: a `LoRAServer` for a LoRA model."""
    return LoRAServer if isinstance(model, LoRAModel) else RolloutServer
