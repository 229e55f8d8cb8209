"""Mixture-of-experts backends, chosen by name (`--moe-backend`): they run each token through the
experts its router chose."""

from __future__ import annotations

from typing import TYPE_CHECKING

from minisgl.utils.registry import Registry, triton_runs_on

if TYPE_CHECKING:
    from .base import MoEBackend

MOE_BACKENDS: Registry[MoEBackend] = Registry(
    "MoE backend", auto={"cuda": "triton", "cpu": "torch"}
)
MOE_BACKENDS.register("torch", "minisgl.moe.torch_backend:TorchMoE")
MOE_BACKENDS.register("triton", "minisgl.moe.triton_backend:TritonMoE", runs_on=triton_runs_on)

__all__ = ["MOE_BACKENDS"]
