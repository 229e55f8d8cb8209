"""Attention backends over the paged KV pool, chosen by name (`--attention-backend`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from minisgl.utils.registry import Registry, triton_runs_on

if TYPE_CHECKING:
    from .base import AttentionBackend


def cpp_runs_on(device_type: str) -> bool:
    """The C++ kernels run on the CPU where the machine's compiler builds them (on first ask);
    imported here, not above, so that listing the backends (the CLI's --help) needs no torch."""
    from minisgl.kernel import cpp

    return device_type == "cpu" and cpp.available()


ATTENTION_BACKENDS: Registry[AttentionBackend] = Registry(
    "attention backend", auto={"cuda": "triton", "cpu": ("cpp", "batched")}
)
ATTENTION_BACKENDS.register("torch", "minisgl.attention.torch_backend:TorchBackend")
ATTENTION_BACKENDS.register("batched", "minisgl.attention.batched_backend:BatchedBackend")
ATTENTION_BACKENDS.register("cpp", "minisgl.attention.cpp_backend:CppBackend", runs_on=cpp_runs_on)
ATTENTION_BACKENDS.register(
    "triton", "minisgl.attention.triton_backend:TritonBackend", runs_on=triton_runs_on
)

__all__ = ["ATTENTION_BACKENDS"]
