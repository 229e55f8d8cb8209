import torch
import triton
import triton.language as tl

from .pdl import pdl_args, wait_for_previous


@triton.jit
def _rmsnorm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    stride_x,
    stride_residual,
    stride_out,
    n,
    eps,
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
    if HAS_RESIDUAL:
        residual_ptrs = residual_ptr + row * stride_residual + cols
        residual = tl.load(residual_ptrs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)  # rounded as add_ rounds
        tl.store(residual_ptrs, x, mask=mask)
    xf = x.to(tl.float32)
    normed = xf * tl.rsqrt(tl.sum(xf * xf, 0) / n + eps)
    # the reference rounds to the input dtype before the weight multiply (as Hugging Face does)
    y = normed.to(x.dtype).to(tl.float32) * weight
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
) -> None:
    n = x.shape[-1]
    x_rows, out_rows = x.view(-1, n), out.view(-1, n)  # normalised over the last dimension
    residual_rows = x_rows if residual is None else residual.view(-1, n)
    block = triton.next_power_of_2(n)
    _rmsnorm_kernel[(x_rows.shape[0],)](
        x_rows, residual_rows, weight, out_rows,
        x_rows.stride(0), residual_rows.stride(0), out_rows.stride(0), n, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(8, max(1, block // 256)),
        **pdl_args(x.device),
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
) -> None:
    """In place: residual <- x + residual; x <- rmsnorm(residual)."""
    _launch(x, residual, weight, eps, out=x)
