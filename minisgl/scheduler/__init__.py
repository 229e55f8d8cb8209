from .config import SchedulerConfig
from .scheduler import ReqOutput, Scheduler, SchedulerStats

__all__ = ["ReqOutput", "Scheduler", "SchedulerConfig", "SchedulerStats"]
