"""Attaching to vLLM servers as users start them by hand, on real servers (vLLM's CPU build).

Two servers are shared by the module, started together with vLLM's own command line and flags
of the test's choosing, as a user starts one: `protected` with `--api-key`, two served names,
every flag a run needs and a `--max-model-len` shorter than `dew train`'s context; `bare` with
`--api-key` and none of the flags (no development mode, no `--enable-scale-out`, vLLM's default
log-probs); both with their model worker in their engine core's process, as every server the
tests start (tests/conftest.py). They run
through dew's `ServerProcess` only for its process-group clean-up and its
`sitecustomize` (this machine's torchvision cannot load beside torch's CPU build); dew attaches
to them knowing nothing of those processes.
"""

from __future__ import annotations

import re
import time

import httpx
import jax
import numpy as np
import pytest

from _checkpoint import tiny_qwen2
from dew.models import hf
from dew.serve import _vllm_start
from dew.serve._vllm_process import ServerProcess, free_port
from dew.serve.vllm import VLLMEngine, VLLMError

pytestmark = [
    # httpcore's one-chunk body generator, left suspended by a cancelled call (as test_vllm).
    pytest.mark.filterwarnings(
        "ignore:Async generator 'httpx._content.ByteStream.__aiter__' was garbage:ResourceWarning"
    ),
    # The first test waits for both servers: minutes on a loaded machine.
    pytest.mark.timeout(1200),
]

KEY = "dew-hostile-key"
# Shorter than `dew train --task copy`'s context with the tiny checkpoint's tokenizer (21).
SERVER_LEN = 16
NAMES = ("alpha", "beta")
PROMPT = np.array([0, 1, 17, 42, 99, 7], np.int32)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_qwen2(tmp_path_factory.mktemp("hostile-vllm") / "policy")


@pytest.fixture(scope="module")
def servers(folder, tmp_path_factory):
    """The `protected` and `bare` servers' URLs, started at once and ready (GET /health)."""
    logs = tmp_path_factory.mktemp("logs")
    common = ["--dtype", "float32", "--max-model-len", str(SERVER_LEN), "--enforce-eager"]
    common += ["--api-key", KEY]
    protected = ServerProcess(
        folder,
        host="127.0.0.1",
        port=free_port(),
        arguments=[
            *common,
            *("--served-model-name", *NAMES),
            *("--logprobs-mode", "processed_logprobs", "--enable-scale-out"),
            "--no-enable-chunked-prefill",
        ],
        log=logs / "protected.log",
        environment={"VLLM_SERVER_DEV_MODE": "1"},
    )
    bare = ServerProcess(
        folder,
        host="127.0.0.1",
        port=free_port(),
        arguments=common,
        log=logs / "bare.log",
        environment={"VLLM_SERVER_DEV_MODE": "0"},
    )
    try:
        deadline = time.monotonic() + 900
        with httpx.Client() as client:
            protected.wait_ready(deadline, client)
            bare.wait_ready(deadline, client)
        yield {"protected": protected.url, "bare": bare.url}
    finally:
        protected.stop()
        bare.stop()


@pytest.fixture
def no_key(monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)


@pytest.mark.slow
def test_a_server_wanting_an_api_key_is_refused_naming_it_and_the_key(
    servers, folder, tmp_path, no_key
):
    url = servers["protected"]
    with pytest.raises(VLLMError, match=f"the vLLM server {url} wants an API key") as missing:
        VLLMEngine.attach([url], name="alpha", checkpoint=folder, push_dir=tmp_path)
    assert "set VLLM_API_KEY, or give api_key=" in str(missing.value)
    assert "401" in str(missing.value)
    with pytest.raises(VLLMError, match=f"{url} refused the API key dew sent") as wrong:
        VLLMEngine.attach(
            [url], name="alpha", checkpoint=folder, push_dir=tmp_path, api_key="not-the-key"
        )
    assert "--api-key" in str(wrong.value) and "not-the-key" not in str(wrong.value)


