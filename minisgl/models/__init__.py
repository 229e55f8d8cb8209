import sys
from pathlib import Path

import torch
from tqdm import tqdm

from minisgl.distributed import get_tp_info
from minisgl.moe.base import MoEBackend
from minisgl.utils.torch_utils import torch_dtype

from .config import ARCHITECTURES, ModelConfig
from .decoder import CausalLM
from .weights import load_weights

__all__ = [
    "ARCHITECTURES",
    "CausalLM",
    "ModelConfig",
    "build_model",
    "load_model_weights",
    "weight_bytes",
]


def build_model(
    config: ModelConfig, device: torch.device, dtype: torch.dtype, moe_backend: MoEBackend
) -> CausalLM:
    """The model on the meta device (instant, no memory): its weights' names, shapes and bytes
    are known before any is loaded; `device` holds its tables that are no weights (RoPE's)."""
    with torch.device("meta"), torch_dtype(dtype):
        return CausalLM(config, moe_backend, device)


def weight_bytes(model: CausalLM) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def load_model_weights(
    model: CausalLM,
    model_path: Path,
    config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    dummy_weights: bool = False,
) -> None:
    """Stream a built model's weights in, then pack those the CPU's matmuls want in a layout of
    their own."""
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if dummy_weights:
        state = {name: _random_tensor(shape, device, dtype) for name, shape in expected.items()}
    else:
        weights = load_weights(model_path, config, expected, get_tp_info(), device, dtype)
        if sys.stderr.isatty():  # a bar in a terminal only (a tqdm bar leaks a semaphore, too)
            weights = tqdm(weights, total=len(expected), desc="loading weights", unit="tensor")
        state = dict(weights)
    model.load_state_dict(state)
    model.pack_weights()


def _random_tensor(
    shape: tuple[int, ...], device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """Random weights at Hugging Face's init scale; norm weights near 1 so activations stay sane."""
    if len(shape) == 1:
        return 1 + 0.02 * torch.randn(shape, device=device, dtype=dtype)
    return 0.02 * torch.randn(shape, device=device, dtype=dtype)
