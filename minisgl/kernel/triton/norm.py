import torch
import triton
import triton.language as tl

from .pdl import pdl_args, wait_for_previous


@triton.jit
def add_rounded(x, residual):
    """x + residual in fp32, rounded to x's dtype as torch's add_ rounds."""
    return (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)


@triton.jit
def rms_scaled(xf, inv_rms, weight, dtype: tl.constexpr):
    """rmsnorm of fp32 xf given 1 / rms, in fp32: rounded to dtype before the (fp32) weight
    multiply, as the reference (and Hugging Face) rounds."""
    return (xf * inv_rms).to(dtype).to(tl.float32) * weight


@triton.jit
def _rmsnorm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    stride_part,
    stride_x,
    stride_residual,
    stride_out,
    n,
    eps,
    NUM_PARTS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    weight = tl.load(weight_ptr + cols, mask=mask).to(tl.float32)
    wait_for_previous(USE_PDL)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if NUM_PARTS > 1:  # partial sums of x: added in fp32 and rounded once, as a matmul rounds
        total = x.to(tl.float32)
        for part in tl.static_range(1, NUM_PARTS):
            x_part_ptrs = x_ptr + part * stride_part + row * stride_x + cols
            total += tl.load(x_part_ptrs, mask=mask, other=0.0).to(tl.float32)
        x = total.to(x_ptr.dtype.element_ty)
    if HAS_RESIDUAL:
        residual_ptrs = residual_ptr + row * stride_residual + cols
        residual = tl.load(residual_ptrs, mask=mask, other=0.0)
        x = add_rounded(x, residual)
        tl.store(residual_ptrs, x, mask=mask)
    xf = x.to(tl.float32)
    y = rms_scaled(xf, tl.rsqrt(tl.sum(xf * xf, 0) / n + eps), weight, x.dtype)
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
) -> None:
    n = x.shape[-1]
    # normalised over the last dimension; x [parts, rows, N] when it holds partial sums
    parts = x.shape[0] if residual is not None and x.dim() == residual.dim() + 1 else 1
    x_parts, out_rows = x.view(parts, -1, n), out.view(-1, n)
    residual_rows = x_parts[0] if residual is None else residual.view(-1, n)
    block = triton.next_power_of_2(n)
    _rmsnorm_kernel[(out_rows.shape[0],)](
        x_parts, residual_rows, weight, out_rows,
        x_parts.stride(0), x_parts.stride(1), residual_rows.stride(0), out_rows.stride(0), n, eps,
        NUM_PARTS=parts, HAS_RESIDUAL=residual is not None, BLOCK=block,
        num_warps=min(8, max(1, block // 256)), **pdl_args(x.device),
    )  # fmt: skip


def rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """RMSNorm over the last dimension, into `out` when given (which may be x itself)."""
    if out is None:
        out = torch.empty(
            x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device
        )
    _launch(x, None, weight, eps, out)
    return out


def fused_add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """In place: residual <- x + residual; x <- rmsnorm(residual), which is returned. x may be
    [splits, rows, N] partial sums of the addend: the norm then goes into x[0]."""
    out = x[0] if x.dim() == residual.dim() + 1 else x
    _launch(x, residual, weight, eps, out)
    return out
