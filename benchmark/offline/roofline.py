"""The compute side of the floor: what a token costs in FLOPs, the device's measured matmul peak,
and the roofline time of a workload, where each step takes the longer of its memory traffic and
its arithmetic.

The bandwidth floor (`common.floor_bytes`) counts prefill as free and decode as bound by memory
alone; on an 8B model prefill takes a fifth of the run at the matmul peak, and a 256-row decode
step does as much arithmetic as the H200 finishes in the time it reads the weights, so the
roofline is the tighter floor there.
"""

import statistics
from dataclasses import dataclass

import torch
from common import device_seconds

from minisgl.models.config import ModelConfig


@dataclass(frozen=True)
class ModelCost:
    """FLOPs of one token through the model (matmuls; norms and activations are noise)."""

    layer_flops: int  # the layers' matmuls (the experts a token selects, for MoE)
    head_flops: int  # the LM head: only tokens that are sampled pay it
    attention_flops: int  # one query against one key, over all layers (QK^T and PV)

    @classmethod
    def of(cls, mc: ModelConfig) -> "ModelCost":
        qkv_o = mc.hidden_size * (2 * mc.num_qo_heads + 2 * mc.num_kv_heads) * mc.head_dim
        dense_mlp = 3 * mc.hidden_size * mc.intermediate_size
        params = mc.num_layers * (qkv_o + dense_mlp)
        if mc.moe is not None:
            sparse_mlp = mc.moe.top_k * 3 * mc.hidden_size * mc.moe.intermediate_size
            router = mc.hidden_size * mc.moe.num_experts
            params += len(mc.moe.layers) * (sparse_mlp + router - dense_mlp)
        return cls(
            layer_flops=2 * params,
            head_flops=2 * mc.vocab_size * mc.hidden_size,
            attention_flops=4 * mc.num_layers * mc.num_qo_heads * mc.head_dim,
        )

    def prefill_flops(self, prompt_len: int) -> int:
        """One prompt's prefill: every token through the layers, causal attention (half the
        square), and the LM head for its last token."""
        causal_pairs = prompt_len * (prompt_len + 1) // 2
        return prompt_len * self.layer_flops + causal_pairs * self.attention_flops + self.head_flops


def measure_matmul_peak(
    device: torch.device, dtype: torch.dtype, size: int | None = None, repeats: int = 10
) -> float:
    """FLOP/s of a square matmul, the median of `repeats`: the compute roof this device reaches."""
    if size is None:  # large enough for full tiles on every SM; small on the host for smoke runs
        size = 8192 if device.type == "cuda" else 512
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(3):  # warm-ups: clocks up, cuBLAS's choice cached
        torch.matmul(a, b)
    seconds = [device_seconds(lambda: torch.matmul(a, b), device) for _ in range(repeats)]
    return 2 * size**3 / statistics.median(seconds)


def roofline_seconds(
    prompt_lens: list[int],
    output_lens: list[int],
    cost: ModelCost,
    weight_bytes: int,
    kv_per_token: int,
    bandwidth: float,
    peak: float,
) -> tuple[float, float]:
    """(overlapped, serial) lower bounds on a run's time when all requests start together, as
    the bandwidth floor assumes: every prompt is prefilled (bound by its FLOPs) before step 1.

    Overlapped: each decode step takes max(its bytes / bandwidth, its FLOPs / peak). Serial: the
    matmuls (bound by the weights or by their FLOPs), then attention (bound by its KV or its
    FLOPs), one after the other, as an engine that runs one kernel at a time does.
    """
    prefill = sum(cost.prefill_flops(p) for p in prompt_lens) / peak
    overlapped = serial = prefill
    for step in range(1, max(output_lens) + 1):
        live = [p + step for p, o in zip(prompt_lens, output_lens, strict=True) if o >= step]
        context = sum(live)
        matmul_flops = len(live) * (cost.layer_flops + cost.head_flops)
        kv_bytes = context * kv_per_token
        flops = matmul_flops + context * cost.attention_flops
        overlapped += max((weight_bytes + kv_bytes) / bandwidth, flops / peak)
        attention_s = max(kv_bytes / bandwidth, context * cost.attention_flops / peak)
        serial += max(weight_bytes / bandwidth, matmul_flops / peak) + attention_s
    return overlapped, serial
