from collections.abc import Iterator
from contextlib import contextmanager

import torch


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
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_DTYPES.update({"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16})


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """`auto` means bf16 on CUDA (speed) and fp32 on CPU (exact match with the reference)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; supported: auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a freshly built host tensor to `device` without blocking the CPU (pinned staging)."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def pack_to_device(
    device: torch.device, dtype: torch.dtype, **columns: list[int] | list[float]
) -> dict[str, torch.Tensor]:
    """Copy several host lists to the device in one transfer; returns a view per name."""
    flat = [x for values in columns.values() for x in values]
    packed = to_device(torch.tensor(flat, dtype=dtype), device)
    return dict(zip(columns, packed.split([len(v) for v in columns.values()]), strict=True))
