"""Attention backends over the paged KV pool, chosen by name (`--attention-backend`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from minisgl.utils.registry import Registry, triton_runs_on

if TYPE_CHECKING:
    from .base import AttentionBackend


ATTENTION_BACKENDS: Registry[AttentionBackend] = Registry(
    "attention backend", auto={"cuda": "triton", "cpu": "batched"}
)
ATTENTION_BACKENDS.register("torch", "minisgl.attention.torch_backend:TorchBackend")
ATTENTION_BACKENDS.register("batched", "minisgl.attention.batched_backend:BatchedBackend")
ATTENTION_BACKENDS.register(
    "triton", "minisgl.attention.triton_backend:TritonBackend", runs_on=triton_runs_on
)

__all__ = ["ATTENTION_BACKENDS"]
