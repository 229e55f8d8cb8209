"""Temperature sampling in two kernels, each row's logits read about once, split across programs:

    stage 1, program (row, chunk): the chunk's max m_c, its sum S_c of exp(x / T - m_c) and its
             most likely token
    stage 2, program (row): the chunks' sums rescaled to the row's max m give the row's sum S and
             a running sum over chunks; the chunk where it reaches u * S is scanned for the first
             token whose running sum of exp(x / T - m) reaches u * S

which is inverse-CDF sampling from softmax(x / T) with the caller's uniform number u, the same
rule as torch_ops.sample_temperature (it may differ only where u falls on a boundary between two
tokens, as fp32 sums in another order can; if rounding keeps every sum below u * S, the most likely
token is taken).
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
def _best_of_row(max_ptr, best_ptr, row, num_chunks, BLOCK_C: tl.constexpr):
    """The row's chunk maxima, and its most likely token: the first chunk holding the max, and in
    it the first token (torch.argmax's rule on ties)."""
    c = tl.arange(0, BLOCK_C)
    chunk_max = tl.load(max_ptr + row * num_chunks + c, mask=c < num_chunks, other=-float("inf"))
    return chunk_max, tl.load(best_ptr + row * num_chunks + tl.argmax(chunk_max, 0))


def _chunk_scratch(logits: torch.Tensor) -> tuple[int, int, torch.Tensor, torch.Tensor]:
    """(chunk length, chunks per row, each chunk's max and its first most likely token)."""
    bs, vocab = logits.shape
    chunk = min(_CHUNK, triton.next_power_of_2(vocab))
    num_chunks = triton.cdiv(vocab, chunk)
    chunk_max = torch.empty((bs, num_chunks), dtype=torch.float32, device=logits.device)
    chunk_best = torch.empty((bs, num_chunks), dtype=torch.int32, device=logits.device)
    return chunk, num_chunks, chunk_max, chunk_best


@triton.jit
def _chunk_stats_kernel(
    logits_ptr, temperatures_ptr, max_ptr, sum_ptr, best_ptr, stride_row, vocab,
    CHUNK: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    wait_for_previous(USE_PDL)
    row, chunk, num_chunks = tl.program_id(0), tl.program_id(1), tl.num_programs(1)
    _, x = _load_chunk(logits_ptr, row, chunk, stride_row, vocab, CHUNK)
    x = x.to(tl.float32) / tl.load(temperatures_ptr + row)
    m = tl.max(x, 0)
    out = row * num_chunks + chunk
    tl.store(max_ptr + out, m)
    tl.store(sum_ptr + out, tl.sum(tl.exp(x - m), 0))
    tl.store(best_ptr + out, chunk * CHUNK + tl.argmax(x, 0))


@triton.jit
def _sample_kernel(
    logits_ptr, temperatures_ptr, uniforms_ptr, max_ptr, sum_ptr, best_ptr, out_ptr, stride_row,
    vocab, num_chunks, CHUNK: tl.constexpr, BLOCK_C: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    wait_for_previous(USE_PDL)
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK_C)
    chunk_max, best = _best_of_row(max_ptr, best_ptr, row, num_chunks, BLOCK_C)
    m = tl.max(chunk_max, 0)
    weights = tl.load(sum_ptr + row * num_chunks + c, mask=c < num_chunks, other=0.0)
    weights *= tl.exp(chunk_max - m)
    target = tl.load(uniforms_ptr + row) * tl.sum(weights, 0)
    after = tl.cumsum(weights, 0)  # running sum up to and including each chunk
    # no chunk reaching the target (rounding) scans the last one, which then fails over to best
    chunk = tl.min(tl.where((after >= target) & (c < num_chunks), c, num_chunks - 1), 0)
    before = tl.sum(tl.where(c < chunk, weights, 0.0), 0)

    offs, x = _load_chunk(logits_ptr, row, chunk, stride_row, vocab, CHUNK)
    in_row = offs < vocab
    p = tl.exp(x.to(tl.float32) / tl.load(temperatures_ptr + row) - m)
    reached = (before + tl.cumsum(p, 0) >= target) & in_row
    token = tl.min(tl.where(reached, offs, vocab), 0)
    tl.store(out_ptr + row, tl.where(token < vocab, token, best).to(tl.int32))


def sample_temperature(
    logits: torch.Tensor, temperatures: torch.Tensor, uniforms: torch.Tensor
) -> torch.Tensor:
    """Sample one token per row of logits [bs, vocab] from softmax(logits / temperature), with
    the uniform numbers given per row (in (0, 1)). Returns [bs] int32."""
    bs, vocab = logits.shape
    chunk, num_chunks, chunk_max, chunk_best = _chunk_scratch(logits)
    chunk_sum = torch.empty_like(chunk_max)
    _chunk_stats_kernel[(bs, num_chunks)](
        logits, temperatures, chunk_max, chunk_sum, chunk_best, logits.stride(0), vocab,
        CHUNK=chunk, num_warps=8, **pdl_args(logits.device),
    )  # fmt: skip
    out = torch.empty(bs, dtype=torch.int32, device=logits.device)
    _sample_kernel[(bs,)](
        logits, temperatures, uniforms, chunk_max, chunk_sum, chunk_best, out, logits.stride(0),
        vocab, num_chunks, CHUNK=chunk, BLOCK_C=triton.next_power_of_2(num_chunks), num_warps=8,
        **pdl_args(logits.device),
    )  # fmt: skip
    return out


@triton.jit
def _greedy_kernel(
    logits_ptr, max_ptr, best_ptr, counter_ptr, out_ptr, table_ptr, entries_ptr, stride_row,
    vocab, CHUNK: tl.constexpr, BLOCK_C: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    wait_for_previous(USE_PDL)
    row, chunk, num_chunks = tl.program_id(0), tl.program_id(1), tl.num_programs(1)
    # not `_`: Triton types a variable once, and `_` below is a float vector
    _ids, x = _load_chunk(logits_ptr, row, chunk, stride_row, vocab, CHUNK)
    out = row * num_chunks + chunk
    tl.store(max_ptr + out, tl.max(x, 0).to(tl.float32))
    tl.store(best_ptr + out, chunk * CHUNK + tl.argmax(x, 0))  # the first of equal maxima
    tl.debug_barrier()  # every thread's stores precede the count (released by the atomic)
    # the row's last program to finish reduces the chunks
    if tl.atomic_add(counter_ptr + row, 1, sem="acq_rel") == num_chunks - 1:
        tl.store(counter_ptr + row, 0)
        _, token = _best_of_row(max_ptr, best_ptr, row, num_chunks, BLOCK_C)
        tl.store(out_ptr + row, token)
        tl.store(table_ptr + tl.load(entries_ptr + row), token)


def greedy_sample(
    logits: torch.Tensor, token_table: torch.Tensor, entries: torch.Tensor, counters: torch.Tensor
) -> torch.Tensor:
    """Same as torch_ops.greedy_sample, in one kernel in place of argmax, a cast and a scatter:
    each row is split across programs (torch's argmax of one 151,936-logit row takes ~9 us on an
    H200), and the last of them to finish reduces it. counters: int32 zeros, one per row (left
    zero on return)."""
    bs, vocab = logits.shape
    assert counters.numel() >= bs and counters.dtype == torch.int32
    chunk, num_chunks, chunk_max, chunk_best = _chunk_scratch(logits)
    out = torch.empty(bs, dtype=torch.int32, device=logits.device)
    _greedy_kernel[(bs, num_chunks)](
        logits, chunk_max, chunk_best, counters, out, token_table, entries, logits.stride(0),
        vocab, CHUNK=chunk, BLOCK_C=triton.next_power_of_2(num_chunks), num_warps=8,
        **pdl_args(logits.device),
    )  # fmt: skip
    return out
