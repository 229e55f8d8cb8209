"""Batched attention, the CPU's default: a batch's one-token rows (decodes) attend in one SDPA call
per layer, over their K/V gathered through the page table and padded to the longest of them; the
other rows (prompt chunks) one request at a time, as in the reference (TorchBackend).

    keys of the one-token rows, one gather       added to their scores
    row 0: k[loc 0,0] ... k[loc 0,L0-1] k[pad]   0 ... 0 -inf
    row 1: k[loc 1,0] ... k[loc 1,L1-1]          0 ... 0        (L1: the longest)

The reference's loop costs a gather, a GQA repeat and an SDPA call per request and layer: at 32
decoding requests that was ~40 % of a CPU run's time (torch.profiler, benchmark/RESULTS.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from minisgl.core import Batch
from minisgl.utils.torch_utils import to_device

from .torch_backend import Span, TorchBackend

if TYPE_CHECKING:
    from minisgl.engine.context import ForwardBatch


@dataclass(frozen=True)
class OneTokenRows:
    """The rows that compute one token: each attends to every key of its request."""

    rows: torch.Tensor | None  # their rows of q; None: every row of the batch
    entries: torch.Tensor  # [rows, width] int32: flat page-table entries of their keys
    mask: torch.Tensor  # [rows, 1, 1, width]: 0 for a request's keys, -inf for the padding


@dataclass(frozen=True)
class BatchedMetadata:
    one_token: OneTokenRows | None
    spans: list[Span]  # the other requests, attended one at a time


class BatchedBackend(TorchBackend):
    def prepare(self, batch: Batch) -> BatchedMetadata:
        inputs = batch.inputs
        return self._plan(inputs.cu_seqlens_q, inputs.slots, inputs.seq_lens)

    def _plan(self, cu: np.ndarray, slots: np.ndarray, seq_lens: np.ndarray) -> BatchedMetadata:
        extend_lens = np.diff(cu)
        single = np.flatnonzero(extend_lens == 1)
        spans = [
            (int(cu[i]), int(cu[i + 1]), int(slots[i]), int(seq_lens[i]))
            for i in np.flatnonzero(extend_lens > 1)
        ]
        if len(single) == 0:
            return BatchedMetadata(None, spans)
        lens = seq_lens[single]
        positions = np.arange(lens.max())
        entries = slots[single, None] * self.page_table.shape[1] + positions
        padding = torch.from_numpy(positions[None, :] >= lens[:, None])
        dtype = self.pool.k_cache(0).dtype
        mask = torch.zeros(padding.shape, dtype=dtype).masked_fill_(padding, -torch.inf)
        device = self.page_table.device
        everyone = len(single) == len(slots)
        rows = None if everyone else to_device(torch.from_numpy(cu[single]), device)
        one_token = OneTokenRows(
            rows,
            to_device(torch.from_numpy(entries.astype(np.int32)), device),
            to_device(mask[:, None, None, :], device),
        )
        return BatchedMetadata(one_token, spans)

    def forward(self, q: torch.Tensor, layer_id: int, batch: ForwardBatch) -> torch.Tensor:
        metadata: BatchedMetadata | None = batch.attn_metadata
        if metadata is None:  # the graph runner's static-buffer step, which the CPU runs uncaptured
            inputs = batch.inputs
            columns = (inputs.cu_seqlens_q, inputs.slots, inputs.seq_lens)
            metadata = self._plan(*(c.cpu().numpy() for c in columns))
        one = metadata.one_token
        if one is not None and one.rows is None:  # a decode step
            return self._attend_one_token(q, layer_id, one)
        out = torch.empty_like(q)
        if one is not None:
            out[one.rows] = self._attend_one_token(q[one.rows], layer_id, one)
        self.attend_each(q, layer_id, metadata.spans, out)
        return out

    def _attend_one_token(self, q: torch.Tensor, layer_id: int, one: OneTokenRows) -> torch.Tensor:
        """q: [rows, qo_heads, D], one token of each request. Returns the same shape."""
        k_cache, v_cache = self.pool.k_cache(layer_id), self.pool.v_cache(layer_id)
        locs = self.page_table.view(-1).index_select(0, one.entries.view(-1))
        shape = (*one.entries.shape, *k_cache.shape[1:])  # [rows, width, kv_heads, D]
        keys = k_cache.index_select(0, locs).view(shape).transpose(1, 2)
        values = v_cache.index_select(0, locs).view(shape).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2), keys, values, attn_mask=one.mask, enable_gqa=True
        )
        return out.squeeze(2)
