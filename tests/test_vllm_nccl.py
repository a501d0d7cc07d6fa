"""What `NCCLPublisher` broadcasts into GPU vLLM servers, checked where no GPU is: the tensors
and the metadata vLLM sizes its receive buffers from (the broadcast itself runs in
`benchmarks/gpu.py` on a GPU)."""

from __future__ import annotations

import numpy as np
import pytest

from _checkpoint import tiny_qwen2
from dew.models import hf
from dew.models.hf import lora
from dew.serve._vllm_nccl import NCCLPublisher, pushed_shapes, pushed_tensors


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_a_push_sends_every_checkpoint_tensor_and_a_tied_models_head(tmp_path, tied):
    """vLLM's reload reprocesses only the layers that receive tensors: a tied model's push
    must send the embedding as the head too, or the server keeps its start-up head (the folder
    push writes it for the same reason); the metadata lists what the iteration yields, in
    order, or vLLM splits the stream wrongly."""
    model, params = hf.load(tiny_qwen2(tmp_path / "model", tied=tied))
    sent = list(pushed_tensors(model, params))
    names = [name for name, _ in sent]
    assert pushed_shapes(model) == [(name, tensor.shape) for name, tensor in sent]
    assert len(set(names)) == len(names)
    saved = [leaf.name for leaf in hf._params.leaves(model.config)]
    if tied:
        assert names == [*saved, "lm_head.weight"]
        tensors = dict(sent)
        np.testing.assert_array_equal(tensors["lm_head.weight"], tensors[hf._EMBED])
    else:
        assert names == saved
        assert "lm_head.weight" in names


def test_a_lora_run_s_model_is_refused_naming_the_push_it_takes(tmp_path):
    """An adapter is pushed through its folder (the engine's own load); before, a LoRA model
    handed to the publisher went on to NCCL's set-up and failed at its first push, on the
    LoRA model's missing `config`. The refusal comes before any server is reached, so none is
    started here (NCCL itself needs a GPU)."""
    model, _ = hf.load(tiny_qwen2(tmp_path / "model"))
    adapted = lora.LoRAModel(model, lora.LoRAConfig(rank=4, targets=("q_proj",)))
    with pytest.raises(ValueError) as refused:
        NCCLPublisher(None, adapted, master_port=29500)
    assert str(refused.value).startswith("NCCLPublisher broadcasts a checkpoint's full weights")
    assert "\n" not in str(refused.value)
