"""Batched attention, the CPU's default: a batch's one-token rows (decodes) attend in a few SDPA
calls per layer, each over the K/V of a group of rows gathered through the page table and padded
to the group's longest; the other rows (prompt chunks) one request at a time, as in the
reference (TorchBackend).

    one group's keys, one gather                 added to their scores
    row 0: k[loc 0,0] ... k[loc 0,L0-1]          0 ... 0        (L0: the group's longest)
    row 1: k[loc 1,0] ... k[loc 1,L1-1] k[pad]   0 ... 0 -inf

The reference's loop costs a gather, a GQA repeat and an SDPA call per request and layer: at 32
decoding requests that was ~40 % of a CPU run's time (torch.profiler, benchmark/RESULTS.md).
Rows are grouped by length, longest first, where a split saves more padding than a call costs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from minisgl.core import Batch
from minisgl.utils.torch_utils import to_device

from .torch_backend import Span, TorchBackend, prompt_spans

if TYPE_CHECKING:
    from minisgl.engine.context import ForwardBatch

# what a group's calls cost, in K/V bytes gathered and read instead: ~50 us against ~0.37 us a
# padded key of 2 KB (one thread, the CPU benchmark's model)
GROUP_COST_BYTES = 256 << 10


@dataclass(frozen=True)
class OneTokenGroup:
    """Rows that compute one token each, so each attends to every key of its request."""

    rows: torch.Tensor | None  # their rows of q; None: every row of the batch, in order
    entries: torch.Tensor  # [rows, width] int32: flat page-table entries of their keys
    mask: torch.Tensor  # [rows, 1, 1, width] fp32: 0 for a request's keys, -inf for the padding


@dataclass(frozen=True)
class BatchedMetadata:
    groups: list[OneTokenGroup]
    spans: list[Span]  # the other requests, attended one at a time


def length_groups(lens: np.ndarray, min_saved: int) -> list[tuple[int, int]]:
    """[start, end) runs of lens (sorted longest first), each to be padded to its first length:
    split where the split saves the most padded keys, while that is at least min_saved."""
    n = len(lens)
    if n < 2:
        return [(0, n)]
    # a split before row k pads rows k.. to lens[k] rather than lens[0]
    saved = (n - np.arange(1, n)) * (lens[0] - lens[1:])
    k = int(np.argmax(saved)) + 1
    if saved[k - 1] < min_saved:
        return [(0, n)]
    tail = length_groups(lens[k:], min_saved)
    return length_groups(lens[:k], min_saved) + [(k + a, k + b) for a, b in tail]


class BatchedBackend(TorchBackend):
    def prepare(self, batch: Batch) -> BatchedMetadata:
        inputs = batch.inputs
        return self._plan(inputs.cu_seqlens_q, inputs.slots, inputs.seq_lens)

    def _plan(self, cu: np.ndarray, slots: np.ndarray, seq_lens: np.ndarray) -> BatchedMetadata:
        single = np.flatnonzero(np.diff(cu) == 1)
        spans = prompt_spans(cu, slots, seq_lens)
        if len(single) == 0:
            return BatchedMetadata([], spans)
        longest_first = single[np.argsort(-seq_lens[single], kind="stable")]
        k_cache = self.pool.k_cache(0)
        key_bytes = 2 * k_cache[0].numel() * k_cache.element_size()  # its K and V
        runs = length_groups(seq_lens[longest_first], GROUP_COST_BYTES // key_bytes)
        if len(runs) == 1 and len(single) == len(slots):  # a decode step in one call
            return BatchedMetadata([self._group(None, slots, seq_lens)], spans)
        groups = []
        for start, end in runs:
            rows = longest_first[start:end]
            groups.append(self._group(cu[rows], slots[rows], seq_lens[rows]))
        return BatchedMetadata(groups, spans)

    def _group(
        self, rows: np.ndarray | None, slots: np.ndarray, seq_lens: np.ndarray
    ) -> OneTokenGroup:
        positions = np.arange(seq_lens.max())
        entries = slots[:, None] * self.page_table.shape[1] + positions
        padding = torch.from_numpy(positions[None, :] >= seq_lens[:, None])
        mask = torch.zeros(padding.shape).masked_fill_(padding, -torch.inf)
        device = self.page_table.device
        return OneTokenGroup(
            None if rows is None else to_device(torch.from_numpy(rows), device),
            to_device(torch.from_numpy(entries.astype(np.int32)), device),
            to_device(mask[:, None, None, :], device),
        )

    def forward(self, q: torch.Tensor, layer_id: int, batch: ForwardBatch) -> torch.Tensor:
        metadata: BatchedMetadata | None = batch.attn_metadata
        if metadata is None:  # the graph runner's static-buffer step, which the CPU runs uncaptured
            inputs = batch.inputs
            columns = (inputs.cu_seqlens_q, inputs.slots, inputs.seq_lens)
            metadata = self._plan(*(c.cpu().numpy() for c in columns))
        groups = metadata.groups
        if len(groups) == 1 and groups[0].rows is None:
            return self._attend_one_token(q, layer_id, groups[0])
        out = torch.empty_like(q)
        for group in groups:
            out[group.rows] = self._attend_one_token(q[group.rows], layer_id, group)
        self.attend_each(q, layer_id, metadata.spans, out)
        return out

    def _attend_one_token(
        self, q: torch.Tensor, layer_id: int, group: OneTokenGroup
    ) -> torch.Tensor:
        """q: [rows, qo_heads, D], one token of each request. Returns the same shape. In fp32:
        the CPU's bf16 SDPA took 15 ms for 32 rows where the upcast and fp32 took 5.4 (one
        thread)."""
        k_cache, v_cache = self.pool.k_cache(layer_id), self.pool.v_cache(layer_id)
        (rows, width), (kv_heads, head_dim) = group.entries.shape, k_cache.shape[1:]
        locs = self.page_table.view(-1).index_select(0, group.entries.view(-1))
        # gathered as [rows, kv_heads, width, D], each (request, head) one run of keys: gather and
        # SDPA took 10-15 % less than on a strided view of [rows, width, kv_heads, D] (32 rows)
        heads = torch.arange(kv_heads, dtype=locs.dtype, device=locs.device)
        head_rows = (locs.view(rows, 1, width) * kv_heads + heads[:, None]).view(-1)
        shape = (rows, kv_heads, width, head_dim)
        keys = k_cache.view(-1, head_dim).index_select(0, head_rows).float().view(shape)
        values = v_cache.view(-1, head_dim).index_select(0, head_rows).float().view(shape)
        out = F.scaled_dot_product_attention(
            q.float().unsqueeze(2), keys, values, attn_mask=group.mask, enable_gqa=True
        )
        return out.squeeze(2).to(q.dtype)
