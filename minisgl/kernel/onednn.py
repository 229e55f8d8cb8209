"""Matmuls on the CPU through oneDNN, each weight packed once into oneDNN's blocked layout for it.
torch's F.linear sends fp32 to MKL and bf16 to oneDNN with the weight in its plain layout, which
oneDNN reorders on every call. On the workplace's 2-core AMD EPYC (Zen 5), fp32 through MKL ran
the CPU benchmark model's matmuls at 1/2 to 1/4 of oneDNN's speed (32 x 32000 x 512: 28 against
8 ms), and packing cut a run's CPU time by a further 20 % (benchmark/RESULTS.md, 2026-12-02).
oneDNN's fp32 sums are ordered differently from MKL's: results differ in the last bits."""

import os

import torch

# below this many multiply-adds F.linear is faster: a oneDNN call costs ~15 us more (2-core EPYC)
MIN_MACS = 1 << 20


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """weight [N, K] in oneDNN's layout, where oneDNN runs its dtype on this CPU (fp32, bf16 with
    native bf16); None elsewhere, or when MINISGL_CPU_MATMUL=torch asks for F.linear everywhere
    (the reference, for tests and ablation)."""
    if (
        weight.device.type != "cpu"
        or os.environ.get("MINISGL_CPU_MATMUL") == "torch"
        or not torch.backends.mkldnn.is_available()
    ):
        return None
    if weight.dtype == torch.float32 or (
        weight.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    ):
        return torch.ops.mkldnn._reorder_linear_weight(weight, None)
    return None


def serves(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None) -> bool:
    """Whether oneDNN takes x @ weight^T: packed, and enough work to repay its call."""
    return packed is not None and x.numel() // x.shape[-1] * weight.numel() >= MIN_MACS


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
