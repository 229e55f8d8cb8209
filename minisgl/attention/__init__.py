import torch

from minisgl.kvcache import KVPool
from minisgl.utils import Registry

from .base import AttentionBackend
from .torch_backend import TorchBackend

ATTENTION_BACKENDS: Registry[AttentionBackend] = Registry("attention backend")
ATTENTION_BACKENDS.register("torch")(TorchBackend)


@ATTENTION_BACKENDS.register("triton")
def _triton_backend(pool: KVPool, page_table: torch.Tensor) -> AttentionBackend:
    from .triton_backend import TritonBackend  # imported when chosen: needs triton installed

    return TritonBackend(pool, page_table)


def create_attention_backend(name: str, pool: KVPool, page_table: torch.Tensor) -> AttentionBackend:
    return ATTENTION_BACKENDS.get(name)(pool, page_table)


__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionBackend",
    "TorchBackend",
    "create_attention_backend",
]
