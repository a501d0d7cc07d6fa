"""A push into vLLM servers: what a pushed folder must hold for vLLM to load all of it (a full
checkpoint, reloaded in place, or a LoRA adapter, loaded in place under one name), and how a
VLLMEngine drives the push on every server (`_Pushes`: `load`, `load_async`, at the end).

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

import concurrent.futures
import contextlib
import functools
import json
import shutil
import struct
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import trio

from dew._checks import check_int
from dew.models import hf
from dew.serve._vllm_http import _log, _Server
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


class _Pushes:
    """VLLMEngine's pushes: `load`, `load_async`, and the pause and resume of a hand-made push.

    A part of `VLLMEngine` (`_vllm`), kept here beside what a pushed folder must hold so that
    each part reads in one sitting: its methods use the state `VLLMEngine.__init__` sets.
    """

    def load(self, variables, version: int) -> None:
        """Serve `variables` under `version` on every live server (the Publisher protocol):
        `load_async`, run to its end from any thread.

        It runs in a trio run of its own, on a thread of its own, and blocks the caller until
        every server serves the new weights: called from a trio run, it holds that run for the
        whole push, where `await engine.load_async(...)` would not (the scheduler awaits that).

        Raises:
            VLLMError: as `load_async`: a step of the push failed, or no server is alive.
            ValueError: as `load_async`: a bad version, or params the writer refuses.
        """
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dew-push") as pool:
            pool.submit(trio.run, self.load_async, variables, version).result()

    async def load_async(self, variables, version: int) -> None:
        """Serve `variables` under `version` on every live server, letting the trio run that
        awaits it go on meanwhile: the rollouts in flight, a gateway and the fleet's other calls.

        Writes them as a checkpoint folder under the push folder (in a worker thread), then
        pauses every server in "keep" mode (calls in flight freeze, then go on under the new
        weights, each keeping the version its first token was drawn under), has each reload
        its weights from the folder and empty its prefix cache (what the old weights computed;
        the calls in flight recompute theirs), sets the version and resumes them; each step on every
        server at once, over an HTTP client of the push's own. Returns once every server serves
        them. Cancelled (or failing) after the pause, it resumes the servers that still answer
        before it lets the cancel (or error) through; a reload already under way may still land,
        so until the next push a server may serve the new weights under the old version (the
        behaviour log-probs are still those of the weights that drew the tokens). Servers left
        out as restarted (see the class) are reloaded with the pushed weights and labelled, and
        take calls again; a push with no server alive but those still pushes to them.

        Raises:
            VLLMError: naming the server's URL and its error when a step of the push fails (the
                servers are resumed first where they still answer), or when no server is alive.
            ValueError: if `version` is not an int >= 0, or as the checkpoint writer refuses
                `variables`.
        """
        version = check_int("version", version, low=0)
        began = time.perf_counter()
        if not any(server.restarted for server in self._servers):
            self._live_for(version)
        if self.lora:
            # A new folder even after a failed push, which some servers may have loaded.
            self._adapter_pushes += 1
            index = self._adapter_pushes
            folder = self._push_dir / f"adapter-{index}"
        else:
            folder = self._push_dir / f"push-{version}"
        await trio.to_thread.run_sync(self._write, folder, variables)
        # Made in a worker thread too: making a client (its TLS context) takes tens of ms.
        client = await trio.to_thread.run_sync(
            functools.partial(httpx.AsyncClient, timeout=self._timeout, headers=self._headers)
        )
        async with client:
            if any(server.alive for server in self._servers):
                await self._push_to_live(client, folder, version)
            async with trio.open_nursery() as nursery:
                for server in self._servers:
                    if server.restarted:
                        nursery.start_soon(self._rejoin, client, server, folder, version)
        self._live_for(version)
        with self._lock:
            self._version = version
            if self.lora:
                self._adapters[index] = folder
        if self.lora:
            self._drop_adapters()
        else:
            previous, self._pushed = self._pushed, folder
            if previous is not None and previous != folder:
                shutil.rmtree(previous, ignore_errors=True)
        self.push_bytes.append(pushed_bytes(folder))
        self.push_seconds.append(time.perf_counter() - began)

    def _drop_adapters(self) -> None:
        """Remove the adapter folders of earlier pushes that no call in flight may hold: vLLM
        reads a call's adapter again from its folder at each step (see `_vllm_push`), so a
        folder removed under a call would fail it. A call submitted after push k holds push
        k's folder or a later one."""
        with self._lock:
            held = [pushes for pushes, calls in self._in_flight.items() if calls]
            oldest = min([max(self._adapters), *held])
            dropped = [
                self._adapters.pop(index) for index in list(self._adapters) if index < oldest
            ]
        for folder in dropped:
            shutil.rmtree(folder, ignore_errors=True)

    def _write(self, folder: Path, variables) -> None:
        """Write pushed params as the checkpoint folder the servers reload, a tied model's
        head included (`add_tied_head`: else vLLM's reload leaves the head as it was), or a
        LoRA run's adapter as `save` writes it."""
        if self._save is not None:
            self._save(folder, variables)
        else:
            hf.save(folder, self.model, variables, tokenizer_from=self._checkpoint)
        if not self.lora:
            add_tied_head(folder)

    async def _on_each(
        self,
        client: httpx.AsyncClient,
        path: str,
        check: Callable[[str, httpx.Response], None] | None = None,
        **options,
    ) -> None:
        """POST `path` to every live server at once, `check(url, answer)` each answer (it
        raises VLLMError); the first failure, once all answered.

        Raises:
            VLLMError: naming the URL of a server that failed, or when none is alive.
        """
        failures: list[VLLMError] = []

        async def one(server: _Server) -> None:
            try:
                answer = await self._post_async(client, server, path, **options)
                if check is not None:
                    check(server.url, answer)
            except VLLMError as error:
                if server.alive:
                    failures.append(error)
                else:  # dead: the push goes on with the others, or fails with none left
                    live = sum(other.alive for other in self._servers)
                    _log.warning(
                        "the vLLM server %s is left out (%d left): %s", server.url, live, error
                    )

        async with trio.open_nursery() as nursery:
            for server in self._live_for(None):
                nursery.start_soon(one, server)
        if failures:
            raise failures[0]

    async def _push_to_live(self, client: httpx.AsyncClient, folder: Path, version: int) -> None:
        """Pause every live server, have it reload `folder` and empty its prefix cache (or,
        under LoRA, load the adapter in `folder`: its new path keeps the cache's old blocks
        apart), label it `version`, resume it; resumes those that still answer when a step
        fails or the push is cancelled. The pause makes the swap and the label one step for
        the calls that arrive: none is drawn by the new weights under the old label."""
        try:
            await self._on_each(client, "/pause", params=PAUSE_OPTIONS)
            if self.lora:
                await self._on_each(client, LOAD_ADAPTER, json=self._adapter_load(folder))
            else:
                reload = {"method": "reload_weights", "kwargs": {"weights_path": str(folder)}}
                await self._on_each(client, "/collective_rpc", json=reload)
                await self._on_each(client, RESET, check_reset, params=RESET_OPTIONS)
            label = {"new_version": str(version)}
            await self._on_each(client, "/update_weight_version", json=label)
            await self._on_each(client, "/resume")
        except BaseException as error:
            # Servers left paused would hold every call in flight for good.
            with trio.move_on_after(30, shield=True):
                await self._resume_all_async(client)
            if isinstance(error, VLLMError):
                raise VLLMError(f"pushing version {version}: {error}") from None
            raise

    def _adapter_load(self, folder: Path) -> dict[str, Any]:
        """`LOAD_ADAPTER`'s request: the adapter in `folder`, in place under the run's one name."""
        return {"lora_name": self.adapter, "lora_path": str(folder), "load_inplace": True}

    async def _rejoin(
        self, client: httpx.AsyncClient, server: _Server, folder: Path, version: int
    ) -> None:
        """Reload a restarted server with the weights just pushed and label them, so that it
        takes calls again; one that fails stays out (until the next push tries again)."""
        if server.process is not None and server.process.exit_code() is not None:
            server.restarted = False
            server.died(f"exit code {server.process.exit_code()}")
            return
        reload = {"method": "reload_weights", "kwargs": {"weights_path": str(folder)}}
        try:
            if self.lora:
                await self._post_async(
                    client, server, LOAD_ADAPTER, json=self._adapter_load(folder)
                )
            else:
                await self._post_async(client, server, "/collective_rpc", json=reload)
                reset = await self._post_async(client, server, RESET, params=RESET_OPTIONS)
                check_reset(server.url, reset)
            label = {"new_version": str(version)}
            await self._post_async(client, server, "/update_weight_version", json=label)
        except VLLMError as error:
            _log.warning("the restarted vLLM server %s stays out: %s", server.url, error)
            return
        server.alive, server.restarted, server.failure = True, False, ""
        _log.warning("the restarted vLLM server %s serves version %d again", server.url, version)

    async def _resume_all_async(self, client: httpx.AsyncClient) -> None:
        """Resume the live servers after a failed or cancelled push, those that still answer."""
        async with trio.open_nursery() as nursery:
            for server in self._servers:
                if server.alive:
                    nursery.start_soon(self._resume_quietly, client, server)

    async def _resume_quietly(self, client: httpx.AsyncClient, server: _Server) -> None:
        with contextlib.suppress(VLLMError):
            await self._post_async(client, server, "/resume")

    def pause(self) -> None:
        """Pause every live server in "keep" mode: calls in flight freeze until `resume`.

        Raises:
            VLLMError: naming the server that failed (those paused already are resumed).
        """
        paused = []
        try:
            for server in self._live_for(None):
                self._post(server, "/pause", params={"mode": "keep"})
                paused.append(server)
        except VLLMError:
            self._resume_all(paused)
            raise

    def resume(self, version: int) -> None:
        """Label what the servers hold `version` and resume them; calls from now on report it.

        Raises:
            VLLMError: naming the server that failed.
        """
        for server in self._live_for(version):
            self._post(server, "/update_weight_version", json={"new_version": str(version)})
            self._post(server, "/resume")
        with self._lock:
            self._version = version

    def _resume_all(self, servers: Sequence[_Server] | None = None) -> None:
        """Resume servers after a failed push, those that still answer."""
        for server in self._servers if servers is None else servers:
            if server.alive:
                with contextlib.suppress(VLLMError):
                    self._post(server, "/resume")
