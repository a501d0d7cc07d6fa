"""A checkpoint named by its Hugging Face Hub repository id, fetched into the Hub's cache.

`resolve("Qwen/Qwen3-0.6B")` (or `"Qwen/Qwen3-0.6B@REVISION"`: a branch, tag or commit)
downloads what dew reads of a checkpoint (its config, tensors and tensor index, tokenizer and
chat templates; no `.bin`, `.pt`, ONNX or GGUF copies of the weights) with `huggingface_hub`
into its cache, and gives the snapshot folder, which `load`, the tokenizer and vLLM then read
like any folder. The cache is the Hub library's own, so its
settings hold: `HF_HUB_CACHE` or `HF_HOME` place it, `HF_TOKEN` reads gated or private
repositories, and `HF_HUB_OFFLINE=1` reads the cache alone; offline, or with the Hub out of
reach, a repository cached before is read from the cache.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

from dew.models.hf._gguf import PACKAGED, packaged

# What dew reads of a checkpoint: config.json, generation_config.json, the tensors and their
# index, the tokenizer's files and the chat templates (named ones in a folder of their own).
HUB_FILES = (
    "*.json",
    "*.safetensors",
    "*.jinja",
    "*.txt",
    "tokenizer.model",
    "additional_chat_templates/*",
)
# A repository id as the Hub spells them, an owner and a name, each of letters, digits, "-",
# "_" and ".", neither starting with "." or "-"; then, after "@", a revision: a branch, a tag
# or a commit.
_REPO_ID = re.compile(r"([A-Za-z0-9_][\w.-]*/[A-Za-z0-9_][\w.-]*)(?:@([\w./-]+))?")


def resolve(model: str | os.PathLike) -> Path:
    """The checkpoint folder `model` names: a folder as it is; else, when it reads as a Hub
    repository id ("OWNER/NAME", or "OWNER/NAME@REVISION" for a branch, tag or commit other
    than `main`) and no such folder exists, the repository's snapshot in the Hub's cache,
    downloaded the first time (see the module); or, when it is the short name of a packaged
    GGUF file (`_gguf.PACKAGED`: "smollm2") and no such folder exists, that file.

    Raises:
        ValueError: naming the repository and the Hub's error, when it cannot be had: not on
            the Hub, no such revision, gated without a token, or neither reachable nor cached;
            naming a packaged model and how to install it, when its package is not installed.
    """
    folder = Path(model)
    if not folder.exists() and str(model) in PACKAGED:
        return packaged(str(model))
    named = _REPO_ID.fullmatch(str(model))
    if folder.exists() or named is None:
        return folder
    return _snapshot(named[1], named[2])


@functools.cache
def _snapshot(repo_id: str, revision: str | None) -> Path:
    """The repository's snapshot folder at `revision` (None: main), fetched once a process."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=list(HUB_FILES)))
    except Exception as error:  # the Hub's errors are many: each is named in the message
        at = "" if revision is None else f"@{revision}"
        raise ValueError(
            f"{repo_id}{at} is neither a folder nor a checkpoint the Hugging Face Hub gave "
            f"({type(error).__name__}: {error})"
        ) from None
