import functools
import math

import torch

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


@functools.cache  # every layer shares one RoPE table
def get_rope(
    head_dim: int,
    max_position: int,
    base: float,
    scaling: RopeScaling | None,
    device: torch.device,
) -> RotaryEmbedding:
    """The RoPE table on `device` (a real one: models are built on the meta device, and the
    table is data, not a weight); scaling: llama3's parameters (ModelConfig admits no other
    type), None for plain RoPE."""
    with torch.device(device):
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        if scaling is not None:
            inv_freq = _llama3_inv_freq(inv_freq, dict(scaling))
        return RotaryEmbedding(head_dim, max_position, inv_freq)
