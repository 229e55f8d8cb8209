"""Each row's next token in one kernel: the most likely, or a draw from softmax(logits / T).

    every program (row, chunk): the chunk's max and its first most likely token; for a sampled
        row (T > 0) also S_c, the sum of exp(x / T - m_c) over the chunk (m_c: its max / T)
    the row's last program to finish (a counter per row says which): the most likely token of
        the row; for a sampled row, the chunks' sums rescaled to the row's max give the row's sum
        S and a running sum over chunks, and the chunk where it reaches u * S is scanned for the
        first token whose running sum of exp(x / T - m) reaches u * S

which is inverse-CDF sampling with the caller's uniform number u, the same rule as
torch_ops.sample_tokens (it may differ only where u falls on a boundary between two tokens, as
fp32 sums in another order can; if rounding keeps every sum below u * S, the most likely token is
taken). Each row's logits are read about once, split across programs (torch's argmax of one
151,936-logit row takes ~9 us on an H200). One kernel for greedy and sampled rows alike lets a
CUDA graph hold a sampled decode step whole; greedy rows skip the sums and the scan.
"""

import torch
import triton
import triton.language as tl

from .pdl import pdl_args, wait_for_previous

_CHUNK = 4096  # logits per stage-1 program: one load of 8 KiB (bf16) per program


@triton.jit
def _load_chunk(logits_ptr, row, chunk, stride_row, vocab, CHUNK: tl.constexpr):
    """The chunk's token ids and logits (-inf past the vocabulary)."""
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(
        logits_ptr + row.to(tl.int64) * stride_row + offs, mask=offs < vocab, other=-float("inf")
    )
    return offs, x


@triton.jit
def _first_best(x, index, size):
    """(The index of x's first NaN, or else of its first maximum, which torch.argmax picks: a NaN
    is above any number; the maximum, NaN for a NaN). size: past every index."""
    is_nan = x != x
    key = tl.where(is_nan, float("inf"), x.to(tl.float32))
    top = tl.max(key, 0)
    # among the keys equal to the top, NaNs rank first, then each by its index
    rank = tl.min(tl.where(key == top, tl.where(is_nan, index, index + size), 2 * size), 0)
    nan_first = rank < size
    return tl.where(nan_first, rank, rank - size), tl.where(nan_first, float("nan"), top)


@triton.jit
def _best_of_row(max_ptr, best_ptr, row, num_chunks, BLOCK_C: tl.constexpr):
    """The row's chunk maxima (NaN for a chunk holding one), and its most likely token: the first
    chunk holding the max, and in it the first token."""
    c = tl.arange(0, BLOCK_C)
    chunk_max = tl.load(max_ptr + row * num_chunks + c, mask=c < num_chunks, other=-float("inf"))
    best_chunk, _max = _first_best(chunk_max, c, BLOCK_C)
    return chunk_max, tl.load(best_ptr + row * num_chunks + best_chunk)


