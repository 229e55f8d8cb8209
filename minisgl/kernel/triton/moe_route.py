"""The router of a mixture-of-experts layer in one kernel: softmax over the experts, top-k, and
the rescale of the k weights to sum 1, one program per token, in fp32.

In torch the same is five to seven kernels per sparse layer (softmax, top-k's two, the sum, the
division, the cast): about 20 us of a 76 us Qwen3-30B-A3B layer at one request (H200 profile).
"""

import torch
import triton
import triton.language as tl

from .pdl import pdl_args, wait_for_previous


@triton.jit
def _route_kernel(
    logits_ptr, weights_ptr, ids_ptr, stride_logits, num_experts,
    TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
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
    out = token * TOP_K + slots
    tl.store(weights_ptr + out, weights.to(weights_ptr.dtype.element_ty), mask=slots < TOP_K)
    tl.store(ids_ptr + out, ids, mask=slots < TOP_K)


def moe_route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [tokens, top_k] in the logits' dtype, expert ids [tokens, top_k] int64)."""
    tokens, num_experts = router_logits.shape
    weights = torch.empty(tokens, top_k, dtype=router_logits.dtype, device=router_logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=router_logits.device)
    if tokens == 0:
        return weights, ids
    _route_kernel[(tokens,)](
        router_logits, weights, ids, router_logits.stride(0), num_experts,
        TOP_K=top_k, RENORMALIZE=renormalize, BLOCK_E=triton.next_power_of_2(num_experts),
        BLOCK_K=triton.next_power_of_2(top_k),
        num_warps=1,  # a few values a thread: its reductions need no shared memory or barrier
        **pdl_args(router_logits.device),
    )  # fmt: skip
    return weights, ids
