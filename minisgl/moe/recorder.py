"""Which experts a run's decode steps select, for the benchmarks' memory floor: a step reads the
weights of each expert its tokens chose once, however many of its tokens chose it.

    with recording() as recorder:    # eager forwards only: a CUDA graph replays without Python
        llm.generate(...)
    recorder.mean_selected()         # distinct experts per sparse layer and decode step
"""

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from minisgl.engine.context import current_forward


class ExpertRecorder:
    """Counts, over the decode forwards it is active for, the distinct experts that each sparse
    layer's tokens select; on the device, so recording reads nothing back until asked."""

    def __init__(self) -> None:
        self.layer_steps = 0  # (sparse layer, decode step) pairs seen
        self._selected: torch.Tensor | None = None  # their distinct experts, summed

    def record(self, ids: torch.Tensor, num_experts: int) -> None:
        chosen = torch.zeros(num_experts, dtype=torch.bool, device=ids.device)
        chosen[ids.flatten()] = True
        count = chosen.sum()
        self._selected = count if self._selected is None else self._selected + count
        self.layer_steps += 1

    def mean_selected(self) -> float:
        """Distinct experts per sparse layer and decode step."""
        if self._selected is None:
            raise ValueError("no decode step of a sparse layer was recorded")
        return self._selected.item() / self.layer_steps


_ACTIVE: list[ExpertRecorder] = []


@contextmanager
def recording() -> Iterator[ExpertRecorder]:
    """A recorder that the sparse layers' decode forwards report to while the block runs."""
    if _ACTIVE:
        raise RuntimeError("nested expert recording")
    recorder = ExpertRecorder()
    _ACTIVE.append(recorder)
    try:
        yield recorder
    finally:
        _ACTIVE.pop()


def record_routing(ids: torch.Tensor, num_experts: int) -> None:
    """A sparse layer's choice of experts ([tokens, k]), counted if a decode forward runs while
    recording."""
    if _ACTIVE and current_forward().is_decode:
        _ACTIVE[0].record(ids, num_experts)
