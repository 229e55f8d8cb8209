"""Op dispatch: a Triton kernel for CUDA fp16/bf16 tensors when triton is installed, else the
PyTorch reference. fp32 takes the reference, which the tests compare with Hugging Face, except for
two ops that run their kernel on any CUDA tensor: the table reads and writes (exact either way)
and sampling (an exact argmax; only the kernel writes the host's token table inside a graph); for
matmuls on the CPU, which take oneDNN with the weight packed at load (`onednn.py`); and for RoPE
(with QK-norm), RMSNorm and SiLU-and-mul on the CPU in fp32, which take the C++ kernels (`cpp/`):
RoPE alone bit-equal to the reference, QK-norm, RMSNorm and SiLU-and-mul within float rounding.

`minisgl.kernel.triton` holds the Triton twin of each op dispatched below (same name, same
semantics as `torch_ops`'s), and the attention and MoE kernels their backends call; it is imported
on first use only, so CPU-only installs never import triton.
"""

import functools
import importlib.util
import os
from types import ModuleType

import torch

from . import cpp, onednn, torch_ops
from .torch_ops import DeviceWrites, KVStore, indexing

_FAST_DTYPES = (torch.float16, torch.bfloat16)
# Slices of K per row count, for matrices of at most 2,048 output features. bench_split_k.py on an
# H200 (bf16; 28 layers of o_proj or down_proj, each with the residual add + RMSNorm after it):
# from 3 to 224 rows, 4 slices ran 1.05-1.74x as fast as cuBLAS's matmul, and as fast as 2 or
# faster; at 256 rows 2 slices 1.12-1.19x, 0.5-2 % ahead of 4; at 512 rows 2 slices 1.03x, 4
# slower than cuBLAS; from 1,024 rows neither was faster
_SPLIT_K_MAX_FEATURES = 2048
_SPLIT_K_BY_ROWS = ((224, 4), (512, 2))  # (up to this many rows, slices)


@functools.cache
def _fast_ops() -> ModuleType:
    if importlib.util.find_spec("triton") is None:
        return torch_ops
    from . import triton as triton_ops

    return triton_ops


def _ops_for(x: torch.Tensor) -> ModuleType:
    return _fast_ops() if x.is_cuda and x.dtype in _FAST_DTYPES else torch_ops


def rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """RMSNorm over the last dimension, into `out` when given (which may be x itself)."""
    ops = cpp if cpp.serves_norm(x, weight, out) else _ops_for(x)
    return ops.rmsnorm(x, weight, eps, out)


def fused_add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """In place: residual <- x + residual; x <- rmsnorm(residual), which is returned. x may be
    [splits, rows, N] partial sums of the addend (`linear_split_k`'s); the norm then goes into
    x[0]."""
    ops = cpp if cpp.serves_norm(x, weight, residual) else _ops_for(x)
    return ops.fused_add_rmsnorm(x, residual, weight, eps)


def apply_rope_inplace(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    kv_store: KVStore | None = None,
) -> None:
    """NeoX-style rotary embedding in place, after a per-head RMSNorm when qk_norm =
    (q_weight, k_weight, eps) is given, and then the K/V rows into the pool when kv_store is
    given (one kernel on a GPU, and on the CPU in fp32); cos_sin_cache: [max_pos, D], cos then
    sin."""
    serves = cpp.serves_rope(positions, query, key, head_size, qk_norm, kv_store)
    ops = cpp if serves else _ops_for(query)
    ops.apply_rope_inplace(positions, query, key, head_size, cos_sin_cache, qk_norm, kv_store)


def _gemv_ops(x: torch.Tensor, weight: torch.Tensor) -> ModuleType | None:
    """The Triton ops where their GEMV serves x @ weight^T (a tiny decode batch on a GPU)."""
    ops = _ops_for(x)
    if ops is torch_ops or x.dim() != 2 or not ops.use_gemv(x.shape[0], weight.shape[0]):
        return None
    return ops


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """weight [N, K] in the layout the CPU's matmul kernel wants, to pass as `packed` with it;
    None where no kernel wants one (on a GPU)."""
    return onednn.pack(weight)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    packed: torch.Tensor | None = None,
) -> torch.Tensor:
    """F.linear; a small decode batch on a GPU takes the Triton GEMV (it streams W faster), a
    large enough matmul on the CPU oneDNN, given the weight packed (`pack_weight`)."""
    ops = _gemv_ops(x, weight)
    if ops is not None:
        return ops.linear(x, weight, bias)
    if onednn.serves(x, weight, packed):
        return onednn.linear(x, packed, bias)
    return torch_ops.linear(x, weight, bias)


def split_k_slices(x: torch.Tensor, weight: torch.Tensor) -> int:
    """How many slices of the input features `linear_split_k` cuts x @ weight^T into (1: none).
    MINISGL_SPLIT_K=N forces N slices on any device (for tests and ablation; 0 or 1: none)."""
    forced = os.environ.get("MINISGL_SPLIT_K")
    rows, (n, k) = x.shape[0], weight.shape
    if forced is not None:
        splits = int(forced)
    elif _ops_for(x) is torch_ops or n > _SPLIT_K_MAX_FEATURES or _gemv_ops(x, weight) is not None:
        splits = 1
    else:
        splits = next((s for max_rows, s in _SPLIT_K_BY_ROWS if rows <= max_rows), 1)
    return splits if splits > 1 and k % splits == 0 else 1


