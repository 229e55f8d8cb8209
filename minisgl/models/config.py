from dataclasses import dataclass

from transformers import PretrainedConfig

from minisgl.config import ConfigError
from minisgl.layers.rotary import RopeScaling


@dataclass(frozen=True)
class ArchTraits:
    """How one Hugging Face architecture differs from the plain Llama decoder."""

    model_type: str  # its config's: Hugging Face builds the model that model_type names
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3)
    qkv_bias: bool = False  # biases on q, k and v (never on o_proj)
    moe: bool = False  # sparse layers of routed experts (Qwen3-MoE's config fields)
    # config flags that give Hugging Face's model biases we do not model (attention_bias puts one
    # on o_proj too): refused when true, not dropped
    bias_flags: tuple[str, ...] = ()
    # its sliding window is on the layers `layer_types` names (Qwen3-MoE's never reads them)
    window_by_layer_types: bool = True


ARCHITECTURES: dict[str, ArchTraits] = {
    "LlamaForCausalLM": ArchTraits("llama", bias_flags=("attention_bias", "mlp_bias")),
    "MistralForCausalLM": ArchTraits("mistral"),  # its attention_bias is never read by HF
    "Qwen2ForCausalLM": ArchTraits("qwen2", qkv_bias=True),
    "Qwen3ForCausalLM": ArchTraits("qwen3", qk_norm=True, bias_flags=("attention_bias",)),
    "Qwen3MoeForCausalLM": ArchTraits(
        "qwen3_moe",
        qk_norm=True,
        moe=True,
        bias_flags=("attention_bias",),
        window_by_layer_types=False,
    ),
}


