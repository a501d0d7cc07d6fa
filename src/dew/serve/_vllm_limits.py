"""What a vLLM server's scheduler settings must be to take the bursts of calls dew sends.

dew seeds every call (a rollout's `key`), and starts a batch's rollouts at once: a step of the
default `dew train` sends 8 tasks x 16 samples, plus the batch read ahead. vLLM's scheduler
takes at most `--max-num-batched-tokens` new tokens a step (2,048 by default on a CPU) and, with
chunked prefill on (its default), splits the prompt that crosses that budget over two steps.
On vLLM's CPU build a seeded call whose prompt is split kills the engine ("RuntimeError: CPU
Generator does not use offset"): every call fails, and the server is gone. Without chunked
prefill a prompt that does not fit waits for the next step whole, so no burst can split one;
the scheduler then takes `max(--max-num-batched-tokens, --max-model-len)` tokens a step, so
every prompt fits one step. The servers dew starts run so (`START_FLAGS`); a server started by
hand on a CPU with chunked prefill on is refused as dew attaches to it (`burst_problem`),
naming the flag, before a burst kills it mid-run. A GPU build seeds its calls with generators
that take offsets, so chunked prefill stays allowed there.
"""

from __future__ import annotations

START_FLAGS = ("--no-enable-chunked-prefill",)
"""The flags every server dew starts runs with, for the bursts it sends (see the module)."""
INFO = "/server_info"
"""vLLM's endpoint (development mode) that answers its configuration. Its first answer takes
seconds of the server's CPU (vLLM 0.32 collects the machine's environment with it, `pip list`
and `pip show` included, whatever the query asks), so dew asks it only of servers whose flags it
did not choose alone (`_vllm_checks`)."""
INFO_OPTIONS = {"config_format": "json"}
SERVED_DTYPES = ("float32", "bfloat16", "float16")
"""The `--dtype` values a server reports as given (`served_dtype`); vLLM resolves the others
("auto": the checkpoint's, "half", "float") itself."""


def burst_problem(info: object) -> str | None:
    """What makes a server unable to take dew's bursts, from its `/server_info` answer (JSON):
    chunked prefill on a CPU server, as a part of a refusal naming the flag to start it with;
    None when nothing does, or the answer does not say (an older or another server)."""
    config = info.get("vllm_config") if isinstance(info, dict) else None
    if not isinstance(config, dict):
        return None
    scheduler = config.get("scheduler_config") or {}
    device = config.get("device_config") or {}
    on_cpu = "cpu" in {str(device.get("device")), str(device.get("device_type"))}
    if not (on_cpu and scheduler.get("enable_chunked_prefill") is True):
        return None
    return (
        "it runs on a CPU with chunked prefill on, and vLLM's CPU engine dies of a seeded call "
        "whose prompt it splits over steps, which a burst of dew's calls makes ('CPU Generator "
        "does not use offset'): start it with --no-enable-chunked-prefill"
    )


def served_dtype(info: object) -> str | None:
    """The dtype a server computes in ("float32", "bfloat16", ...), from its `/server_info`
    answer; None where the answer does not say."""
    config = info.get("vllm_config") if isinstance(info, dict) else None
    model = config.get("model_config") if isinstance(config, dict) else None
    dtype = model.get("dtype") if isinstance(model, dict) else None
    return dtype.removeprefix("torch.") if isinstance(dtype, str) else None
