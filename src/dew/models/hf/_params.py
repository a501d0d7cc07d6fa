"""The params table: each checkpoint tensor, the leaf of dew's params it becomes, and how.

`TABLE` (the model's own tensors) and `LAYER` (each decoder block's, `{i}` its index) are the
part to read when adding a family: a row names the checkpoint tensor, the leaf's path in the
params tree, the leaf's shape in config fields, the layout change between the two (a transpose
to dew's [in, out] matmuls, a reshape to heads), the leaf's sharding over a device mesh (mesh
axis names, one per leaf axis), and which configs have it.

The params tree is `{"embed", "norm", "lm_head" (untied only), "layers": [per block]}`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import attrs
import numpy as np

from dew.models.hf._config import HFConfig

FSDP = "fsdp"
"""The mesh axis params and optimizer state are split over (and the batch, with `DATA`)."""
TENSOR = "tensor"
"""The mesh axis attention heads and MLP columns are split over."""


@attrs.frozen
class Layout:
    """How a checkpoint tensor's layout differs from its leaf's.

    to_leaf(array, shape) turns the checkpoint's array into the leaf's `shape`; to_tensor(array)
    turns a leaf back; tensor_shape(shape) is the checkpoint's shape of a leaf of `shape`.
    """

    to_leaf: Callable[[np.ndarray, tuple[int, ...]], np.ndarray]
    to_tensor: Callable[[np.ndarray], np.ndarray]
    tensor_shape: Callable[[tuple[int, ...]], tuple[int, ...]]


SAME = Layout(lambda array, shape: array.reshape(shape), lambda array: array, lambda shape: shape)
"""Stored as used: embeddings, norms."""
TRANSPOSED = Layout(lambda array, shape: array.T, lambda array: array.T, lambda shape: shape[::-1])
"""A torch Linear's [out, in] weight as dew's [in, out]."""
TO_HEADS = Layout(
    lambda array, shape: array.T.reshape(shape),
    lambda array: array.reshape(array.shape[0], -1).T,
    lambda shape: (shape[1] * shape[2], shape[0]),
)
"""A projection into heads, [heads * head_dim, in], as [in, heads, head_dim]."""
FROM_HEADS = Layout(
    lambda array, shape: array.T.reshape(shape),
    lambda array: array.reshape(-1, array.shape[-1]).T,
    lambda shape: (shape[2], shape[0] * shape[1]),
)
"""The projection out of heads, [out, heads * head_dim], as [heads, head_dim, out]."""
HEADS = Layout(
    lambda array, shape: array.reshape(shape),
    lambda array: array.reshape(-1),
    lambda shape: (shape[0] * shape[1],),
)
"""A bias of heads, [heads * head_dim], as [heads, head_dim]."""


def _always(config: HFConfig) -> bool:
    return True


@attrs.frozen
class Entry:
    """One row of the table: checkpoint tensor `name` is the leaf at `path`, of `shape` (config
    fields), stored in the checkpoint as `layout` says, sharded as `spec` (a mesh axis or None
    per leaf axis), present when `when(config)`."""

    name: str
    path: tuple[str, ...]
    shape: tuple[str, ...]
    layout: Layout
    spec: tuple[str | None, ...]
    when: Callable[[HFConfig], bool] = _always

    def leaf_shape(self, config: HFConfig) -> tuple[int, ...]:
        return tuple(getattr(config, field) for field in self.shape)

    @property
    def kind(self) -> str:
        """How a random init fills it: "ones" (norm gains), "zeros" (biases) or "normal"."""
        leaf = self.path[-1]
        return "ones" if leaf.endswith("norm") else "zeros" if leaf.endswith("bias") else "normal"


def _untied(config: HFConfig) -> bool:
    return not config.tied


def _qkv_bias(config: HFConfig) -> bool:
    return config.qkv_bias


def _o_bias(config: HFConfig) -> bool:
    return config.o_bias


def _qk_norm(config: HFConfig) -> bool:
    return config.qk_norm


H, F, V, D = "hidden", "intermediate", "vocab", "head_dim"
Q, KV = "heads", "kv_heads"

# fmt: off
TABLE = (
    Entry("model.embed_tokens.weight", ("embed",), (V, H), SAME, (TENSOR, FSDP)),
    Entry("model.norm.weight", ("norm",), (H,), SAME, (None,)),
    Entry("lm_head.weight", ("lm_head",), (V, H), SAME, (TENSOR, FSDP), _untied),
)
"""The model's tensors outside the blocks."""