def linear_split_k(
    x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None = None
) -> torch.Tensor:
    """x @ weight^T, or, where that is faster, its partial sums over slices of the input features
    as [splits, rows, N], for the one reader that sums them on its way: fused_add_rmsnorm.
    cuBLAS gives a matrix of few output features (o_proj and down_proj) few tiles at a mid-size
    decode batch, and leaves most SMs idle; slicing K multiplies the tiles. packed: as for
    `linear`."""
    splits = split_k_slices(x, weight)
    if splits == 1:
        return linear(x, weight, packed=packed)
    return torch_ops.linear_split_k(x, weight, splits)


def rmsnorm_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    gated: bool = False,
    packed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """linear(rmsnorm(x + residual)) and the new residual x + residual (x itself when residual
    is None); gated: weight = [W_gate; W_up] and the first result is silu_and_mul of the linear.
    Where the GEMV serves, the norm and the activation run inside it: one kernel instead of two or
    three, and x and residual are left as they were; else x and residual are updated in place as
    by fused_add_rmsnorm, and x may be linear_split_k's partial sums."""
    ops = _gemv_ops(x, weight)
    if ops is None:
        if residual is None:
            y, residual = linear(rmsnorm(x, norm_weight, eps), weight, bias, packed), x
        else:
            y = linear(fused_add_rmsnorm(x, residual, norm_weight, eps), weight, bias, packed)
        return (silu_and_mul(y) if gated else y), residual
    new_residual = (
        None if residual is None else torch.empty_like(x, memory_format=torch.contiguous_format)
    )
    prologue = ops.Prologue(norm_weight, eps, residual, new_residual)
    y = ops.linear(x, weight, bias, prologue=prologue, gated=gated)
    return y, x if new_residual is None else new_residual


def add_rmsnorm_linear(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    warm: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(h, linear(h), the new residual x + residual), h = rmsnorm(x + residual): for a MoE layer,
    whose router and experts both read h. Where the GEMV serves, its kernel computes all three
    (one launch less than the norm's kernel and the matmul's), and pulls `warm` (a later
    kernel's weight) into L2 at one row; else as fused_add_rmsnorm (in place, x may be
    linear_split_k's partial sums) and linear."""
    ops = _gemv_ops(x, weight)
    if ops is None:
        h = fused_add_rmsnorm(x, residual, norm_weight, eps)
        return h, linear(h, weight), residual
    h = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    new_residual = torch.empty_like(x, memory_format=torch.contiguous_format)
    prologue = ops.Prologue(norm_weight, eps, residual, new_residual, h)
    return h, ops.linear(x, weight, prologue=prologue, warm=warm), new_residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] along the last dimension -> silu(gate) * up."""
    ops = cpp if cpp.serves_activation(x) else _ops_for(x)
    return ops.silu_and_mul(x)


def moe_route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, warm: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, expert ids) [tokens, top_k] of each token's top-k experts by the softmax over
    them, the weights rescaled to sum to 1 when `renormalize`; computed in fp32. warm: the
    experts' gate/up weights, which the Triton kernel may start pulling into L2 (its docs)."""
    ops = _ops_for(router_logits)
    if ops is torch_ops:
        return ops.moe_route(router_logits, top_k, renormalize)
    return ops.moe_route(router_logits, top_k, renormalize, warm)


def sample_tokens(
    logits: torch.Tensor,
    token_table: torch.Tensor,
    entries: torch.Tensor,
    counters: torch.Tensor,
    temperatures: torch.Tensor | None = None,
    uniforms: torch.Tensor | None = None,
    host_table: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each row's next token as [bs] int32, also written into the flattened token table at
    entries (and into host_table, a pinned host copy of the table, when given): the most likely
    where temperatures is None or a row's temperature is 0, else a draw from
    softmax(logits / temperature) driven by the row's uniform number in (0, 1). counters: int32
    zeros, at least one per row, which the Triton kernel leaves zero. On a GPU the kernel serves
    every dtype: its argmax is exact, and only it can write host memory inside a CUDA graph."""
    ops = _fast_ops() if logits.is_cuda else torch_ops
    return ops.sample_tokens(
        logits, token_table, entries, counters, temperatures, uniforms, host_table
    )


def read_tables(
    page_table: torch.Tensor,
    token_table: torch.Tensor,
    page_writes: DeviceWrites,
    token_writes: DeviceWrites,
    token_entries: torch.Tensor,
    page_entries: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply the writes ((flat entries, values)) to the tables, then read the token ids at
    token_entries and the KV locations at page_entries. Integer copies, exact either way: the
    Triton kernel serves on any CUDA device."""
    ops = _fast_ops() if page_table.is_cuda else torch_ops
    return ops.read_tables(
        page_table, token_table, page_writes, token_writes, token_entries, page_entries
    )


__all__ = [
    "DeviceWrites",
    "KVStore",
    "add_rmsnorm_linear",
    "apply_rope_inplace",
    "fused_add_rmsnorm",
    "indexing",
    "linear",
    "linear_split_k",
    "moe_route",
    "pack_weight",
    "read_tables",
    "rmsnorm",
    "rmsnorm_linear",
    "sample_tokens",
    "silu_and_mul",
    "torch_ops",
]
