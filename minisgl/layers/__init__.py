from .attention import AttentionLayer
from .base import BaseOP, OPList, StateLessOP
from .embedding import ParallelLMHead, VocabParallelEmbedding
from .linear import (
    LinearColParallelMerged,
    LinearQKVMerged,
    LinearRowParallel,
    local_kv_heads,
)
from .moe import SparseMLP
from .norm import RMSNorm
from .rotary import get_rope

__all__ = [
    "AttentionLayer",
    "BaseOP",
    "LinearColParallelMerged",
    "LinearQKVMerged",
    "LinearRowParallel",
    "OPList",
    "ParallelLMHead",
    "RMSNorm",
    "SparseMLP",
    "StateLessOP",
    "VocabParallelEmbedding",
    "get_rope",
    "local_kv_heads",
]
