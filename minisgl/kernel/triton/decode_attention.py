"""Paged decode attention: one new token per request, K/V read through the page table, split-K.

    one request's keys, at pool locations page_table[slot, 0:seq_len]
    |<-- split 0 -->|<-- split 1 -->| ... |<- last used split ->|  (unused splits)
    split_len = ceil(seq_len / S) rounded up to BLOCK_N, so a short request uses fewer splits

    program (split, head block, rank r): the HEADS query heads of a block (all GROUP heads of a
        KV head, or a part of them) attend to the split's keys -> partial output o_s and its
        log2-sum-exp lse_s in scratch;
        the last of the request's used splits to finish (a counter per (req, head block) says which)
        then reduces: out = sum_s 2^(lse_s - max) * o_s / sum_s 2^(lse_s - max), and resets the
        counter to 0 for the next launch. A request that needs one split writes its output directly.

One launch, not a split kernel and a reduce kernel: a decode step of one request is ~200 kernels
of a few microseconds, so a launch per layer is worth saving.

S depends on the batch size only: a CUDA graph replays the same grid and scratch buffers with new
seq_lens, so every split derives its token range from seq_lens inside the kernel; programs past a
request's used splits do nothing.

A program's time grows with its request's length, and the GPU starts programs in grid order, so a
long request started last leaves the other SMs idle while it finishes. Given the rows sorted
longest first (`longest_first`, from the host), rank r is the r-th longest request (without it,
row r): the short requests come last and fill the tail. Each request's programs are adjacent.

At a small batch each program reads its first block of keys before waiting for the kernel before
it (see pdl.py): seq_lens, the page table and every key but the new token's were written before
the forward began; only the new token's row, which that kernel stores, is read after the wait. At
one request this is the attention's whole read. At large batches the held block cost more than it
saved (batch 256 took twice as long), so only batches up to PREFETCH_MAX_BATCH do it.
"""

import functools
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .attention_block import attend_block, attend_loaded, dot_block, load_kv
from .pdl import pdl_args, wait_for_previous

_BLOCK_N = 64  # keys per step, one request or fp32: 16 KiB of bf16 K (or V) at head_dim 128
_ONE_REQUEST_PROGRAMS_PER_SM = 16
# one request's GQA group above 4 query heads (an even one) runs as two programs of half the heads
# each: at 32/4 heads (Qwen3-30B-A3B) 8.08 us against 10.29 at 768 keys, 8.23 against 10.69 at
# 2,048 (H200, bf16, in a CUDA graph; groups of 2 gained nothing from splitting)
_ONE_REQUEST_MAX_HEADS = 4
_ONE_REQUEST_HEAD_BLOCKS = 2  # programs per KV head and split where the group is split
# 2 to PREFETCH_MAX_BATCH requests: 128 keys per step in 3 stages where they fit (192 KiB of bf16
# K and V at head_dim 128; 2 stages elsewhere), at most 2 programs per SM, so each reads several
# blocks: 16 requests took 35.3 us against 64.8 with 64 keys and ~16 programs per SM (H200, bf16)
_FEW_REQUESTS_PROGRAMS_PER_SM = 2
# keys per step from 2 requests up, in 2-byte dtypes (fp32 tiles would not fit): above
# PREFETCH_MAX_BATCH, with half the programs, batch 256 took 287.7 us against 300.2 at 64 keys
# (H200, bf16, contexts 100-2,048)
_MULTI_REQUEST_BLOCK_N = 128
_LARGE_BATCH_PROGRAMS_PER_SM = 8
_MAX_SPLITS = 32
# fp32 partials the reduce loads at once (one split's heads x head_dim where that is more): 64
# registers a thread at 4 warps
_REDUCE_ELEMENTS = 8192
PREFETCH_MAX_BATCH = 16
_HOPPER_SHARED_MEMORY = 232_448  # bytes a program may use on an H100 or H200 (an A100: 166,912)


class DecodeLaunch(NamedTuple):
    block_n: int  # keys per step
    num_warps: int = 4
    num_stages: int = 2
    heads: int = 0  # query heads per program, a divisor of the GQA group (0: the whole group)


