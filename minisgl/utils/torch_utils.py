from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import torch

from minisgl.config import ConfigError


@contextmanager
def torch_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Temporarily change the default dtype of newly created tensors."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def resolve_device(device: str | torch.device) -> torch.device:
    """`auto`: CUDA if there is one, else the CPU; raises ConfigError for any device but a CUDA
    one and the CPU (which has no index but 0), and for CUDA on a machine without it."""
    name = "cuda" if str(device) == "auto" and torch.cuda.is_available() else str(device)
    try:
        resolved = torch.device("cpu" if name == "auto" else name)
    except RuntimeError:  # not a device torch knows
        resolved = None
    if resolved is None or not (
        resolved.type == "cuda" or (resolved.type == "cpu" and resolved.index in (None, 0))
    ):
        raise ConfigError(f"device {name!r} is not supported; use auto, cpu, cuda or cuda:N")
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r}: no CUDA device is available")
    if resolved.type == "cuda" and resolved.index is None:
        resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved


_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_DTYPES.update({"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16})
_DTYPES.update({"float": torch.float32, "half": torch.float16})  # vLLM's and SGLang's names


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """`auto` means bf16 on CUDA (speed) and fp32 on CPU (exact match with the reference)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; supported: auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a freshly built host tensor to `device` without blocking the CPU (pinned staging)."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def copy_to_device(host: torch.Tensor, out: torch.Tensor) -> None:
    """Copy a freshly built host tensor into `out` without blocking the CPU (pinned staging)."""
    if out.device.type == "cuda":
        host = host.pin_memory()
    out.copy_(host, non_blocking=True)


ALIGN_BYTES = 16  # where packed device columns start (see pack_to_device)
_NUMPY_DTYPES = {torch.int32: np.int32, torch.int64: np.int64, torch.float32: np.float32}


class PinnedStaging:
    """Pinned host buffers that host arrays are copied to the GPU through, pinned once and reused
    in turn: pinning a fresh buffer for each 8k-token prefill's inputs took 1.6-3.4 ms of host
    time on some machines. A buffer is written again only once its last copy has run: with
    overlap, a step's copy may still wait behind the GPU's work while the next step is packed."""

    def __init__(self, slots: int = 2) -> None:
        self._buffers = [torch.empty(0, dtype=torch.uint8, pin_memory=True) for _ in range(slots)]
        self._copied = [torch.cuda.Event() for _ in range(slots)]
        self._turn = 0

    def to_device(self, host: np.ndarray, device: torch.device) -> torch.Tensor:
        slot, self._turn = self._turn, (self._turn + 1) % len(self._buffers)
        self._copied[slot].synchronize()
        if self._buffers[slot].numel() < host.nbytes:  # grown by doubling: pinning is slow
            size = max(host.nbytes, 2 * self._buffers[slot].numel())
            self._buffers[slot] = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        staged = self._buffers[slot][: host.nbytes]
        staged.numpy()[:] = host.view(np.uint8)
        out = staged.to(device, non_blocking=True)
        self._copied[slot].record()
        return out.view(torch.from_numpy(host[:0]).dtype)


def pack_to_device(
    device: torch.device,
    dtype: torch.dtype,
    staging: PinnedStaging | None = None,
    **columns: Sequence[int] | Sequence[float] | np.ndarray,
) -> dict[str, torch.Tensor]:
    """Copy several host columns (lists or arrays) to the device in one transfer, through
    `staging` where given; returns a view per name.

    Each view starts 16-byte aligned: Triton compiles a kernel variant per pointer alignment, so
    unaligned views would make new batch sizes compile new variants while serving."""
    align = ALIGN_BYTES // dtype.itemsize
    views, end = {}, 0
    for name, values in columns.items():
        views[name] = slice(end, end + len(values))
        end += len(values) + -len(values) % align
    np_dtype = _NUMPY_DTYPES[dtype]
    host = np.zeros(end, dtype=np_dtype)  # filled in numpy: no torch op per column
    for name, values in columns.items():
        if isinstance(values, np.ndarray):
            host[views[name]] = values
        else:  # fromiter converts a list of Python numbers faster than slice assignment
            host[views[name]] = np.fromiter(values, np_dtype, count=len(values))
    if staging is not None:
        packed = staging.to_device(host, device)
    else:
        packed = to_device(torch.from_numpy(host), device)
    return {name: packed[view] for name, view in views.items()}