@dataclass(frozen=True)
class MoEConfig:
    """The sparse layers: each token runs through `top_k` of `num_experts` gated MLPs."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    renormalize: bool  # the top-k probabilities rescaled to sum to 1 (norm_topk_prob)
    layers: tuple[int, ...]  # the sparse layers' ids; the others have a dense MLP


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    moe: MoEConfig | None  # None: every layer dense

    def check_tp(self, tp_size: int) -> None:
        """Raise ConfigError unless `tp_size` ranks can split this model: each takes an equal
        share of the attention heads, of the KV heads (or shares one), and of every MLP."""
        shares = {"attention heads": self.num_qo_heads}
        if self.moe is None or len(self.moe.layers) < self.num_layers:
            shares["MLP intermediate size"] = self.intermediate_size
        if self.moe is not None:
            shares["expert intermediate size"] = self.moe.intermediate_size
        for what, size in shares.items():
            if size % tp_size:
                raise ConfigError(f"--tp {tp_size} must divide the model's {what} ({size})")
        kv = self.num_kv_heads
        if kv % tp_size if kv >= tp_size else tp_size % kv:
            raise ConfigError(
                f"--tp {tp_size} must divide the model's {kv} KV heads or be a multiple of them"
            )

    @classmethod
    def from_hf(cls, config: PretrainedConfig) -> "ModelConfig":
        archs = list(getattr(config, "architectures", None) or [])
        arch = next((a for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            raise ConfigError(
                f"unsupported architecture {archs}; supported: {', '.join(sorted(ARCHITECTURES))}"
            )
        traits = ARCHITECTURES[arch]
        if config.model_type != traits.model_type:
            # which of the two Hugging Face would run is not ours to guess: a Qwen3-MoE config
            # labelled Qwen3 was served with Qwen3's window, and its tokens differed
            raise ConfigError(
                f"the config's architectures ({arch}) and model_type ({config.model_type!r}) "
                f"disagree: {arch} has model_type {traits.model_type!r}"
            )
        quantization = getattr(config, "quantization_config", None)
        if quantization is not None:
            method = (
                quantization.get("quant_method")
                if isinstance(quantization, dict)
                else getattr(quantization, "quant_method", None)
            )
            raise ConfigError(
                f"quantized checkpoints are not supported (quantization_config: {method!r}); "
                "serve the model's bf16 or fp16 weights"
            )
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ConfigError(f"unsupported hidden_act {config.hidden_act!r}; supported: silu")
        head_dim = (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        if biased := [flag for flag in traits.bias_flags if getattr(config, flag, False)]:
            raise ConfigError(f"unsupported {arch} setting {', '.join(biased)}: true")
        rope_theta, rope_scaling = _rope_settings(config)
        max_positions = _max_positions(config, traits)
        return cls(
            architecture=arch,
            num_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_qo_heads=config.num_attention_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            head_dim=head_dim,
            vocab_size=config.vocab_size,
            rms_norm_eps=config.rms_norm_eps,
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=traits.qkv_bias,
            qk_norm=traits.qk_norm,
            moe=_moe_config(config) if traits.moe else None,
        )


def _max_positions(config: PretrainedConfig, traits: ArchTraits) -> int:
    """The longest context: max_position_embeddings, capped where some layer attends over fewer
    positions back (sliding-window and chunked attention are not implemented). A sliding window,
    on the layers its `layer_types` say where the config has them and the architecture reads
    them (Qwen2's windows start at layer max_window_layers), else on every layer once it is set
    (the Qwen configs clear it where use_sliding_window is off; Mistral's never reads that);
    Llama 4's attention chunks, which Hugging Face's generate caches as a window."""
    spans = [config.max_position_embeddings, getattr(config, "attention_chunk_size", None)]
    layer_types = getattr(config, "layer_types", None) if traits.window_by_layer_types else None
    if layer_types is None or "sliding_attention" in layer_types:
        spans.append(getattr(config, "sliding_window", None))
    return min(span for span in spans if span)


def _moe_config(config: PretrainedConfig) -> MoEConfig | None:
    """Which layers are sparse, decided as Hugging Face's Qwen3MoeDecoderLayer decides: those
    not in mlp_only_layers whose number (from 1) is a multiple of decoder_sparse_step."""
    num_experts = config.num_experts
    if config.decoder_sparse_step < 1:
        raise ConfigError(f"decoder_sparse_step must be >= 1, not {config.decoder_sparse_step}")
    if num_experts > 0 and not 1 <= config.num_experts_per_tok <= num_experts:
        raise ConfigError(
            f"num_experts_per_tok ({config.num_experts_per_tok}) must be in [1, num_experts "
            f"({num_experts})]"
        )
    dense = set(config.mlp_only_layers)
    layers = tuple(
        i
        for i in range(config.num_hidden_layers)
        if i not in dense and num_experts > 0 and (i + 1) % config.decoder_sparse_step == 0
    )
    if not layers:
        return None
    return MoEConfig(
        num_experts=num_experts,
        top_k=config.num_experts_per_tok,
        intermediate_size=config.moe_intermediate_size,
        renormalize=bool(config.norm_topk_prob),
        layers=layers,
    )


def _rope_settings(config: PretrainedConfig) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) from either transformers 5's `rope_parameters` or 4's `rope_scaling`."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    scaling = dict(getattr(config, "rope_scaling", None) or params)
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    scaling.pop("rope_theta", None)
    # Hugging Face's default RoPE ignores it, its llama3 RoPE and vLLM do not: refused
    partial = params.get("partial_rotary_factor") or getattr(config, "partial_rotary_factor", None)
    if partial not in (None, 1.0):
        raise ConfigError(f"unsupported partial_rotary_factor {partial}; supported: 1.0")
    scaling.pop("partial_rotary_factor", None)
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise ConfigError(
            f"unsupported rope_scaling type {rope_type!r}; supported: default, llama3"
        )
    # transformers 5 lets a top-level original_max_position_embeddings override the scaling's
    if (original := getattr(config, "original_max_position_embeddings", None)) is not None:
        scaling["original_max_position_embeddings"] = original
    return theta, tuple(sorted(scaling.items()))
