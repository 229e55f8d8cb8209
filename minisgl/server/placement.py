"""Where each --dp replica runs: on GPUs of its own and on a share of the CPU cores."""

import os
from dataclasses import dataclass
from pathlib import Path

from minisgl.utils.cpus import CGROUP, usable_cpus


@dataclass(frozen=True)
class Placement:
    """A replica's GPUs (the CUDA_VISIBLE_DEVICES its processes see) and CPU cores."""

    gpus: str
    cpus: frozenset[int]

    def apply(self) -> None:
        """In each of the replica's processes, before torch is imported (CUDA reads the variable
        once); its scheduler then takes a torch thread per core it has."""
        os.environ["CUDA_VISIBLE_DEVICES"] = self.gpus
        os.sched_setaffinity(0, self.cpus)


def placements(dp_size: int, tp_size: int, cgroup: Path = CGROUP) -> list[Placement]:
    """Replica i's: GPUs i*tp .. i*tp+tp-1 of those visible, and the i-th of dp_size equal shares
    of the cores this process may use (its mask, capped by the cgroup's quota), or the whole mask
    with fewer such cores than replicas. Replicas sharing the cores would each run a torch thread
    per core: more threads than cores, which then wait on each other at every parallel section
    (on 2 cores, 10x slower requests)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = visible.split(",") if visible else [str(g) for g in range(dp_size * tp_size)]
    cpus = sorted(os.sched_getaffinity(0))
    share = usable_cpus(cgroup) // dp_size
    return [
        Placement(
            ",".join(gpus[i * tp_size : (i + 1) * tp_size]),
            frozenset(cpus[i * share : (i + 1) * share] if share else cpus),
        )
        for i in range(dp_size)
    ]