LAYER = (
    Entry("input_layernorm.weight", ("attn_norm",), (H,), SAME, (None,)),
    Entry("self_attn.q_proj.weight", ("q",), (H, Q, D), TO_HEADS, (FSDP, TENSOR, None)),
    Entry("self_attn.k_proj.weight", ("k",), (H, KV, D), TO_HEADS, (FSDP, TENSOR, None)),
    Entry("self_attn.v_proj.weight", ("v",), (H, KV, D), TO_HEADS, (FSDP, TENSOR, None)),
    Entry("self_attn.q_proj.bias", ("q_bias",), (Q, D), HEADS, (TENSOR, None), _qkv_bias),
    Entry("self_attn.k_proj.bias", ("k_bias",), (KV, D), HEADS, (TENSOR, None), _qkv_bias),
    Entry("self_attn.v_proj.bias", ("v_bias",), (KV, D), HEADS, (TENSOR, None), _qkv_bias),
    Entry("self_attn.q_norm.weight", ("q_norm",), (D,), SAME, (None,), _qk_norm),
    Entry("self_attn.k_norm.weight", ("k_norm",), (D,), SAME, (None,), _qk_norm),
    Entry("self_attn.o_proj.weight", ("o",), (Q, D, H), FROM_HEADS, (TENSOR, None, FSDP)),
    Entry("self_attn.o_proj.bias", ("o_bias",), (H,), SAME, (None,), _o_bias),
    Entry("post_attention_layernorm.weight", ("mlp_norm",), (H,), SAME, (None,)),
    Entry("mlp.gate_proj.weight", ("gate",), (H, F), TRANSPOSED, (FSDP, TENSOR)),
    Entry("mlp.up_proj.weight", ("up",), (H, F), TRANSPOSED, (FSDP, TENSOR)),
    Entry("mlp.down_proj.weight", ("down",), (F, H), TRANSPOSED, (TENSOR, FSDP)),
)
"""Each decoder block's tensors, named after `model.layers.{i}.`."""
# fmt: on

LAYER_PREFIX = "model.layers.{i}."

IGNORED = (
    "model.layers.{i}.self_attn.rotary_emb.inv_freq",
    "model.layers.{i}.self_attn.rotary_emb.cos_cached",
    "model.layers.{i}.self_attn.rotary_emb.sin_cached",
    "model.rotary_emb.inv_freq",
)
"""Tensors some checkpoints hold that transformers and vLLM recompute and ignore: RoPE's
buffers, per layer as older releases and some training tools saved them, or once a model."""


@attrs.frozen
class Leaf:
    """A row of the table for one model: the tensor's full name, where its leaf goes."""

    name: str
    path: tuple[Any, ...]
    shape: tuple[int, ...]
    entry: Entry

    @property
    def tensor_shape(self) -> tuple[int, ...]:
        return self.entry.layout.tensor_shape(self.shape)


def leaves(config: HFConfig) -> Iterator[Leaf]:
    """Every tensor of a checkpoint of `config`, in the params tree's order of construction."""
    for entry in TABLE:
        if entry.when(config):
            yield Leaf(entry.name, entry.path, entry.leaf_shape(config), entry)
    for index in range(config.layers):
        prefix = LAYER_PREFIX.format(i=index)
        for entry in LAYER:
            if entry.when(config):
                path = ("layers", index, *entry.path)
                yield Leaf(prefix + entry.name, path, entry.leaf_shape(config), entry)


def ignored(name: str, config: HFConfig) -> bool:
    """Whether a checkpoint tensor not in the table is one transformers ignores too: RoPE's
    buffer, or the output projection of a tied model (which is the embedding)."""
    if config.tied and name == "lm_head.weight":
        return True
    return any(
        name == pattern.format(i=index) for pattern in IGNORED for index in range(config.layers)
    )


def empty_tree(config: HFConfig) -> dict[str, Any]:
    """The params tree's containers, for leaves to be set into by path."""
    return {"layers": [{} for _ in range(config.layers)]}


def set_leaf(tree: dict[str, Any], path: tuple[Any, ...], value: Any) -> None:
    """Put `value` at `path` ("layers", i, name or name) in `tree`."""
    node = tree
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value


def get_leaf(tree: dict[str, Any], path: tuple[Any, ...]) -> Any:
    node = tree
    for key in path:
        node = node[key]
    return node
