"""How many CPU cores this process may use: its affinity mask, capped by a cgroup CPU quota. A
container started with `--cpus N` keeps every core of its host in the mask and throttles to N
cores' time instead, so a torch thread per core of the mask would oversubscribe the quota: the
threads then wait on each other at every parallel section (on 2 cores, 10x slower requests)."""

import math
import os
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")


def cgroup_cpu_limit(root: Path = CGROUP) -> int | None:
    """Cores of CPU time the cgroup allows (its quota over its period, rounded up), or None where
    no quota is set or readable. cgroup v2's cpu.max ("max 100000" or "QUOTA PERIOD"), else
    v1's cpu.cfs_quota_us (-1: none) and cpu.cfs_period_us."""
    try:
        if (root / "cpu.max").exists():
            quota, period = (root / "cpu.max").read_text().split()
            if quota == "max":
                return None
        else:
            quota = (root / "cpu" / "cpu.cfs_quota_us").read_text().strip()
            period = (root / "cpu" / "cpu.cfs_period_us").read_text().strip()
            if int(quota) < 0:
                return None
        return max(1, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError):
        return None


def usable_cpus(root: Path = CGROUP) -> int:
    """The cores of the affinity mask, at most the cgroup's quota."""
    cores = len(os.sched_getaffinity(0))
    limit = cgroup_cpu_limit(root)
    return cores if limit is None else min(cores, limit)
