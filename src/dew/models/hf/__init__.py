"""Hugging Face checkpoint folders of the Llama family, loaded into and saved from dew's JAX model.

`load(folder)` reads a checkpoint folder (`config.json`, and `model.safetensors` or a sharded
`model.safetensors.index.json`), or the one a Hub repository id names (`resolve`), of a
`LlamaForCausalLM`, `MistralForCausalLM`, `Qwen2ForCausalLM` or `Qwen3ForCausalLM` into an
`HFModel` (a `dew.models.Model`, so the objective, the engine and the scheduler take it
unchanged) and its params. `save` writes a model's params back as a folder `transformers` and
vLLM load as it is: the same tensor names, shapes and dtypes, `config.json`, and the tokenizer
files of the folder it came from.

`load` reads a GGUF file (llama.cpp's format) of those families too, or a packaged one named by
its short name (`resolve("smollm2")`), with the `gguf` extra: its tensors dequantized, its
tokenizer and chat template read from its metadata (`_gguf`); `save` of such a model writes a
folder as for any other, its tokenizer files made from the file's metadata.

Loading reads tensor by tensor, each converted and placed before the next is read, so the host
never holds the params twice; saving writes tensor by tensor likewise. Every problem a folder
has (a tensor missing, extra, of another shape; a truncated file) is found from the files'
headers before any tensor is read, and reported at once in one error; the one exception is a
tied model's saved `lm_head.weight`, compared with the embedding (a block of rows at a time).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open

from dew._documents import read_document
from dew.models.hf import _params
from dew.models.hf._config import (
    CONFIG,
    FAMILIES,
    HFConfig,
    Llama3Scaling,
    check_dtype,
    read_config,
)
from dew.models.hf._gguf import GGUF, is_gguf
from dew.models.hf._hub import resolve
from dew.models.hf._modeling import HFModel
from dew.models.hf._write import (
    _DTYPE_NAMES,
    _check_params,
    _fsync,
    _swap_in,
    _tensors_of,
    _write_safetensors,
)

__all__ = [
    "FAMILIES",
    "CheckpointError",
    "HFConfig",
    "HFModel",
    "is_gguf",
    "Llama3Scaling",
    "load",
    "model_of",
    "resolve",
    "save",
    "TOKENIZER_FILES",
]

WEIGHTS = "model.safetensors"
"""A single-file checkpoint's tensors."""
INDEX = "model.safetensors.index.json"
"""A sharded checkpoint's index: which file holds each tensor."""
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "chat_template.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "generation_config.json",
    "additional_chat_templates",  # a folder: named templates (transformers' `tool_use`)
)
"""The files `save` copies from `tokenizer_from`, those that exist: the tokenizer, its chat
template, and the generation settings that name its stop tokens."""

# safetensors' dtype names of the float dtypes a checkpoint may hold, and numpy's of them.
_TENSOR_DTYPES = {
    "F32": np.dtype(np.float32),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F16": np.dtype(np.float16),
}
# A tied model's output projection, which transformers' checkpoints leave out, and what it is.
_HEAD = "lm_head.weight"
_EMBED = "model.embed_tokens.weight"
_COMPARED_BYTES = 1 << 26  # the most of each tensor held at once while comparing the two


class CheckpointError(ValueError):
    """A checkpoint folder dew cannot load: its one problem in one line, or every problem
    found, one a line."""


