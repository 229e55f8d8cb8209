"""Host time to schedule one decode step: reserve each request's next KV page, take its page-table
write, build the batch, upload it (one host-to-device copy; the forward applies the write and
gathers the inputs) and build its sampling arguments, as every decode step does. In the
fourth session this host work, not the GPU, set the step time of one request on an H200
(benchmark/RESULTS.md), so it is timed here on its own, with no model.

    python benchmark/host/bench_decode_step.py                  # the CPU (no GPU needed)
    python benchmark/host/bench_decode_step.py --device cuda
    python benchmark/host/bench_decode_step.py --temperature 0.6   # sampled, as bench.py's run
"""

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from minisgl.core import EngineLayout, Req, SamplingParams
from minisgl.engine.engine import upload
from minisgl.engine.sampler import Sampler
from minisgl.kvcache.manager import KVCacheManager
from minisgl.scheduler.batch_builder import build_batch
from minisgl.utils.torch_utils import PinnedStaging

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "offline"))
from common import run_device  # one line, not a traceback, where the device is missing

VOCAB_SIZE = 151936  # Qwen3's: where top-k is off, the sampler sends the vocabulary size


def time_steps(
    batch_size: int, device: torch.device, steps: int, context: int, temperature: float
) -> list[float]:
    """Seconds per scheduled decode step for batch_size requests of `context` tokens each."""
    width = context + steps + 1
    layout = EngineLayout(batch_size * width, 1, batch_size, width, width, width, VOCAB_SIZE)
    kv = KVCacheManager(batch_size * width, 1, width, "radix")
    params = SamplingParams(temperature=temperature)
    reqs = [Req(i, [1] * context, params, seed=i, slot=i) for i in range(batch_size)]
    token_table = torch.zeros((batch_size + 1, width), dtype=torch.int32, device=device)
    sampler = Sampler(VOCAB_SIZE, device, token_table)
    staging = PinnedStaging() if device.type == "cuda" else None  # as the engine's eager steps
    for req in reqs:
        kv.admit(req.slot, [])
        if not kv.reserve(req.slot, context):
            raise RuntimeError("the pool is sized to hold every request")
    kv.take_page_writes()  # the prompts' pages: written by their prefill, not timed here
    lens = [context] * batch_size
    seconds = []
    for _ in range(steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        if not kv.reserve_all([(req.slot, n + 1) for req, n in zip(reqs, lens, strict=True)]):
            raise RuntimeError("the pool is sized to hold every request")
        writes = kv.take_page_writes()
        batch = build_batch(reqs, lens, [1] * batch_size, layout, None, writes)
        upload(batch.inputs, device, staging)  # an eager step's copy; a graph copies alike
        sampler.prepare(batch)
        seconds.append(time.perf_counter() - start)
        assert batch.is_decode and batch.num_tokens == batch_size
        lens = [n + 1 for n in lens]
    return seconds


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    args = parser.parse_args(argv)
    device = run_device(args.device)
    torch.set_num_threads(1)
    rows = []
    print(f"{'batch':>6} {'median us/step':>15} {'p90 us/step':>12}")
    for batch_size in (1, 16, 256):
        seconds = time_steps(batch_size, device, args.steps, 256, args.temperature)
        seconds = seconds[args.steps // 10 :]  # the first steps warm the caches up
        row = {
            "batch": batch_size,
            "median_us": 1e6 * statistics.median(seconds),
            "p90_us": 1e6 * statistics.quantiles(seconds, n=10)[-1],
        }
        print(f"{batch_size:>6} {row['median_us']:>15.1f} {row['p90_us']:>12.1f}")
        rows.append(row)
    return rows


if __name__ == "__main__":
    main()
