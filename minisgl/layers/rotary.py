import functools
import math

import torch

from minisgl.config import ConfigError
from minisgl.kernel import KVStore, apply_rope_inplace

from .base import StateLessOP

RopeScaling = tuple[tuple[str, float | int | str], ...]


class RotaryEmbedding(StateLessOP):
    def __init__(self, head_size: int, max_position: int, inv_freq: torch.Tensor) -> None:
        self.head_size = head_size
        t = torch.arange(max_position, dtype=torch.float)
        freqs = torch.outer(t, inv_freq.to(t.device))  # [max_pos, D/2]
        # underscore: not a weight; computed once at start-up and looked up by position
        self._cos_sin_cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)

    def forward(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
        kv_store: KVStore | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q and k in place; qk_norm = (q_weight, k_weight, eps) normalises each head
        first (Qwen3's QK-norm) and kv_store writes the rotated keys and the values into the
        pool, in the same kernel."""
        apply_rope_inplace(
            positions, query, key, self.head_size, self._cos_sin_cache, qk_norm, kv_store
        )
        return query, key


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1 long context: keep high frequencies, divide low ones by `factor`, blend between."""
    factor = scaling["factor"]
    low_freq_factor, high_freq_factor = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


_ROPE_DEVICE: torch.device | None = None


def set_rope_device(device: torch.device) -> None:
    """The real device for the RoPE table when the model is built on the meta device."""
    global _ROPE_DEVICE
    _ROPE_DEVICE = device


@functools.cache  # every layer shares one RoPE table
def _get_rope(
    head_dim: int, max_position: int, base: float, scaling: RopeScaling | None, device: torch.device
) -> RotaryEmbedding:
    with torch.device(device):
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        scaling_dict = dict(scaling) if scaling else {}
        rope_type = scaling_dict.get("rope_type", scaling_dict.get("type", "default"))
        if rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling_dict)
        elif rope_type != "default":
            raise ConfigError(
                f"unsupported rope_scaling type {rope_type!r}; supported: default, llama3"
            )
        return RotaryEmbedding(head_dim, max_position, inv_freq)


def get_rope(
    head_dim: int, max_position: int, base: float, scaling: RopeScaling | None = None
) -> RotaryEmbedding:
    device = torch.empty(0).device
    if device.type == "meta":
        # the model is built on the meta device, but the RoPE table is real data
        if _ROPE_DEVICE is None:
            raise RuntimeError("Call set_rope_device() before building a model on meta device")
        device = _ROPE_DEVICE
    return _get_rope(head_dim, max_position, base, scaling, device)
