from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from minisgl.core import Batch
from minisgl.kernel.triton import (
    decode_attention,
    decode_num_splits,
    extend_attention,
    extend_blocks,
    num_sms,
    split_counter_count,
)
from minisgl.kvcache.pool import KVPool
from minisgl.utils.torch_utils import pack_to_device

from .base import AttentionBackend

if TYPE_CHECKING:
    from minisgl.engine.context import ForwardBatch


@dataclass
class ExtendMetadata:
    """The q-block -> request map that the extend kernel's grid walks."""

    block_req: torch.Tensor  # [num_blocks] int32: the request of each block of new tokens
    block_start: torch.Tensor  # [num_blocks] int32: the block's first new-token index in it


class TritonBackend(AttentionBackend):
    """Paged Triton kernels: split-K decode attention and ragged causal extend attention.

    Decode reads only the Batch's own tensors, so a CUDA graph's static batches work as-is."""

    def __init__(self, pool: KVPool, page_table: torch.Tensor) -> None:
        super().__init__(pool, page_table)
        # decode's split counters, per (request, head block): zero between launches
        count = split_counter_count(page_table.shape[0], pool.k_cache(0).shape[1])
        self.split_counters = torch.zeros(count, dtype=torch.int32, device=page_table.device)

    def prepare(self, batch: Batch) -> ExtendMetadata | None:
        if batch.is_decode:
            return None
        block_req, block_start = extend_blocks(batch.prefix_lens, batch.extend_lens)
        device = self.page_table.device
        t = pack_to_device(device, torch.int32, block_req=block_req, block_start=block_start)
        return ExtendMetadata(**t)

    def forward(self, q: torch.Tensor, layer_id: int, batch: ForwardBatch) -> torch.Tensor:
        k_cache, v_cache = self.pool.k_cache(layer_id), self.pool.v_cache(layer_id)
        inputs = batch.inputs
        if batch.is_decode:
            num_splits = decode_num_splits(q.shape[0], k_cache.shape[1], num_sms(q.device))
            return decode_attention(
                q, k_cache, v_cache, self.page_table, inputs.slots, inputs.seq_lens, num_splits,
                self.split_counters, inputs.longest_first,
            )  # fmt: skip
        meta: ExtendMetadata = batch.attn_metadata
        return extend_attention(
            q,
            k_cache,
            v_cache,
            self.page_table,
            inputs.slots,
            inputs.seq_lens,
            inputs.cu_seqlens_q,
            meta.block_req,
            meta.block_start,
        )
