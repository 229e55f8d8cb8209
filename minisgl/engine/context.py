"""What layers read during a forward: the batch being computed, on the device.

The engine reads a batch's inputs from its tables (`load_inputs`) and sets the batch for one
forward (`forward_context`); the attention layer and the LM head read it (`current_forward`), so
that the model's forward takes only the input ids.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from minisgl.kernel import read_tables

if TYPE_CHECKING:
    from minisgl.attention.base import AttentionBackend
    from minisgl.core import BatchInputs


@dataclass(frozen=True, eq=False)
class ForwardBatch:
    """One forward's batch on the device. out_loc: the pool location each token's K/V goes to,
    read from the page table by the forward's first op."""

    is_decode: bool
    inputs: BatchInputs[torch.Tensor]
    out_loc: torch.Tensor
    attn_backend: AttentionBackend
    attn_metadata: Any  # the backend's own, from its `prepare` (None when it needs none)


def load_inputs(
    inputs: BatchInputs[torch.Tensor], page_table: torch.Tensor, token_table: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first thing a forward does (inside the CUDA graph when one replays): apply the batch's
    table writes, then read its input ids and KV locations (out_loc) from the tables."""
    return read_tables(
        page_table, token_table, (inputs.page_write_entries, inputs.page_write_values),
        (inputs.token_write_entries, inputs.token_write_values),
        inputs.token_entries, inputs.page_entries,
    )  # fmt: skip


_CURRENT: list[ForwardBatch] = []


@contextmanager
def forward_context(batch: ForwardBatch) -> Iterator[None]:
    """`batch` is the current forward's while the block runs (one forward at a time)."""
    if _CURRENT:
        raise RuntimeError("nested forward")
    _CURRENT.append(batch)
    try:
        yield
    finally:
        _CURRENT.pop()


def current_forward() -> ForwardBatch:
    if not _CURRENT:
        raise RuntimeError("no forward is running")
    return _CURRENT[0]
