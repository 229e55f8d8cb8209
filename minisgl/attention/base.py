from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

import torch

from minisgl.core import Batch
from minisgl.kvcache.pool import KVPool

if TYPE_CHECKING:
    from minisgl.engine.context import ForwardBatch


class AttentionBackend(ABC):
    """Computes attention over the paged pool, which already holds the step's K/V: the attention
    layer writes them (in the same kernel as RoPE) before calling `forward`.

    What every backend needs about a batch (slots, seq_lens, cu_seqlens_q) is in its inputs. A
    new backend (FlashInfer, FlashAttention, ...) is one file: subclass, implement `forward` (and
    `prepare` for metadata of its own), register a name.
    """

    # whether a decode step can be captured in a CUDA graph: no host reads of batch tensors and
    # no shape that depends on the batch's contents
    supports_cuda_graph = True

    def __init__(self, pool: KVPool, page_table: torch.Tensor) -> None:
        self.pool = pool
        self.page_table = page_table  # read-only here; the KV cache manager decides its entries

    def prepare(self, batch: Batch) -> Any:
        """The backend's own metadata for an eager forward of `batch` (None: it needs none).
        CUDA-graph replays get None: decode must need nothing beyond the batch's inputs."""
        return None

    @abstractmethod
    def forward(self, q: torch.Tensor, layer_id: int, batch: ForwardBatch) -> torch.Tensor:
        """q: [tokens, qo_heads, D]. Returns [tokens, qo_heads, D]."""
