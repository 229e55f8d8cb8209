"""Attention backends over the paged KV pool, chosen by name (`--attention-backend`)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from minisgl.utils.registry import Registry

if TYPE_CHECKING:
    from .base import AttentionBackend


def _triton_runs_on(device_type: str) -> bool:
    """Triton compiles for CUDA; on the CPU only its interpreter runs it (TRITON_INTERPRET=1)."""
    return device_type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


ATTENTION_BACKENDS: Registry[AttentionBackend] = Registry(
    "attention backend", auto={"cuda": "triton", "cpu": "batched"}
)
ATTENTION_BACKENDS.register("torch", "minisgl.attention.torch_backend:TorchBackend")
ATTENTION_BACKENDS.register("batched", "minisgl.attention.batched_backend:BatchedBackend")
ATTENTION_BACKENDS.register(
    "triton", "minisgl.attention.triton_backend:TritonBackend", runs_on=_triton_runs_on
)

__all__ = ["ATTENTION_BACKENDS"]
