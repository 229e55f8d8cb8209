"""The fused mixture-of-experts: each token through the k experts its router chose, weighted and
summed (`MoEBackend.forward`'s contract). A (token, slot) pair is p = t * k + j. Both paths read
the weights of the chosen experts only, and apply the SiLU-and-mul inside the gate/up kernel, so
the intermediate is [pairs, inter], never [pairs, 2 * inter]:

- a few tokens (decode): no grouping. The gate/up kernel is a GEMV per pair over its expert's
  rows (gemv.py's, gate and up rows interleaved); the down kernel reads a token's k experts'
  rows in one loop (at one token, the first two as a block before its PDL wait), each h scaled
  by its routing weight, summed in fp32, so it writes [tokens, hidden] itself. Both issue each
  tile's load before the previous tile's products.
- more tokens: the pairs grouped by expert in blocks (moe_align.py) and a grouped GEMM over the
  blocks, each program one block's rows times one tile of its expert. The gate/up kernel keeps a
  gate and an up accumulator for the same rows; the down kernel multiplies each row by its
  routing weight and writes [pairs, hidden], summed over k after.

Every launch has a fixed grid for a given token count (the grouped one sized by the worst case),
so a decode step's CUDA graph holds the whole layer.
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .activation import silu_and_mul_rounded
from .gemv import GemvConfig, weight_eviction
from .moe_align import align_by_expert
from .pdl import pdl_args, wait_for_previous

# up to this many tokens the GEMVs run: there the grouping's ~18 small torch ops (a launch each,
# ~2 us in a graph) cost more than reading twice the few experts that two pairs share.
# bench_moe.py on an H200, Qwen3-30B-A3B's layer: 8 tokens 151 us (GEMVs) against 160 (grouped),
# 16 tokens 293 against 228
_GEMV_MAX_TOKENS = 8


class MoETile(NamedTuple):
    block_m: int  # pairs per program (tl.dot needs 16 at least)
    block_n: int  # rows of W per program; the gate/up kernel's are half gate, half up
    block_k: int  # elements of each W row per iteration
    num_warps: int
    num_stages: int


# decode: a program per pair (gate/up) or token (down) and a few rows of W. `bench_moe.py
# --sweep` on an H200, one token at Qwen3-30B-A3B's layer (each kernel's tile varied, the
# other's fixed; us for the layer's pair of kernels): gate/up 22.7 at (16, 256, 2) against 24.6
# at gemv.py's gated (8, 512, 4); down 24.6 at (4, 1024, 4), a whole expert row of 768 a step,
# against 29.4 at (8, 512, 4)
DEFAULT_GEMV_TILES = GemvConfig(16, 256, 2), GemvConfig(4, 1024, 4)  # gate/up, down
# one token's down kernel loads its first 2 experts' rows (a tile each) as a block before its
# wait, with the loop's first tile, while the gate/up kernel's last programs run: Qwen3-30B-A3B at
# one request on an H100, 2.726 -> 2.691-2.699 ms a step (with the router's L2 warming); 4
# experts (233 registers a thread, 2 programs an SM) 2.746 against 2.724 for 2 without it
_EARLY_EXPERTS = 2
# grouped, by the mean pairs per expert: (up to this many, tile); after vLLM's tuned tiles for
# 128 experts of 768 on an H200 (its token counts 128, 256, 512 and 1,024 at top-8); block_n
# counts W rows, so the gate/up kernel's two accumulators take half each
_GROUPED_TILES = (
    # most experts have a block of padding: the smallest block, long K steps (memory-bound)
    (8, MoETile(16, 128, 128, 4, 3)),
    # a block about twice the mean: few blocks per expert re-read its tiles, little padding
    (16, MoETile(32, 128, 128, 4, 3)),
    (32, MoETile(64, 128, 64, 4, 3)),
)
# prefill: compute-bound, the largest tiles with 8 warps and a deep pipeline
_LARGE_TILE = MoETile(128, 256, 64, 8, 4)


def grouped_tile(pairs: int, num_experts: int) -> MoETile:
    """The tile for `pairs` over `num_experts`, by the mean per expert (a near-even routing)."""
    mean = pairs / num_experts
    return next((tile for most, tile in _GROUPED_TILES if mean <= most), _LARGE_TILE)


@triton.jit
def _moe_gemv_gate_up_kernel(
    x_ptr, w_ptr, ids_ptr, h_ptr, N, K, stride_x, stride_we, stride_wn, stride_h,
    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    W_EVICTION: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    # h[pair, n] for BLOCK_N // 2 features n: rows gate_n and up_n (N rows below) alternate.
    # Each tile's load is issued before the previous tile's products (two in flight). Every
    # program passes its wait before anything else: the down kernel's early loads rely on it
    pair = tl.program_id(1)
    r = tl.arange(0, BLOCK_N)
    n = tl.program_id(0) * (BLOCK_N // 2) + r // 2
    n_mask = n < N
    k = tl.arange(0, BLOCK_K)
    wait_for_previous(USE_PDL)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    w_rows = w_ptr + expert * stride_we + (n + (r % 2) * N)[:, None] * stride_wn
    x_row = x_ptr + (pair // TOP_K) * stride_x
    w = tl.load(
        w_rows + k[None, :],
        mask=n_mask[:, None] & (k < K)[None, :],
        other=0.0,
        eviction_policy=W_EVICTION,
    )
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        k_mask = k0 + k < K
        w_next = tl.load(
            w_rows + k0 + k[None, :],
            mask=n_mask[:, None] & k_mask[None, :],
            other=0.0,
            eviction_policy=W_EVICTION,
        )
        x = tl.load(x_row + k0 - BLOCK_K + k)  # a tile before the last is whole
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        w = w_next
    last = (tl.cdiv(K, BLOCK_K) - 1) * BLOCK_K
    x = tl.load(x_row + last + k, mask=last + k < K, other=0.0)
    acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    gate, up = tl.split(tl.reshape(tl.sum(acc, 1), [BLOCK_N // 2, 2]))
    first = tl.program_id(0) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    out = silu_and_mul_rounded(gate, up, h_ptr.dtype.element_ty)
    tl.store(h_ptr + pair * stride_h + first, out, mask=first < N)


@triton.jit
def _down_weights(
    w_ptr, ids_ptr, first_pair, i, steps, n, n_mask, k, K, stride_we, stride_wn,
    BLOCK_K: tl.constexpr, W_EVICTION: tl.constexpr,
):  # fmt: skip
    """Tile i of a token's down rows end to end: W's rows n of its pair's expert."""
    k0 = (i % steps) * BLOCK_K
    expert = tl.load(ids_ptr + first_pair + i // steps).to(tl.int64)
    w_rows = w_ptr + expert * stride_we + n[:, None] * stride_wn
    mask = n_mask[:, None] & (k0 + k < K)[None, :]
    return tl.load(w_rows + k0 + k[None, :], mask=mask, other=0.0, eviction_policy=W_EVICTION)


@triton.jit
def _down_input(h_ptr, weights_ptr, first_pair, i, steps, k, K, stride_h, BLOCK_K: tl.constexpr):
    """The h that tile i multiplies, scaled by its pair's routing weight."""
    pair = first_pair + i // steps
    k0 = (i % steps) * BLOCK_K
    h = tl.load(h_ptr + pair * stride_h + k0 + k, mask=k0 + k < K, other=0.0).to(tl.float32)
    return h * tl.load(weights_ptr + pair).to(tl.float32)


@triton.jit
def _moe_gemv_down_kernel(
    h_ptr, w_ptr, ids_ptr, weights_ptr, out_ptr, N, K, stride_h, stride_we, stride_wn,
    stride_out, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EARLY: tl.constexpr, W_EVICTION: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    # out[token, n] for BLOCK_N features n: one loop over the token's k experts' rows end to end,
    # each tile's load issued before the previous tile's products, so the next expert's rows are
    # in flight while one's are summed; EARLY > 0: the first EARLY experts' rows as one block
    # ahead of the loop (the host passes it only where one tile holds a whole row, K <= BLOCK_K)
    token = tl.program_id(1)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    k = tl.arange(0, BLOCK_K)
    steps = tl.cdiv(K, BLOCK_K)
    first_pair = token * TOP_K
    # the ids are the route's, two kernels back: the gate/up kernel lets this one launch once its
    # programs have passed their wait, which returns once the route has finished (pdl.py), so
    # the block and the loop's first tile load before this kernel's wait
    if EARLY > 0:
        early_pairs = first_pair + tl.arange(0, EARLY)
        experts = tl.load(ids_ptr + early_pairs).to(tl.int64)
        w_early = tl.load(
            w_ptr + experts[:, None, None] * stride_we + n[None, :, None] * stride_wn
            + k[None, None, :],
            mask=n_mask[None, :, None] & (k < K)[None, None, :], other=0.0,
            eviction_policy=W_EVICTION,
        )  # fmt: skip
    w = _down_weights(
        w_ptr, ids_ptr, first_pair, EARLY, steps, n, n_mask, k, K, stride_we, stride_wn, BLOCK_K,
        W_EVICTION,
    )  # fmt: skip
    wait_for_previous(USE_PDL)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    if EARLY > 0:
        h_early = tl.load(
            h_ptr + early_pairs[:, None] * stride_h + k[None, :], mask=(k < K)[None, :], other=0.0
        ).to(tl.float32)
        h_early *= tl.load(weights_ptr + early_pairs).to(tl.float32)[:, None]
        acc += tl.sum(w_early.to(tl.float32) * h_early[:, None, :], 0)
    h = _down_input(h_ptr, weights_ptr, first_pair, EARLY, steps, k, K, stride_h, BLOCK_K)
    for i in range(EARLY + 1, TOP_K * steps):
        w_next = _down_weights(
            w_ptr, ids_ptr, first_pair, i, steps, n, n_mask, k, K, stride_we, stride_wn, BLOCK_K,
            W_EVICTION,
        )  # fmt: skip
        h_next = _down_input(h_ptr, weights_ptr, first_pair, i, steps, k, K, stride_h, BLOCK_K)
        acc += w.to(tl.float32) * h[None, :]
        w, h = w_next, h_next
    acc += w.to(tl.float32) * h[None, :]
    tl.store(
        out_ptr + token * stride_out + n, tl.sum(acc, 1).to(out_ptr.dtype.element_ty), mask=n_mask
    )


@triton.jit
def _block_rows(slots_ptr, expert_ptr, num_pairs, BLOCK_M: tl.constexpr):
    """This program's block (a valid one): its rows' pairs, which rows hold one, its expert."""
    block = tl.program_id(1)
    slots = tl.load(slots_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    return slots, slots < num_pairs, tl.load(expert_ptr + block).to(tl.int64)


@triton.jit(do_not_specialize=["num_pairs"])  # one build for every token count
def _moe_gate_up_kernel(
    x_ptr, w_ptr, h_ptr, slots_ptr, expert_ptr, num_blocks_ptr, num_pairs, N, K, stride_x,
    stride_we, stride_wn, stride_h, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    # h[pair, n] for the block's pairs and BLOCK_N features n: silu(x W_gate^T) * (x W_up^T)
    wait_for_previous(USE_PDL)
    if tl.program_id(1) >= tl.load(num_blocks_ptr):
        return
    slots, valid, expert = _block_rows(slots_ptr, expert_ptr, num_pairs, BLOCK_M)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + (slots // TOP_K)[:, None] * stride_x
    gate_cols = w_ptr + expert * stride_we + n[None, :] * stride_wn  # W^T tiles: [k, n]
    up_cols = gate_cols + N * stride_wn
    gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = k0 + k < K
        x = tl.load(x_rows + k0 + k[None, :], mask=valid[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & n_mask[None, :]
        w_gate = tl.load(gate_cols + k0 + k[:, None], mask=w_mask, other=0.0)
        w_up = tl.load(up_cols + k0 + k[:, None], mask=w_mask, other=0.0)
        gate = tl.dot(x, w_gate, gate, input_precision="ieee")
        up = tl.dot(x, w_up, up, input_precision="ieee")
    out = silu_and_mul_rounded(gate, up, h_ptr.dtype.element_ty)
    mask = valid[:, None] & n_mask[None, :]
    tl.store(h_ptr + slots[:, None] * stride_h + n[None, :], out, mask=mask)


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_down_kernel(
    h_ptr, w_ptr, weights_ptr, out_ptr, slots_ptr, expert_ptr, num_blocks_ptr, num_pairs, N, K,
    stride_h, stride_we, stride_wn, stride_out, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    # out[pair, n] = weight[pair] * (h[pair] W^T)[n] for the block's pairs and BLOCK_N features
    wait_for_previous(USE_PDL)
    if tl.program_id(1) >= tl.load(num_blocks_ptr):
        return
    slots, valid, expert = _block_rows(slots_ptr, expert_ptr, num_pairs, BLOCK_M)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    k = tl.arange(0, BLOCK_K)
    h_rows = h_ptr + slots[:, None] * stride_h
    w_cols = w_ptr + expert * stride_we + n[None, :] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = k0 + k < K
        h = tl.load(h_rows + k0 + k[None, :], mask=valid[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_cols + k0 + k[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(h, w, acc, input_precision="ieee")
    acc *= tl.load(weights_ptr + slots, mask=valid, other=0.0).to(tl.float32)[:, None]
    out = acc.to(out_ptr.dtype.element_ty)
    mask = valid[:, None] & n_mask[None, :]
    tl.store(out_ptr + slots[:, None] * stride_out + n[None, :], out, mask=mask)


def _check(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> None:
    assert x.stride(1) == 1 and w13.stride(2) == 1 and w2.stride(2) == 1
    assert w13.shape[1] == 2 * w2.shape[2] and ids.shape == weights.shape
    assert ids.is_contiguous() and weights.is_contiguous()


def _block_k(block_k: int, k: int, dtype: torch.dtype) -> int:
    """The tiles' block_k counts 2-byte elements: fp32 takes half as many (a pipeline stage
    needs the same shared memory), and no more than K needs."""
    return min(block_k * 2 // dtype.itemsize, max(16, triton.next_power_of_2(k)))


def gemv_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up: GemvConfig = DEFAULT_GEMV_TILES[0],
    down: GemvConfig = DEFAULT_GEMV_TILES[1],
) -> torch.Tensor:
    """fused_moe's path for a few tokens: a GEMV per pair, then one per token over its pairs."""
    _check(x, w13, w2, weights, ids)
    (tokens, top_k), (hidden, inter) = ids.shape, w2.shape[1:]
    # one token's k experts are distinct: each row of theirs is read once
    eviction = weight_eviction(tokens)
    h = torch.empty((tokens * top_k, inter), dtype=x.dtype, device=x.device)
    _moe_gemv_gate_up_kernel[(triton.cdiv(inter, gate_up.block_n // 2), tokens * top_k)](
        x, w13, ids, h, inter, hidden, x.stride(0), w13.stride(0), w13.stride(1), h.stride(0),
        TOP_K=top_k, BLOCK_N=gate_up.block_n, BLOCK_K=_block_k(gate_up.block_k, hidden, x.dtype),
        W_EVICTION=eviction, num_warps=gate_up.num_warps, **pdl_args(x.device),
    )  # fmt: skip
    out = torch.empty_like(x)
    down_k = _block_k(down.block_k, inter, x.dtype)
    early = _EARLY_EXPERTS if tokens == 1 and down_k >= inter and top_k > _EARLY_EXPERTS else 0
    _moe_gemv_down_kernel[(triton.cdiv(hidden, down.block_n), tokens)](
        h, w2, ids, weights, out, hidden, inter, h.stride(0), w2.stride(0), w2.stride(1),
        out.stride(0), TOP_K=top_k, BLOCK_N=down.block_n, BLOCK_K=down_k, EARLY=early,
        W_EVICTION=eviction, num_warps=down.num_warps, **pdl_args(x.device),
    )  # fmt: skip
    return out


def grouped_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    tile: MoETile,
) -> torch.Tensor:
    """fused_moe's path for more tokens: grouped GEMMs over the pairs in blocks of one expert."""
    _check(x, w13, w2, weights, ids)
    (tokens, top_k), (num_experts, hidden, inter) = ids.shape, w2.shape
    pairs = tokens * top_k
    blocks = align_by_expert(ids, num_experts, tile.block_m)
    grid_m = blocks.expert.numel()
    launch = dict(
        BLOCK_M=tile.block_m, num_warps=tile.num_warps, num_stages=tile.num_stages,
        **pdl_args(x.device),
    )  # fmt: skip
    h = torch.empty((pairs, inter), dtype=x.dtype, device=x.device)
    _moe_gate_up_kernel[(triton.cdiv(inter, tile.block_n // 2), grid_m)](
        x, w13, h, *blocks, pairs, inter, hidden, x.stride(0), w13.stride(0), w13.stride(1),
        h.stride(0), TOP_K=top_k, BLOCK_N=tile.block_n // 2,
        BLOCK_K=_block_k(tile.block_k, hidden, x.dtype), **launch,
    )  # fmt: skip
    out = torch.empty((pairs, hidden), dtype=x.dtype, device=x.device)
    _moe_down_kernel[(triton.cdiv(hidden, tile.block_n), grid_m)](
        h, w2, weights, out, *blocks, pairs, hidden, inter, h.stride(0), w2.stride(0),
        w2.stride(1), out.stride(0), BLOCK_N=tile.block_n, BLOCK_K=_block_k(tile.block_k, inter, x.dtype),
        **launch,
    )  # fmt: skip
    return out.view(tokens, top_k, hidden).sum(1)


def fused_moe(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """x: [tokens, hidden]; w13: [experts, 2 * inter, hidden], each expert's gate rows then its
    up rows; w2: [experts, hidden, inter]; weights, ids: [tokens, k] (contiguous). Returns
    [tokens, hidden]: sum over j of weights[t, j] * w2[e] @ (silu(gate_e @ x[t]) * (up_e @
    x[t])), e = ids[t, j]; by the GEMVs or the grouped GEMM, as the token count says."""
    if ids.shape[0] <= _GEMV_MAX_TOKENS:
        return gemv_moe(x, w13, w2, weights, ids)
    return grouped_moe(x, w13, w2, weights, ids, grouped_tile(ids.numel(), w13.shape[0]))
