"""The sparse MLP of a mixture-of-experts layer (Qwen3-MoE): a router picks each token's top-k
experts, an MoE backend runs them. Under TP each rank holds a slice of every expert's
intermediate dimension, as of a dense MLP's, and the partial outputs are summed across ranks."""

import torch

from minisgl.distributed import all_reduce, get_tp_info
from minisgl.kernel import add_rmsnorm_linear, moe_route
from minisgl.moe.base import MoEBackend, Routing
from minisgl.moe.recorder import record_routing
from minisgl.utils import div_even

from .base import BaseOP
from .norm import RMSNorm


class Router(BaseOP):
    """The gate's [experts, hidden] weight, whole on every rank. Weights only: the sparse MLP
    runs it with the norm before it (add_rmsnorm_linear)."""

    def __init__(self, num_experts: int, hidden_size: int) -> None:
        self.weight = torch.empty(num_experts, hidden_size)


class Experts(BaseOP):
    """Every expert's gated MLP, stacked: gate_up_proj [experts, 2 * inter, hidden] (each
    expert's gate rows, then its up rows) and down_proj [experts, hidden, inter], inter being
    this rank's slice. Weights only: the MoE backend runs them."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        local = div_even(intermediate_size, get_tp_info().size)
        self.gate_up_proj = torch.empty(num_experts, 2 * local, hidden_size)
        self.down_proj = torch.empty(num_experts, hidden_size, local)


class SparseMLP(BaseOP):
    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        renormalize: bool,
        backend: MoEBackend,
    ) -> None:
        self.gate = Router(num_experts, hidden_size)
        self.experts = Experts(num_experts, hidden_size, intermediate_size)
        self._top_k = top_k
        self._renormalize = renormalize
        self._backend = backend
        self._tp_size = get_tp_info().size

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        input_norm: RMSNorm,
        next_weight: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The experts' output for norm(x + residual) and the new residual, x + residual.
        next_weight: the next layer's first matmul's, which the router's matmul may pull into
        L2 (add_rmsnorm_linear's `warm`)."""
        x, logits, residual = add_rmsnorm_linear(
            x, residual, input_norm.weight, input_norm.eps, self.gate.weight, next_weight
        )
        experts = self.experts
        routing = Routing(*moe_route(logits, self._top_k, self._renormalize, experts.gate_up_proj))
        record_routing(routing.ids, self.gate.weight.shape[0])
        out = self._backend.forward(x, experts.gate_up_proj, experts.down_proj, routing)
        return (out if self._tp_size == 1 else all_reduce(out)), residual
