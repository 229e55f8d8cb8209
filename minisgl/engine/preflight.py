"""An engine's settings checked before any process starts and before any weight loads, so that a
bad one fails at once, in one line: the server's launcher and the offline LLM both run them. What
only the engine can know (whether the KV cache fits in the memory left after the weights) fails
when it builds, in one line too."""

from minisgl.attention import ATTENTION_BACKENDS
from minisgl.config import (
    ConfigError,
    EngineConfig,
    check_kv_capacity,
    check_table_size,
    kv_pages,
    max_seq_len,
)
from minisgl.models.config import ModelConfig
from minisgl.models.weights import scan_checkpoint
from minisgl.moe import MOE_BACKENDS
from minisgl.utils.hf import cached_load_hf_config
from minisgl.utils.torch_utils import resolve_device, resolve_dtype


def check_engine_config(config: EngineConfig) -> ModelConfig:
    """The model's config; raises ConfigError unless the engine can be built as `config` says,
    the checkpoint included (from its files' headers: no weight is read)."""
    device = resolve_device(config.device)
    resolve_dtype(config.dtype, device)
    ATTENTION_BACKENDS.resolve(config.attention_backend, device.type)
    MOE_BACKENDS.resolve(config.moe_backend, device.type)
    path = config.model_path
    try:
        model = ModelConfig.from_hf(cached_load_hf_config(path))
    except (OSError, KeyError) as e:
        raise ConfigError(f"{path}/config.json cannot be read: {e}") from None
    model.check_tp(config.tp_size)
    seq_len = max_seq_len(config, model.max_position_embeddings)
    check_table_size(config.max_running_requests, config.page_size, seq_len)
    if config.max_kv_tokens is not None:
        check_kv_capacity(
            kv_pages(config.max_kv_tokens, config.page_size), config.page_size, seq_len
        )
    if not config.dummy_weights:
        scan_checkpoint(path, model)
    return model
