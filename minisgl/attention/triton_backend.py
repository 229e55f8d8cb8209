from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from minisgl.core import Batch
from minisgl.kernel.triton import (
    DecodeRope,
    decode_attention,
    decode_num_splits,
    extend_attention,
    extend_blocks,
    num_sms,
)
from minisgl.kvcache import KVPool
from minisgl.utils import pack_to_device

from .base import AttentionBackend, QKNorm

if TYPE_CHECKING:
    from minisgl.layers.rotary import RotaryEmbedding


# decode batches up to this size run RoPE inside decode attention; larger ones run them apart
# (benchmark/kernel/bench_attention.py: the fused kernel is slower at batch 256)
FUSED_ROPE_MAX_BS = 16


@dataclass
class ExtendMetadata:
    """The q-block -> request map that the extend kernel's grid walks."""

    block_req: torch.Tensor  # [num_blocks] int32: the request of each block of new tokens
    block_start: torch.Tensor  # [num_blocks] int32: the block's first new-token index in it


class TritonBackend(AttentionBackend):
    """Paged Triton kernels: split-K decode attention and ragged causal extend attention.

    Decode reads only the Batch's own tensors, so a CUDA graph's static batches work as-is; for
    small batches it also does QK-norm, RoPE and the K/V store itself."""

    def __init__(self, pool: KVPool, page_table: torch.Tensor) -> None:
        super().__init__(pool, page_table)
        # decode's per-(request, KV head) split counters: zero between launches, one row per slot
        num_kv_heads = pool.k_cache(0).shape[1]
        self.split_counters = torch.zeros(
            page_table.shape[0] * num_kv_heads, dtype=torch.int32, device=page_table.device
        )

    def prepare(self, batch: Batch) -> None:
        if batch.is_decode:
            return
        block_req, block_start = extend_blocks(batch.extend_lens)
        t = pack_to_device(
            self.page_table.device, torch.int32, block_req=block_req, block_start=block_start
        )
        batch.attn_metadata = ExtendMetadata(block_req=t["block_req"], block_start=t["block_start"])

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
        if not batch.is_decode or q.shape[0] > FUSED_ROPE_MAX_BS:
            return super().forward_qkv(q, k, v, layer_id, batch, rotary, qk_norm)
        rope = DecodeRope(k, v, batch.out_loc, rotary.cos_sin_cache, qk_norm)
        return self._decode(q.view(q.shape[0], -1, rotary.head_size), layer_id, batch, rope)

    def _decode(
        self, q: torch.Tensor, layer_id: int, batch: Batch, rope: DecodeRope | None
    ) -> torch.Tensor:
        k_cache, v_cache = self.pool.k_cache(layer_id), self.pool.v_cache(layer_id)
        num_splits = decode_num_splits(q.shape[0], k_cache.shape[1], num_sms(q.device))
        return decode_attention(
            q, k_cache, v_cache, self.page_table, batch.slots, batch.seq_lens, num_splits,
            self.split_counters, rope,
        )  # fmt: skip

    def forward(self, q: torch.Tensor, layer_id: int, batch: Batch) -> torch.Tensor:
        if batch.is_decode:
            return self._decode(q, layer_id, batch, None)
        k_cache, v_cache = self.pool.k_cache(layer_id), self.pool.v_cache(layer_id)
        meta: ExtendMetadata = batch.attn_metadata
        return extend_attention(
            q,
            k_cache,
            v_cache,
            self.page_table,
            batch.slots,
            batch.seq_lens,
            batch.cu_seqlens_q,
            meta.block_req,
            meta.block_start,
        )