def decode_launch(
    batch_size: int, dtype: torch.dtype, head_dim: int, shared_memory: int, group: int
) -> DecodeLaunch:
    """The launch for a batch: 64 keys per step for one request (a short context still spreads
    over many SMs), its GQA group (query heads per KV head) in two programs where it is even and
    above 4; in fp32 64 keys too; else 128, in 3 stages up to PREFETCH_MAX_BATCH requests where
    their K and V tiles fit in shared_memory (bytes a program may use), else 2."""
    if batch_size == 1:
        split_group = group > _ONE_REQUEST_MAX_HEADS and group % _ONE_REQUEST_HEAD_BLOCKS == 0
        return DecodeLaunch(_BLOCK_N, heads=group // _ONE_REQUEST_HEAD_BLOCKS if split_group else 0)
    if dtype.itemsize > 2:
        return DecodeLaunch(_BLOCK_N)
    stage_bytes = 2 * _MULTI_REQUEST_BLOCK_N * head_dim * dtype.itemsize  # a K and a V tile
    three_stages = batch_size <= PREFETCH_MAX_BATCH and 3 * stage_bytes <= shared_memory
    return DecodeLaunch(_MULTI_REQUEST_BLOCK_N, num_stages=3 if three_stages else 2)


@functools.cache
def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def shared_memory_per_program(device: torch.device) -> int:
    """Bytes of shared memory a program may use: the device's opt-in limit per block (0 where
    torch does not report it); off CUDA, Hopper's, so the interpreter takes an H200's launches."""
    if device.type != "cuda":
        return _HOPPER_SHARED_MEMORY
    properties = torch.cuda.get_device_properties(device)
    return getattr(properties, "shared_memory_per_block_optin", 0)


def split_counter_count(rows: int, kv_heads: int) -> int:
    """The split counters decode_attention's default launches need for up to `rows` requests."""
    return max(rows, _ONE_REQUEST_HEAD_BLOCKS) * kv_heads


def decode_num_splits(batch_size: int, num_kv_heads: int, sms: int) -> int:
    """Splits per request, from the (request, KV head, split) programs wanted per SM: ~16 for
    one request, so its keys spread over every SM; at most 2 for a few (decode_launch's programs
    then fill an SM each); ~8 above PREFETCH_MAX_BATCH, so a ragged batch leaves no SM with the
    tail; 1 once the batch alone has that many. On an H200 over the offline benchmark, with 64
    keys per step throughout, the rule above PREFETCH_MAX_BATCH spent 3.70 s in decode attention,
    against 3.78 s for a single split from batch 66 up. A function of the batch size only (see the
    module docstring); sms: the device's multiprocessors."""
    pairs = batch_size * num_kv_heads
    if batch_size == 1:
        splits = triton.cdiv(_ONE_REQUEST_PROGRAMS_PER_SM * sms, pairs)
    elif batch_size <= PREFETCH_MAX_BATCH:
        splits = _FEW_REQUESTS_PROGRAMS_PER_SM * sms // pairs
    else:
        splits = triton.cdiv(_LARGE_BATCH_PROGRAMS_PER_SM * sms, pairs)
    return max(1, min(_MAX_SPLITS, splits))


def reduce_chunk(heads: int, block_d: int, num_splits: int) -> int:
    """Splits whose partials the reduce loads at once for a block of `heads` query heads."""
    block_heads = triton.next_power_of_2(heads)
    return min(
        triton.next_power_of_2(num_splits), max(1, _REDUCE_ELEMENTS // (block_heads * block_d))
    )


@triton.jit
def _split_len(seq_len, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys per split of a request of seq_len keys; it uses cdiv(seq_len, split_len) splits."""
    return tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N


@triton.jit
def _split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    page_table_ptr,
    slots_ptr,
    seq_lens_ptr,
    order_ptr,  # [bs] int32: the request rows, longest first (read if ORDERED)
    mid_o_ptr,  # [bs, qo_heads, NUM_SPLITS, BLOCK_D] fp32
    mid_lse_ptr,  # [bs, qo_heads, NUM_SPLITS] fp32
    o_ptr,  # [bs, qo_heads, HEAD_DIM]
    counter_ptr,  # [>= bs * head blocks] int32, zero between launches: splits done per (req, block)
    qk_scale,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_k_loc,
    stride_k_head,
    stride_v_loc,
    stride_v_head,
    stride_pt_row,
    GROUP: tl.constexpr,
    HEADS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    CHUNK_S: tl.constexpr,
    PREFETCH: tl.constexpr,
    ORDERED: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if not PREFETCH:
        wait_for_previous(USE_PDL)
    split, head_block, req = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    kv_head = head_block // (GROUP // HEADS)
    if ORDERED:
        req = tl.load(order_ptr + req)
    seq_len = tl.load(seq_lens_ptr + req)
    slot = tl.load(slots_ptr + req).to(tl.int64)
    split_len = _split_len(seq_len, NUM_SPLITS, BLOCK_N)
    num_used = tl.cdiv(seq_len, split_len)
    start = split * split_len  # past seq_len for an unused split: no keys, nothing stored
    end = tl.minimum(start + split_len, seq_len)

    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    page_row_ptr = page_table_ptr + slot * stride_pt_row
    k_head_ptr = k_ptr + kv_head * stride_k_head
    v_head_ptr = v_ptr + kv_head * stride_v_head
    if PREFETCH:  # the first block: old keys now, the new token's row after the wait
        first_pos = start + tl.arange(0, BLOCK_N)
        first_in = first_pos < end
        locs = tl.load(page_row_ptr + first_pos, mask=first_in, other=0).to(tl.int64)
        is_new = first_pos == seq_len - 1
        k_first, v_first = load_kv(
            locs, first_in & ~is_new, k_head_ptr, v_head_ptr, stride_k_loc, stride_v_loc, d, d_mask
        )
        wait_for_previous(USE_PDL)
        k_new, v_new = load_kv(
            locs, first_in & is_new, k_head_ptr, v_head_ptr, stride_k_loc, stride_v_loc, d, d_mask
        )
        k_first += k_new  # each row is zero in one of the two
        v_first += v_new

    h = tl.arange(0, BLOCK_H)
    heads = head_block * HEADS + h
    head_mask = h < HEADS
    q_ptrs = q_ptr + req * stride_q_tok + heads[:, None] * stride_q_head + d[None, :]
    q = tl.load(q_ptrs, mask=head_mask[:, None] & d_mask[None, :], other=0.0)
    q_pos = tl.zeros([BLOCK_H], dtype=tl.int32) + seq_len - 1  # the new token sees every key

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    rest = start
    if PREFETCH:
        m_i, l_i, acc = attend_loaded(
            q, q_pos, m_i, l_i, acc, k_first, v_first, first_pos, first_in, qk_scale, True
        )
        rest += BLOCK_N
    for block_start in range(rest, end, BLOCK_N):
        pos = block_start + tl.arange(0, BLOCK_N)
        m_i, l_i, acc = attend_block(
            q, q_pos, m_i, l_i, acc, pos, pos < end, page_row_ptr, k_head_ptr, v_head_ptr,
            stride_k_loc, stride_v_loc, d, d_mask, qk_scale, True,
        )  # fmt: skip

    l_i = tl.where(l_i == 0.0, 1.0, l_i)  # only an unused split (stores nothing) has no keys
    out = acc / l_i[:, None]
    if num_used == 1:
        if split == 0:
            o_ptrs = o_ptr + req * stride_o_tok + heads[:, None] * stride_o_head + d[None, :]
            o_mask = head_mask[:, None] & d_mask[None, :]
            tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=o_mask)
    elif split < num_used:
        qo_heads = tl.num_programs(1) * HEADS
        row = (req * qo_heads + heads) * NUM_SPLITS + split
        tl.store(mid_o_ptr + row[:, None] * BLOCK_D + d[None, :], out, mask=head_mask[:, None])
        tl.store(mid_lse_ptr + row, m_i + tl.log2(l_i), mask=head_mask)
        tl.debug_barrier()  # every thread's stores precede the count (released by the atomic)
        counter = counter_ptr + req * tl.num_programs(1) + head_block
        if tl.atomic_add(counter, 1, sem="acq_rel") == num_used - 1:
            tl.store(counter, 0)
            _reduce_splits(
                mid_o_ptr, mid_lse_ptr, o_ptr + req * stride_o_tok, (req * qo_heads) * NUM_SPLITS,
                head_block, num_used, stride_o_head, HEADS, NUM_SPLITS, HEAD_DIM, BLOCK_S, BLOCK_D,
                BLOCK_HEADS, CHUNK_S,
            )  # fmt: skip


@triton.jit
def _reduce_splits(
    mid_o_ptr,
    mid_lse_ptr,
    o_req_ptr,
    first_row,
    head_block,
    num_used,
    stride_o_head,
    HEADS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    CHUNK_S: tl.constexpr,
):
    """Combine the used splits' partial outputs of the head block's query heads: all heads in one
    load per CHUNK_S splits, not a load and a store per head in turn (one request at 32/4 heads
    and 768 keys: 5.5 us against 8.2, H200, bf16, in a CUDA graph). BLOCK_HEADS: HEADS rounded up
    to a power of two. The loads bypass L1: other programs wrote them."""
    h = tl.arange(0, BLOCK_HEADS)
    # padded heads re-read the last real head's rows: in bounds, and no row of -inf only
    head_rows = first_row + (head_block * HEADS + tl.minimum(h, HEADS - 1)) * NUM_SPLITS
    s = tl.arange(0, BLOCK_S)
    lse = tl.load(
        mid_lse_ptr + head_rows[:, None] + s[None, :], mask=(s < num_used)[None, :],
        other=float("-inf"), cache_modifier=".cg",
    )  # fmt: skip
    top = tl.max(lse, 1)
    total = tl.sum(tl.exp2(lse - top[:, None]), 1)
    c = tl.arange(0, CHUNK_S)
    d = tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_HEADS, BLOCK_D], dtype=tl.float32)
    for first in range(0, num_used, CHUNK_S):
        used = (first + c < num_used)[None, :]
        rows = head_rows[:, None] + first + c[None, :]
        weight = tl.exp2(
            tl.load(mid_lse_ptr + rows, mask=used, other=float("-inf"), cache_modifier=".cg")
            - top[:, None]
        )
        partial = tl.load(
            mid_o_ptr + rows[:, :, None] * BLOCK_D + d[None, None, :], mask=used[:, :, None],
            other=0.0, cache_modifier=".cg",
        )  # fmt: skip
        acc += tl.sum(weight[:, :, None] * partial, 1)
    out = acc / total[:, None]
    heads = head_block * HEADS + h
    o_ptrs = o_req_ptr + heads[:, None] * stride_o_head + d[None, :]
    o_mask = (h < HEADS)[:, None] & (d < HEAD_DIM)[None, :]
    tl.store(o_ptrs, out.to(o_req_ptr.dtype.element_ty), mask=o_mask)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    slots: torch.Tensor,
    seq_lens: torch.Tensor,
    num_splits: int,
    split_counters: torch.Tensor,
    longest_first: torch.Tensor | None = None,
    launch: DecodeLaunch | None = None,
) -> torch.Tensor:
    """q: [bs, qo_heads, D] (one token per request); caches: [locations, kv_heads, D];
    page_table: [rows, width] int32 pool locations; slots, seq_lens: [bs] int32 (seq_len >= 1);
    split_counters: int32 zeros, at least bs * qo_heads / launch.heads of them (left zero);
    longest_first: [bs] int32, the rows by seq_len, longest first; a batch above
    PREFETCH_MAX_BATCH then starts its longest requests first (a small one, whose programs all
    run at once, skips that read). Returns [bs, qo_heads, D]. Launch shapes and scratch depend on
    bs and num_splits only; launch: in place of decode_launch's (to sweep it)."""
    bs, qo_heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    group = qo_heads // kv_heads
    block_d = dot_block(head_dim)
    assert split_counters.dtype == torch.int32
    mid_o = torch.empty((bs, qo_heads, num_splits, block_d), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty((bs, qo_heads, num_splits), dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    block_n, num_warps, num_stages, heads = launch or decode_launch(
        bs, q.dtype, head_dim, shared_memory_per_program(q.device), group
    )
    heads = heads or group
    assert group % heads == 0 and split_counters.numel() >= bs * qo_heads // heads
    ordered = longest_first is not None and bs > PREFETCH_MAX_BATCH
    order = longest_first if ordered else seq_lens  # unordered: any int32 pointer, never read
    block_heads = triton.next_power_of_2(heads)
    _split_kernel[(num_splits, qo_heads // heads, bs)](
        q, k_cache, v_cache, page_table, slots, seq_lens, order,
        mid_o, mid_lse, out, split_counters,
        head_dim**-0.5 * math.log2(math.e),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0),
        k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), page_table.stride(0),
        GROUP=group, HEADS=heads, NUM_SPLITS=num_splits, HEAD_DIM=head_dim, BLOCK_H=dot_block(heads),
        BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d, BLOCK_N=block_n,
        BLOCK_HEADS=block_heads, CHUNK_S=reduce_chunk(heads, block_d, num_splits),
        PREFETCH=bs <= PREFETCH_MAX_BATCH, ORDERED=ordered, num_warps=num_warps,
        num_stages=num_stages,
        **pdl_args(q.device),
    )  # fmt: skip
    return out