@pytest.mark.slow
async def test_attached_with_the_key_from_the_environment_it_calls_and_pushes(
    servers, folder, tmp_path, monkeypatch
):
    url = servers["protected"]
    # vLLM guards /v1 and /inference with the key, not its development-mode endpoints: what
    # docs/vllm.md warns of.
    assert httpx.get(f"{url}/v1/models").status_code == 401
    assert httpx.get(f"{url}/is_paused").status_code == 200
    monkeypatch.setenv("VLLM_API_KEY", KEY)
    engine = VLLMEngine.attach([url], checkpoint=folder, push_dir=tmp_path, version=3)
    params = hf.load(folder)[1]
    try:
        # No name given: the served name whose folder is the checkpoint, the first listed.
        assert (engine.name, engine.max_len, engine.version) == ("alpha", SERVER_LEN, 3)
        async with engine:
            before = await engine.generate(PROMPT, max_tokens=4, key=1)
            await engine.load_async(params, 4)
            after = await engine.generate(PROMPT, max_tokens=4, key=1)
    finally:
        engine.close()
    assert before.version == 3 and after.version == 4
    assert len(after.completion) == 4 and np.all(after.logprobs <= 0)
    assert httpx.get(f"{url}/weight_info").json() == {"weight_version": "4"}


@pytest.mark.slow
def test_urls_as_users_paste_them_are_normalised_or_refused_naming_them(
    servers, folder, tmp_path, no_key
):
    url = servers["protected"]
    for pasted in (f"{url}/", f"{url}/v1", f" {url}/v1/ "):
        engine = VLLMEngine.attach(
            [pasted], name="beta", checkpoint=folder, push_dir=tmp_path, api_key=KEY
        )
        engine.close()
        assert engine.urls == (url,)
    address = url.removeprefix("http://")
    refusals = {
        address: f"'{address}' is not a vLLM server URL .*: give its scheme, http://{address}",
        f"ftp://{address}": "is not a vLLM server URL",
        f"{url}/v1?model=alpha": "a base URL has no query or fragment",
        "http://:8000": "it names no host",
        "http://127.0.0.1:80000": "Port out of range",
    }
    for pasted, culprit in refusals.items():
        with pytest.raises(ValueError, match=culprit):
            VLLMEngine.attach([pasted], name="beta", push_dir=tmp_path, api_key=KEY)
    with pytest.raises(ValueError, match=f"the vLLM server {url} is given twice"):
        VLLMEngine.attach([url, f"{url}/v1"], name="beta", push_dir=tmp_path, api_key=KEY)
    with pytest.raises(ValueError, match="a list of server URLs, got the string"):
        VLLMEngine.attach(url, name="beta", push_dir=tmp_path, api_key=KEY)
    # An endpoint pasted for the base URL reaches the server, which answers 404.
    with pytest.raises(VLLMError, match="a vLLM server's base URL"):
        VLLMEngine.attach(
            [f"{url}/v1/completions"], checkpoint=folder, push_dir=tmp_path, api_key=KEY
        )


@pytest.mark.slow
async def test_a_server_serving_several_names_serves_each_and_lists_them_for_another(
    servers, folder, tmp_path, no_key
):
    url = servers["protected"]
    for name in NAMES:
        engine = VLLMEngine.attach(
            [url], name=name, checkpoint=folder, push_dir=tmp_path, api_key=KEY
        )
        try:
            async with engine:
                call = await engine.generate(PROMPT, max_tokens=3, key=2)
        finally:
            engine.close()
        assert engine.name == name and len(call.completion) == 3
    with pytest.raises(VLLMError, match=rf"{url} serves \['alpha', 'beta'\], not the run's model"):
        VLLMEngine.attach([url], name="gamma", checkpoint=folder, push_dir=tmp_path, api_key=KEY)


