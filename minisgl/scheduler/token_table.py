import itertools

import numpy as np

from minisgl.core import EngineLayout
from minisgl.utils.arrays import ragged_arange


class TokenTable:
    """Decides the entries of the engine's token table: every running request's token ids on the
    device, one row per slot, [slots + 1, max_seq_len].

    A step's input ids are read from there by (slot, position), and the engine writes each sampled
    id back on the device, so the next step can be launched before the host has seen it. The last
    row is a sink for the tokens of requests that sample nothing this step (a mid-prompt chunk).
    """

    def __init__(self, layout: EngineLayout) -> None:
        self.width = layout.token_table_width
        self._free_slots = list(range(layout.num_slots - 1, -1, -1))
        self._pending: list[tuple[int, int, list[int]]] = []  # (slot, start, ids) to write

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def alloc_slot(self) -> int:
        return self._free_slots.pop()

    def free_slot(self, slot: int) -> None:
        self._free_slots.append(slot)

    def write(self, slot: int, start: int, ids: list[int]) -> None:
        """Host-known ids (a prompt); they go out with the next batch (take_writes)."""
        self._pending.append((slot, start, ids))

    def take_writes(self) -> tuple[np.ndarray, np.ndarray]:
        """The writes since the last call: (flat entry of the table, token id), int64 arrays."""
        pending, self._pending = self._pending, []
        # each write fills consecutive entries of one row: a range of the flattened table
        starts = [slot * self.width + start for slot, start, _ in pending]
        entries = ragged_arange(starts, [len(ids) for _, _, ids in pending])
        token_ids = itertools.chain.from_iterable(ids for _, _, ids in pending)
        return entries, np.fromiter(token_ids, np.int64, count=len(entries))
