"""The router of a mixture-of-experts layer in one kernel: softmax over the experts, top-k, and
the rescale of the k weights to sum 1, one program per token (at one token, more: below), in fp32.

In torch the same is five to seven kernels per sparse layer (softmax, top-k's two, the sum, the
division, the cast): about 20 us of a 76 us Qwen3-30B-A3B layer at one request (H200 profile).

At one token on a Hopper more programs route the same token, and each pulls a piece of the
first rows of a chosen expert's gate or up weights into L2 (l2_warm.py): the gate/up GEMV can load
nothing until the route has chosen.
"""

import torch
import triton
import triton.language as tl

from .l2_warm import can_warm, prefetch_l2
from .pdl import pdl_args, wait_for_previous

# the chosen experts' bytes warmed, split evenly over their gate and up rows: of 3, 6, 12 and 24
# MiB, 6 paid most (Qwen3-30B-A3B at one request, H100: 2.691-2.699 -> 2.665-2.675 ms a step; 3 MiB
# 2.700, 12 MiB 2.680, 24 MiB 2.703), in pieces of two programs per expert's gate or up rows
_WARM_BYTES = 6 * 2**20
_WARM_PROGRAMS_PER_CHUNK = 2


@triton.jit
def _route_kernel(
    logits_ptr, weights_ptr, ids_ptr, stride_logits, num_experts,
    warm_ptr, expert_bytes, up_offset, chunk_bytes,
    TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr, PIECES: tl.constexpr, WARM: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    # program (token, 0) writes the route; with WARM, program (token, 1 + c * PIECES + p) warms
    # piece p of chunk c: the first chunk_bytes of slot c // 2's expert's gate (c even) or up rows
    wait_for_previous(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_E)
    present = experts < num_experts
    logits = tl.load(
        logits_ptr + token * stride_logits + experts, mask=present, other=-float("inf")
    )
    logits = logits.to(tl.float32)
    exp = tl.exp(logits - tl.max(logits, 0))
    probs = exp / tl.sum(exp, 0)
    slots = tl.arange(0, BLOCK_K)
    weights = tl.zeros([BLOCK_K], dtype=tl.float32)
    ids = tl.zeros([BLOCK_K], dtype=tl.int64)
    # a pick is one max over keys that order by probability, then by the lower id (as torch):
    # the bits of a float >= 0 order as the float does. -1 is never chosen
    bits = probs.to(tl.int32, bitcast=True).to(tl.int64)
    left = tl.where(present, bits * BLOCK_E + (BLOCK_E - 1 - experts), -1)
    for k in tl.static_range(TOP_K):
        best = tl.max(left, 0)
        chosen = BLOCK_E - 1 - best % BLOCK_E
        weight = (best // BLOCK_E).to(tl.int32).to(tl.float32, bitcast=True)
        weights = tl.where(slots == k, weight, weights)
        ids = tl.where(slots == k, chosen, ids)
        left = tl.where(experts == chosen, -1, left)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, 0)  # unused slots hold 0
    warmer = tl.program_id(1) - 1
    if warmer < 0:
        out = token * TOP_K + slots
        tl.store(weights_ptr + out, weights.to(weights_ptr.dtype.element_ty), mask=slots < TOP_K)
        tl.store(ids_ptr + out, ids, mask=slots < TOP_K)
    elif WARM:  # a constexpr: no bulk prefetch is compiled for a device without one
        chunk = warmer // PIECES
        expert = tl.sum(tl.where(slots == chunk // 2, ids, 0), 0)
        piece = chunk_bytes // PIECES
        first = expert * expert_bytes + (chunk % 2) * up_offset + (warmer % PIECES) * piece
        prefetch_l2(warm_ptr.to(tl.pointer_type(tl.int8)) + first, piece)


def moe_route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, warm: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [tokens, top_k] in the logits' dtype, expert ids [tokens, top_k] int64). warm:
    the experts' gate/up weights [experts, 2 * inter, hidden] (gate rows, then up rows), whose
    chosen experts' first rows one token's route pulls into L2 where the device can."""
    tokens, num_experts = router_logits.shape
    weights = torch.empty(tokens, top_k, dtype=router_logits.dtype, device=router_logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=router_logits.device)
    if tokens == 0:
        return weights, ids
    expert_bytes = up_offset = chunk_bytes = 0
    if warm is not None and tokens == 1 and can_warm(warm.device):
        assert warm.is_contiguous()
        row_bytes = warm.shape[2] * warm.element_size()
        expert_bytes, up_offset = warm.shape[1] * row_bytes, warm.shape[1] // 2 * row_bytes
        unit = 16 * _WARM_PROGRAMS_PER_CHUNK  # each piece whole bulk-copy units
        chunk_bytes = min(_WARM_BYTES // (2 * top_k), up_offset) // unit * unit
    warmers = 2 * top_k * _WARM_PROGRAMS_PER_CHUNK if chunk_bytes else 0
    _route_kernel[(tokens, 1 + warmers)](
        router_logits, weights, ids, router_logits.stride(0), num_experts,
        warm if warmers else router_logits, expert_bytes, up_offset, chunk_bytes,
        TOP_K=top_k, RENORMALIZE=renormalize, BLOCK_E=triton.next_power_of_2(num_experts),
        BLOCK_K=triton.next_power_of_2(top_k), PIECES=_WARM_PROGRAMS_PER_CHUNK,
        WARM=warmers > 0,
        num_warps=1,  # a few values a thread: its reductions need no shared memory or barrier
        **pdl_args(router_logits.device),
    )  # fmt: skip
    return weights, ids
