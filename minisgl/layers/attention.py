import torch

from minisgl.engine.context import current_forward
from minisgl.kernel import KVStore

from .base import StateLessOP
from .norm import RMSNorm
from .rotary import RotaryEmbedding


class AttentionLayer(StateLessOP):
    """Splits the merged qkv; applies QK-norm and RoPE and writes K/V into the pool, in one op;
    then the attention backend attends over the pool. Holds no weights of its own."""

    def __init__(
        self,
        layer_id: int,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rotary: RotaryEmbedding,
        q_norm: RMSNorm | None = None,
        k_norm: RMSNorm | None = None,
    ) -> None:
        self.layer_id = layer_id
        self.num_qo_heads = num_qo_heads
        self.head_dim = head_dim
        self.qo_attn_dim = num_qo_heads * head_dim
        self.kv_attn_dim = num_kv_heads * head_dim
        self.rotary = rotary
        self.q_norm = q_norm
        self.k_norm = k_norm

    def forward(self, qkv: torch.Tensor) -> torch.Tensor:
        batch = current_forward()
        # strided views into qkv: every op below works in place on them, no copies
        q, k, v = qkv.split([self.qo_attn_dim, self.kv_attn_dim, self.kv_attn_dim], dim=-1)
        qk_norm = None
        if self.q_norm is not None and self.k_norm is not None:
            qk_norm = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        pool = batch.attn_backend.pool
        kv_store = KVStore(
            pool.k_cache(self.layer_id), pool.v_cache(self.layer_id), batch.out_loc, v
        )
        q, _ = self.rotary.forward(batch.inputs.positions, q, k, qk_norm, kv_store)
        o = batch.attn_backend.forward(
            q.view(-1, self.num_qo_heads, self.head_dim), self.layer_id, batch
        )
        return o.reshape(-1, self.qo_attn_dim)
