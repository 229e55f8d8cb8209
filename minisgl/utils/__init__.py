"""Small helpers. This package's top level imports nothing heavy; the torch helpers are in
`utils.torch_utils`, the numpy ones in `utils.arrays`, the Hugging Face config loader in `utils.hf`."""

from .logger import init_logger
from .misc import div_ceil, div_even
from .model_path import (
    DEFAULT_MODEL_PATH,
    load_eos_token_ids,
    resolve_model_path,
    sampling_defaults,
)

__all__ = [
    "DEFAULT_MODEL_PATH",
    "div_ceil",
    "div_even",
    "init_logger",
    "load_eos_token_ids",
    "resolve_model_path",
    "sampling_defaults",
]
