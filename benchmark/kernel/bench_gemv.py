"""Small-batch GEMV (minisgl.kernel.triton.gemv) on the Qwen3-0.6B linear shapes (and
Qwen3-30B-A3B's dense ones, `a3b_*`), next to cuBLAS
(F.linear) and the device's copy bandwidth: the default tile, and with --sweep a sweep of tiles at
one row (how the default was chosen). At one row, the GEMV with the ops around it fused in (the
layer norm before it; SiLU-and-mul after the gate/up projection) against their own kernels.

Each measurement runs the shape's matmul over 28 distinct weights (one per layer, as a decode step
does; the LM head has one), inside a CUDA graph, so W streams from HBM and not from L2. The figure
is GB/s of W read.

    python benchmark/kernel/bench_gemv.py            # bf16 (H200)
    python benchmark/kernel/bench_gemv.py --json out.json
"""

import argparse
import itertools
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from bench_attention import copy_bandwidth
from triton.testing import do_bench_cudagraph

from minisgl.kernel.triton import fused_add_rmsnorm, silu_and_mul
from minisgl.kernel.triton.gemv import GemvConfig, Prologue, default_config, linear

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "offline"))
from common import write_json  # with the provenance every result records

NUM_LAYERS = 28
SHAPES = {  # name: (N, K, copies)
    "qkv_proj": (4096, 1024, NUM_LAYERS),
    "o_proj": (1024, 2048, NUM_LAYERS),
    "gate_up_proj": (6144, 1024, NUM_LAYERS),
    "down_proj": (1024, 3072, NUM_LAYERS),
    "lm_head": (151936, 1024, 1),
    "a3b_qkv_proj": (5120, 2048, 48),
    "a3b_o_proj": (2048, 4096, 48),
    "a3b_lm_head": (151936, 2048, 1),
}
FUSED = {
    "qkv_proj": "rmsnorm",
    "gate_up_proj": "rmsnorm + silu_and_mul",
    "lm_head": "rmsnorm",
    "a3b_qkv_proj": "rmsnorm",
    "a3b_lm_head": "rmsnorm",
}
DEFAULT_SHAPES = [name for name in SHAPES if not name.startswith("a3b_")]
SWEEP = [
    GemvConfig(block_n, block_k, num_warps)
    for block_n, block_k, num_warps in itertools.product(
        (1, 2, 4, 8, 16, 32), (256, 512, 1024, 2048), (4, 8)
    )
    if 1024 <= block_n * block_k <= 32768
]


def time_us(
    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    weights: list[torch.Tensor],
) -> float:
    """Microseconds for one pass of fn(x, w) over every weight."""
    return do_bench_cudagraph(lambda: [fn(x, w) for w in weights]) * 1e3


def fused_and_separate(
    ops: str, k: int, dtype: torch.dtype
) -> tuple[dict[str, Any], Callable, torch.Tensor]:
    """linear()'s arguments that put `ops` inside the GEMV, fn(x, w) running their own kernels
    around the GEMV, and x."""
    residual, norm_weight = (torch.randn(1, k, dtype=dtype, device="cuda") for _ in range(2))
    gated = ops.endswith("silu_and_mul")

    def separate(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        fused_add_rmsnorm(x, residual, norm_weight[0], 1e-6)
        return silu_and_mul(linear(x, w)) if gated else linear(x, w)

    prologue = Prologue(norm_weight[0], 1e-6, residual, torch.empty_like(residual))
    x = torch.randn(1, k, dtype=dtype, device="cuda")
    return {"prologue": prologue, "gated": gated}, separate, x


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--json", help="also write every measurement here")
    parser.add_argument("--sweep", action="store_true", help="also time a sweep of tiles (1 row)")
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=DEFAULT_SHAPES)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_gemv: no CUDA device, nothing to measure (the kernel needs a GPU)")
        return
    dtype = getattr(torch, args.dtype)
    copy_bw = copy_bandwidth()
    print(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s; {args.dtype}")
    results: list[dict] = []

    def record(shape: str, rows: int, kernel: str, us: float, nbytes: int) -> None:
        gbs = nbytes / us / 1e3
        results.append({"shape": shape, "rows": rows, "kernel": kernel, "us": us, "GB/s": gbs})
        print(f"{shape:>13} {rows:>4} {kernel:>34} {us:>9.1f} us {gbs:>7.0f} GB/s "
              f"{gbs * 1e9 / copy_bw:>5.0%}")  # fmt: skip

    for shape in args.shapes:
        n, k, copies = SHAPES[shape]
        weights = [torch.randn(n, k, dtype=dtype, device="cuda") / k**0.5 for _ in range(copies)]
        nbytes = copies * n * k * dtype.itemsize
        for rows in (1, 2, 4):
            x = torch.randn(rows, k, dtype=dtype, device="cuda")
            want = F.linear(x, weights[0]).float()
            error = (linear(x, weights[0]).float() - want).abs().max().item()
            assert error < 0.05, f"{shape} rows {rows}: max error {error}"
            record(shape, rows, "cuBLAS", time_us(F.linear, x, weights), nbytes)
            record(shape, rows, f"default {tuple(default_config(n, k))}",
                   time_us(linear, x, weights), nbytes)  # fmt: skip
        fused = FUSED.get(shape)
        if fused is not None:
            fused_kwargs, separate, fused_x = fused_and_separate(fused, k, dtype)
            record(shape, 1, f"{fused}, separate", time_us(separate, fused_x, weights), nbytes)
            us = time_us(partial(linear, **fused_kwargs), fused_x, weights)
            record(shape, 1, f"{fused} fused", us, nbytes)
        if not args.sweep:
            continue
        x = torch.randn(1, k, dtype=dtype, device="cuda")
        variants = [("sweep", x, {})]
        if fused is not None:
            variants.append((f"{fused} fused", fused_x, fused_kwargs))
        for name, x, kwargs in variants:
            sweep = []
            for config in SWEEP:
                if config.block_k > 2 * k or (kwargs.get("gated") and config.block_n == 1):
                    continue
                us = time_us(partial(linear, config=config, **kwargs), x, weights)
                sweep.append((us, config))
            for us, config in sorted(sweep)[:5]:
                record(shape, 1, f"{name} {tuple(config)}", us, nbytes)
    if args.json:
        write_json(args.json, {"measurements": results})


if __name__ == "__main__":
    main()
