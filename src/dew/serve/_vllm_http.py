"""The HTTP between a VLLMEngine and its servers: the requests, their answers and their errors.

A call is a request to vLLM's token-in/token-out endpoint (`_body`), streamed back token by token
(`_stream`) and read into a `Call` (`_call`); the engine's other requests (a push's steps, the
checks of an attached server) are plain POSTs and GETs (`_post`, `_send`, `_post_async`). Every
error names the server's URL; a server that stops answering or whose process ended counts as
dead (`_Server.died`), and one that answers under weights dew never labelled as restarted.
`_ServerRequests` is a part of `VLLMEngine` (`_vllm`), kept in a module of its own so that each
part reads in one sitting: its methods use the state `VLLMEngine.__init__` sets.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from typing import Any

import httpx
import numpy as np

from dew._checks import check_int, check_number
from dew.objectives.rl.sessions import Call
from dew.serve._failure import CallFailed
from dew.serve._requests import checked_prompt
from dew.serve._vllm_process import ServerProcess, VLLMError

_GENERATE = "/inference/v1/generate"
# Logged under the engine's module name (`_vllm`): one logger for all of VLLMEngine's parts.
_log = logging.getLogger("dew.serve._vllm")

API_KEY_VARIABLE = "VLLM_API_KEY"
"""The environment variable dew reads the servers' API key from when none is given, as vLLM's
own server reads it (`--api-key` unset): dew sends it as `Authorization: Bearer KEY`."""
READ_TIMEOUT = 600.0
"""Seconds a server may send nothing while dew waits on it (`read_timeout`): a first token on
a loaded CPU takes tens of seconds, a push of a 7 B checkpoint from disk about a minute."""


class _Server:
    """One server of the engine: its URL, the process when dew started it, whether it is alive
    and how many calls it holds, and whether it lost the weights dew pushed (`restarted`: it
    is left out until a push reloads them)."""

    def __init__(self, url: str, process: ServerProcess | None = None):
        self.url = url
        self.process = process
        self.alive = True
        self.restarted = False
        self.calls = 0
        self.failure = ""

    def died(self, why: str) -> None:
        self.alive = False
        self.failure = f"{why}{self.log_note}"

    @property
    def log_note(self) -> str:
        """Where the server's own account of a failure is: ", its log PATH" for a server dew
        started, "" for an attached one."""
        return "" if self.process is None else f", its log {self.process.log}"


class _ServerRequests:
    """VLLMEngine's requests to its servers: a call's stream, the server it goes to, the POSTs
    and GETs of pushes and checks, and the errors of each, naming the server."""

    async def _stream(self, server: _Server, body: dict, tokens: list[int]) -> dict:
        """Run a call as a stream of its tokens, `tokens` growing as they come (what a cancelled
        call drew, for note_progress), and return its choice, its chunks joined.

        Raises:
            CallFailed: when the server fails (5xx) or its stream ends before the call does.
            VLLMError: when it refuses the call or reports an error in the stream.
            httpx.TransportError: when the connection breaks.
        """
        ids: list[int] | None = []
        content: list | None = []
        last: dict = {}
        problem = None
        url = f"{server.url}{_GENERATE}"
        async with self._client.stream("POST", url, json={**body, "stream": True}) as answer:
            if answer.status_code != 200:
                await answer.aread()
                if answer.status_code >= 500:
                    raise await self._lost(server, _said(answer))
                if answer.status_code == 401:
                    raise self._refused(server, _GENERATE, answer)
                if answer.status_code == 404 and body["model"] == self.adapter:
                    # vLLM knows no adapter of that name: it lost the one pushed last.
                    raise self._restarted(server, f"no adapter {self.adapter!r}")
                raise VLLMError(f"the vLLM server {server.url} refused the call: {_said(answer)}")
            # Read to the end whatever comes: leaving httpx's line iterator half read would leave
            # its generators for the garbage collector (trio warns of each).
            async for line in answer.aiter_lines():
                data = line.removeprefix("data: ")
                if data == line or data == "[DONE]" or problem is not None:
                    continue  # a blank separator, the end, or what follows an error
                try:
                    chunk = json.loads(data)
                except ValueError:
                    problem = f"a line that is not JSON: {data!r:.200}"
                    continue
                if "error" in chunk:
                    problem = f"{chunk['error']!r:.500}"
                    continue
                for choice in chunk.get("choices") or ():
                    delta = choice.get("token_ids")
                    drawn = (choice.get("logprobs") or {}).get("content")
                    if delta is None or drawn is None:
                        ids = content = None  # not a token-in/token-out answer: `_call` says so
                    if ids is not None:
                        tokens.extend(delta)
                        ids.extend(delta)
                        content.extend(drawn)
                    last = choice
        if problem is not None:
            raise VLLMError(
                f"the vLLM server {server.url} failed the call{server.log_note}: {problem}"
            )
        if ids is not None and last.get("finish_reason") is None:
            raise CallFailed(
                f"the vLLM server {server.url} ended the call's stream before the call ended"
            )
        return {
            "token_ids": ids,
            "logprobs": {"content": content},
            "finish_reason": last.get("finish_reason"),
            "weight_versions": last.get("weight_versions"),
        }

    def _pick(self) -> _Server:
        live = [server for server in self._servers if server.alive]
        if not live:
            raise VLLMError(f"no vLLM server is alive: {self._obituary()}")
        return min(live, key=lambda server: server.calls)

    async def _lost(self, server: _Server, error: object) -> CallFailed:
        """The failure of a call its server dropped; the server counts as dead when its process
        ended or it no longer answers `/health`."""
        why = f"{type(error).__name__}: {error}" if isinstance(error, Exception) else str(error)
        if server.process is not None and server.process.exit_code() is not None:
            server.died(f"exit code {server.process.exit_code()}")
        elif not await self._healthy(self._client, server):
            server.died(why)
        return CallFailed(f"the vLLM server {server.url} failed the call{server.log_note}: {why}")

    async def _healthy(self, client: httpx.AsyncClient, server: _Server) -> bool:
        """Whether the server's process runs (for one dew started) and it answers `/health`
        within 5 s: a server that failed a request and is not healthy is dead."""
        if server.process is not None and server.process.exit_code() is not None:
            return False
        try:
            return (await client.get(f"{server.url}/health", timeout=5)).status_code == 200
        except httpx.HTTPError:
            return False

    def _restarted(self, server: _Server, serves: str) -> CallFailed:
        """The failure of a call drawn by weights dew never labelled: every server dew calls
        carries the label of the version it pushed, so a server answering under another one
        (vLLM's "default"), or without a LoRA run's adapter, was restarted, or reloaded by
        someone else, and serves weights that are not the run's. It is left out of the calls
        until the next push reloads it.

        Args:
            serves: what it serves instead, "weights labelled 'default'" say.
        """
        if server.alive:
            _log.warning(
                "the vLLM server %s answered a call with %s, not a version dew pushed: it "
                "restarted? it gets no calls until the next push reloads it",
                server.url,
                serves,
            )
        server.died(f"it serves {serves}, not a version dew pushed")
        server.restarted = True
        return CallFailed(
            f"the vLLM server {server.url} served the call with {serves}, not a version dew "
            "pushed (was it restarted?): the call is dropped, the server left out until the "
            "next push reloads it"
        )

    def _obituary(self) -> str:
        return "; ".join(f"{server.url} ({server.failure})" for server in self._servers)

    def _live_for(self, version: int | None) -> list[_Server]:
        if self._closed:
            raise RuntimeError("this VLLMEngine is closed")
        live = [server for server in self._servers if server.alive]
        if not live:
            to = "" if version is None else f" to push version {version} to"
            raise VLLMError(f"no vLLM server is alive{to}: {self._obituary()}")
        return live

    def _post(self, server: _Server, path: str, **options) -> httpx.Response:
        """A synchronous POST to a server; VLLMError naming the URL for any answer but 200."""
        answer = self._send(server, "POST", path, **options)
        if answer.status_code != 200:
            raise self._refused(server, path, answer)
        return answer

    def _send(self, server: _Server, method: str, path: str, **options) -> httpx.Response:
        """A synchronous request to a server, whatever it answers; VLLMError naming the URL
        when it does not answer."""
        try:
            return self._pushes.request(method, f"{server.url}{path}", **options)
        except httpx.HTTPError as error:
            raise self._post_failed(server, path, error) from None

    async def _post_async(
        self, client: httpx.AsyncClient, server: _Server, path: str, **options
    ) -> httpx.Response:
        """`_post` over an async client."""
        try:
            answer = await client.post(f"{server.url}{path}", **options)
        except httpx.HTTPError as error:
            if not await self._healthy(client, server):
                server.died(f"{type(error).__name__} at {path}, and /health does not answer")
            raise self._post_failed(server, path, error) from None
        if answer.status_code != 200:
            raise self._refused(server, path, answer)
        return answer

    def _refused(self, server: _Server, path: str, answer: httpx.Response) -> VLLMError:
        """The error of a server's answer other than 200, naming its URL: a 401 says that it
        wants an API key, or another than the one sent."""
        if answer.status_code != 401:
            return VLLMError(f"the vLLM server {server.url} failed {path}: {_said(answer)}")
        if self._headers:
            why = (
                f"refused the API key dew sent ({API_KEY_VARIABLE}, or api_key=): give the key "
                "it was started with (--api-key)"
            )
        else:
            why = (
                f"wants an API key (it was started with --api-key): set {API_KEY_VARIABLE}, or "
                "give api_key=, to that key"
            )
        return VLLMError(f"the vLLM server {server.url} {why}; it answered {path} {_said(answer)}")

    def _post_failed(self, server: _Server, path: str, error: httpx.HTTPError) -> VLLMError:
        """The error of a POST the server did not answer; the server counts as dead when its
        process ended."""
        if server.process is not None and server.process.exit_code() is not None:
            server.died(f"exit code {server.process.exit_code()}")
        return VLLMError(
            f"the vLLM server {server.url} failed {path}: {type(error).__name__}: {error}"
        )


def _api_key(api_key: str | None) -> str | None:
    """The API key to send: `api_key`, else the environment's VLLM_API_KEY; None for none.

    Raises:
        ValueError: when it holds a space or a control character (a line end read from a
            file, say), which vLLM's key cannot and an HTTP header does not take.
    """
    key = os.environ.get(API_KEY_VARIABLE) if api_key is None else api_key
    if not isinstance(key, str | None):
        raise ValueError(f"api_key must be a string, got {type(key).__name__}")
    if key and not all(" " < character < "\x7f" for character in key):
        where = API_KEY_VARIABLE if api_key is None else "api_key"
        raise ValueError(
            f"{where} holds a space or a control character (a line end read from a file?): "
            "give the key alone"
        )
    return key or None


def _prompt_ids(prompt, max_len: int) -> list[int]:
    return checked_prompt(prompt, max_len).tolist()


def _sampling(temperature, top_k, top_p, key) -> dict[str, Any]:
    check_number("temperature", temperature, low=0)
    sampling: dict[str, Any] = {"temperature": float(temperature)}
    if top_k is not None:
        sampling["top_k"] = check_int("top_k", top_k, low=1)
    if top_p is not None:
        sampling["top_p"] = float(check_number("top_p", top_p, low=0, high=1, low_open=True))
    if key is not None:
        # vLLM takes a signed 64-bit seed.
        sampling["seed"] = check_int("key", key, low=0) % (1 << 63)
    return sampling


def _body(model: str, ids: list[int], *, max_tokens: int, sampling, stop) -> dict[str, Any]:
    """A token-in/token-out request: only the given stop ids end it (`ignore_eos`), and the
    sampled token's log-prob comes back (`logprobs` 0) without detokenising anything."""
    return {
        "model": model,
        "token_ids": ids,
        "output_mode": "tokens",
        "sampling_params": {
            **sampling,
            "max_tokens": max_tokens,
            "stop_token_ids": list(stop),
            "ignore_eos": True,
            "logprobs": 0,
            "detokenize": False,
            "skip_special_tokens": False,
        },
    }


def _call(url: str, prompt: np.ndarray, answer: dict, submitted: int) -> Call:
    """The Call of a generate answer; VLLMError naming the server when it lacks token ids or
    log-probs or they disagree, CallFailed when the server aborted the call."""
    try:
        (choice,) = answer["choices"]
    except (KeyError, TypeError, ValueError):
        raise VLLMError(
            f"the vLLM server {url} answered without one choice: {answer!r:.300}"
        ) from None
    if choice.get("finish_reason") == "abort":
        raise CallFailed(f"the vLLM server {url} aborted the call")
    tokens = choice.get("token_ids")
    content = (choice.get("logprobs") or {}).get("content")
    if tokens is None or content is None:
        raise VLLMError(
            f"the vLLM server {url} answered without token ids or log-probs: is it a vLLM "
            "token-in/token-out endpoint?"
        )
    logprobs = [entry.get("logprob") for entry in content]
    if len(logprobs) != len(tokens) or any(
        not isinstance(value, float) or math.isnan(value) for value in logprobs
    ):
        raise VLLMError(
            f"the vLLM server {url} answered {len(tokens)} token ids with log-probs "
            f"{logprobs!r:.200}"
        )
    return Call(
        prompt=prompt,
        completion=np.asarray(tokens, np.int32),
        logprobs=np.asarray(logprobs, np.float32),
        version=_started_under(choice.get("weight_versions"), submitted),
    )


def _first_label(spans) -> str | None:
    """The label of the weights that drew a call's first token, from vLLM's weight version
    spans; None where the server gives none."""
    with contextlib.suppress(IndexError, KeyError, TypeError):
        return str(spans[0]["version"])
    return None


def _started_under(spans, submitted: int) -> int:
    """The version that drew a call's first token, from vLLM's weight version spans; the version
    served at submission where the server labels none (or not with dew's integers)."""
    label = _first_label(spans)
    return int(label) if label is not None and label.isdigit() else submitted


def _said(answer: httpx.Response) -> str:
    """A server's error answer in one line: its status and message. An answer that is not
    JSON (another server on the port: a web server's HTML error page) is named by its content
    type and what answered (the Server header), never pasted in."""
    try:
        body = answer.json()
        message = body.get("error") or body.get("detail") or body.get("message") or body
        if isinstance(message, dict):
            message = message.get("message", message)
    except (ValueError, AttributeError):
        kind = answer.headers.get("content-type", "no content type").split(";")[0]
        lines = answer.text.strip().splitlines()
        first = lines[0][:200] if len(lines) == 1 and "html" not in kind else ""
        who = answer.headers.get("server")
        message = f"({kind}{f', from {who}' if who else ''}){f' {first}' if first else ''}"
    return f"{answer.status_code} {' '.join(str(message).split())[:500]}"
