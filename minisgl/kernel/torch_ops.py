"""PyTorch reference ops. Their order of operations matches Hugging Face, so fp32 agrees bit for bit."""

from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F


class KVStore(NamedTuple):
    """Where a step's K/V rows go: caches [locations, kv_heads, D], out_loc [tokens]; and the values."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    out_loc: torch.Tensor
    value: torch.Tensor


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
) -> torch.Tensor:
    """In place: residual <- x + residual; x <- rmsnorm(residual), which is returned. x may be
    [splits, rows, N] partial sums of the addend (`linear_split_k`'s): they are summed in fp32 and
    rounded once, as a matmul rounds its output, and the norm goes into x[0]."""
    out = x
    if x.dim() == residual.dim() + 1:
        out, x = x[0], x.sum(0, dtype=torch.float32).to(x.dtype)
    residual.add_(x)
    return rmsnorm(residual, weight, eps, out=out)


def apply_rope_inplace(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    kv_store: KVStore | None = None,
) -> None:
    """NeoX-style rotary embedding (the two halves paired), in place; with qk_norm =
    (q_weight, k_weight, eps), each head of q and k is RMS-normalised first (Qwen3's QK-norm);
    with kv_store, the rotated keys and the values are then written into the pool.

    query: [T, Hq * D] or [T, Hq, D], possibly strided views of the merged qkv; key likewise;
    cos_sin_cache: [max_pos, D], cos then sin.
    """
    q, k = (t.view(t.shape[0], -1, head_size) for t in (query, key))
    if qk_norm is not None:
        qk_rmsnorm_inplace(q, k, qk_norm)
    cos, sin = cos_sin_cache[positions.long()].chunk(2, dim=-1)  # [T, D/2]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    both = _heads_together(q, k)  # one op for q's and k's heads, the same arithmetic on each
    for x in (q, k) if both is None else (both,):
        x1, x2 = x[..., : head_size // 2], x[..., head_size // 2 :]
        c, s = cos.to(x.dtype), sin.to(x.dtype)
        o1 = x1 * c - x2 * s
        o2 = x2 * c + x1 * s
        x.copy_(torch.cat([o1, o2], dim=-1))
    if kv_store is not None:
        store_kv(kv_store.k_cache, kv_store.v_cache, kv_store.out_loc, key, kv_store.value)


def qk_rmsnorm_inplace(
    q: torch.Tensor, k: torch.Tensor, qk_norm: tuple[torch.Tensor, torch.Tensor, float]
) -> None:
    """Each head of q and k [T, heads, D] RMS-normalised in place, by qk_norm = (q_weight,
    k_weight, eps)."""
    q_weight, k_weight, eps = qk_norm
    both = _heads_together(q, k)
    if both is None:
        rmsnorm(q, q_weight, eps, out=q)
        rmsnorm(k, k_weight, eps, out=k)
    else:
        weight = torch.cat([q_weight.expand(q.shape[1], -1), k_weight.expand(k.shape[1], -1)])
        rmsnorm(both, weight, eps, out=both)


def _heads_together(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """q's heads then k's as one [T, Hq + Hk, D] view, where each row of k directly follows q's
    in memory within one storage (the merged qkv split); None elsewhere."""
    rows, heads, head_size = q.shape
    size = q.element_size()
    if (
        k.shape[0] != rows
        or k.dtype != q.dtype
        or q.stride()[1:] != (head_size, 1)
        or k.stride()[1:] != (head_size, 1)
        or (rows > 1 and k.stride(0) != q.stride(0))
        or k.data_ptr() != q.data_ptr() + heads * head_size * size
        # two tensors may also lie side by side: a view of both would run past q's storage
        or k.untyped_storage().data_ptr() != q.untyped_storage().data_ptr()
    ):
        return None
    return q.as_strided((rows, heads + k.shape[1], head_size), q.stride(), q.storage_offset())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def linear_split_k(x: torch.Tensor, weight: torch.Tensor, splits: int) -> torch.Tensor:
    """x @ weight^T as `splits` partial sums over equal slices of the input features, stacked as
    [splits, rows, N]: one batched matmul over strided views, no copies."""
    rows, k = x.shape
    slice_k = k // splits
    x_slices = x.view(rows, splits, slice_k).transpose(0, 1)
    weight_slices = weight.view(weight.shape[0], splits, slice_k).permute(1, 2, 0)
    return torch.bmm(x_slices, weight_slices)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] along the last dimension -> silu(gate) * up."""
    gate, up = x.chunk(2, dim=-1)
    # a strided view takes torch's other CPU loop on AVX2 machines, off HF's (contiguous) in
    # the last bit
    return F.silu(gate.contiguous()) * up


def moe_route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, expert ids) of each token's top-k experts by the softmax over them, the weights
    rescaled to sum to 1 when `renormalize`; in fp32, as Hugging Face computes them, and returned
    in the logits' dtype."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


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


def row_cumsum(x: torch.Tensor) -> torch.Tensor:
    """cumsum over the last dimension of [rows, n], the same bits on every run. CUDA scans a
    tensor of one row with CUB's decoupled look-back, whose float sums depend on the order in
    which blocks finish (pytorch/pytorch#75240), while the rows of a 2-D scan are each summed in a
    fixed order: so a lone row is scanned as two."""
    if x.is_cuda and x.shape[0] == 1:
        return x.expand(2, -1).cumsum(dim=-1)[:1]
    return x.cumsum(dim=-1)


def inverse_cdf(
    probs: torch.Tensor, uniforms: torch.Tensor, fallback: torch.Tensor
) -> torch.Tensor:
    """Per row, the first index where the running sum of probs reaches uniforms * the row's sum.
    A token of probability 0 is never picked (uniforms are in (0, 1)). A row whose sum is not a
    positive finite number (NaN probabilities) takes its `fallback` token instead: no row can pick
    an index outside the vocabulary."""
    cdf = row_cumsum(probs)  # fp32 sums of non-negative numbers never decrease: stays sorted
    total = cdf[:, -1:]
    picked = torch.searchsorted(cdf, torch.minimum(uniforms[:, None] * total, total)).squeeze(1)
    valid = torch.isfinite(total[:, 0]) & (total[:, 0] > 0)
    return torch.where(valid, picked, fallback.to(picked.dtype))


def sample_temperature(
    logits: torch.Tensor, temperatures: torch.Tensor, uniforms: torch.Tensor
) -> torch.Tensor:
    """One token per row of logits [bs, vocab] from softmax(logits / temperature), driven by the
    given uniform numbers; a row whose probabilities are not finite takes its argmax. Returns [bs]
    int32."""
    probs = torch.softmax(logits.float() / temperatures[:, None], dim=-1)
    return inverse_cdf(probs, uniforms, logits.argmax(dim=-1)).to(torch.int32)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax as [bs] int32: the first of equal maxima, a NaN above any number."""
    # in fp32, the same argmax: the CPU's bf16 argmax took 3.6 ms for 32 x 32,000, fp32's 1.2;
    # numpy's took 0.07 ms on one thread (torch's 1.2) and 0.08 on two (torch's 8.4)
    scores = logits.float()
    if scores.is_cpu:
        return torch.from_numpy(scores.numpy().argmax(-1).astype(np.int32))
    return scores.argmax(dim=-1).to(torch.int32)


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
    entries [bs] (and into host_table, the table's copy on the host, when given): the most likely
    (the first on a tie) where temperatures is None or a row's temperature is 0, else
    sample_temperature's draw with the row's uniform number. counters: the Triton kernel's
    scratch, unused here."""
    tokens = greedy_tokens(logits)
    if temperatures is not None:
        assert uniforms is not None
        sampled = temperatures > 0
        drawn = sample_temperature(logits, torch.where(sampled, temperatures, 1.0), uniforms)
        tokens = torch.where(sampled, drawn, tokens)
    token_table.view(-1).scatter_(0, entries, tokens)
    if host_table is not None:
        host = host_table.device
        host_table.view(-1).scatter_(0, entries.to(host), tokens.to(host))
    return tokens


DeviceWrites = tuple[torch.Tensor, torch.Tensor]  # (flat entries, values), int32


def read_tables(
    page_table: torch.Tensor,
    token_table: torch.Tensor,
    page_writes: DeviceWrites,
    token_writes: DeviceWrites,
    token_entries: torch.Tensor,
    page_entries: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply the writes to the (flattened) tables, then read the token ids at token_entries and
    the KV locations at page_entries."""
    for table, writes in [(page_table, page_writes), (token_table, token_writes)]:
        table.view(-1).scatter_(0, *writes)
    return (
        token_table.view(-1).index_select(0, token_entries),
        page_table.view(-1).index_select(0, page_entries),
    )
