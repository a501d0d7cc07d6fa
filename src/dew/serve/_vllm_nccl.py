"""NCCLPublisher: weight pushes into GPU vLLM servers through vLLM's NCCL weight transfer.

On GPUs, writing a checkpoint folder per push costs a disk round trip of the whole model; vLLM's
NCCL weight-transfer engine broadcasts the tensors from the trainer's GPU into every server's
workers instead. The trainer opens the NCCL group as rank 0 once (vLLM's
`NCCLTrainerWeightTransferEngine.trainer_init`, which also has each server join it through its
`/init_weight_transfer_engine` endpoint); each push pauses the servers in "keep" mode,
broadcasts every checkpoint tensor of the params (named, shaped and laid out as
`dew.models.hf.save` writes them), sets the weights version and resumes.

The broadcast goes through the same layer-by-layer reload as a folder push (vLLM's
`initialize_layerwise_reload` / `finalize_layerwise_reload`), which re-runs a layer's post-load
processing only for layers that received tensors. So a tied checkpoint's push also sends the
embedding as `lm_head.weight`, as a folder push writes it (`dew.serve._vllm_push`): without it
the server would go on computing logits with its start-up head (`pushed_tensors`).

The servers must run with `--weight-transfer-config '{"backend": "nccl"}'` on GPUs. Exercised by
`benchmarks/gpu.py` where a GPU exists; the CPU path (`VLLMEngine.load`) is the tested
default.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from dew._checks import check_int
from dew.models import hf
from dew.models.hf.lora import LoRAModel
from dew.serve._vllm import VLLMEngine

NCCL_SERVER_FLAGS = ("--weight-transfer-config", '{"backend": "nccl"}')
"""The vLLM flags a server needs to receive NCCL pushes."""


class NCCLPublisher:
    """A Publisher that broadcasts params into a `VLLMEngine`'s GPU servers over NCCL.

    Args:
        engine: the servers (started with `NCCL_SERVER_FLAGS` among their `arguments`).
        model: the `dew.models.hf.HFModel` the params are of.
        master_address: the trainer's address the servers' workers reach for the rendezvous.
        master_port: a free port there.
        workers_per_server: each server's inference workers (its tensor x pipeline parallel
            size).

    Raises:
        ImportError: without torch and vLLM's weight-transfer engines.
        ValueError: for a LoRA run's model or engine: NCCL carries a checkpoint's full
            weights, and an adapter push is the engine's own (its folder, loaded in place).
    """

    def __init__(
        self,
        engine: VLLMEngine,
        model,
        *,
        master_address: str = "127.0.0.1",
        master_port: int,
        workers_per_server: int = 1,
    ):
        if isinstance(model, LoRAModel) or getattr(engine, "lora", False):
            raise ValueError(
                "NCCLPublisher broadcasts a checkpoint's full weights; a LoRA run pushes its "
                "adapter through the engine's own load (VLLMEngine.load: the adapter's folder, "
                "loaded in place on every server)"
            )
        import torch
        from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
        from vllm.distributed.weight_transfer.nccl_engine import (
            NCCLTrainerInitInfo,
            NCCLTrainerWeightTransferEngine,
        )

        self.engine = engine
        self._model = model
        self._variables = None
        publisher = self

        class _ParamsSource(WeightSource):
            """The params being pushed, as checkpoint tensors on the trainer's GPU."""

            def metadata(self) -> list[ParamMeta]:
                dtype = _torch_dtype(model.dtype)
                return [ParamMeta(name, dtype, shape) for name, shape in pushed_shapes(model)]

            def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
                for name, tensor in pushed_tensors(model, publisher._variables):
                    yield name, torch.from_numpy(tensor).to("cuda", non_blocking=True)

        # One trainer rank (0) and every server's workers.
        workers = check_int("workers_per_server", workers_per_server, low=1)
        if len(engine.urls) != 1:
            raise ValueError(
                "NCCLPublisher drives one server per NCCL group; give it an engine of one "
                f"server, got {len(engine.urls)}"
            )
        info = NCCLTrainerInitInfo(
            master_address=master_address,
            master_port=check_int("master_port", master_port, low=1),
            world_size=1 + workers,
            rank=0,
        )
        self._client = HTTPVLLMWeightSyncClient(engine.urls[0])
        self._transfer = NCCLTrainerWeightTransferEngine.trainer_init(
            info, client=self._client, source=_ParamsSource()
        )

    @property
    def version(self) -> int:
        """The version calls submitted now start under (the last one pushed)."""
        return self.engine.version

    def load(self, variables, version: int) -> None:
        """Broadcast `variables` into the server and serve them under `version`."""
        version = check_int("version", version, low=0)
        self._variables = variables
        try:
            self.engine.pause()
            try:
                self._transfer.send_weights()
            finally:
                self.engine.resume(version)
        finally:
            self._variables = None


def pushed_shapes(model) -> list[tuple[str, tuple[int, ...]]]:
    """The name and shape of each tensor a push of `model`'s params sends, in the order
    `pushed_tensors` yields them (vLLM sizes its receive buffers from this list)."""
    shapes = [(leaf.name, tuple(leaf.tensor_shape)) for leaf in hf._params.leaves(model.config)]
    if model.config.tied:
        shapes.append((hf._HEAD, dict(shapes)[hf._EMBED]))
    return shapes


def pushed_tensors(model, params) -> Iterator[tuple[str, np.ndarray]]:
    """Each checkpoint tensor of `params`, and for a tied model the embedding once more as the
    head, so that the server's reload reprocesses its head (see the module's docstring)."""
    for name, tensor in hf._tensors_of(model, params):
        yield name, tensor
        if model.config.tied and name == hf._EMBED:
            embedding = tensor
    if model.config.tied:
        yield hf._HEAD, embedding


def _torch_dtype(name: str):
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]
