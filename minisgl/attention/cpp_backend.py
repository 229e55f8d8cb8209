"""The CPU's default attention: every row that computes one token (a decode) in one call of a C++
kernel that reads each request's K/V where it lies in the pool (`kernel/cpp`), so nothing is
gathered, padded or masked; the other rows (prompt chunks) one request at a time, as in the
reference, whose SDPA suits many query rows. Where no C++ compiler builds the kernel, "auto" takes
the batched backend instead.

32 decode rows of 100-380 keys (heads 8/4 of 64, fp32, 2 threads): the batched backend's gathers
and SDPA 1.9-2.6 ms a layer, this kernel 0.3-0.5 ms with the keys in cache and 1.0-1.3 without;
the CPU benchmark's run 2.71 -> 2.14 s with the RoPE kernel (benchmark/RESULTS.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from minisgl.core import Batch
from minisgl.kernel import cpp

from .torch_backend import Span, TorchBackend, prompt_spans

if TYPE_CHECKING:
    from minisgl.engine.context import ForwardBatch


class CppBackend(TorchBackend):
    def prepare(self, batch: Batch) -> list[Span]:
        inputs = batch.inputs
        return prompt_spans(inputs.cu_seqlens_q, inputs.slots, inputs.seq_lens)

    def forward(self, q: torch.Tensor, layer_id: int, batch: ForwardBatch) -> torch.Tensor:
        k_cache, v_cache = self.pool.k_cache(layer_id), self.pool.v_cache(layer_id)
        if not cpp.serves_decode_attention(k_cache, v_cache):  # fp16: every row as the reference
            return super().forward(q, layer_id, batch)
        inputs = batch.inputs
        columns = (inputs.cu_seqlens_q, inputs.slots, inputs.seq_lens)
        spans: list[Span] | None = batch.attn_metadata
        if spans is None:  # the graph runner's static-buffer step, which the CPU runs uncaptured
            spans = prompt_spans(*(c.numpy() for c in columns))
        out = torch.empty_like(q)
        if len(spans) < len(inputs.slots):  # some rows decode
            cpp.decode_attention(q, k_cache, v_cache, self.page_table, *columns, out)
        self.attend_each(q, layer_id, spans, out)
        return out
