from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerConfig:
    chunk_size: int = 8192  # tokens per step, decodes first; a longer prompt is prefilled in chunks
    cache: str = "radix"  # prefix cache: radix (reuse shared prefixes) or naive (no reuse)
    overlap: bool = True  # build step k+1 while step k computes
    seed: int = 0  # draws the sampling seed of requests that give none

    def __post_init__(self) -> None:
        if self.chunk_size < 1:
            raise ValueError("chunk_size must be >= 1")
