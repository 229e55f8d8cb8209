from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from minisgl.core import Batch
from minisgl.kvcache import KVPool
from minisgl.utils import to_device


@dataclass
class AttnMetadata:
    """What every backend needs about a batch, built once per batch (or copied into a CUDA graph's
    static buffers). Request i's new tokens are rows cu_seqlens_q[i]:cu_seqlens_q[i+1] of q."""

    slots: torch.Tensor  # [bs] int32: page-table row of each request
    seq_lens: torch.Tensor  # [bs] int32: KV length after this step
    prefix_lens: torch.Tensor  # [bs] int32: KV already in the pool before this step
    cu_seqlens_q: torch.Tensor  # [bs + 1] int32
    last_indices: torch.Tensor  # [bs] int64: row of each request's last new token
    max_seq_len: int
    max_extend_len: int


def build_metadata(batch: Batch, slots: list[int], device: torch.device) -> AttnMetadata:
    prefix_lens, extend_lens = batch.prefix_lens, batch.extend_lens
    cu = [0]
    for n in extend_lens:
        cu.append(cu[-1] + n)
    host = torch.tensor(
        [slots, [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)], prefix_lens],
        dtype=torch.int32,
    )
    host_cu = torch.tensor(cu, dtype=torch.int32)
    dev, cu_dev = to_device(host, device), to_device(host_cu, device)
    return AttnMetadata(
        slots=dev[0],
        seq_lens=dev[1],
        prefix_lens=dev[2],
        cu_seqlens_q=cu_dev,
        last_indices=(cu_dev[1:] - 1).long(),
        max_seq_len=max(p + e for p, e in zip(prefix_lens, extend_lens, strict=True)),
        max_extend_len=max(extend_lens),
    )


class AttentionBackend(ABC):
    """Writes a step's K/V into the pool and computes attention over the paged pool.

    A new backend (FlashInfer, FlashAttention, ...) is one file: subclass, implement `forward`
    (and `prepare` if it needs more metadata than AttnMetadata), register a name.
    """

    def __init__(self, pool: KVPool, page_table: torch.Tensor) -> None:
        self.pool = pool
        self.page_table = page_table  # read-only here; the KV cache manager writes it

    def prepare(self, batch: Batch) -> None:
        """Build `batch.attn_metadata`; called once per batch before the forward."""
        batch.attn_metadata = build_metadata(
            batch, [r.slot for r in batch.reqs], self.page_table.device
        )

    @abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: Batch
    ) -> torch.Tensor:
        """q: [tokens, qo_heads, D]; k, v: [tokens, kv_heads, D]. Returns [tokens, qo_heads, D]."""
