import torch

from minisgl.kernel import silu_and_mul

from .base import StateLessOP


class SiluAndMul(StateLessOP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)
