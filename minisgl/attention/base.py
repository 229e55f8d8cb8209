from abc import ABC, abstractmethod

import torch

from minisgl.core import Batch
from minisgl.kvcache import KVPool


class AttentionBackend(ABC):
    """Computes attention over the paged pool, which already holds the step's K/V: the attention
    layer writes them (in the same kernel as RoPE) before calling `forward`.

    What every backend needs about a batch (slots, seq_lens, cu_seqlens_q) is on the Batch. A new
    backend (FlashInfer, FlashAttention, ...) is one file: subclass, implement `forward` (and
    `prepare` for metadata of its own), register a name.
    """

    # whether a decode step can be captured in a CUDA graph: no host reads of batch tensors and
    # no shape that depends on the batch's contents
    supports_cuda_graph = True

    def __init__(self, pool: KVPool, page_table: torch.Tensor) -> None:
        self.pool = pool
        self.page_table = page_table  # read-only here; the KV cache manager decides its entries

    def prepare(self, batch: Batch) -> None:  # noqa: B027  (optional hook)
        """Build `batch.attn_metadata` if the backend needs any; called once per batch.
        Not called for CUDA-graph replays, so decode must need nothing beyond the Batch."""

    @abstractmethod
    def forward(self, q: torch.Tensor, layer_id: int, batch: Batch) -> torch.Tensor:
        """q: [tokens, qo_heads, D]. Returns [tokens, qo_heads, D]."""
