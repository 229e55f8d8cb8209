"""Paged extend (prefill) attention: each request's new tokens attend causally to its cached prefix
and to themselves, every K/V read through the page table (the backend stored the new K/V first).

Ragged batches run in one launch: the host cuts each request's new tokens into blocks of
EXTEND_BLOCK_M rows and lists (request, first row) per block, so no program idles on padding.
Blocks that read the most keys come first, each block's head programs side by side: the SMs take
the longest programs first and finish together, where one long causal prompt's last blocks would
otherwise start in the last wave.
"""

import math

import torch
import triton
import triton.language as tl

from .attention_block import attend_block, dot_block
from .pdl import pdl_args, wait_for_previous

EXTEND_BLOCK_M = 64  # new tokens per program; the host-side block map is built in these units


@triton.jit
def _extend_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    page_table_ptr,
    slots_ptr,
    seq_lens_ptr,
    cu_seqlens_q_ptr,
    block_req_ptr,
    block_start_ptr,
    qk_scale,
    stride_q_tok,
    stride_q_head,
    stride_k_loc,
    stride_k_head,
    stride_v_loc,
    stride_v_head,
    stride_o_tok,
    stride_o_head,
    stride_pt_row,
    GROUP: tl.constexpr,
    HEADS: tl.constexpr,  # query heads of one KV head per program (a power of two)
    HEAD_PROGRAMS: tl.constexpr,  # programs per block of new tokens: KV heads x cdiv(GROUP, HEADS)
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_previous(USE_PDL)
    block, head_block = tl.program_id(0) // HEAD_PROGRAMS, tl.program_id(0) % HEAD_PROGRAMS
    programs_per_kv_head = tl.cdiv(GROUP, HEADS)
    kv_head = head_block // programs_per_kv_head
    req = tl.load(block_req_ptr + block)
    first = tl.load(block_start_ptr + block)
    q_begin = tl.load(cu_seqlens_q_ptr + req)
    extend_len = tl.load(cu_seqlens_q_ptr + req + 1) - q_begin
    seq_len = tl.load(seq_lens_ptr + req)
    slot = tl.load(slots_ptr + req).to(tl.int64)

    # row r of the tile: new token first + r // HEADS, query head r % HEADS of the program's
    # heads, so the heads sharing K/V read each block of it once
    r = tl.arange(0, BLOCK_M * HEADS)
    t = first + r // HEADS  # index among the request's new tokens
    g = (head_block % programs_per_kv_head) * HEADS + r % HEADS  # head within the KV group
    heads = kv_head * GROUP + g
    row_mask = (t < extend_len) & (g < GROUP)
    prefix_len = seq_len - extend_len
    q_pos = prefix_len + t  # absolute position: sees keys up to and including it
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    rows = (q_begin + t).to(tl.int64)
    q_ptrs = q_ptr + rows[:, None] * stride_q_tok + heads[:, None] * stride_q_head + d[None, :]
    q = tl.load(q_ptrs, mask=row_mask[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_M * HEADS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M * HEADS], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M * HEADS, BLOCK_D], dtype=tl.float32)
    page_row_ptr = page_table_ptr + slot * stride_pt_row
    k_head_ptr = k_ptr + kv_head * stride_k_head
    v_head_ptr = v_ptr + kv_head * stride_v_head
    key_end = tl.minimum(seq_len, prefix_len + first + BLOCK_M)  # after the block's last row
    # every row sees the keys up to its first row's position: no mask before that (the cached
    # prefix and earlier blocks), the causal mask on the last key blocks only
    unmasked_end = (prefix_len + first + 1) // BLOCK_N * BLOCK_N
    for block_start in range(0, unmasked_end, BLOCK_N):
        pos = block_start + tl.arange(0, BLOCK_N)
        m_i, l_i, acc = attend_block(
            q, q_pos, m_i, l_i, acc, pos, pos < key_end, page_row_ptr, k_head_ptr, v_head_ptr,
            stride_k_loc, stride_v_loc, d, d_mask, qk_scale, False,
        )  # fmt: skip
    for block_start in range(unmasked_end, key_end, BLOCK_N):
        pos = block_start + tl.arange(0, BLOCK_N)
        m_i, l_i, acc = attend_block(
            q, q_pos, m_i, l_i, acc, pos, pos < key_end, page_row_ptr, k_head_ptr, v_head_ptr,
            stride_k_loc, stride_v_loc, d, d_mask, qk_scale, True,
        )  # fmt: skip

    out = acc / l_i[:, None]  # every row sees key 0, so l_i > 0
    o_ptrs = o_ptr + rows[:, None] * stride_o_tok + heads[:, None] * stride_o_head + d[None, :]
    tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


def extend_blocks(prefix_lens: list[int], extend_lens: list[int]) -> tuple[list[int], list[int]]:
    """(request, first new-token index) of each q block, as two lists, the blocks that read the
    most keys first (ties in request order)."""
    blocks = [(i, s) for i, n in enumerate(extend_lens) for s in range(0, n, EXTEND_BLOCK_M)]
    keys_read = [prefix_lens[i] + min(s + EXTEND_BLOCK_M, extend_lens[i]) for i, s in blocks]
    order = sorted(range(len(blocks)), key=keys_read.__getitem__, reverse=True)
    return [blocks[b][0] for b in order], [blocks[b][1] for b in order]


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    slots: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    block_req: torch.Tensor,
    block_start: torch.Tensor,
) -> torch.Tensor:
    """q: [tokens, qo_heads, D], request i's rows at cu_seqlens_q[i]:cu_seqlens_q[i+1];
    caches: [locations, kv_heads, D] already holding the new K/V; page_table: [rows, width] int32;
    slots, seq_lens: [bs] int32; block_req, block_start: the rows of `extend_blocks`.
    Returns [tokens, qo_heads, D]."""
    _, qo_heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    group = qo_heads // kv_heads
    # two query heads per program where a KV head serves two or more (tiles of 128 rows): 216 us
    # against 227 with one (H200, bf16, a 16,384-token chunk, 16 / 8 heads; best of 14 launches)
    heads = min(triton.next_power_of_2(group), 2)
    head_programs = kv_heads * triton.cdiv(group, heads)
    out = torch.empty_like(q)
    two_bytes = q.element_size() == 2  # fp32 tiles take twice the shared memory
    _extend_kernel[(block_req.shape[0] * head_programs,)](
        q, k_cache, v_cache, out, page_table, slots, seq_lens, cu_seqlens_q, block_req,
        block_start, head_dim**-0.5 * math.log2(math.e),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), out.stride(0), out.stride(1), page_table.stride(0),
        GROUP=group, HEADS=heads, HEAD_PROGRAMS=head_programs, HEAD_DIM=head_dim,
        BLOCK_M=EXTEND_BLOCK_M, BLOCK_D=dot_block(head_dim), BLOCK_N=64 if two_bytes else 32,
        num_warps=4, num_stages=3 if two_bytes else 2, **pdl_args(q.device),
    )  # fmt: skip
    return out
