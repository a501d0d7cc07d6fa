"""A run's vLLM servers (`--engine vllm`, docs/vllm.md): the checkpoint folder they hold, and
the engine attached to them (`--engine-url`) or started on loopback (`--engine-servers`).

Apart from `_run.py`, which builds and runs the run, because it is the one engine that lives
outside the run's process: folders, URLs and server processes.
"""

from __future__ import annotations

import time
from pathlib import Path

import jax

from dew.models import hf
from dew.models.hf import lora
from dew.train._config import TrainConfig


def _served_folder(config: TrainConfig, run: Path, model, variables) -> Path | None:
    """The checkpoint folder the run's vLLM servers hold (None without `--engine vllm`): the
    `--model` folder; for a GGUF file, which vLLM does not serve as dew reads it, the params
    loaded from it written as a folder, the run's own `vllm/process-I/model` (each process
    writes its copy from the params it loaded whole, before any mesh splits them)."""
    if config.engine != "vllm":
        return None
    checkpoint = hf.resolve(config.model)
    if not hf.is_gguf(checkpoint):
        return checkpoint
    folder = run / "vllm" / f"process-{jax.process_index()}" / "model"
    if isinstance(model, lora.LoRAModel):  # the servers hold the base; pushes carry the rest
        model, variables = model.base, variables["base"]
    hf.save(folder, model, variables, tokenizer_from=checkpoint)
    return folder


def _vllm_engine(
    config: TrainConfig, run: Path, served: Path, model, tokenizer, max_len: int, version: int
):
    """The run's vLLM servers (docs/vllm.md): this process's share of those at `--engine-url`
    (process I of P takes every P-th URL from the I-th: each process pushes its own weights to
    servers of its own), or `--engine-servers` started on loopback with the `served` folder,
    their logs and pushed checkpoints under the run folder's `vllm/process-I/`. The servers
    hold the folder's weights, the trainer's `version` ones only from the first push on, which
    the scheduler makes before any rollout."""
    # The vllm extra, only where it is asked for.
    from dew.serve.vllm import VLLMEngine, VLLMError

    index, processes = jax.process_index(), jax.process_count()
    work = run / "vllm" / f"process-{index}"
    began = time.monotonic()
    if config.engine_url is not None:
        urls = config.engine_url[index::processes]
        print(f"attaching to vLLM at {', '.join(urls)}", flush=True)
        engine = VLLMEngine.attach(
            urls,
            checkpoint=served,
            model=model,
            tokenizer=tokenizer,
            push_dir=work,
            version=version,
            read_timeout=config.engine_timeout,
        )
        if engine.max_len < max_len:
            engine.close()
            raise VLLMError(
                f"--engine-url: the servers take {engine.max_len} tokens (--max-model-len), "
                f"the task's sequences reach {max_len}"
            )
        print(f"vLLM ready in {time.monotonic() - began:.0f}s", flush=True)
        return engine
    # A server takes a minute to start on a CPU, minutes on a loaded one: said, not silent.
    print(f"starting {config.engine_servers} vLLM server(s), logs in {work}", flush=True)
    engine = VLLMEngine.start(
        served,
        servers=config.engine_servers,
        max_model_len=max_len,
        dtype=model.dtype,
        model=model,
        tokenizer=tokenizer,
        version=version,
        work_dir=work,
        read_timeout=config.engine_timeout,
    )
    print(f"vLLM ready in {time.monotonic() - began:.0f}s at {', '.join(engine.urls)}", flush=True)
    return engine