def load(
    folder: str | os.PathLike, *, dtype: str | None = None, shardings: Any = None
) -> tuple[HFModel, dict]:
    """The model and params of the checkpoint folder `folder`.

    Args:
        folder: a Hugging Face checkpoint folder: `config.json`, and `model.safetensors` or
            `model.safetensors.index.json` with the files it names; or a Hub repository id
            ("OWNER/NAME"), fetched into the Hub's cache (`resolve`); or a GGUF file, or the
            short name of a packaged one ("smollm2").
        dtype: the params' dtype, "float32" or "bfloat16"; None keeps the checkpoint's (its
            `config.json`'s `dtype`, else its tensors'; a GGUF file's is float32, what its
            quantized tensors dequantize to, unless its embedding is bfloat16).
        shardings: a pytree of `jax.sharding.Sharding`s laid out as the params (see
            `dew.models.hf.sharding`) to place each leaf on as it is read; None puts every leaf
            on the default device.

    Returns:
        The `HFModel` and its params.

    Raises:
        ValueError: naming the folder or `config.json` and its field, when the config is
            missing or not one dew computes (see `HFConfig`).
        CheckpointError: listing, each with its tensor and file, every tensor missing, extra,
            of another shape or of a dtype that is not a float; a file the index names that
            is missing, or one that is truncated or not safetensors; an `lm_head.weight` that
            is not the embedding in a model whose `tie_word_embeddings` is true (transformers
            would use it, vLLM the embedding). With `dtype` None, a checkpoint whose
            `config.json` names a dtype dew does not train (float16): pass `dtype`. For a
            GGUF file: a metadata key naming what dew does not compute (an architecture, a
            RoPE scaling, a tokenizer), every tensor missing, extra, of another shape or of a
            quantization the gguf package does not dequantize.
    """
    folder = resolve(folder)
    if is_gguf(folder):
        gguf = _checked_gguf(folder)
        model = HFModel(gguf.config, check_dtype(gguf.default_dtype if dtype is None else dtype))
        return model, _read_params(model, gguf.tensor, shardings)
    config, named = read_config(folder)
    files = _tensor_files(folder)
    headers, expected = _check_tensors(folder, config, files, compare_tied=True)
    if dtype is None:
        dtype = _default_dtype(folder, named, headers, expected)
    model = HFModel(config, check_dtype(dtype))

    def read(name: str) -> np.ndarray:
        # The file is opened for each tensor: safetensors maps the whole file, and the pages a
        # read touched stay in the process's memory until the map is closed.
        with safe_open(folder / files[name], framework="numpy") as opened:
            return opened.get_tensor(name)

    return model, _read_params(model, read, shardings)


def model_of(folder: str | os.PathLike, *, dtype: str | None = None) -> HFModel:
    """The model of the checkpoint folder `folder`, from its `config.json` and the tensors'
    headers, no tensor read: to build the shardings `load` places each tensor on as it reads.
    `folder` may be a Hub repository id, as `load`'s.

    Raises:
        ValueError, CheckpointError: as `load`, for the config and the headers.
    """
    folder = resolve(folder)
    if is_gguf(folder):
        gguf = _checked_gguf(folder)
        return HFModel(gguf.config, check_dtype(gguf.default_dtype if dtype is None else dtype))
    config, named = read_config(folder)
    headers, expected = _check_tensors(folder, config, _tensor_files(folder))
    if dtype is None:
        dtype = _default_dtype(folder, named, headers, expected)
    return HFModel(config, check_dtype(dtype))


def _read_params(model: HFModel, read: Callable[[str], np.ndarray], shardings: Any) -> dict:
    """The params of `model`, each checkpoint tensor `read(name)` in turn, converted to its
    leaf in the model's dtype and placed (on its sharding in `shardings`, else the default
    device) before the next is read, so the host never holds the params twice."""
    target = np.dtype(jnp.dtype(model.dtype))
    tree = _params.empty_tree(model.config)
    for leaf in _params.leaves(model.config):
        tensor = read(leaf.name)
        value = leaf.entry.layout.to_leaf(tensor, leaf.shape).astype(target, copy=False)
        del tensor
        placement = None if shardings is None else _params.get_leaf(shardings, leaf.path)
        _params.set_leaf(tree, leaf.path, _place(value, placement))
        del value
    return tree


def _checked_gguf(path: Path) -> GGUF:
    """The GGUF file at `path`, its metadata and every tensor's name, shape and type checked.

    Raises:
        ValueError: naming the file and the metadata key it cannot take (`GGUF.open`).
        CheckpointError: listing every tensor missing, extra, of another shape or of a type the
            gguf package does not dequantize.
    """
    gguf = GGUF.open(path)
    problems = gguf.problems(list(_params.leaves(gguf.config)))
    if problems:
        raise CheckpointError(
            f"cannot load the GGUF file {path} ({len(problems)} problem"
            f"{'s' if len(problems) > 1 else ''}):\n  " + "\n  ".join(problems)
        )
    return gguf


