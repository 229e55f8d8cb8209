"""The matmuls with few output features (Qwen3-0.6B's o_proj and down_proj: 1,024), each with the
residual add + RMSNorm that reads its output, as the decoder runs them: cuBLAS's matmul against
partial sums over slices of K (`linear_split_k`: one batched matmul) that the norm adds up. How
`minisgl.kernel`'s split-K rule (rows and slices) was chosen.

Each figure is microseconds for 28 layers' distinct weights in one CUDA graph, so W streams from
HBM and not from L2.

    python benchmark/kernel/bench_split_k.py
"""

import argparse
import functools
from collections.abc import Callable

import torch
from triton.testing import do_bench_cudagraph

from minisgl.kernel import torch_ops
from minisgl.kernel.triton import fused_add_rmsnorm

NUM_LAYERS = 28
SHAPES = {"o_proj": (1024, 2048), "down_proj": (1024, 3072)}  # name: (N, K)
EPS = 1e-6


def matmul_and_norm(
    x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, splits: int, w: torch.Tensor
) -> torch.Tensor:
    """One layer's o_proj (or down_proj) and the residual add + RMSNorm after it; splits=1:
    cuBLAS's matmul."""
    y = torch_ops.linear(x, w) if splits == 1 else torch_ops.linear_split_k(x, w, splits)
    return fused_add_rmsnorm(y, residual, norm_weight, EPS)


def time_us(step: Callable[[torch.Tensor], torch.Tensor], weights: list[torch.Tensor]) -> float:
    return do_bench_cudagraph(lambda: [step(w) for w in weights]) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rows", type=int, nargs="+", default=[3, 8, 16, 32, 64, 128, 256, 512, 1024, 2048]
    )
    parser.add_argument("--splits", type=int, nargs="+", default=[2, 4, 8])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_split_k: no CUDA device, nothing to measure")
        return
    dtype, device = torch.bfloat16, torch.device("cuda")
    torch.manual_seed(0)
    print("us for 28 layers: matmul + residual add + RMSNorm; ratio = cuBLAS / split")
    for name, (n, k) in SHAPES.items():
        weights = [
            torch.randn(n, k, dtype=dtype, device=device) / k**0.5 for _ in range(NUM_LAYERS)
        ]
        norm_weight = torch.ones(n, dtype=dtype, device=device)
        for rows in args.rows:
            x = torch.randn(rows, k, dtype=dtype, device=device)
            residual = torch.randn(rows, n, dtype=dtype, device=device)
            layer = functools.partial(matmul_and_norm, x, residual, norm_weight)
            baseline = time_us(functools.partial(layer, 1), weights)
            cells = [f"{name:>9} rows {rows:>4}: cuBLAS {baseline:6.1f}"]
            for splits in args.splits:
                us = time_us(functools.partial(layer, splits), weights)
                cells.append(f"{splits} slices {us:6.1f} ({baseline / us:.2f}x)")
            print(", ".join(cells), flush=True)


if __name__ == "__main__":
    main()
