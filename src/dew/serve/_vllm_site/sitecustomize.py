"""Imported by every Python process of a vLLM server dew starts (its folder leads PYTHONPATH).

vLLM's CPU build pulls in torchvision/torchaudio/torchcodec builds that cannot load beside torch's
CPU release, and vLLM imports them in each process it spawns (the model inspector, the engine
core), not only in the one dew starts: each process hides them first (`dew._torch_media`).

Finding which of them cannot load means importing them, torch included: 1.8 CPU-seconds, which
every Python process a server starts paid again (torch's inductor starts six, probing the CPU's
vector instructions at a server's first log-prob call, and `/server_info` three `pip` runs:
about 16 CPU-seconds a server). The first process finds out and leaves its verdict in the
environment (`MEDIA_VERDICT`, the names it hid, comma-separated), so that the processes it starts
hide the same names without importing anything.

A server whose model worker runs in its engine core's process (VLLM_ENABLE_V1_MULTIPROCESSING=0,
as the tests run theirs) forks that engine core from the API server rather than spawning it
(`fork_engine_core`): vLLM's CPU platform asks for spawn for every process it starts, and a
spawned engine core is a fresh Python importing torch and vLLM again before it starts. A tiny
model's server was ready in 51-59 s spawned against 31-39 s forked, 22.4 against 14.4-15.8
CPU-seconds, peak 1.76 against 1.60 GB (loaded 2-core machine).
"""

import importlib.abc
import importlib.machinery
import os
import sys

from dew._torch_media import hide_broken_media_packages

_CPU_PLATFORM = "vllm.platforms.cpu"
MEDIA_VERDICT = "_DEW_HIDDEN_MEDIA"
"""The variable holding the media packages found broken by the process that started this one."""


def hide_media_packages() -> None:
    """Hide the broken media packages: those named in the inherited verdict, or, without one,
    those `hide_broken_media_packages` finds, then recorded for the processes started later."""
    verdict = os.environ.get(MEDIA_VERDICT)
    if verdict is None:
        os.environ[MEDIA_VERDICT] = ",".join(hide_broken_media_packages())
        return
    for name in filter(None, verdict.split(",")):
        sys.modules.setdefault(name, None)


def fork_engine_core() -> None:
    """Let vLLM fork its engine core when the model worker runs inside it.

    vLLM's CPU platform sets VLLM_WORKER_MULTIPROC_METHOD=spawn as it checks a server's
    configuration, for the worker processes it binds to cores. With the worker in the engine
    core's process there are none: the engine core is the only process the API server starts,
    which vLLM forks on its GPU builds (its default method), and forked it inherits the modules
    the API server imported. So after the CPU platform's check, the method is put back to fork,
    where the environment asks for that layout as vLLM checks. In vLLM's default layout (a
    worker process beside the engine core) nothing changes.
    """
    sys.meta_path.insert(0, _ForkAfterCpuCheck())


class _ForkAfterCpuCheck(importlib.abc.MetaPathFinder):
    """Finds vLLM's CPU platform module as usual and, once it has run, wraps its check."""

    def find_spec(self, name, path, target=None):
        if name != _CPU_PLATFORM:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            _wrap_check(module.CpuPlatform)

        spec.loader.exec_module = exec_module
        return spec


def _wrap_check(platform: type) -> None:
    """Make `platform.check_and_update_config` leave vLLM's start method at fork when the
    model worker runs in the engine core's process."""
    check = platform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config):
        check(cls, vllm_config)
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

    platform.check_and_update_config = classmethod(check_and_update_config)


hide_media_packages()
fork_engine_core()
