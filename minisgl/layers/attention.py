import torch

from minisgl.core import get_global_ctx

from .base import StateLessOP
from .norm import RMSNorm
from .rotary import RotaryEmbedding


class AttentionLayer(StateLessOP):
    """Splits the merged qkv, applies QK-norm and RoPE, and hands q/k/v to the attention backend,
    which writes the KV pool and computes attention. Holds no weights of its own."""

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
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.qo_attn_dim = num_qo_heads * head_dim
        self.kv_attn_dim = num_kv_heads * head_dim
        self.rotary = rotary
        self.q_norm = q_norm
        self.k_norm = k_norm

    def forward(self, qkv: torch.Tensor) -> torch.Tensor:
        ctx = get_global_ctx()
        assert ctx.batch is not None and ctx.attn_backend is not None
        q, k, v = qkv.split([self.qo_attn_dim, self.kv_attn_dim, self.kv_attn_dim], dim=-1)
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        if self.q_norm is not None:
            self.q_norm.forward_inplace(q.view(-1, self.num_qo_heads, self.head_dim))
        if self.k_norm is not None:
            self.k_norm.forward_inplace(k.view(-1, self.num_kv_heads, self.head_dim))
        q, k = self.rotary.forward(ctx.batch.positions, q, k)
        o = ctx.attn_backend.forward(
            q.view(-1, self.num_qo_heads, self.head_dim),
            k.view(-1, self.num_kv_heads, self.head_dim),
            v.view(-1, self.num_kv_heads, self.head_dim),
            self.layer_id,
            ctx.batch,
        )
        return o.reshape(-1, self.qo_attn_dim)