def _place(value: np.ndarray, sharding) -> jax.Array:
    """A host array as a jax array on `sharding` (each device its own slice, so a process
    addresses only its devices' shards), or on the default device."""
    if sharding is None:
        return jnp.asarray(value)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def _tensor_files(folder: Path) -> dict[str, str]:
    """Each tensor's file name: from the sharded index, else all in `model.safetensors`.

    Raises:
        CheckpointError: naming the folder when it has neither, or the index when it is not
            JSON of a weight map.
    """
    index = folder / INDEX
    if index.is_file():
        try:
            weight_map = read_document(index)["weight_map"]
            if not (
                isinstance(weight_map, dict)
                and all(isinstance(file, str) for file in weight_map.values())
            ):
                raise ValueError("weight_map must map tensor names to file names")
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as error:
            raise CheckpointError(f"{index} is not a safetensors index: {error!r}") from None
        return dict(weight_map)
    single = folder / WEIGHTS
    if not single.is_file():
        raise CheckpointError(f"{folder} has neither {WEIGHTS} nor {INDEX}: no tensors to load")
    with _opened(single) as opened:
        return dict.fromkeys(opened.keys(), WEIGHTS)


class _opened:
    """`safe_open` of a file, its errors (truncated, not safetensors) as a CheckpointError
    naming the file."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        try:
            self.handle = safe_open(self.path, framework="numpy")
            return self.handle.__enter__()
        except (SafetensorError, OSError) as error:
            raise CheckpointError(
                f"{self.path} is truncated or not a safetensors file: {error}"
            ) from None

    def __exit__(self, *exc):
        return self.handle.__exit__(*exc)


def _check_tensors(
    folder: Path,
    config: HFConfig,
    files: Mapping[str, str],
    *,
    compare_tied: bool = False,
) -> tuple[dict[str, tuple[str, list[int]]], list[_params.Leaf]]:
    """Every tensor's dtype and shape, read from the files' headers, and the tensors a model of
    `config` has; every problem collected. The config's sizes are checked against the headers
    first (`_size_problems`), before the tensors a model of them has are listed: a config that
    promises a billion layers must not list a billion layers' tensors. With `compare_tied`, a
    tied model's `lm_head.weight`, where the files hold one, is read and compared with the
    embedding too.

    Raises:
        CheckpointError: listing every problem at once.
    """
    problems: list[str] = []
    headers: dict[str, tuple[str, list[int]]] = {}
    holders: dict[str, list[str]] = {}
    unreadable = set()
    for file in sorted(set(files.values())):
        path = folder / file
        if not path.is_file():
            problems.append(f"{path} is missing (the index names it)")
            unreadable.add(file)
            continue
        try:
            with _opened(path) as opened:
                for name in opened.keys():
                    tensor = opened.get_slice(name)
                    headers[name] = (tensor.get_dtype(), list(tensor.get_shape()))
                    holders.setdefault(name, []).append(file)
        except CheckpointError as error:
            problems.append(str(error))
            unreadable.add(file)
    held = {
        name: files[name] if files.get(name) in found else found[0]
        for name, found in holders.items()
    }
    for name, file in files.items():
        if name in holders and file not in holders[name]:
            problems.append(
                f"tensor {name}: {folder / INDEX} names {file}, but "
                f"{' and '.join(holders[name])} hold{'s' if len(holders[name]) == 1 else ''} it"
            )
    sizes = _size_problems(folder, config, headers, held)
    if sizes:
        _refuse(folder, problems + sizes)
    expected = list(_params.leaves(config))
    architecture = config.architecture
    wanted = {leaf.name for leaf in expected}
    for leaf in expected:
        if leaf.name not in headers:
            if files.get(leaf.name) not in unreadable:  # else its file is reported above
                listing = INDEX if (folder / INDEX).is_file() else WEIGHTS
                where = folder / files.get(leaf.name, listing)
                hint = ""
                if leaf.name == _HEAD:
                    hint = (
                        f" ({CONFIG}'s tie_word_embeddings is false or absent; a model whose "
                        "output projection is its embedding says true)"
                    )
                problems.append(f"tensor {leaf.name} is missing from {where}{hint}")
            continue
        kind, shape = headers[leaf.name]
        path = folder / held[leaf.name]
        if tuple(shape) != leaf.tensor_shape:
            problems.append(
                f"tensor {leaf.name} in {path} is {shape}, a {architecture} of this "
                f"config.json has {list(leaf.tensor_shape)}"
            )
        if kind not in _TENSOR_DTYPES:
            problems.append(
                f"tensor {leaf.name} in {path} is {kind}, not a float dtype dew loads "
                f"({', '.join(_TENSOR_DTYPES)})"
            )
    for name in sorted(set(held) - wanted):
        if not _params.ignored(name, config):
            problems.append(
                f"tensor {name} in {folder / held[name]} is not one a {architecture} of this "
                "config.json has"
            )
    if compare_tied and config.tied and _HEAD in held and _EMBED in held and not problems:
        if not _same_tensor(folder, held, _HEAD, _EMBED):
            problems.append(
                f"tensor {_HEAD} in {folder / held[_HEAD]} is not {_EMBED}, but {CONFIG}'s "
                "tie_word_embeddings is true: transformers would use it as the output "
                "projection, vLLM the embedding; set tie_word_embeddings to false, or remove "
                "the tensor"
            )
    if problems:
        _refuse(folder, problems)
    return headers, expected


def _refuse(folder: Path, problems: list[str]) -> None:
    """Raise the CheckpointError of `problems`: one line for one, else one a line."""
    if len(problems) == 1:
        raise CheckpointError(f"cannot load the checkpoint in {folder}: {problems[0]}")
    raise CheckpointError(
        f"cannot load the checkpoint in {folder} ({len(problems)} problem"
        f"{'s' if len(problems) > 1 else ''}):\n  " + "\n  ".join(problems)
    )


_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def _size_problems(
    folder: Path,
    config: HFConfig,
    headers: Mapping[str, tuple[str, list[int]]],
    held: Mapping[str, str],
) -> list[str]:
    """The sizes of `config.json` (layers, vocabulary, widths, heads) that the tensors' headers
    contradict, each named by the file's own field, its value and the tensor (and file) that
    holds another: checked from shapes alone, before anything of the config's size is made.
    A tensor absent or of another rank is left to the tensor-by-tensor check."""
    problems = []
    # head_dim, where config.json gives none, is hidden_size / num_attention_heads.
    head_dim = (
        "head_dim"
        if config.source.get("head_dim") is not None
        else "hidden_size / num_attention_heads"
    )

    def against(field: str, value: int, name: str, axis: int, *, each: int = 1) -> None:
        """Refuse `field` = `value` (times `each` head_dim) where tensor `name`'s axis is not
        that long."""
        shape = headers.get(name, (None, []))[1]
        if len(shape) > axis and shape[axis] != value * each:
            rows = "" if each == 1 else f" ({value} x {head_dim} {each} = {value * each} rows)"
            problems.append(
                f"{CONFIG}'s {field} = {value}{rows}, but {held[name]} holds {name} of shape "
                f"{shape}"
            )

    against("vocab_size", config.vocab, _EMBED, 0)
    against("hidden_size", config.hidden, _EMBED, 1)
    layers = sorted({int(found.group(1)) for name in headers if (found := _LAYER.match(name))})
    if not layers or layers[-1] + 1 != config.layers:
        source = f"the files {INDEX} names" if (folder / INDEX).is_file() else WEIGHTS
        holds = f"layers {layers[0]}..{layers[-1]}" if layers else "no model.layers tensors"
        problems.append(
            f"{CONFIG}'s num_hidden_layers = {config.layers}, but {source} holds {holds}"
        )
    if not layers:
        return problems
    block = _params.LAYER_PREFIX.format(i=layers[0])
    against("intermediate_size", config.intermediate, block + "mlp.gate_proj.weight", 0)
    query, key = block + "self_attn.q_proj.weight", block + "self_attn.k_proj.weight"
    against("num_attention_heads", config.heads, query, 0, each=config.head_dim)
    against("num_key_value_heads", config.kv_heads, key, 0, each=config.head_dim)
    if config.qk_norm:
        against(head_dim, config.head_dim, block + "self_attn.q_norm.weight", 0)
    return problems


def _same_tensor(folder: Path, held: Mapping[str, str], name: str, other: str) -> bool:
    """Whether tensors `name` and `other` hold equal values (as float32, as transformers'
    `torch.equal` of the loaded params), compared a block of rows at a time."""
    with _opened(folder / held[name]) as first, _opened(folder / held[other]) as second:
        a, b = first.get_slice(name), second.get_slice(other)
        shape = a.get_shape()
        if list(shape) != list(b.get_shape()):
            return False
        row = max(1, int(np.prod(shape[1:])) * 4)
        step = max(1, _COMPARED_BYTES // row)
        for start in range(0, shape[0], step):
            block = slice(start, min(start + step, shape[0]))
            if not np.array_equal(a[block].astype(np.float32), b[block].astype(np.float32)):
                return False
    return True


def _default_dtype(
    folder: Path,
    named: str | None,
    headers: Mapping[str, tuple[str, list[int]]],
    expected: list[_params.Leaf],
) -> str:
    """The params' dtype when the caller names none: the one config.json names, else the
    embedding's.

    Raises:
        CheckpointError: naming config.json's dtype where it is not one dew trains (float16),
            or the tensors' where config.json names none and they are not.
    """
    if named in _DTYPE_NAMES:
        return named
    if named is not None:
        raise CheckpointError(
            f"the checkpoint in {folder} is {named} ({CONFIG}'s dtype), which dew does not "
            "train: pass dtype='float32' (exact for float16 weights) or 'bfloat16'"
        )
    kind = headers[expected[0].name][0]
    for name, tensor in _DTYPE_NAMES.items():
        if tensor == kind:
            return name
    raise CheckpointError(
        f"the checkpoint in {folder} holds {kind} tensors and its {CONFIG} names no dtype: "
        "pass dtype='float32' or 'bfloat16'"
    )


def save(
    folder: str | os.PathLike,
    model: HFModel,
    params: dict,
    *,
    tokenizer_from: str | os.PathLike | None = None,
    notes: Mapping[str, str] | None = None,
) -> None:
    """Write `params` of `model` as a checkpoint folder `transformers` and vLLM load unchanged.

    The folder gets `config.json` (the loaded one, with the params' dtype), `model.safetensors`
    (the checkpoint's tensor names, shapes and layouts, in the params' dtype) and the tokenizer
    files of `tokenizer_from` (`TOKENIZER_FILES`, those it has). It is written whole or not at
    all: into a fresh folder beside it, then renamed over it.

    Params sharded over a mesh are gathered one tensor at a time, each written before the next
    is gathered, so the host holds one tensor, never the params. In a pool of processes whose
    mesh spans them, every process calls `save` alike (each tensor's gather is a collective)
    and process 0 alone writes the folder. Params a process holds whole (a pool's replicated
    params, as each process pushes them to its own vLLM servers) are written by whichever
    process calls it.

    Args:
        folder: where to write; replaced when it exists.
        model: the model the params are of.
        params: its params, laid out as `model.init`'s.
        tokenizer_from: a folder whose tokenizer files to copy (the checkpoint loaded), a GGUF
            file whose tokenizer and chat template to write as a folder's files, or None.
        notes: text files to write into the folder with the rest, by name (`dew export`'s
            record that it wrote the folder), so the folder never appears without them.

    Raises:
        ValueError: when a params leaf's shape or dtype is not the model's, naming the leaf;
            when `folder` is a file or `tokenizer_from` neither a folder nor a GGUF file.
    """
    if not isinstance(model, HFModel):
        raise TypeError(f"model must be a dew.models.hf.HFModel, got {type(model).__name__}")
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{folder} is a file, not a checkpoint folder to write")
    tokenizer_files: dict[str, str] = {}
    if tokenizer_from is not None and is_gguf(tokenizer_from):
        tokenizer_files = GGUF.open(tokenizer_from).tokenizer_files()
    elif tokenizer_from is not None and not Path(tokenizer_from).is_dir():
        raise ValueError(f"tokenizer_from {tokenizer_from} is neither a folder nor a GGUF file")
    _check_params(model, params)
    spans = any(
        isinstance(leaf, jax.Array) and not leaf.is_fully_addressable
        for leaf in jax.tree.leaves(params)
    )
    if spans and jax.process_index() != 0:
        for _ in _tensors_of(model, params):  # join process 0's gathers, writing nothing
            pass
        return
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = folder.with_name(f".{folder.name}.{secrets.token_hex(4)}.partial")
    staging.mkdir()
    try:
        config = model.config.to_json(model.dtype)
        (staging / CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        _write_safetensors(staging / WEIGHTS, _tensors_of(model, params), model)
        for name, text in tokenizer_files.items():
            (staging / name).write_text(text, encoding="utf-8")
        if tokenizer_from is not None and not tokenizer_files:
            for name in TOKENIZER_FILES:
                source = Path(tokenizer_from) / name
                if source.is_file():
                    shutil.copyfile(source, staging / name)
                elif source.is_dir():
                    shutil.copytree(source, staging / name)
        for name, text in (notes or {}).items():
            (staging / name).write_text(text, encoding="utf-8")
        for written in staging.rglob("*"):
            if written.is_file():
                _fsync(written)
        _swap_in(staging, folder)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
