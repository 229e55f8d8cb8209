"""y = x @ W^T (+ b) for one or two rows: the matmul of a tiny decode batch, which only has to
stream W once. cuBLAS picks GEMM tiles for it and, on the Qwen3-0.6B layer shapes on an H200,
reads W at 330-2,100 GB/s; here each program owns a few output features and reads their rows of W
in wide, contiguous chunks, with enough programs to keep every SM loading.

    W [N, K]:  | rows n0..n0+BLOCK_N (one program) | ...      x [M, K] is re-read from cache

Products are summed into a [BLOCK_N, BLOCK_K] fp32 tile and reduced across K once at the end, so
the loop body is loads and multiply-adds only. The first tile of W is loaded before waiting for the
previous kernel (see pdl.py): those loads overlap its tail.

A prologue computes x from what the op before the matmul would have read: rmsnorm(x + residual) for
the projections after a layer norm. At one row that op is a kernel of a few microseconds whose
output is a few KiB, so computing it again in every program (from L2) costs less than launching it.
Where another op reads the normed row too (a MoE layer's experts, after its router's matmul), the
first program also stores it.

The gated epilogue computes silu(gate) * up for W = [W_gate; W_up] (the gate/up projection): a
program reads the rows of both halves for its features, interleaved, so the activation costs no
extra traffic and the down projection reads a finished input.

At one row a GEMV that reads little (a MoE layer's router) may also pull a later kernel's weight
into L2 before its wait (`warm`, l2_warm.py).
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .activation import silu_and_mul_rounded
from .l2_warm import warm_args, warm_l2
from .norm import add_rounded, rms_scaled
from .pdl import pdl_args, wait_for_previous

_FEW_FEATURES = 2048  # o_proj and down_proj of Qwen3-0.6B: 1024 output features
_MANY_FEATURES = 65536  # an LM head (Qwen3: 151,936); the QKV and gate/up projections have fewer


def weight_eviction(rows: int) -> str:
    """The weights' L2 policy: read by one row, a tile is read once a step, so it goes first and
    leaves the cache to the rest (one request on an H100: Qwen3-30B-A3B 2.845 -> 2.792 ms a
    step, Llama-3.1-8B 5.403 -> 5.378); more rows may read it again from L2."""
    return "evict_first" if rows == 1 else ""


class GemvConfig(NamedTuple):
    block_n: int  # output features per program
    block_k: int  # elements of each W row loaded per iteration
    num_warps: int


@triton.jit
def _input_chunk(
    x_row, residual_row, norm_w_ptr, k, k_mask, inv_rms,
    NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):  # fmt: skip
    """Elements k of the matmul's input, rounded where the unfused kernels round:
    rmsnorm(x + residual) given the row's 1 / rms."""
    x = tl.load(x_row + k, mask=k_mask, other=0.0)
    if NORM:
        if HAS_RESIDUAL:
            residual = tl.load(residual_row + k, mask=k_mask, other=0.0)
            x = add_rounded(x, residual)
        weight = tl.load(norm_w_ptr + k, mask=k_mask, other=0.0).to(tl.float32)
        x = rms_scaled(x.to(tl.float32), inv_rms, weight, x.dtype).to(x.dtype)
    return x


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, residual_ptr, residual_out_ptr, norm_w_ptr, normed_out_ptr, eps,
    N, K, stride_x, stride_w, stride_y, stride_residual, warm_ptr, warm_bytes,
    ROWS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GATED: tl.constexpr, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, NORMED_OUT: tl.constexpr,
    BLOCK_ROW: tl.constexpr, W_EVICTION: tl.constexpr, WARM: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    warm_l2(warm_ptr, warm_bytes, WARM)  # a weight: read before the wait (pdl.py)
    # N: output features. BLOCK_N rows of W per program; gated, rows (gate_j, up_j) alternate
    # (W_up starts N rows below W_gate) and the program writes BLOCK_N // 2 features
    r = tl.arange(0, BLOCK_N)
    if GATED:
        n = tl.program_id(0) * (BLOCK_N // 2) + r // 2
        w_row = n + (r % 2) * N
    else:
        n = tl.program_id(0) * BLOCK_N + r
        w_row = n
    n_mask = n < N
    k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + w_row[:, None].to(tl.int64) * stride_w
    w_first = tl.load(
        w_rows + k[None, :],
        mask=n_mask[:, None] & (k < K)[None, :],
        other=0.0,
        eviction_policy=W_EVICTION,
    )
    wait_for_previous(USE_PDL)
    for row in tl.static_range(ROWS):  # a second row re-reads W (after the first tile) from L2
        x_row = x_ptr + row * stride_x
        residual_row = residual_ptr + row * stride_residual
        inv_rms = 1.0
        if NORM:  # the whole row first, for its rms; one program keeps x + residual
            cols = tl.arange(0, BLOCK_ROW)
            x = tl.load(x_row + cols, mask=cols < K, other=0.0)
            if HAS_RESIDUAL:
                residual = tl.load(residual_row + cols, mask=cols < K, other=0.0)
                x = add_rounded(x, residual)
                if tl.program_id(0) == 0:
                    tl.store(residual_out_ptr + row * K + cols, x, mask=cols < K)
            xf = x.to(tl.float32)
            inv_rms = tl.rsqrt(tl.sum(xf * xf, 0) / K + eps)
            if NORMED_OUT and tl.program_id(0) == 0:
                normed = _input_chunk(
                    x_row, residual_row, norm_w_ptr, cols, cols < K, inv_rms, NORM, HAS_RESIDUAL
                )
                tl.store(normed_out_ptr + row * K + cols, normed, mask=cols < K)
        x = _input_chunk(x_row, residual_row, norm_w_ptr, k, k < K, inv_rms, NORM, HAS_RESIDUAL)
        acc = w_first.to(tl.float32) * x.to(tl.float32)[None, :]
        for k0 in range(BLOCK_K, K, BLOCK_K):
            k_mask = k0 + k < K
            w = tl.load(
                w_rows + k0 + k[None, :],
                mask=n_mask[:, None] & k_mask[None, :],
                other=0.0,
                eviction_policy=W_EVICTION,
            )
            x = _input_chunk(
                x_row, residual_row, norm_w_ptr, k0 + k, k_mask, inv_rms, NORM, HAS_RESIDUAL
            )
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        y = tl.sum(acc, 1)
        if HAS_BIAS:
            y += tl.load(b_ptr + w_row, mask=n_mask, other=0.0).to(tl.float32)
        if GATED:
            gate, up = tl.split(tl.reshape(y, [BLOCK_N // 2, 2]))
            first = tl.program_id(0) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
            out = silu_and_mul_rounded(gate, up, y_ptr.dtype.element_ty)
            tl.store(y_ptr + row * stride_y + first, out, mask=first < N)
        else:
            tl.store(y_ptr + row * stride_y + n, y.to(y_ptr.dtype.element_ty), mask=n_mask)


def use_gemv(rows: int, n: int) -> bool:
    """Where this kernel beats cuBLAS (bench_gemv.py on an H200, Qwen3-0.6B shapes): one row,
    and two rows of a matrix with few output features (cuBLAS leaves most SMs idle on those)."""
    return rows == 1 or (rows == 2 and n <= _FEW_FEATURES)


def default_config(n: int, k: int, norm: bool = False, gated: bool = False) -> GemvConfig:
    """The tile for W [n, k] (n: rows of W), from bench_gemv.py's sweeps on an H200 (one row,
    kernels launched with PDL; each figure's run is in benchmark/RESULTS.md): wide programs for
    many output features, long rows per program for few, and the fused variants their own."""
    if gated:  # gate/up + SiLU: 122.2 us against 129.1 (Qwen3-0.6B's 28 layers)
        block_n, block_k, num_warps = 8, 512, 4
    elif norm and n > _MANY_FEATURES:  # an LM head + final norm: 70.6 us against 81.2 (0.6B)
        block_n, block_k, num_warps = 16, 512, 4
    elif norm and n > _FEW_FEATURES and 1024 < k <= 2048:
        # Qwen3-30B-A3B's QKV + norm: 327.0 us against 380.1 (48 layers); at K 4,096 Llama-3.1-8B's
        # step took 4.25 ms with it, 4.21 with the next tile
        block_n, block_k, num_warps = 8, 512, 8
    elif norm and n > _FEW_FEATURES:  # QKV + norm: 96.5 us against 105.4 at (16, 512, 8) (0.6B)
        block_n, block_k, num_warps = 16, 1024, 4
    elif n > _FEW_FEATURES:
        block_n, block_k, num_warps = 16, 512, 8
    elif k <= 2048:
        # o_proj and down_proj, chosen in the model, where the next kernel needs SMs free to start
        # its loads: a 0.6B step took 653.6 us against 663.8 with tiles that fill every SM
        block_n, block_k, num_warps = 8, 2048, 8
    elif n > 1024:  # Qwen3-30B-A3B's o_proj (K 4,096): 243.3 us against 295.4 (48 layers)
        block_n, block_k, num_warps = 1, 1024, 4
    else:
        block_n, block_k, num_warps = 2, 2048, 8
    return GemvConfig(block_n, min(block_k, max(16, triton.next_power_of_2(k))), num_warps)


class Prologue(NamedTuple):
    """An op fused in front of the matmul, so that its input never goes through memory."""

    norm_weight: torch.Tensor | None = None  # rmsnorm(x [+ residual]) with these weights
    eps: float = 0.0
    residual: torch.Tensor | None = None  # added to x first; the sum goes to residual_out
    residual_out: torch.Tensor | None = None  # [rows, K], contiguous
    normed_out: torch.Tensor | None = None  # [rows, K], contiguous: receives the normed x


_NO_PROLOGUE = Prologue()


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: GemvConfig | None = None,
    prologue: Prologue = _NO_PROLOGUE,
    gated: bool = False,
    warm: torch.Tensor | None = None,
) -> torch.Tensor:
    """F.linear for x of a few rows ([rows, K], last dimension contiguous), after the prologue's
    op on x; gated: W = [W_gate; W_up] and the result is silu(x @ W_gate^T) * (x @ W_up^T);
    warm: a later kernel's weight (contiguous), pulled into L2 at one row (l2_warm.py)."""
    rows = x.shape[0]
    w_rows, k = weight.shape
    assert weight.stride(1) == 1 and x.stride(1) == 1 and x.shape[1] == k
    norm, residual, residual_out = prologue.norm_weight, prologue.residual, prologue.residual_out
    assert (residual is None) == (residual_out is None) and (norm is not None or residual is None)
    assert residual_out is None or residual_out.is_contiguous()
    normed_out = prologue.normed_out
    assert normed_out is None or (norm is not None and normed_out.is_contiguous())
    block_n, block_k, num_warps = config or default_config(w_rows, k, norm is not None, gated)
    n = w_rows // 2 if gated else w_rows
    features_per_program = block_n // 2 if gated else block_n
    assert not gated or (w_rows % 2 == 0 and block_n % 2 == 0)
    y = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, features_per_program),)](
        x, weight, weight if bias is None else bias, y, x if residual is None else residual,
        x if residual_out is None else residual_out, weight if norm is None else norm,
        x if normed_out is None else normed_out,
        prologue.eps, n, k, x.stride(0), weight.stride(0), y.stride(0),
        0 if residual is None else residual.stride(0),
        ROWS=rows, HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k,
        GATED=gated, NORM=norm is not None, HAS_RESIDUAL=residual is not None,
        NORMED_OUT=normed_out is not None,
        BLOCK_ROW=triton.next_power_of_2(k) if norm is not None else 1,
        W_EVICTION=weight_eviction(rows), num_warps=num_warps, **warm_args(warm, rows, x),
        **pdl_args(x.device),
    )  # fmt: skip
    return y
