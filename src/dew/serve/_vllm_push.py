"""What a pushed checkpoint folder must hold for vLLM's in-place reload to load all of it.

vLLM's `reload_weights` (which a push has each server run through `/collective_rpc`) reloads
layer by layer: it puts every layer's tensors aside, loads the folder's tensors into fresh ones,
and re-runs a layer's post-load processing only once that layer got all its tensors. A layer the
folder holds nothing for keeps its old tensors and its old processing, with a warning in the
server's log ("Failed to load weights").

A checkpoint that ties its output projection to its embedding (`tie_word_embeddings`, as most
small models have it) holds no `lm_head.weight`: the head's tensor is the embedding's, so its
values do change with the embedding's reload. But vLLM's CPU build computes the logits from a
packed copy of the head's weight, made by the head's post-load processing, and that is not
redone for a head that loaded nothing: the server went on computing logits with the start-up
head under the pushed layers. A push folder of a tied checkpoint therefore also holds the
embedding as `lm_head.weight` (`add_tied_head`): during the reload the head's tensor is apart
from the embedding's, so vLLM loads it into the head and repacks it. The folder stays a
checkpoint `transformers`, vLLM and `dew.models.hf.load` read as before (a tied model's saved
head equal to its embedding is what they expect of one).

A push also empties each server's prefix cache on purpose (`RESET`), after the reload: the
cached blocks hold keys and values the old weights computed, and a later prompt sharing them
would be computed partly under the old weights. vLLM's `/pause` clears the cache by default too,
but documents that as deprecated and ignored in "keep" mode; a push asks it not to
(`PAUSE_OPTIONS`) and resets the cache itself, so what it relies on is vLLM's documented reset.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from dew.models import hf
from dew.serve._vllm_process import VLLMError

HEAD_FILE = "lm_head.safetensors"
"""The file of a tied checkpoint's push folder that holds its head: the embedding's bytes."""
_COPIED_BYTES = 1 << 26  # the most of the embedding held at once while copying it

PAUSE_OPTIONS = {"mode": "keep", "clear_cache": "false"}
"""`/pause`'s query: calls in flight freeze and go on after the resume; the cache is reset by
`RESET` after the reload, not by the pause's deprecated default."""
RESET = "/reset_prefix_cache"
"""vLLM's endpoint (development mode) that empties a server's prefix cache."""
RESET_OPTIONS = {"reset_running_requests": "true"}
"""`RESET`'s query: calls in flight (frozen by the pause) give their blocks back and are
recomputed under the new weights when they go on, as their tokens from then on must be."""


def add_tied_head(folder: Path) -> bool:
    """Write the embedding as `lm_head.weight` into `folder`, a pushed checkpoint, when its
    config ties the two and it holds no head, so that vLLM's reload reprocesses the head.

    The embedding's bytes are copied as they are (whatever their dtype) from the file that holds
    them into `HEAD_FILE`, which a sharded folder's index then lists.

    Returns:
        Whether it wrote the head.

    Raises:
        ValueError: naming the folder's file when it holds no embedding or is not safetensors.
    """
    config = json.loads((folder / hf.CONFIG).read_text(encoding="utf-8"))
    text = config.get("text_config") or {}
    if not config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)):
        return False
    files = hf._tensor_files(folder)
    if hf._HEAD in files:
        return False
    if hf._EMBED not in files:
        raise ValueError(f"{folder}: a tied checkpoint without {hf._EMBED} to push as its head")
    source = folder / files[hf._EMBED]
    with open(source, "rb") as reading:
        try:
            (length,) = struct.unpack("<Q", reading.read(8))
            entry = json.loads(reading.read(length))[hf._EMBED]
            start, stop = entry["data_offsets"]
        except (struct.error, ValueError, KeyError, TypeError) as error:
            raise ValueError(f"{source} is not a safetensors file: {error!r}") from None
        header = {hf._HEAD: {**entry, "data_offsets": [0, stop - start]}}
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
        reading.seek(8 + length + start)
        with open(folder / HEAD_FILE, "wb") as writing:
            writing.write(struct.pack("<Q", len(encoded)))
            writing.write(encoded)
            left = stop - start
            while left:
                block = reading.read(min(left, _COPIED_BYTES))
                if not block:
                    raise ValueError(f"{source} is truncated: {hf._EMBED} ends past its end")
                writing.write(block)
                left -= len(block)
    index = folder / hf.INDEX
    if index.is_file():
        listing = json.loads(index.read_text(encoding="utf-8"))
        listing["weight_map"][hf._HEAD] = HEAD_FILE
        index.write_text(json.dumps(listing, indent=2) + "\n", encoding="utf-8")
    return True


def check_reset(url: str, answer) -> None:
    """Raise VLLMError naming the server at `url` when its answer to `RESET` (an httpx response
    of status 200) does not say the cache was emptied."""
    try:
        success = answer.json().get("success")
    except (ValueError, AttributeError):
        success = None
    if success is not True:
        raise VLLMError(
            f"the vLLM server {url} did not empty its prefix cache ({RESET} answered "
            f"{answer.text!r:.200}): calls would reuse what the old weights computed"
        )
