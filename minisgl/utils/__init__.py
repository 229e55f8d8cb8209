from .hf import DEFAULT_MODEL_PATH, cached_load_hf_config, load_eos_token_ids, resolve_model_path
from .logger import init_logger
from .misc import div_ceil, div_even
from .registry import Registry
from .torch_utils import (
    copy_to_device,
    pack_to_device,
    ragged_arange,
    repeat_each,
    resolve_device,
    resolve_dtype,
    to_device,
    torch_dtype,
)

__all__ = [
    "DEFAULT_MODEL_PATH",
    "Registry",
    "cached_load_hf_config",
    "copy_to_device",
    "div_ceil",
    "div_even",
    "init_logger",
    "load_eos_token_ids",
    "pack_to_device",
    "ragged_arange",
    "repeat_each",
    "resolve_device",
    "resolve_dtype",
    "resolve_model_path",
    "to_device",
    "torch_dtype",
]
