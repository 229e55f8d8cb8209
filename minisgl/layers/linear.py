"""Linear layers, one class per way of sharding under tensor parallelism (TP size 1: plain linears).

Each computes this rank's shapes from the TP info; the weight loader slices checkpoints to match.
"""

import torch

from minisgl.distributed import all_reduce, get_tp_info
from minisgl.kernel import linear, linear_split_k, pack_weight, rmsnorm_linear
from minisgl.utils import div_even

from .base import BaseOP
from .norm import RMSNorm


class _LinearTPImpl(BaseOP):
    """This rank's [output, input] slice of a linear layer."""

    def __init__(self, local_isize: int, local_osize: int, has_bias: bool) -> None:
        self.weight = torch.empty(local_osize, local_isize)
        self.bias = torch.empty(local_osize) if has_bias else None
        self._packed: torch.Tensor | None = None

    def pack_weights(self) -> None:
        self._packed = pack_weight(self.weight)

    def forward_normed(
        self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None, gated: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """self(norm(x + residual)) and the new residual, x + residual (x when there is none);
        gated: the output is [gate | up] and silu(gate) * up is returned instead. For a tiny
        decode batch on a GPU the norm and the activation run inside the matmul's kernel."""
        return rmsnorm_linear(
            x, residual, norm.weight, norm.eps, self.weight, self.bias, gated, self._packed
        )


class LinearColParallelMerged(_LinearTPImpl):
    """Projections of the same input stacked along the output (gate_up_proj), each split along its
    output dimension across ranks."""

    def __init__(self, input_size: int, output_sizes: list[int]) -> None:
        tp = get_tp_info().size
        local_osize = sum(div_even(size, tp) for size in output_sizes)
        super().__init__(input_size, local_osize, has_bias=False)


def local_kv_heads(num_kv_heads: int, tp_size: int) -> int:
    """KV heads per rank: split when there are enough, else each rank keeps one (replicated)."""
    if num_kv_heads >= tp_size:
        return div_even(num_kv_heads, tp_size)
    div_even(tp_size, num_kv_heads)
    return 1


class LinearQKVMerged(_LinearTPImpl):
    """q, k and v stacked along the output and split by head."""

    def __init__(
        self, hidden_size: int, head_dim: int, num_qo_heads: int, num_kv_heads: int, has_bias: bool
    ) -> None:
        tp = get_tp_info().size
        local_heads = div_even(num_qo_heads, tp) + 2 * local_kv_heads(num_kv_heads, tp)
        super().__init__(hidden_size, local_heads * head_dim, has_bias)


class LinearRowParallel(_LinearTPImpl):
    """Split along the input dimension; the partial products are summed across ranks (no bias).
    On one rank the output may instead be partial sums over slices of the input, [splits, rows,
    N] (`linear_split_k`): the residual add + RMSNorm that reads it (`forward_normed` of the next
    projection, or the LM head) sums them."""

    def __init__(self, input_size: int, output_size: int) -> None:
        tp = get_tp_info().size
        super().__init__(div_even(input_size, tp), output_size, False)
        self._tp_size = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._tp_size == 1:
            return linear_split_k(x, self.weight, self._packed)
        return all_reduce(linear(x, self.weight, packed=self._packed))
