import torch

from .base import BaseOP


class RMSNorm(BaseOP):
    """An RMSNorm's weight and eps: weights only, the norm itself runs inside the op that reads
    its output (the next projection's matmul, the RoPE kernel, the LM head)."""

    def __init__(self, size: int, eps: float) -> None:
        self.eps = eps
        self.weight = torch.empty(size)
