import torch

from minisgl.kernel.triton import fused_moe

from .base import MoEBackend, Routing


class TritonMoE(MoEBackend):
    """The fused Triton kernels (`minisgl.kernel.triton.fused_moe`): a GEMV per chosen expert for
    a few tokens, a grouped GEMM over the tokens sorted by expert for more. Shapes depend on the
    token count only and nothing is read back to the host, so a decode step's CUDA graph holds
    the layer."""

    def forward(
        self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, routing: Routing
    ) -> torch.Tensor:
        return fused_moe(x, w13, w2, routing.weights.contiguous(), routing.ids.contiguous())
