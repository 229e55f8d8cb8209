"""Decode attention's launch at ragged large batches (contexts 100-2,048, the offline benchmark's
mix): keys per step (BLOCK_N), warps, pipeline stages and splits, each timed inside a CUDA graph
and reported as a share of the copy bandwidth, next to the default launch. It chose the tile for
batches above PREFETCH_MAX_BATCH (RESULTS.md, ninth session).

    python benchmark/kernel/sweep_decode_attention.py            # bf16, batches 256 and 128
"""

import argparse
import functools
import itertools
import math
import random

import torch
import triton
from bench_attention import HEAD_DIM, KV_HEADS, QO_HEADS, Setup, copy_bandwidth
from triton.testing import do_bench_cudagraph

from minisgl.kernel.triton import decode_attention, decode_num_splits, num_sms
from minisgl.kernel.triton.attention_block import dot_block
from minisgl.kernel.triton.decode_attention import _split_kernel
from minisgl.kernel.triton.pdl import pdl_args

BLOCK_NS, WARPS, STAGES = (32, 64, 128), (4, 8), (2, 3, 4)


def launch(
    q: torch.Tensor, args: tuple[torch.Tensor, ...], counters: torch.Tensor,
    splits: int, block_n: int, warps: int, stages: int,
) -> torch.Tensor:  # fmt: skip
    """decode_attention's launch (without the small-batch prefetch) with the given parameters."""
    k_cache, v_cache, page_table, slots, seq_lens = args
    bs, qo_heads, head_dim = q.shape
    group, block_d = qo_heads // KV_HEADS, dot_block(head_dim)
    mid_o = torch.empty((bs, qo_heads, splits, block_d), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty((bs, qo_heads, splits), dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    _split_kernel[(bs, KV_HEADS, splits)](
        q, k_cache, v_cache, page_table, slots, seq_lens, mid_o, mid_lse, out, counters,
        head_dim**-0.5 * math.log2(math.e),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0),
        k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), page_table.stride(0),
        GROUP=group, NUM_SPLITS=splits, HEAD_DIM=head_dim, BLOCK_H=dot_block(group),
        BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=block_d, BLOCK_N=block_n,
        PREFETCH=False, num_warps=warps, num_stages=stages, **pdl_args(q.device),
    )  # fmt: skip
    return out


def sweep(ctx_lens: list[int], copy_bw: float, top: int) -> None:
    bs, dtype = len(ctx_lens), torch.bfloat16
    setup = Setup(ctx_lens, 1, dtype)
    q = torch.randn(bs, QO_HEADS, HEAD_DIM, dtype=dtype, device="cuda")
    kernel_args = setup.kernel_args(setup.batch(1))
    counters = torch.zeros(bs * KV_HEADS, dtype=torch.int32, device="cuda")
    default_splits = decode_num_splits(bs, KV_HEADS, num_sms(q.device))
    default = functools.partial(decode_attention, q, *kernel_args, default_splits, counters)
    want = default().float()
    kv_bytes = 2 * sum(ctx_lens) * KV_HEADS * HEAD_DIM * dtype.itemsize
    results = []
    for tile in itertools.product(BLOCK_NS, WARPS, STAGES, sorted({1, 2, 4, default_splits})):
        block_n, warps, stages, splits = tile
        run = functools.partial(launch, q, kernel_args, counters, splits, block_n, warps, stages)
        try:
            error = (run().float() - want).abs().max().item()
            results.append((do_bench_cudagraph(run) * 1e-3, tile, error))
        except triton.runtime.errors.OutOfResources:
            continue
    seconds = do_bench_cudagraph(default) * 1e-3
    print(
        f"bs {bs}, default launch ({default_splits} splits): {seconds * 1e6:.1f} us, "
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
