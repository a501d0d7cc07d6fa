"""What a vLLM server must run with to serve a run, checked as dew starts or attaches to it.

An attached server must serve the run's model and report its max_model_len (`_check_attached`);
every server, started or attached, must have vLLM's RL endpoints (development mode), its
token-in/token-out endpoint, and log-probs of the distribution it draws from; a CPU server must
run without chunked prefill (`dew.serve._vllm_limits`); a LoRA run's must load adapters of the
run's rank while it runs (`_check_serving`). A server is refused naming all it lacks at once,
since one started by hand takes minutes to start again. Chunked prefill, the adapters' rank and
the dtype (`_check_dtype`) are read from the server's configuration (`/server_info`), except on
the servers dew started with flags it chose alone, which run as those flags say: that
endpoint's first answer costs a server seconds of CPU (`dew.serve._vllm_limits.INFO`).
`_ServerChecks` is a part of `VLLMEngine` (`_vllm`), kept in a module of its own so that each
part reads in one sitting: its methods use the state `VLLMEngine.__init__` sets.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import httpx
import numpy as np

from dew.serve._vllm_http import _GENERATE, READ_TIMEOUT, _body, _call, _log, _said, _Server
from dew.serve._vllm_limits import INFO, INFO_OPTIONS, burst_problem, served_dtype
from dew.serve._vllm_process import VLLMError
from dew.serve._vllm_push import LOAD_ADAPTER, LORA_ENVIRONMENT, lora_problem


class _ServerChecks:
    """VLLMEngine's checks of what a server serves, and the label of its first weights."""

    def _check_attached(self, server: _Server) -> int:
        """The attached server's max_model_len, once it is known to serve the run's model."""
        # A listing is quick: a server silent for longer than the run allows (read_timeout,
        # `dew train --engine-timeout`) or 30 s is not one to attach to.
        timeout = min(30.0, self._read_timeout)
        try:
            answer = self._pushes.get(f"{server.url}/v1/models", timeout=timeout)
        except httpx.TimeoutException:
            raise VLLMError(
                f"the vLLM server {server.url} does not answer /v1/models: it sent nothing for "
                f"{timeout:g} s"
            ) from None
        except httpx.HTTPError as error:
            raise VLLMError(f"the vLLM server {server.url} does not answer: {error}") from None
        if answer.status_code == 404:
            raise VLLMError(
                f"the vLLM server {server.url} answered /v1/models {_said(answer)}: is "
                f"{server.url} a vLLM server's base URL (http://HOST:PORT)?"
            )
        if answer.status_code != 200:
            raise self._refused(server, "/v1/models", answer)
        try:
            served = {entry["id"]: entry for entry in answer.json()["data"]}
        except (KeyError, TypeError, ValueError):
            raise VLLMError(
                f"the vLLM server {server.url} answered /v1/models with {answer.text!r:.300}: "
                "is it a vLLM server?"
            ) from None
        if self.name is None:
            self.name = _served_name(served, Path(self._checkpoint))
        if self.name not in served:
            run = self._checkpoint if self.name is None else repr(self.name)
            raise VLLMError(
                f"the vLLM server {server.url} serves {sorted(served)}, not the run's model {run}"
            )
        length = served[self.name].get("max_model_len")
        if not isinstance(length, int) or length < 2:
            raise VLLMError(
                f"the vLLM server {server.url} reports no max_model_len for {self.name!r} on "
                f"/v1/models (it answered {length!r}): is it a vLLM server?"
            )
        return length

    def _check_serving(self, server: _Server) -> None:
        """Refuse a server that lacks what a run needs, naming all it lacks at once (a server
        started by hand takes minutes to start again): vLLM's development mode (its RL
        endpoints), its token-in/token-out endpoint (`--enable-scale-out`), and log-probs of
        the distribution it draws from (`--logprobs-mode processed_logprobs`). A call drawn
        with top_k 1 tells the last: the distribution it draws from keeps one token, of
        log-prob 0, where vLLM's default (`raw_logprobs`) reports that token's log-prob before
        top-k, below 0 unless the model is certain of it (so four tokens are drawn); a server
        without the token-in/token-out endpoint draws it through /v1/completions. A CPU server
        with chunked prefill on is refused too: a burst of dew's seeded calls would kill it
        (`dew.serve._vllm_limits`); and for a LoRA run, one that serves no adapters of the
        run's rank (`lora_problem`) or cannot load them while it runs."""
        lacks = []
        paused = self._send(server, "GET", "/is_paused")
        if paused.status_code == 404:
            lacks.append(
                "it has no RL endpoints (/pause, /collective_rpc): start it with "
                "VLLM_SERVER_DEV_MODE=1"
            )
        elif paused.status_code != 200:
            raise self._refused(server, "/is_paused", paused)
        sampling = {"temperature": 1.0, "top_k": 1}
        body = _body(self.name, [0], max_tokens=4, sampling=sampling, stop=())
        # A server's first call warms it up: tens of seconds on a CPU, whatever read_timeout is.
        answer = self._send(server, "POST", _GENERATE, json=body, timeout=READ_TIMEOUT)
        logprobs = None
        # vLLM 0.32 answers 403 "Scale-out endpoints are disabled", others 404.
        if answer.status_code == 404 or (
            answer.status_code == 403 and "scale-out" in answer.text.lower()
        ):
            lacks.append(
                f"it has no token-in/token-out endpoint ({_GENERATE} answered "
                f"{answer.status_code}): start it with --enable-scale-out"
            )
            # What the server lacks besides, to say it now: a check the next attach repeats.
            with contextlib.suppress(VLLMError):
                logprobs = self._completion_logprobs(server)
        elif answer.status_code != 200:
            raise self._refused(server, _GENERATE, answer)
        else:
            logprobs = _call(server.url, np.zeros(1, np.int32), answer.json(), 0).logprobs
        # Its configuration is a development-mode endpoint too; a proxy may not pass it on. Its
        # first answer takes seconds (vLLM collects its environment), whatever read_timeout is:
        # a server dew started with flags of its own alone runs as they say (`_started_dtype`).
        info = None
        if server.process is not None and self._started_dtype is not None:
            self._check_dtype(server, self._started_dtype)
        elif paused.is_success:
            info = self._send(server, "GET", INFO, params=INFO_OPTIONS, timeout=READ_TIMEOUT)
        if info is not None and info.status_code not in (200, 404):
            raise self._refused(server, INFO, info)
        if info is not None and info.status_code == 200:
            with contextlib.suppress(ValueError):
                problem = burst_problem(info.json())
                if problem is not None:
                    lacks.append(problem)
                self._check_dtype(server, served_dtype(info.json()))
                if self.lora and (problem := lora_problem(info.json(), self._lora_rank)):
                    lacks.append(problem)
        if self.lora and self._send(server, "GET", LOAD_ADAPTER).status_code == 404:
            lacks.append(
                f"it cannot load adapters while it runs ({LOAD_ADAPTER} is missing): start it "
                f"with {' '.join(f'{name}={value}' for name, value in LORA_ENVIRONMENT.items())}"
            )
        if logprobs is not None and np.abs(logprobs).max() > 1e-6:
            lacks.append(
                "it reports log-probs of another distribution than the one it draws from "
                f"(drawn with top_k 1, they are {logprobs.tolist()}, not 0): start it with "
                "--logprobs-mode processed_logprobs, or the run would train on wrong behaviour "
                "log-probs"
            )
        if lacks:
            lacking = "; ".join(lacks)
            raise VLLMError(f"the vLLM server {server.url} cannot serve the run: {lacking}")

    def _check_dtype(self, server: _Server, dtype: str | None) -> None:
        """Say in one line when a server computes in another dtype than the run's model (a
        server started without `--dtype float32` serves a float32 checkpoint in bfloat16): its
        behaviour log-probs then differ from dew's by that rounding, which `mismatch/engine`
        shows at about 1e-8 where float32 on both sides gives 1e-14."""
        wanted = getattr(self._model, "dtype", None)
        if dtype is not None and wanted is not None and dtype != wanted:
            _log.warning(
                "the vLLM server %s computes in %s, the run's model in %s: its log-probs differ "
                "from dew's by %s rounding; start it with --dtype %s to match",
                server.url,
                dtype,
                wanted,
                dtype,
                wanted,
            )

    def _completion_logprobs(self, server: _Server) -> np.ndarray:
        """The log-probs of a call drawn with top_k 1 through the OpenAI completions endpoint."""
        body = {
            "model": self.name,
            "prompt": [0],
            "max_tokens": 4,
            "temperature": 1.0,
            "top_k": 1,
            "logprobs": 1,
            "ignore_eos": True,
        }
        answer = self._post(server, "/v1/completions", json=body, timeout=READ_TIMEOUT)
        try:
            values = answer.json()["choices"][0]["logprobs"]["token_logprobs"]
            return np.asarray(values, np.float64)
        except (IndexError, KeyError, TypeError, ValueError):
            raise VLLMError(
                f"the vLLM server {server.url} answered /v1/completions without log-probs"
            ) from None

    def _warm_up(self, version: int, server: _Server) -> None:
        """Check what a server serves with (`_check_serving`: its first call, which takes tens
        of seconds on a CPU) and label its weights `version`."""
        self._check_serving(server)
        self._post(server, "/update_weight_version", json={"new_version": str(version)})


def _served_name(served: dict[str, dict], checkpoint: Path) -> str | None:
    """The served model whose folder (vLLM's `root`) is `checkpoint`, else the one named as its
    folder, or, for a snapshot in the Hugging Face Hub's cache (`.../models--OWNER--NAME/
    snapshots/COMMIT`), the one named or rooted as its repository id (a server started with
    `vllm serve OWNER/NAME`); None when none is."""
    for name, entry in served.items():
        root = entry.get("root")
        if root and Path(root).resolve() == checkpoint.resolve():
            return name
    repository = checkpoint.parent.parent.name
    if checkpoint.parent.name == "snapshots" and repository.startswith("models--"):
        repo_id = repository.removeprefix("models--").replace("--", "/", 1)
        for name, entry in served.items():
            if repo_id in (name, entry.get("root")):
                return name
    return checkpoint.name if checkpoint.name in served else None
