"""The one decoder: Llama, Mistral, Qwen2, Qwen3 and Qwen3-MoE differ only in what ModelConfig
says."""

import torch

from minisgl.distributed import get_tp_info
from minisgl.layers import (
    AttentionLayer,
    BaseOP,
    LinearColParallelMerged,
    LinearQKVMerged,
    LinearRowParallel,
    OPList,
    ParallelLMHead,
    RMSNorm,
    SparseMLP,
    VocabParallelEmbedding,
    get_rope,
    local_kv_heads,
)
from minisgl.moe.base import MoEBackend
from minisgl.utils import div_even

from .config import ModelConfig


class RopeAttn(BaseOP):
    def __init__(self, config: ModelConfig, layer_id: int, device: torch.device) -> None:
        tp = get_tp_info().size
        num_qo_heads = div_even(config.num_qo_heads, tp)
        num_kv_heads = local_kv_heads(config.num_kv_heads, tp)
        head_dim = config.head_dim
        self.qkv_proj = LinearQKVMerged(
            config.hidden_size, head_dim, config.num_qo_heads, config.num_kv_heads, config.qkv_bias
        )
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps) if config.qk_norm else None
        rotary = get_rope(
            head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling,
            device,
        )  # fmt: skip
        self.attn = AttentionLayer(
            layer_id, num_qo_heads, num_kv_heads, head_dim, rotary, self.q_norm, self.k_norm
        )
        # row-parallel over the heads this rank holds
        self.o_proj = LinearRowParallel(config.num_qo_heads * head_dim, config.hidden_size)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, input_norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        qkv, residual = self.qkv_proj.forward_normed(input_norm, x, residual)
        return self.o_proj.forward(self.attn.forward(qkv)), residual


class GatedMLP(BaseOP):
    def __init__(self, config: ModelConfig) -> None:
        size = config.intermediate_size
        self.gate_up_proj = LinearColParallelMerged(config.hidden_size, [size, size])
        self.down_proj = LinearRowParallel(size, config.hidden_size)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor, input_norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.gate_up_proj.forward_normed(input_norm, x, residual, gated=True)
        return self.down_proj.forward(hidden), residual


def _mlp(config: ModelConfig, layer_id: int, moe_backend: MoEBackend) -> GatedMLP | SparseMLP:
    moe = config.moe
    if moe is None or layer_id not in moe.layers:
        return GatedMLP(config)
    return SparseMLP(
        config.hidden_size, moe.num_experts, moe.top_k, moe.intermediate_size, moe.renormalize,
        moe_backend,
    )  # fmt: skip


class DecoderLayer(BaseOP):
    def __init__(
        self, config: ModelConfig, layer_id: int, moe_backend: MoEBackend, device: torch.device
    ) -> None:
        self.self_attn = RopeAttn(config, layer_id, device)
        self.mlp = _mlp(config, layer_id, moe_backend)
        # weights only: each norm runs inside the projection after it (forward_normed)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, next_qkv: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """next_qkv: the next layer's QKV weight (None for the last), which a sparse MLP's
        router pulls into L2 while it waits on latency."""
        # each block's input norm runs in its first projection: one kernel for a tiny batch
        x, residual = self.self_attn.forward(x, residual, self.input_layernorm)
        if isinstance(self.mlp, SparseMLP):
            return self.mlp.forward(x, residual, self.post_attention_layernorm, next_qkv)
        return self.mlp.forward(x, residual, self.post_attention_layernorm)


class DecoderModel(BaseOP):
    def __init__(self, config: ModelConfig, moe_backend: MoEBackend, device: torch.device) -> None:
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = OPList(
            [DecoderLayer(config, i, moe_backend, device) for i in range(config.num_layers)]
        )
        # weights only: the final norm runs inside the LM head
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The last layer's output (partial sums where LinearRowParallel split it) and the
        residual stream, before the final norm."""
        x = self.embed_tokens.forward(input_ids)
        residual = None
        layers = list(self.layers)
        next_qkvs = [layer.self_attn.qkv_proj.weight for layer in layers[1:]] + [None]
        for layer, next_qkv in zip(layers, next_qkvs, strict=True):
            x, residual = layer.forward(x, residual, next_qkv)
        assert residual is not None
        return x, residual


class CausalLM(BaseOP):
    """Decoder + LM head. `forward` computes the current forward's batch (`engine.context`) and
    returns the logits of each request's last token. `moe_backend` runs the sparse layers'
    experts (a dense model never calls it); `device` holds its tables that are no weights (RoPE's),
    as the weights are loaded onto it."""

    def __init__(self, config: ModelConfig, moe_backend: MoEBackend, device: torch.device) -> None:
        self.model = DecoderModel(config, moe_backend, device)
        tied = self.model.embed_tokens if config.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tied)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x, residual = self.model.forward(input_ids)
        return self.lm_head.forward(x, residual, self.model.norm)
