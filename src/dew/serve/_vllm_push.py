"""What a pushed folder must hold for vLLM to load all of it: a full checkpoint (reloaded in
place) or a LoRA adapter (loaded in place under one name).

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

An adapter push (a run that trains a LoRA adapter of the served checkpoint) writes only the
adapter, as PEFT saves one, and has each server load it with `LOAD_ADAPTER` under the run's one
adapter name, in place (`load_inplace`), each version from a folder of its own: vLLM keys its
prefix cache on the adapter's name and path, so a new path is what keeps a later prompt from
reusing blocks the previous adapter computed (an in-place reload from the same path keeps them).
The servers run with `lora_flags` and `LORA_ENVIRONMENT`.

What vLLM does to calls in flight during an adapter swap (0.32, checked by
tests/test_vllm_lora.py): a call holds the adapter request it was resolved to when it arrived,
path included, and each engine step loads in place the adapter of the newest call in its batch.
So a call in flight goes on under the old adapter, read again from the old folder at each step,
until a call that arrived after the swap joins its batch; from that step on every call in the
batch is drawn by the new one. A call's tokens may thus be drawn by two versions, as under a full
push; its behaviour log-probs are still those of the adapter that drew each token. The old
folder must therefore stay while calls that may hold it are in flight: the engine removes a
version's folder only once no call submitted under it or before it is in flight.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from dew._checks import check_int
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


LOAD_ADAPTER = "/v1/load_lora_adapter"
"""vLLM's endpoint that loads a LoRA adapter from a folder under a name."""
LORA_ENVIRONMENT = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
"""What a server needs in its environment to take `LOAD_ADAPTER` at all."""
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The adapter ranks a vLLM server can be started for (`--max-lora-rank`, 0.32)."""


def lora_flags(rank: int) -> list[str]:
    """The vLLM flags of a server that serves adapters of rank up to `rank`, one at a time: the
    smallest `--max-lora-rank` vLLM takes that holds `rank` (it takes only `LORA_RANKS`).

    Raises:
        ValueError: naming lora_rank when it is not an int within [1, 512].
    """
    rank = check_int("lora_rank", rank, low=1, high=LORA_RANKS[-1])
    served = min(allowed for allowed in LORA_RANKS if allowed >= rank)
    return ["--enable-lora", "--max-lora-rank", str(served), "--max-loras", "1"]


def lora_problem(info: object, rank: int | None) -> str | None:
    """What keeps a server from loading a LoRA run's adapters, from its `/server_info` answer
    (JSON), as a part of a refusal naming the flag to start it with: LoRA off, or a
    `--max-lora-rank` below the adapter's `rank` (None: not known yet); None when nothing does
    or the answer does not say."""
    config = info.get("vllm_config") if isinstance(info, dict) else None
    if not isinstance(config, dict) or "lora_config" not in config:
        return None
    served = config["lora_config"]
    if not isinstance(served, dict):
        return f"it serves no LoRA adapters: start it with {' '.join(lora_flags(rank or 8))}"
    most = served.get("max_lora_rank")
    if rank is not None and isinstance(most, int) and most < rank:
        return (
            f"it serves adapters of rank up to {most}, the run's is {rank}: start it with "
            f"{' '.join(lora_flags(rank))}"
        )
    return None


def pushed_bytes(folder: Path) -> int:
    """The bytes of the tensors a push folder holds (its safetensors files): what each server
    reads at a push, whether a full checkpoint or an adapter."""
    return sum(file.stat().st_size for file in Path(folder).glob("*.safetensors"))


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
