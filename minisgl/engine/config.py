from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to build the model, the KV pool and the kernels it runs."""

    model_path: Path
    device: str = "auto"  # auto: cuda when available, else cpu
    dtype: str = "auto"  # auto: bfloat16 on cuda, float32 on cpu
    page_size: int = 1
    max_running_requests: int = 256
    max_kv_tokens: int | None = None  # None: sized from free memory
    memory_fraction: float = 0.85  # of the device memory free at start-up, for weights + KV
    attention_backend: str = "auto"  # auto: triton on cuda, torch on cpu
    cuda_graph_max_bs: int | None = None  # None: auto (on cuda only); 0: off
    dummy_weights: bool = False
    tp_rank: int = 0
    tp_size: int = 1
    dist_init_method: str | None = None  # torch.distributed init URL when tp_size > 1

    def __post_init__(self) -> None:
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp rank {self.tp_rank} is outside a TP size of {self.tp_size}")
        if self.page_size < 1:
            raise ValueError("page_size must be >= 1")
        if self.max_running_requests < 1:
            raise ValueError("max_running_requests must be >= 1")
        if self.max_kv_tokens is not None and self.max_kv_tokens < 1:
            raise ValueError("max_kv_tokens must be >= 1")
        if not 0 < self.memory_fraction <= 1:
            raise ValueError("memory_fraction must be in (0, 1]")
