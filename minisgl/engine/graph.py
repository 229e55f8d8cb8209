"""CUDA graphs for decode batches.

Each captured size replays the whole step with no launch overhead: the table writes and reads, the
model, and the tokens (greedy or drawn with a temperature) written into the token table. A batch is
padded up to the next captured size with padding rows that point at the dummy slot and the dummy
KV page, so padding never touches a real request's state. The same static-buffer path runs on the
CPU without capture, so CI checks the padding logic against the plain forward.
"""

import bisect
from collections.abc import Callable
from dataclasses import fields

import numpy as np
import torch

from minisgl.core import Batch, BatchInputs, EngineLayout
from minisgl.utils import init_logger
from minisgl.utils.torch_utils import ALIGN_BYTES, copy_to_device

logger = init_logger(__name__)

# (is_decode, inputs, attention metadata, (temperatures, uniforms) or None: all greedy)
#   -> (logits, tokens)
Sampling = tuple[torch.Tensor, torch.Tensor] | None
StepFn = Callable[[bool, BatchInputs[torch.Tensor], object, Sampling], tuple[torch.Tensor, ...]]

# The rows of a captured size's static input block: a decode batch's inputs with one entry per
# request, and a page's entries per request for its page-table writes (a decode adds at most
# one page per request). cu_seqlens_q and last_indices of a decode are ranges, and a batch a
# graph runs writes no token ids and asks for no prompt logprobs.
_ROWS = tuple(
    f.name
    for f in fields(BatchInputs)
    if f.name
    not in (
        "cu_seqlens_q", "last_indices", "token_write_entries", "token_write_values",
        "prompt_rows", "prompt_targets",
    )
)  # fmt: skip
_PAGE_WRITES = ("page_write_entries", "page_write_values")
_ALIGN = ALIGN_BYTES // 4  # int32 entries: each row starts aligned, as pack_to_device's columns


def _row_spans(bs: int, page_size: int) -> dict[str, slice]:
    """Where each row of size bs's static block lies in it."""
    spans, end = {}, 0
    for row in _ROWS:
        width = bs * page_size if row in _PAGE_WRITES else bs
        spans[row] = slice(end, end + width)
        end += width + -width % _ALIGN
    return spans


def graph_batch_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to max_bs (padding wastes at most 15 rows)."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_bs] + list(range(16, max_bs + 1, 16))
    return sorted({*sizes, max_bs})


