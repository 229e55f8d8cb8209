import functools
from pathlib import Path

from transformers import AutoConfig, PretrainedConfig


@functools.cache
def cached_load_hf_config(model_path: str | Path) -> PretrainedConfig:
    return AutoConfig.from_pretrained(str(model_path))
