"""CUDA graphs for decode batches.

Each captured size replays the whole model forward with no launch overhead. A batch is padded up to
the next captured size with padding rows that point at the dummy slot and the dummy KV page, so
padding never touches a real request's state. The same static-buffer path runs on the CPU without
capture, so CI checks the padding logic against the plain forward.
"""

import bisect

import torch

from minisgl.attention import AttentionBackend, AttnMetadata
from minisgl.core import Batch, get_global_ctx
from minisgl.models import CausalLM
from minisgl.utils import init_logger

logger = init_logger(__name__)


def graph_batch_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to max_bs (padding wastes at most 15 rows)."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_bs] + list(range(16, max_bs + 1, 16))
    return sorted(set([*sizes, max_bs]))


class GraphRunner:
    def __init__(
        self,
        model: CausalLM,
        attn_backend: AttentionBackend,
        max_bs: int,
        dummy_slot: int,
        dummy_loc: int,
        max_seq_len: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.attn_backend = attn_backend
        self.sizes = graph_batch_sizes(max_bs)
        self.max_bs = max_bs
        self.dummy_slot, self.dummy_loc = dummy_slot, dummy_loc
        self.device = device
        rows = torch.arange(max_bs + 1, dtype=torch.int32, device=device)
        zeros = torch.zeros(max_bs, dtype=torch.int32, device=device)
        self._input_ids = zeros.clone()
        self._positions = zeros.clone()
        self._out_loc = zeros.clone()
        self._meta = AttnMetadata(
            slots=zeros.clone(),
            seq_lens=zeros.clone(),
            prefix_lens=zeros.clone(),
            cu_seqlens_q=rows,  # one new token per row in a decode
            last_indices=rows[:-1].long(),
            max_seq_len=max_seq_len,
            max_extend_len=1,
        )
        self._batches = {bs: self._static_batch(bs) for bs in self.sizes}
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        if device.type == "cuda":
            self._capture_all()

    def _static_batch(self, bs: int) -> Batch:
        m = self._meta
        meta = AttnMetadata(
            m.slots[:bs],
            m.seq_lens[:bs],
            m.prefix_lens[:bs],
            m.cu_seqlens_q[: bs + 1],
            m.last_indices[:bs],
            m.max_seq_len,
            1,
        )
        # no Req objects: layers only read the tensors and the metadata
        return Batch(
            reqs=[],
            prefix_lens=[],
            extend_lens=[],
            sample_rows=[],
            input_ids=self._input_ids[:bs],
            positions=self._positions[:bs],
            out_loc=self._out_loc[:bs],
            slots=m.slots[:bs],
            is_decode=True,
            attn_metadata=meta,
        )

    def _fill_padding(self, start: int, end: int) -> None:
        self._input_ids[start:end] = 0
        self._positions[start:end] = 0
        self._out_loc[start:end] = self.dummy_loc
        self._meta.slots[start:end] = self.dummy_slot
        self._meta.seq_lens[start:end] = 1
        self._meta.prefix_lens[start:end] = 0

    def _capture_all(self) -> None:
        ctx = get_global_ctx()
        self._fill_padding(0, self.max_bs)
        pool = None
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for bs in reversed(
                self.sizes
            ):  # largest first, so smaller graphs reuse its memory pool
                batch = self._batches[bs]
                with ctx.forward_batch(batch, self.attn_backend):
                    self.model.forward()  # warm-up: lazy initialisation stays out of the graph
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool, stream=stream):
                        logits = self.model.forward()
                pool = graph.pool()
                self._graphs[bs] = (graph, logits)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        logger.info("captured CUDA graphs for decode batch sizes %s", self.sizes)

    def can_run(self, batch: Batch) -> bool:
        return batch.is_decode and batch.size <= self.max_bs

    def run(self, batch: Batch) -> torch.Tensor:
        bs = batch.size
        padded = self.sizes[bisect.bisect_left(self.sizes, bs)]
        meta: AttnMetadata = batch.attn_metadata
        self._input_ids[:bs].copy_(batch.input_ids)
        self._positions[:bs].copy_(batch.positions)
        self._out_loc[:bs].copy_(batch.out_loc)
        self._meta.slots[:bs].copy_(meta.slots)
        self._meta.seq_lens[:bs].copy_(meta.seq_lens)
        self._meta.prefix_lens[:bs].copy_(meta.prefix_lens)
        self._fill_padding(bs, padded)
        if padded in self._graphs:
            graph, logits = self._graphs[padded]
            graph.replay()
        else:  # the CPU twin: same static buffers, no capture
            with get_global_ctx().forward_batch(self._batches[padded], self.attn_backend):
                logits = self.model.forward()
        return logits[:bs]
