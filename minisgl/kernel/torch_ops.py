"""PyTorch reference ops. Their order of operations matches Hugging Face, so fp32 agrees bit for bit."""

import torch
import torch.nn.functional as F


def rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = weight * y.to(x.dtype)
    if out is not None:
        out.copy_(y)
        return out
    return y


def fused_add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> None:
    """In place: residual <- x + residual; x <- rmsnorm(residual)."""
    residual.add_(x)
    rmsnorm(residual, weight, eps, out=x)


def apply_rope_inplace(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
) -> None:
    """NeoX-style rotary embedding (the two halves paired), in place.

    query: [T, Hq * D] or [T, Hq, D]; key likewise; cos_sin_cache: [max_pos, D], cos then sin.
    """
    cos, sin = cos_sin_cache[positions.long()].chunk(2, dim=-1)  # [T, D/2] each
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    for t in (query, key):
        x = t.view(t.shape[0], -1, head_size)
        x1, x2 = x[..., : head_size // 2], x[..., head_size // 2 :]
        c, s = cos.to(x.dtype), sin.to(x.dtype)
        o1 = x1 * c - x2 * s
        o2 = x2 * c + x1 * s
        x.copy_(torch.cat([o1, o2], dim=-1))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] along the last dimension -> silu(gate) * up."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def indexing(
    weight: torch.Tensor, ids: torch.Tensor, vocab_range: tuple[int, int] | None = None
) -> torch.Tensor:
    """Embedding lookup. With vocab_range=(start, length) the weight holds only that slice of the
    vocabulary: ids outside it give zero rows (another TP rank holds them)."""
    if vocab_range is None:
        return F.embedding(ids, weight)
    start, length = vocab_range
    local = ids - start
    outside = (local < 0) | (local >= length)
    out = F.embedding(local.masked_fill(outside, 0), weight)
    return out.masked_fill(outside.unsqueeze(-1), 0)


def store_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out_loc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """Write this step's K/V rows into the pool. Caches are [slots, kv_heads, head_dim] views."""
    k_cache[out_loc] = k.view(-1, *k_cache.shape[1:])
    v_cache[out_loc] = v.view(-1, *v_cache.shape[1:])
