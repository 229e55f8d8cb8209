"""The inner step both paged attention kernels share: one block of keys, read through the page table."""

import triton
import triton.language as tl

_MIN_DOT_SIZE = 16  # tl.dot needs every dimension >= 16


def dot_block(n: int) -> int:
    """The power-of-two tile size that holds n, at least tl.dot's minimum (head groups pad up)."""
    return max(_MIN_DOT_SIZE, triton.next_power_of_2(n))


@triton.jit
def load_kv(locs, mask, k_ptr, v_ptr, stride_k_loc, stride_v_loc, d, d_mask):
    """The K and V rows at pool locations locs (zeros where mask is off)."""
    kv_mask = mask[:, None] & d_mask[None, :]
    # V is loaded before the scores need K, so a program of one block waits on memory once
    k = tl.load(k_ptr + locs[:, None] * stride_k_loc + d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_ptr + locs[:, None] * stride_v_loc + d[None, :], mask=kv_mask, other=0.0)
    return k, v


@triton.jit
def attend_loaded(
    q,  # [ROWS, BLOCK_D]: query rows, one head each
    q_pos,  # [ROWS]: each row's absolute position; it sees keys at positions <= q_pos
    m_i,  # [ROWS] running max of the scores (log2 units)
    l_i,  # [ROWS] running sum of 2^(score - m_i)
    acc,  # [ROWS, BLOCK_D] fp32 running sum of 2^(score - m_i) * v
    k,  # [BLOCK_N, BLOCK_D] this block's keys and values
    v,
    pos,  # [BLOCK_N] absolute key positions of this block
    in_range,  # [BLOCK_N] which of them exist
    qk_scale,  # softmax scale * log2(e): the kernels use exp2
    MASKED: tl.constexpr,  # False: every row sees every key of the block (no select needed)
):
    # ieee only changes fp32 inputs (no TF32, so fp32 matches the reference); fp16/bf16 ignore it
    scores = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
    if MASKED:
        visible = in_range[None, :] & (pos[None, :] <= q_pos[:, None])
        scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return m_new, l_i * alpha + tl.sum(p, 1), acc


@triton.jit
def attend_block(
    q, q_pos, m_i, l_i, acc, pos, in_range,
    page_row_ptr,  # the request's page-table row: pool location of each position
    k_ptr,  # K cache already offset to the KV head
    v_ptr, stride_k_loc, stride_v_loc, d, d_mask, qk_scale,
    MASKED: tl.constexpr,  # False: the whole block exists and every row sees it
):  # fmt: skip
    """attend_loaded on the block of keys at positions pos, read through the page table."""
    if MASKED:
        locs = tl.load(page_row_ptr + pos, mask=in_range, other=0).to(tl.int64)
        k, v = load_kv(locs, in_range, k_ptr, v_ptr, stride_k_loc, stride_v_loc, d, d_mask)
    else:
        locs = tl.load(page_row_ptr + pos).to(tl.int64)
        # other=0: a head_dim below its block's width leaves columns that enter the dot product
        k_ptrs = k_ptr + locs[:, None] * stride_k_loc + d[None, :]
        v_ptrs = v_ptr + locs[:, None] * stride_v_loc + d[None, :]
        k = tl.load(k_ptrs, mask=d_mask[None, :], other=0.0)
        v = tl.load(v_ptrs, mask=d_mask[None, :], other=0.0)
    return attend_loaded(q, q_pos, m_i, l_i, acc, k, v, pos, in_range, qk_scale, MASKED)