class GraphRunner:
    def __init__(
        self,
        step: StepFn,
        max_bs: int,
        layout: EngineLayout,
        dummy_loc: int,
        device: torch.device,
    ) -> None:
        self.step = step
        self.sizes = graph_batch_sizes(max_bs)
        self.max_bs = max_bs
        self.page_size = layout.page_size
        self._spans = {bs: _row_spans(bs, layout.page_size) for bs in self.sizes}
        # Padding rows: any token at position 0 of the dummy slot, reading and rewriting the dummy
        # page's entry, its sampled token going to the token table's sink row (the dummy slot's
        # row there). A request without a page write of its own rewrites the dummy entry too.
        dummy_slot = layout.sink_slot
        dummy_entry = dummy_slot * layout.page_table_width
        padding_row = {  # longest_first: set per column below
            "positions": 0, "token_entries": 0, "page_entries": dummy_entry, "slots": dummy_slot,
            "seq_lens": 1, "longest_first": 0,
            "sample_entries": dummy_slot * layout.token_table_width,
            "page_write_entries": dummy_entry, "page_write_values": dummy_loc,
        }  # fmt: skip
        # each size's static inputs: one contiguous block of its rows, so that a batch's inputs
        # arrive in one host-to-device copy straight into it. The host image starts as padding;
        # in the longest-first order padding rows (one token) come last, each as itself
        self._images = {}
        for bs, spans in self._spans.items():
            image = np.zeros(max(span.stop for span in spans.values()), dtype=np.int32)
            for row, span in spans.items():
                image[span] = padding_row[row]
            image[spans["longest_first"]] = np.arange(bs)
            self._images[bs] = image
        self._inputs = {
            bs: torch.tensor(image, device=device) for bs, image in self._images.items()
        }
        # each row's temperature (0: greedy) and uniform number, read by the step's sampling
        # kernel. Zero while every batch since the last zeroing was greedy: an all-greedy step
        # then writes nothing here
        self._sampling = torch.zeros((2, max_bs), dtype=torch.float32, device=device)
        self._sampling_is_zero = True
        self._rows = torch.arange(max_bs + 1, dtype=torch.int32, device=device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        if device.type == "cuda":
            self._capture_all(device)

    def static_inputs(self, padded: int, rows: int, num_writes: int) -> BatchInputs[torch.Tensor]:
        """The first `rows` entries of each row of size `padded`'s static inputs, and of its page
        writes the first `num_writes`."""
        block = self._inputs[padded]
        views = {
            row: block[span.start : span.start + (num_writes if row in _PAGE_WRITES else rows)]
            for row, span in self._spans[padded].items()
        }
        no_writes = self._rows[:0]
        return BatchInputs(
            cu_seqlens_q=self._rows[: rows + 1],
            last_indices=self._rows[:rows],
            token_write_entries=no_writes,
            token_write_values=no_writes,
            prompt_rows=no_writes,
            prompt_targets=no_writes,
            **views,
        )

    def _capture_all(self, device: torch.device) -> None:
        pool = None
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for bs in reversed(self.sizes):  # largest first: smaller graphs reuse its memory pool
                inputs, sampling = self._all_static_inputs(bs), self._static_sampling(bs)
                self.step(True, inputs, None, sampling)  # warm-up: lazy initialisation stays out
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    logits, tokens = self.step(True, inputs, None, sampling)
                pool = graph.pool()
                self._graphs[bs] = (graph, logits, tokens)
        torch.cuda.current_stream(device).wait_stream(stream)
        logger.info("captured CUDA graphs for decode batch sizes %s", self.sizes)

    @property
    def captured(self) -> bool:
        """Whether replays run captured graphs (on CUDA, until `release`)."""
        return bool(self._graphs)

    def release(self) -> None:
        """Destroy the captured graphs now; replays then run the step uncaptured, as the CPU's."""
        if self._graphs:
            torch.cuda.synchronize()  # no replay may still be running
        for graph, _, _ in self._graphs.values():
            graph.reset()
        self._graphs.clear()

    def _all_static_inputs(self, bs: int) -> BatchInputs[torch.Tensor]:
        """A captured size's whole static inputs: what its graph reads."""
        return self.static_inputs(bs, bs, bs * self.page_size)

    def can_run(self, batch: Batch) -> bool:
        """A decode batch whose only table writes are at most a page's entries per request (a
        request admitted with a one-token prompt, or readmitted, writes more: it runs eagerly)."""
        return (
            batch.is_decode
            and batch.size <= self.max_bs
            and len(batch.inputs.token_write_entries) == 0
            and len(batch.inputs.page_write_entries) <= batch.size * self.page_size
        )

    def _static_sampling(self, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._sampling[0, :bs], self._sampling[1, :bs]

    def run(
        self, batch: Batch, sampling: Sampling
    ) -> tuple[torch.Tensor, torch.Tensor, BatchInputs[torch.Tensor]]:
        """Upload the batch's inputs into the static ones and replay; returns its logits and
        tokens (already written into the token table) and its own part of the static inputs.
        sampling: (temperatures, uniforms), or None when every row is greedy."""
        bs = batch.size
        if sampling is not None:  # padding columns keep older values: their tokens are not kept
            torch.stack(sampling, out=self._sampling[:, :bs])
            self._sampling_is_zero = False
        elif not self._sampling_is_zero:
            self._sampling.zero_()
            self._sampling_is_zero = True
        padded = self.sizes[bisect.bisect_left(self.sizes, bs)]
        # a copy: the template's columns past bs (page writes: past num_writes) stay padding rows
        image = self._images[padded].copy()
        columns = vars(batch.inputs)
        num_writes = len(batch.inputs.page_write_entries)
        for row, span in self._spans[padded].items():
            filled = num_writes if row in _PAGE_WRITES else bs
            image[span.start : span.start + filled] = columns[row]
        copy_to_device(torch.from_numpy(image), self._inputs[padded])
        logits, tokens = self.replay(padded)
        return logits[:bs], tokens[:bs], self.static_inputs(padded, bs, num_writes)

    def replay(self, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the step of captured size bs on whatever its static inputs hold. Replayed alone in
        a loop, it times the GPU's part of a decode step."""
        if bs in self._graphs:
            graph, logits, tokens = self._graphs[bs]
            graph.replay()
            return logits, tokens
        # the CPU twin: same static buffers, no capture
        return self.step(True, self._all_static_inputs(bs), None, self._static_sampling(bs))
