from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from .base import AttentionBackend

if TYPE_CHECKING:
    from minisgl.engine.context import ForwardBatch

# one request's rows of q and whose keys they attend: (start, end, slot, seq_len)
Span = tuple[int, int, int, int]


def prompt_spans(cu_seqlens_q: np.ndarray, slots: np.ndarray, seq_lens: np.ndarray) -> list[Span]:
    """The spans of the requests that compute more than one token (prompt chunks)."""
    return [
        (int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1]), int(slots[i]), int(seq_lens[i]))
        for i in np.flatnonzero(np.diff(cu_seqlens_q) > 1)
    ]


class TorchBackend(AttentionBackend):
    """The reference: gathers each request's K/V through the page table and runs SDPA with a causal
    mask placed at the request's absolute positions. One request at a time; clear, not fast.
    Its loop reads the batch's lengths on the host, so a CUDA graph cannot capture it."""

    supports_cuda_graph = False

    def forward(self, q: torch.Tensor, layer_id: int, batch: ForwardBatch) -> torch.Tensor:
        out = torch.empty_like(q)
        cu = batch.inputs.cu_seqlens_q.tolist()
        spans = zip(
            cu[:-1], cu[1:], batch.inputs.slots.tolist(), batch.inputs.seq_lens.tolist(),
            strict=True,
        )  # fmt: skip
        self.attend_each(q, layer_id, spans, out)
        return out

    def attend_each(
        self, q: torch.Tensor, layer_id: int, spans: Iterable[Span], out: torch.Tensor
    ) -> None:
        """out[start:end] = attention of q[start:end] over the first seq_len keys of the slot,
        for each span."""
        k_cache, v_cache = self.pool.k_cache(layer_id), self.pool.v_cache(layer_id)
        group = q.shape[1] // k_cache.shape[1]
        for start, end, slot, seq_len in spans:
            if start == end:
                continue
            locs = self.page_table[slot, :seq_len].long()
            # [1, H, S, D] like Hugging Face's SDPA call, so fp32 results agree bit for bit
            keys = k_cache[locs].repeat_interleave(group, dim=1).transpose(0, 1)[None]
            values = v_cache[locs].repeat_interleave(group, dim=1).transpose(0, 1)[None]
            query = q[start:end].transpose(0, 1)[None]
            out[start:end] = _causal_sdpa(query, keys, values)[0].transpose(0, 1)


def _causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of the last T of S positions: the t-th query sits at S - T + t."""
    num_new, seq_len = q.shape[2], k.shape[2]
    if num_new == seq_len:  # no cached prefix: the plain causal mask
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if num_new == 1:  # a decode sees every key
        return F.scaled_dot_product_attention(q, k, v)
    q_pos = torch.arange(seq_len - num_new, seq_len, device=q.device)
    mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
