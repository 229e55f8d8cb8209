import torch
import triton
import triton.language as tl

from .pdl import pdl_args, wait_for_previous

_MAX_BLOCK = 1024


@triton.jit
def _store_kv_kernel(
    k_cache_ptr,
    v_cache_ptr,
    out_loc_ptr,
    k_ptr,
    v_ptr,
    stride_k_cache,
    stride_v_cache,
    stride_k,
    stride_v,
    ROW: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_previous(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    loc = tl.load(out_loc_ptr + token).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < ROW
    k = tl.load(k_ptr + token * stride_k + cols, mask=mask)
    tl.store(k_cache_ptr + loc * stride_k_cache + cols, k, mask=mask)
    v = tl.load(v_ptr + token * stride_v + cols, mask=mask)
    tl.store(v_cache_ptr + loc * stride_v_cache + cols, v, mask=mask)


def store_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out_loc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """Write this step's K/V rows into the pool, both in one launch. Caches are
    [locations, kv_heads, head_dim] views; k, v: [tokens, kv_heads * head_dim] or [tokens, kv_heads, head_dim]."""
    # one row per location; view (never a copy) so that the writes land in the pool
    k_rows, v_rows = k_cache.view(k_cache.shape[0], -1), v_cache.view(v_cache.shape[0], -1)
    k, v = k.reshape(k.shape[0], -1), v.reshape(v.shape[0], -1)
    row = k_rows.shape[1]
    block = min(_MAX_BLOCK, triton.next_power_of_2(row))
    _store_kv_kernel[(out_loc.shape[0], triton.cdiv(row, block))](
        k_rows, v_rows, out_loc, k, v,
        k_rows.stride(0), v_rows.stride(0), k.stride(0), v.stride(0),
        ROW=row, BLOCK=block, **pdl_args(k.device),
    )  # fmt: skip
