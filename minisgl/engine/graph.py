"""CUDA graphs for decode batches.

Each captured size replays the whole model forward with no launch overhead. A batch is padded up to
the next captured size with padding rows that point at the dummy slot and the dummy KV page, so
padding never touches a real request's state. The same static-buffer path runs on the CPU without
capture, so CI checks the padding logic against the plain forward.
"""

import bisect

import torch

from minisgl.attention import AttentionBackend
from minisgl.core import Batch, get_global_ctx
from minisgl.models import CausalLM
from minisgl.utils import init_logger

logger = init_logger(__name__)


def graph_batch_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to max_bs (padding wastes at most 15 rows)."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_bs] + list(range(16, max_bs + 1, 16))
    return sorted({*sizes, max_bs})


class GraphRunner:
    def __init__(
        self,
        model: CausalLM,
        attn_backend: AttentionBackend,
        max_bs: int,
        dummy_slot: int,
        dummy_loc: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.attn_backend = attn_backend
        self.sizes = graph_batch_sizes(max_bs)
        self.max_bs = max_bs
        # one buffer per batch field; padding rows: any token at position 0 of the dummy slot,
        # writing its KV into the dummy page
        self._fields = ("input_ids", "positions", "out_loc", "slots", "seq_lens")
        self._static = torch.zeros((len(self._fields), max_bs), dtype=torch.int32, device=device)
        self._padding = torch.tensor(
            [0, 0, dummy_loc, dummy_slot, 1], dtype=torch.int32, device=device
        )
        self._static[:] = self._padding[:, None]
        rows = torch.arange(max_bs + 1, dtype=torch.int32, device=device)
        self._batches = {bs: self._static_batch(bs, rows) for bs in self.sizes}
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        if device.type == "cuda":
            self._capture_all(device)

    def _static_batch(self, bs: int, rows: torch.Tensor) -> Batch:
        views = dict(zip(self._fields, self._static[:, :bs], strict=True))
        # no Req objects: layers only read the tensors; one new token per row in a decode
        return Batch(
            reqs=[], prefix_lens=[], extend_lens=[], sample_rows=[], is_decode=True,
            cu_seqlens_q=rows[: bs + 1], last_indices=rows[:bs], **views,
        )  # fmt: skip

    def _capture_all(self, device: torch.device) -> None:
        ctx = get_global_ctx()
        pool = None
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
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
        torch.cuda.current_stream(device).wait_stream(stream)
        logger.info("captured CUDA graphs for decode batch sizes %s", self.sizes)

    def can_run(self, batch: Batch) -> bool:
        return batch.is_decode and batch.size <= self.max_bs

    def run(self, batch: Batch) -> torch.Tensor:
        bs = batch.size
        padded = self.sizes[bisect.bisect_left(self.sizes, bs)]
        torch.stack([getattr(batch, f) for f in self._fields], out=self._static[:, :bs])
        if padded > bs:
            self._static[:, bs:padded] = self._padding[:, None]
        return self.replay(padded)[:bs]

    def replay(self, bs: int) -> torch.Tensor:
        """Run the forward of captured size bs on whatever its static inputs hold; the logits.
        Replayed alone in a loop, it times the GPU's part of a decode step."""
        if bs in self._graphs:
            graph, logits = self._graphs[bs]
            graph.replay()
            return logits
        # the CPU twin: same static buffers, no capture
        with get_global_ctx().forward_batch(self._batches[bs], self.attn_backend):
            return self.model.forward()