@pytest.mark.slow
def test_dew_train_refuses_a_server_shorter_than_its_context_at_attach(
    servers, folder, tmp_path, monkeypatch, capsys
):
    """`dew train --engine-url` with the key in VLLM_API_KEY: the run stops before its first
    rollout, naming the server's length and the task's; without the key, naming the key."""
    from dew.cli import main

    url = servers["protected"]
    run = tmp_path / "run"
    argv = ["train", "--model", str(folder), "--engine", "vllm", "--run", str(run)]
    argv += ["--engine-url", f"{url}/v1", "--batch-size", "2", "--groups", "2", "--tasks", "10"]
    argv += ["--eval-every", "0", "--samples", "0", "--steps", "1"]
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    with jax.numpy_dtype_promotion("standard"):
        assert main(argv) == 1
    said = capsys.readouterr().err
    assert "dew train: " in said and "wants an API" in said and "Traceback" not in said, said
    # The refused run trained nothing: the folder takes the next run without --resume.
    monkeypatch.setenv("VLLM_API_KEY", KEY)
    with jax.numpy_dtype_promotion("standard"):
        assert main(argv) == 1
    said = capsys.readouterr().err
    lengths = re.search(
        r"the servers take (\d+) tokens \(--max-model-len\), the task's sequences reach (\d+)",
        said,
    )
    assert lengths is not None and "Traceback" not in said, said
    assert int(lengths[1]) == SERVER_LEN < int(lengths[2])
    assert not (run / "metrics.jsonl").exists() or not (run / "metrics.jsonl").read_text()


def test_dew_train_refuses_urls_that_cannot_be_servers_before_anything_starts(
    folder, tmp_path, capsys
):
    from dew.cli import main

    for urls, culprit in [
        (["localhost:8000"], "give its scheme, http://localhost:8000"),
        (["http://127.0.0.1:9", "http://127.0.0.1:9/v1/"], "http://127.0.0.1:9 is given twice"),
    ]:
        argv = ["train", "--model", str(folder), "--engine", "vllm", "--run", str(tmp_path / "r")]
        with pytest.raises(SystemExit) as exited:
            main([*argv, "--engine-url", *urls])
        assert exited.value.code == 2
        assert culprit in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


@pytest.mark.slow
def test_a_server_lacking_every_flag_behind_an_api_key_is_refused_naming_each(
    servers, folder, tmp_path, no_key
):
    url = servers["bare"]
    with pytest.raises(VLLMError, match=f"the vLLM server {url} wants an API key"):
        VLLMEngine.attach([url], checkpoint=folder, push_dir=tmp_path)
    with pytest.raises(VLLMError, match=f"the vLLM server {url} cannot serve the run: ") as lacks:
        VLLMEngine.attach([url], checkpoint=folder, push_dir=tmp_path, api_key=KEY)
    message = str(lacks.value)
    for flag in (
        "start it with VLLM_SERVER_DEV_MODE=1",
        "start it with --enable-scale-out",
        "start it with --logprobs-mode processed_logprobs",
    ):
        assert flag in message, message


def test_start_gives_the_servers_their_api_key_out_of_their_command_line(
    folder, tmp_path, monkeypatch
):
    """`start(api_key=)` hands the key to each server as VLLM_API_KEY (vLLM's `--api-key` in
    `ps` for all to read otherwise) and sends it; a key in `arguments` is refused."""
    started = []

    class Refused(ServerProcess):
        def __init__(self, checkpoint, **options):
            started.append(options)
            self.url = "http://127.0.0.1:9"

        def wait_ready(self, deadline, client):
            raise VLLMError("not started")

    stopped = []
    monkeypatch.setattr(_vllm_start, "ServerProcess", Refused)
    monkeypatch.setattr(_vllm_start, "stop_servers", stopped.extend)
    monkeypatch.setenv("VLLM_API_KEY", "from-the-environment")
    for api_key, sent in [(KEY, KEY), (None, "from-the-environment"), ("", "")]:
        with pytest.raises(VLLMError, match="not started"):
            VLLMEngine.start(folder, max_model_len=SERVER_LEN, work_dir=tmp_path, api_key=api_key)
        options = started.pop()
        assert isinstance(stopped.pop(), Refused) and not stopped  # what failed is stopped
        assert options["environment"]["VLLM_API_KEY"] == sent
        assert not any("key" in flag for flag in options["arguments"])
    with pytest.raises(ValueError, match="give the servers' API key as api_key="):
        VLLMEngine.start(
            folder, max_model_len=SERVER_LEN, work_dir=tmp_path, arguments=["--api-key", KEY]
        )
    monkeypatch.setenv("VLLM_API_KEY", KEY + "\n")
    with pytest.raises(ValueError, match="VLLM_API_KEY holds a space or a control character"):
        VLLMEngine.attach(["http://127.0.0.1:9"], name="alpha", push_dir=tmp_path)
