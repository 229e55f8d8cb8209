from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

from minisgl.core import Batch
from minisgl.kernel import KVStore
from minisgl.kvcache import KVPool

if TYPE_CHECKING:
    from minisgl.layers.rotary import RotaryEmbedding

QKNorm = tuple[torch.Tensor, torch.Tensor, float]  # (q_weight, k_weight, eps)


class AttentionBackend(ABC):
    """Computes a layer's attention from its raw q, k, v: QK-norm and RoPE, the step's K/V into the
    paged pool, then attention over the pool (`forward_qkv`). By default one kernel does the first
    two and `forward` the last; a backend may fuse more.

    What every backend needs about a batch (slots, seq_lens, cu_seqlens_q) is on the Batch. A new
    backend (FlashInfer, FlashAttention, ...) is one file: subclass, implement `forward` (and
    `prepare` for metadata of its own), register a name.
    """

    # whether a decode step can be captured in a CUDA graph: no host reads of batch tensors and
    # no shape that depends on the batch's contents
    supports_cuda_graph = True

    def __init__(self, pool: KVPool, page_table: torch.Tensor) -> None:
        self.pool = pool
        self.page_table = page_table  # read-only here; the KV cache manager writes it

    def prepare(self, batch: Batch) -> None:  # noqa: B027  (optional hook)
        """Build `batch.attn_metadata` if the backend needs any; called once per batch.
        Not called for CUDA-graph replays, so decode must need nothing beyond the Batch."""

    def forward_qkv(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        batch: Batch,
        rotary: "RotaryEmbedding",
        qk_norm: QKNorm | None,
    ) -> torch.Tensor:
        """q, k, v: the step's projections [tokens, heads * D] (strided views of the merged qkv,
        changed in place). Returns [tokens, qo_heads, D]."""
        kv_store = KVStore(
            self.pool.k_cache(layer_id), self.pool.v_cache(layer_id), batch.out_loc, v
        )
        q, _ = rotary.forward(batch.positions, q, k, qk_norm, kv_store)
        return self.forward(q.view(q.shape[0], -1, rotary.head_size), layer_id, batch)

    @abstractmethod
    def forward(self, q: torch.Tensor, layer_id: int, batch: Batch) -> torch.Tensor:
        """Attention over the pool, which holds the step's K/V. q: [tokens, qo_heads, D], after
        RoPE. Returns [tokens, qo_heads, D]."""
