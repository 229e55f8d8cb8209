import torch
import triton
import triton.language as tl

from .pdl import pdl_args, wait_for_previous

_MAX_BLOCK = 1024


@triton.jit
def silu_and_mul_rounded(gate, up, dtype: tl.constexpr):
    """silu(gate) * up, rounded to dtype where the reference rounds: the inputs (a matmul's fp32
    sums), silu's output, the product."""
    gate = gate.to(dtype).to(tl.float32)
    up = up.to(dtype).to(tl.float32)
    return ((gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * up).to(dtype)


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, stride_x, stride_out, n, BLOCK: tl.constexpr, USE_PDL: tl.constexpr
):
    wait_for_previous(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + n + cols, mask=mask, other=0.0)
    out = silu_and_mul_rounded(gate, up, gate.dtype)
    tl.store(out_ptr + row * stride_out + cols, out, mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] along the last dimension -> silu(gate) * up."""
    n = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    x_rows, out_rows = x.view(-1, 2 * n), out.view(-1, n)
    block = min(_MAX_BLOCK, triton.next_power_of_2(n))
    _silu_and_mul_kernel[(x_rows.shape[0], triton.cdiv(n, block))](
        x_rows,
        out_rows,
        x_rows.stride(0),
        out_rows.stride(0),
        n,
        BLOCK=block,
        **pdl_args(x.device),
    )
    return out
