"""Decode attention's launch at ragged large batches (contexts 100-2,048, the offline benchmark's
mix): keys per step (BLOCK_N), warps, pipeline stages and splits, each timed inside a CUDA graph
and reported as a share of the copy bandwidth, next to the default launch with and without the
longest-first order. It chose the tile for batches above PREFETCH_MAX_BATCH (RESULTS.md, ninth
session).

    python benchmark/kernel/sweep_decode_attention.py            # bf16, batches 256 and 128
"""

import argparse
import functools
import itertools
import random

import torch
import triton
from bench_attention import HEAD_DIM, KV_HEADS, QO_HEADS, Setup, copy_bandwidth
from triton.testing import do_bench_cudagraph

from minisgl.kernel.triton import decode_attention, decode_num_splits, num_sms
from minisgl.kernel.triton.decode_attention import DecodeLaunch

BLOCK_NS, WARPS, STAGES = (32, 64, 128), (4, 8), (2, 3, 4)


def sweep(ctx_lens: list[int], copy_bw: float, top: int) -> None:
    bs, dtype = len(ctx_lens), torch.bfloat16
    setup = Setup(ctx_lens, 1, dtype)
    q = torch.randn(bs, QO_HEADS, HEAD_DIM, dtype=dtype, device="cuda")
    batch = setup.batch(1)
    kernel_args, order = setup.kernel_args(batch), batch.longest_first
    counters = torch.zeros(bs * KV_HEADS, dtype=torch.int32, device="cuda")
    default_splits = decode_num_splits(bs, KV_HEADS, num_sms(q.device))
    default = functools.partial(decode_attention, q, *kernel_args, default_splits, counters, order)
    unordered = functools.partial(decode_attention, q, *kernel_args, default_splits, counters)
    want = default().float()
    kv_bytes = 2 * sum(ctx_lens) * KV_HEADS * HEAD_DIM * dtype.itemsize
    results = []
    for tile in itertools.product(BLOCK_NS, WARPS, STAGES, sorted({1, 2, 4, default_splits})):
        *launch, splits = tile
        run = functools.partial(
            decode_attention, q, *kernel_args, splits, counters, order, DecodeLaunch(*launch)
        )
        try:
            error = (run().float() - want).abs().max().item()
            results.append((do_bench_cudagraph(run) * 1e-3, tile, error))
        except triton.runtime.errors.OutOfResources:
            continue
    for name, fn in (("in the batch's order", unordered), ("longest first", default)):
        seconds = do_bench_cudagraph(fn) * 1e-3
        print(
            f"bs {bs}, default launch ({default_splits} splits), {name}: {seconds * 1e6:.1f} us, "
            f"{kv_bytes / seconds / copy_bw:.1%} of copy"
        )
    for seconds, (block_n, warps, stages, splits), error in sorted(results)[:top]:
        print(
            f"bs {bs:>3} BLOCK_N {block_n:>3} warps {warps} stages {stages} splits {splits}: "
            f"{seconds * 1e6:7.1f} us {kv_bytes / seconds / copy_bw:6.1%} of copy, "
            f"max difference from the default {error:.2e}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[256, 128])
    parser.add_argument("--top", type=int, default=8, help="launches printed per batch size")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("sweep_decode_attention: no CUDA device, nothing to measure")
        return
    copy_bw = copy_bandwidth()
    print(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s")
    rng = random.Random(0)
    for bs in args.batch_sizes:
        sweep([rng.randint(100, 2048) for _ in range(bs)], copy_bw, args.top)


if __name__ == "__main__":
    main()
