"""What to build and how to schedule: the engine's and the scheduler's settings, with every default
in one place. The CLI (`minisgl --help`) and the offline `LLM(model, **overrides)` set the same
fields by the same names. Imports nothing heavy: `minisgl --help` reads it without torch.
"""

import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A setting, or a model directory, that cannot be served: found at start-up, said in a line."""


# tokens per step when none is given. The server's: a longer step delays its running streams.
SERVER_CHUNK_SIZE = 8192


def offline_chunk_size(device_type: str, total_memory: int = 0, device_name: str = "") -> int:
    """The offline API's tokens per step: 16,384 on a GPU of 70 GiB or more but an A100, else
    8,192 (vLLM's defaults; vLLM measured the larger one slower on an A100). An H200's eager
    prefill step costs the host about as long to launch as the GPU needs for 8,192 tokens: twice
    the tokens ran the offline benchmark 1.6-3.4 % faster."""
    large = device_type == "cuda" and total_memory >= 70 << 30 and "A100" not in device_name
    return 16384 if large else SERVER_CHUNK_SIZE


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to build the model, the KV pool and the kernels it runs."""

    model_path: Path
    device: str = "auto"  # auto: cuda when available, else cpu
    dtype: str = "auto"  # auto: bfloat16 on cuda, float32 on cpu
    page_size: int = 1
    max_running_requests: int = 256
    max_kv_tokens: int | None = None  # None: sized from free memory
    max_model_len: int | None = None  # None: the model's; the KV pool must hold one such request
    # of the device memory free at start-up, for weights + KV; None: the engine's default
    gpu_memory_utilization: float | None = None
    attention_backend: str = "auto"  # auto: the registry's default for the device
    moe_backend: str = "auto"  # a MoE model's experts; auto: as attention_backend
    cuda_graph_max_bs: int | None = None  # None: max_running_requests on cuda; 0: off
    dummy_weights: bool = False
    tp_rank: int = 0
    tp_size: int = 1
    nnodes: int = 1  # machines the TP ranks are spread over, an even share on each
    dist_init_method: str | None = None  # torch.distributed init URL when tp_size > 1

    def __post_init__(self) -> None:
        check_positive(self, "page_size", "max_running_requests", "tp_size", "nnodes")
        if self.tp_size % self.nnodes != 0:
            raise ConfigError(
                f"a TP size of {self.tp_size} does not split over {self.nnodes} nodes"
            )
        check_positive(self, "max_kv_tokens", "max_model_len", optional=True)
        if not 0 <= self.tp_rank < self.tp_size:
            raise ConfigError(f"tp rank {self.tp_rank} is outside a TP size of {self.tp_size}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError("gpu_memory_utilization must be in (0, 1]")
        if self.gpu_memory_utilization is not None and self.max_kv_tokens is not None:
            raise ConfigError(
                "max_kv_tokens fixes the KV cache that gpu_memory_utilization would size: give one"
            )
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 0:
            raise ConfigError("cuda_graph_max_bs must be >= 0")

    @property
    def ranks_per_node(self) -> int:
        return self.tp_size // self.nnodes

    @property
    def local_rank(self) -> int:
        """This rank's place among its node's ranks (nodes hold consecutive ranks): its GPU."""
        return self.tp_rank % self.ranks_per_node


@dataclass(frozen=True)
class SchedulerConfig:
    chunk_size: int = SERVER_CHUNK_SIZE  # tokens per step, decodes first; longer prompts in chunks
    cache: str = "radix"  # prefix cache: radix (reuse shared prefixes) or naive (no reuse)
    overlap: bool = True  # build step k+1 while step k computes
    seed: int = 0  # draws the sampling seed of requests that give none
    # seconds a structured output's grammar may take to compile, its wait for a grammar thread
    # included; past it the request ends in error. On a 2-core CPU with Qwen3's vocabulary
    # (xgrammar 0.2.9) a Pydantic model compiles in milliseconds, an object of 400 optional
    # properties in 0.9 s, of 800 in 4.6 s: the time grows about as the cube of their number
    grammar_timeout: float = 30.0

    def __post_init__(self) -> None:
        check_positive(self, "chunk_size")
        timeout = self.grammar_timeout
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, int | float)
            or not 0 < timeout < math.inf
        ):
            raise ConfigError(f"grammar_timeout must be a number of seconds > 0, not {timeout!r}")
        if not isinstance(self.overlap, bool):
            raise ConfigError(f"overlap must be a bool, not {self.overlap!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ConfigError(f"seed must be an integer, not {self.seed!r}")


def check_positive(config: Any, *names: str, optional: bool = False) -> None:
    """Raise ValueError unless each named field is an int >= 1 (or None, when optional)."""
    for name in names:
        value = getattr(config, name)
        if optional and value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be an integer >= 1, not {value!r}")


def split_overrides(overrides: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(EngineConfig fields, SchedulerConfig fields) of `overrides`; an unknown name raises."""
    engine_names = {f.name for f in fields(EngineConfig)}
    scheduler_names = {f.name for f in fields(SchedulerConfig)}
    if "model_path" in overrides:
        raise ConfigError("model_path: give the model as the first argument")
    unknown = sorted(set(overrides) - engine_names - scheduler_names)
    if unknown:
        raise ConfigError(f"unknown setting(s) {', '.join(unknown)}")
    engine = {k: v for k, v in overrides.items() if k in engine_names}
    scheduler = {k: v for k, v in overrides.items() if k in scheduler_names}
    return engine, scheduler


def max_seq_len(config: EngineConfig, model_positions: int) -> int:
    """The longest sequence a request may reach: the model's, or max_model_len below it."""
    wanted = config.max_model_len
    if wanted is not None and wanted > model_positions:
        raise ConfigError(f"max_model_len {wanted} exceeds the model's {model_positions} positions")
    return wanted or model_positions


def kv_pages(kv_tokens: int, page_size: int) -> int:
    """The pages of a KV cache asked to hold kv_tokens: rounded up to whole pages."""
    return -(-kv_tokens // page_size)


def page_table_width(seq_len: int, page_size: int) -> int:
    """The page table's columns: a token of the longest request each, in whole pages."""
    return kv_pages(seq_len, page_size) * page_size


def check_table_size(max_running_requests: int, page_size: int, seq_len: int) -> None:
    """Raise ConfigError unless the page and token tables (a row per running request and one
    for padding, a column per token of the longest request, in whole pages) index with int32
    entries."""
    width = page_table_width(seq_len, page_size)
    if (max_running_requests + 1) * width >= 2**31:
        raise ConfigError(
            f"max_running_requests {max_running_requests} x a context of {width} tokens is past "
            "the page and token tables' int32 entries: lower max_running_requests or max_model_len"
        )


def check_kv_capacity(num_pages: int, page_size: int, seq_len: int) -> None:
    """Raise ConfigError unless a KV cache of num_pages pages holds one request of seq_len
    tokens."""
    kv_tokens = num_pages * page_size
    if kv_tokens < seq_len:
        raise ConfigError(
            f"the KV cache holds {kv_tokens} tokens, fewer than one request of the maximum model "
            f"length ({seq_len}): give it more (--max-kv-tokens, --gpu-memory-utilization) or set "
            f"--max-model-len to at most {kv_tokens}"
        )
