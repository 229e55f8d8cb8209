from dataclasses import dataclass

from minisgl.engine import EngineConfig
from minisgl.scheduler import SchedulerConfig


@dataclass(frozen=True)
class ServerArgs:
    """What to serve and how; `minisgl --help` explains each option."""

    engine: EngineConfig  # tp_rank is 0; the launcher derives each rank's config
    scheduler: SchedulerConfig
    served_model_name: str
    host: str = "127.0.0.1"
    port: int = 1919
    api_key: str | None = None
    shell: bool = False
