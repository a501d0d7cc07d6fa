"""Weight pushes into a GPU vLLM server: NCCL broadcast (`NCCLPublisher`) against the folder.

Where a CUDA GPU and vLLM's CUDA build exist, one vLLM server of a random Qwen2 checkpoint
starts on the GPU with vLLM's NCCL weight-transfer engine (`NCCL_SERVER_FLAGS`), and the same
params are pushed `--pushes` times each way: broadcast over NCCL from the trainer's process
(`dew.serve.vllm.NCCLPublisher`), and written as a checkpoint folder that the server reloads
(`VLLMEngine.load`, the CPU path). The best time and the rate in GiB/s of each are printed,
and the server's log-probs after an NCCL push are compared with those after a folder push of
the same params, so a broadcast that lands the wrong tensors fails the run.

Without a GPU it says so and prints only the params' size: the CPU path is measured by
`benchmarks/engines.py`.

    python benchmarks/vllm_nccl_push.py [--width 1024 --layers 8 --pushes 5]
    python benchmarks/vllm_nccl_push.py --smoke
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile
import time

import jax
import numpy as np
import trio

from dew.models import hf
from dew.serve.vllm import NCCL_SERVER_FLAGS, NCCLPublisher, VLLMEngine, free_port

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))
from _checkpoint import tiny_qwen2  # noqa: E402


def gpu() -> bool:
    from dew._torch_media import hide_broken_media_packages

    hide_broken_media_packages()
    import torch

    return torch.cuda.is_available()


async def logprobs(engine: VLLMEngine) -> np.ndarray:
    async with engine:
        call = await engine.generate(np.arange(8, dtype=np.int32), max_tokens=16, key=0)
    return call.logprobs


def best(push, pushes: int) -> float:
    times = []
    for _ in range(pushes):
        start = time.perf_counter()
        push()
        times.append(time.perf_counter() - start)
    return min(times)


def main(args) -> None:
    with tempfile.TemporaryDirectory() as root:
        folder = tiny_qwen2(pathlib.Path(root) / "model", hidden=args.width, layers=args.layers)
        model, params = hf.load(folder)
        size = sum(leaf.nbytes for leaf in jax.tree.leaves(params))
        print(f"params: {size / 2**20:.2f} MiB of float32 ({args.layers} layers of {args.width})")
        if not gpu():
            print("no CUDA GPU on this machine: the NCCL push is not measured here")
            return
        arguments = [*NCCL_SERVER_FLAGS, "--gpu-memory-utilization", "0.3"]
        with VLLMEngine.start(folder, max_model_len=64, model=model, arguments=arguments) as engine:
            publisher = NCCLPublisher(engine, model, master_port=free_port())
            version = iter(range(1, 1000))
            nccl = best(lambda: publisher.load(params, next(version)), args.pushes)
            after_nccl = trio.run(logprobs, engine)
            folder_push = best(lambda: engine.load(params, next(version)), args.pushes)
            after_folder = trio.run(logprobs, engine)
        np.testing.assert_allclose(after_nccl, after_folder, atol=1e-5)
        for name, seconds in (("NCCL broadcast", nccl), ("checkpoint folder", folder_push)):
            rate = size / seconds / 2**30
            print(f"  {name:17s} {seconds:.3f} s ({rate:.2f} GiB/s, best of {args.pushes})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny model, one push each")
    parser.add_argument("--width", type=int, default=1024, help="hidden width (1024)")
    parser.add_argument("--layers", type=int, default=8, help="layers (8)")
    parser.add_argument("--pushes", type=int, default=5, help="pushes each way (5)")
    args = parser.parse_args()
    if args.smoke:
        args.width, args.layers, args.pushes = 128, 2, 1
    main(args)