@triton.jit
def _draw(
    logits_ptr, sum_ptr, row, num_chunks, stride_row, vocab, scaled_max, u, temperature, best,
    CHUNK: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """The sampled token of a row, from its chunks' maxima / T (scaled_max) and sums."""
    c = tl.arange(0, BLOCK_C)
    m = tl.max(scaled_max, 0)
    weights = tl.load(sum_ptr + row * num_chunks + c, mask=c < num_chunks, other=0.0)
    weights *= tl.exp(scaled_max - m)
    target = u * tl.sum(weights, 0)
    after = tl.cumsum(weights, 0)  # running sum up to and including each chunk
    # no chunk reaching the target (rounding) scans the last one, which then fails over to best
    chunk = tl.min(tl.where((after >= target) & (c < num_chunks), c, num_chunks - 1), 0)
    before = tl.sum(tl.where(c < chunk, weights, 0.0), 0)

    offs, x = _load_chunk(logits_ptr, row, chunk, stride_row, vocab, CHUNK)
    p = tl.exp(x.to(tl.float32) / temperature - m)
    reached = (before + tl.cumsum(p, 0) >= target) & (offs < vocab)
    token = tl.min(tl.where(reached, offs, vocab), 0)
    return tl.where(token < vocab, token, best).to(tl.int32)


@triton.jit
def _sample_kernel(
    logits_ptr, temperatures_ptr, uniforms_ptr, max_ptr, sum_ptr, best_ptr, counter_ptr, out_ptr,
    table_ptr, host_table_ptr, entries_ptr, stride_row, vocab,
    CHUNK: tl.constexpr, BLOCK_C: tl.constexpr, SAMPLED: tl.constexpr, HOST_COPY: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    wait_for_previous(USE_PDL)
    row, chunk, num_chunks = tl.program_id(0), tl.program_id(1), tl.num_programs(1)
    # not `_`: Triton types a variable once, and `_` below is a float vector
    ids, x = _load_chunk(logits_ptr, row, chunk, stride_row, vocab, CHUNK)
    out = row * num_chunks + chunk
    best, x_max = _first_best(x, ids, chunk * CHUNK + CHUNK)
    tl.store(max_ptr + out, x_max)
    tl.store(best_ptr + out, best)
    temperature = 0.0
    if SAMPLED:
        temperature = tl.load(temperatures_ptr + row)
    if temperature > 0:  # x_max / T is the max of x / T: rounding keeps the order
        tl.store(
            sum_ptr + out, tl.sum(tl.exp(x.to(tl.float32) / temperature - x_max / temperature), 0)
        )
    tl.debug_barrier()  # every thread's stores precede the count (released by the atomic)
    # the row's last program to finish reduces the chunks
    if tl.atomic_add(counter_ptr + row, 1, sem="acq_rel") == num_chunks - 1:
        tl.store(counter_ptr + row, 0)
        chunk_max, token = _best_of_row(max_ptr, best_ptr, row, num_chunks, BLOCK_C)
        if temperature > 0:
            token = _draw(
                logits_ptr, sum_ptr, row, num_chunks, stride_row, vocab, chunk_max / temperature,
                tl.load(uniforms_ptr + row), temperature, token, CHUNK, BLOCK_C,
            )  # fmt: skip
        tl.store(out_ptr + row, token)
        entry = tl.load(entries_ptr + row)
        tl.store(table_ptr + entry, token)
        if HOST_COPY:  # pinned host memory, written over the bus: no copy op after the step
            tl.store(host_table_ptr + entry, token)


def sample_tokens(
    logits: torch.Tensor,
    token_table: torch.Tensor,
    entries: torch.Tensor,
    counters: torch.Tensor,
    temperatures: torch.Tensor | None = None,
    uniforms: torch.Tensor | None = None,
    host_table: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same as torch_ops.sample_tokens, in one kernel. counters: int32 zeros, one per row (left
    zero on return); host_table: in pinned memory, which the GPU writes directly."""
    bs, vocab = logits.shape
    assert counters.numel() >= bs and counters.dtype == torch.int32
    chunk = min(_CHUNK, triton.next_power_of_2(vocab))
    num_chunks = triton.cdiv(vocab, chunk)
    chunk_max, chunk_sum = (
        torch.empty((bs, num_chunks), dtype=torch.float32, device=logits.device) for _ in range(2)
    )
    chunk_best = torch.empty((bs, num_chunks), dtype=torch.int32, device=logits.device)
    out = torch.empty(bs, dtype=torch.int32, device=logits.device)
    sampled = temperatures is not None
    # without temperatures the uniforms are never read: any float pointer stands in
    temperatures = temperatures if sampled else chunk_max
    uniforms = uniforms if uniforms is not None else chunk_max
    _sample_kernel[(bs, num_chunks)](
        logits, temperatures, uniforms, chunk_max, chunk_sum, chunk_best, counters, out,
        token_table, token_table if host_table is None else host_table, entries,
        logits.stride(0), vocab,
        CHUNK=chunk, BLOCK_C=triton.next_power_of_2(num_chunks), SAMPLED=sampled,
        HOST_COPY=host_table is not None, num_warps=8, **pdl_args(logits.device),
    )  # fmt: skip
    return out
