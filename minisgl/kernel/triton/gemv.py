"""y = x @ W^T (+ b) for one or two rows: the matmul of a tiny decode batch, which only has to
stream W once. cuBLAS picks GEMM tiles for it and, on the Qwen3-0.6B layer shapes on an H200,
reads W at 330-2,100 GB/s; here each program owns a few output features and reads their rows of W
in wide, contiguous chunks, with enough programs to keep every SM loading.

    W [N, K]:  | rows n0..n0+BLOCK_N (one program) | ...      x [M, K] is re-read from cache

Products are summed into a [BLOCK_N, BLOCK_K] fp32 tile and reduced across K once at the end, so
the loop body is loads and multiply-adds only. The first tile of W is loaded before waiting for the
previous kernel (see pdl.py): those loads overlap its tail.
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .pdl import pdl_args, wait_for_previous

_FEW_FEATURES = 2048  # o_proj and down_proj of Qwen3-0.6B: 1024 output features


class GemvConfig(NamedTuple):
    block_n: int  # output features per program
    block_k: int  # elements of each W row loaded per iteration
    num_warps: int


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, N, K, stride_x, stride_w, stride_y,
    ROWS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + n[:, None].to(tl.int64) * stride_w
    w_first = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & (k < K)[None, :], other=0.0)
    wait_for_previous(USE_PDL)
    for row in tl.static_range(ROWS):  # a second row re-reads W (after the first tile) from L2
        x = tl.load(x_ptr + row * stride_x + k, mask=k < K, other=0.0)
        acc = w_first.to(tl.float32) * x.to(tl.float32)[None, :]
        for k0 in range(BLOCK_K, K, BLOCK_K):
            k_mask = k0 + k < K
            w = tl.load(w_rows + k0 + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            x = tl.load(x_ptr + row * stride_x + k0 + k, mask=k_mask, other=0.0)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        y = tl.sum(acc, 1)
        if HAS_BIAS:
            y += tl.load(b_ptr + n, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * stride_y + n, y.to(y_ptr.dtype.element_ty), mask=n_mask)


def use_gemv(rows: int, n: int) -> bool:
    """Where this kernel beats cuBLAS (bench_gemv.py on an H200, Qwen3-0.6B shapes): one row,
    and two rows of a matrix with few output features (cuBLAS leaves most SMs idle on those)."""
    return rows == 1 or (rows == 2 and n <= _FEW_FEATURES)


def default_config(n: int, k: int) -> GemvConfig:
    """The tile for W [n, k], from bench_gemv.py's sweep on an H200 (one row): with few output
    features, long rows per program keep enough bytes in flight; with many, more programs do."""
    block_n, block_k, num_warps = (2, 2048, 8) if n <= _FEW_FEATURES else (8, 512, 4)
    return GemvConfig(block_n, min(block_k, max(16, triton.next_power_of_2(k))), num_warps)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """F.linear for x of a few rows ([rows, K], last dimension contiguous)."""
    rows, k = x.shape
    n = weight.shape[0]
    assert weight.stride(1) == 1 and x.stride(1) == 1
    block_n, block_k, num_warps = config or default_config(n, k)
    y = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, weight if bias is None else bias, y, n, k, x.stride(0), weight.stride(0), y.stride(0),
        ROWS=rows, HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=num_warps, **pdl_args(x.device),
    )  # fmt: skip
    return y
