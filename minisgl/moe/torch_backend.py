import torch

from minisgl.kernel import linear, silu_and_mul

from .base import MoEBackend, Routing


class TorchMoE(MoEBackend):
    """The reference: tokens grouped by expert, one matmul pair per expert that received any.
    Each expert's weighted output is added in ascending expert order, as Hugging Face's eager
    experts add theirs, so fp32 agrees with it to the last bits."""

    # the host reads how many tokens each expert received
    supports_cuda_graph = False

    def forward(
        self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, routing: Routing
    ) -> torch.Tensor:
        ids = routing.ids.flatten()
        order = ids.argsort(stable=True)
        tokens = order // routing.ids.shape[1]
        weights = routing.weights.flatten()[order, None]
        counts = torch.bincount(ids, minlength=w13.shape[0]).tolist()
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows = tokens[start : start + count]
            hidden = silu_and_mul(linear(x[rows], w13[expert]))
            out.index_add_(0, rows, linear(hidden, w2[expert]) * weights[start : start + count])
            start += count
        return out
