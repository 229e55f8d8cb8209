from abc import ABC, abstractmethod
from typing import NamedTuple

import torch


class Routing(NamedTuple):
    """Each token's chosen experts: ids [tokens, k] and the weights of their outputs [tokens, k]."""

    weights: torch.Tensor
    ids: torch.Tensor


class MoEBackend(ABC):
    """Runs each token through the experts its router chose and sums their outputs, weighted.

    The router (a softmax top-k, `minisgl.layers.moe`) is the layer's; a backend sees only its
    choice. A new backend is one file: subclass, implement `forward`, register a name.
    """

    # whether a decode step can be captured in a CUDA graph: no host reads of batch tensors and
    # no shape that depends on the batch's contents
    supports_cuda_graph = True

    @abstractmethod
    def forward(
        self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, routing: Routing
    ) -> torch.Tensor:
        """x: [tokens, hidden]; w13: [experts, 2 * inter, hidden], each expert's gate rows then
        its up rows; w2: [experts, hidden, inter]. Returns [tokens, hidden]: the sum over j of
        routing.weights[t, j] * expert_{routing.ids[t, j]}(x[t]), an expert being
        w2 @ (silu(gate @ x) * (up @ x))."""
