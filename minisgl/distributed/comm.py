"""The collectives a TP layer needs, over the default process group (gloo on CPU, NCCL on GPU)."""

import torch
import torch.distributed as dist

# torch 2.13 renamed all_gather_into_tensor (its old name warns once per rank); the GPU image's
# torch (2.11) has only the old one
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sums every rank's `x` into it, in place."""
    dist.all_reduce(x)
    return x


def all_gather(x: torch.Tensor) -> torch.Tensor:
    """Concatenates every rank's `x` along dimension 0."""
    out = torch.empty(
        (dist.get_world_size() * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device
    )
    _all_gather_single(out, x.contiguous())
    return out


def broadcast(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's `x` on every rank, in place."""
    dist.broadcast(x, 0)
    return x
