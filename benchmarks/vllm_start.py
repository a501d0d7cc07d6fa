"""vLLM servers forked from dew's zygote against fresh processes: CPU-seconds and seconds to ready.

Starts `--engines` engines of `--servers` servers each, one after the other (as a notebook, a
resumed run or a test suite does), of one tiny random Qwen2 checkpoint, and draws one call from
each engine (a server's first call with log-probs is where torch probes the CPU). Each way runs
in a Python process of its own: every server a fresh process (DEW_VLLM_ZYGOTE=0), then every
server forked from a zygote that imported vLLM once (`dew.serve._vllm_fork`). A way's
CPU-seconds are its process's, its servers' and its zygote's, counted once it has exited.

    python benchmarks/vllm_start.py            # 3 engines of 2 servers, each way
    python benchmarks/vllm_start.py --smoke    # 1 engine of 1 server, as dew starts it, here
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np
import trio

from dew.serve.vllm import VLLMEngine

# The tests' tiny checkpoint maker (transformers' save_pretrained of a random Qwen2).
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))
from _checkpoint import tiny_qwen2  # noqa: E402

WAYS = {"fresh": "0", "zygote": "1"}


def start_engines(engines: int, servers: int) -> list[float]:
    """Seconds each engine took from `start` to its first call's answer."""
    seconds = []
    with tempfile.TemporaryDirectory() as folder:
        root = pathlib.Path(folder)
        checkpoint = tiny_qwen2(root / "tiny", seed=0)
        for index in range(engines):
            began = time.perf_counter()
            with VLLMEngine.start(
                checkpoint, servers=servers, max_model_len=128, work_dir=root / f"e{index}"
            ) as engine:

                async def draw(engine=engine, key=index) -> None:
                    async with engine:
                        prompt = np.array([0, 1, 17, 42], np.int32)
                        await engine.generate(prompt, max_tokens=4, key=key)

                trio.run(draw)
                seconds.append(time.perf_counter() - began)
    return seconds


def measure(way: str, engines: int, servers: int) -> dict:
    """Run one way in a process of its own: its seconds and every CPU-second it caused."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    began = time.perf_counter()
    done = subprocess.run(
        [sys.executable, __file__, "--way", way, f"--engines={engines}", f"--servers={servers}"],
        capture_output=True,
        text=True,
        env={**os.environ, "DEW_VLLM_ZYGOTE": WAYS[way]},
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"the {way} run failed:\n{done.stderr[-3000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    ready = json.loads(done.stdout.strip().splitlines()[-1])
    return {"cpu": cpu, "wall": time.perf_counter() - began, "ready": ready}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, default=3)
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--way", choices=sorted(WAYS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # dew's tests' layout
    if args.way:  # one way, in the process `measure` started
        print(json.dumps(start_engines(args.engines, args.servers)))
        return
    if args.smoke:
        (seconds,) = start_engines(1, 1)
        print(f"1 engine of 1 server, as dew starts it: ready and answered in {seconds:.1f} s")
        return
    print(f"{args.engines} engines of {args.servers} tiny servers, one after the other")
    print(f"{'way':>8} {'CPU-s':>8} {'wall s':>8}  seconds to each engine's first answer")
    results = {way: measure(way, args.engines, args.servers) for way in WAYS}
    for way, result in results.items():
        ready = " ".join(f"{s:.1f}" for s in result["ready"])
        print(f"{way:>8} {result['cpu']:8.1f} {result['wall']:8.1f}  {ready}")
    ratio = results["zygote"]["cpu"] / results["fresh"]["cpu"]
    print(f"zygote / fresh CPU-seconds: {ratio:.2f}")


if __name__ == "__main__":
    main()
