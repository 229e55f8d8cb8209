import torch
import triton
import triton.language as tl

from ..torch_ops import KVStore
from .decode_attention import PREFETCH_MAX_BATCH
from .norm import rms_scaled
from .pdl import launch_next_then_wait, pdl_args, wait_for_previous


@triton.jit
def _mul(a, b):
    """a * b rounded to a's dtype, as a torch op rounds; the explicit rounding also keeps the
    compiler from fusing it into a multiply-add with the following sum."""
    return (a.to(tl.float32) * b.to(tl.float32)).to(a.dtype)


@triton.jit
def _rotate_heads(
    ptr, stride_head, num_heads, cos, sin, i, i_mask, norm_w_ptr, eps,
    HALF, HAS_NORM: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """One token's heads in place: optional RMSNorm over each head, then the NeoX rotation
    (x1, x2) -> (x1 c - x2 s, x2 c + x1 s). Returns the rotated halves and their mask."""
    h = tl.arange(0, BLOCK_H)
    mask = (h < num_heads)[:, None] & i_mask[None, :]
    x1_ptrs = ptr + h[:, None] * stride_head + i[None, :]
    x1 = tl.load(x1_ptrs, mask=mask, other=0.0)
    x2 = tl.load(x1_ptrs + HALF, mask=mask, other=0.0)
    if HAS_NORM:  # rounded where torch_ops.rmsnorm rounds: to the dtype, then times the weight
        x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
        scale = tl.rsqrt((tl.sum(x1f * x1f, 1) + tl.sum(x2f * x2f, 1)) / (2 * HALF) + eps)
        w1 = tl.load(norm_w_ptr + i, mask=i_mask, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(norm_w_ptr + HALF + i, mask=i_mask, other=0.0).to(tl.float32)[None, :]
        x1 = rms_scaled(x1f, scale[:, None], w1, x1.dtype).to(x1.dtype)
        x2 = rms_scaled(x2f, scale[:, None], w2, x2.dtype).to(x2.dtype)
    # in the tensor's dtype, like the reference: cos/sin cast first, each product rounded
    c, s = cos.to(x1.dtype)[None, :], sin.to(x1.dtype)[None, :]
    o1, o2 = _mul(x1, c) - _mul(x2, s), _mul(x2, c) + _mul(x1, s)
    tl.store(x1_ptrs, o1, mask=mask)
    tl.store(x1_ptrs + HALF, o2, mask=mask)
    return o1, o2, mask


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, v_ptr, positions_ptr, cos_sin_ptr, q_norm_ptr, k_norm_ptr, eps,
    k_cache_ptr, v_cache_ptr, out_loc_ptr,
    stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
    stride_k_cache_loc, stride_k_cache_head, stride_v_cache_loc, stride_v_cache_head,
    stride_cos_sin, num_q_heads, num_k_heads,
    HALF: tl.constexpr, HAS_NORM: tl.constexpr, STORE_KV: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr, LAUNCH_NEXT_EARLY: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    """Program (token, 0) rotates the query heads; (token, 1) the key heads, and writes K and V
    into the pool at out_loc[token] when STORE_KV."""
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    i_mask = i < HALF
    cos = tl.load(cos_sin_ptr + pos * stride_cos_sin + i, mask=i_mask, other=0.0)
    sin = tl.load(cos_sin_ptr + pos * stride_cos_sin + HALF + i, mask=i_mask, other=0.0)
    # positions are an input and cos/sin a weight (pdl.py): read before the wait. A small decode
    # batch's attention, which prefetches its keys, may launch at once and do so while this runs
    if LAUNCH_NEXT_EARLY:
        launch_next_then_wait(USE_PDL)
    else:
        wait_for_previous(USE_PDL)
    if tl.program_id(1) == 0:
        _rotate_heads(
            q_ptr + token * stride_q_tok, stride_q_head, num_q_heads, cos, sin, i, i_mask,
            q_norm_ptr, eps, HALF, HAS_NORM, BLOCK_QH,
        )  # fmt: skip
    else:
        k1, k2, mask = _rotate_heads(
            k_ptr + token * stride_k_tok, stride_k_head, num_k_heads, cos, sin, i, i_mask,
            k_norm_ptr, eps, HALF, HAS_NORM, BLOCK_KH,
        )  # fmt: skip
        if STORE_KV:
            loc = tl.load(out_loc_ptr + token).to(tl.int64)
            h = tl.arange(0, BLOCK_KH)[:, None]
            k_dst = k_cache_ptr + loc * stride_k_cache_loc + h * stride_k_cache_head + i[None, :]
            tl.store(k_dst, k1, mask=mask)
            tl.store(k_dst + HALF, k2, mask=mask)
            v_src = v_ptr + token * stride_v_tok + h * stride_v_head + i[None, :]
            v_dst = v_cache_ptr + loc * stride_v_cache_loc + h * stride_v_cache_head + i[None, :]
            tl.store(v_dst, tl.load(v_src, mask=mask), mask=mask)
            tl.store(v_dst + HALF, tl.load(v_src + HALF, mask=mask), mask=mask)


def apply_rope_inplace(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    kv_store: KVStore | None = None,
) -> None:
    """NeoX-style rotary embedding (the two halves paired), in place; with qk_norm = (q_weight,
    k_weight, eps) each head is RMS-normalised first, and with kv_store the rotated keys and the
    values are written into the pool, all in the same pass.

    query: [T, Hq * D] or [T, Hq, D] (strided views are fine); key likewise;
    cos_sin_cache: [max_pos, D], cos then sin.
    """
    q = query.view(query.shape[0], -1, head_size)
    k = key.view(key.shape[0], -1, head_size)
    half = head_size // 2
    q_w, k_w, eps = qk_norm if qk_norm is not None else (q, k, 0.0)  # weights unread without norm
    # without a store, the pool arguments are never read: k stands in for them
    k_cache, v_cache, out_loc, value = kv_store if kv_store is not None else (k, k, positions, k)
    v = value.view(value.shape[0], -1, head_size)
    _rope_kernel[(q.shape[0], 2)](
        q, k, v, positions, cos_sin_cache, q_w, k_w, eps, k_cache, v_cache, out_loc,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        cos_sin_cache.stride(0), q.shape[1], k.shape[1],
        HALF=half, HAS_NORM=qk_norm is not None, STORE_KV=kv_store is not None,
        BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_QH=triton.next_power_of_2(q.shape[1]), BLOCK_KH=triton.next_power_of_2(k.shape[1]),
        # above it, an early launch only held SMs: bench.py 1 % slower on an H200
        LAUNCH_NEXT_EARLY=q.shape[0] <= PREFETCH_MAX_BATCH, **pdl_args(q.device),
    )  # fmt: skip
