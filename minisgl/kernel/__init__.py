"""Op dispatch: a fast kernel for CUDA half-precision tensors when one is installed, else the reference.

fp32 always takes the reference path: it is what the correctness tests compare with Hugging Face.
"""

from . import torch_ops
from .torch_ops import (
    apply_rope_inplace,
    fused_add_rmsnorm,
    indexing,
    rmsnorm,
    silu_and_mul,
    store_kv,
)

__all__ = [
    "apply_rope_inplace",
    "fused_add_rmsnorm",
    "indexing",
    "rmsnorm",
    "silu_and_mul",
    "store_kv",
    "torch_ops",
]
