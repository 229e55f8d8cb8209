"""Temperature sampling in one kernel: a row of logits is read twice and nothing else is written.

    pass 1: online max m and sum S of exp(x / T - m) over the row (softmax's normaliser)
    pass 2: the first token whose running sum of exp(x / T - m) reaches u * S

which is inverse-CDF sampling from softmax(x / T) with the caller's uniform number u, the same
rule as torch_ops.sample_temperature (it may differ only where u falls on a boundary between two
tokens, as fp32 sums in another order can).
"""

import torch
import triton
import triton.language as tl

_MAX_BLOCK = 4096


@triton.jit
def _sample_kernel(
    logits_ptr, temperatures_ptr, uniforms_ptr, out_ptr, stride_row, vocab, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    inv_t = 1.0 / tl.load(temperatures_ptr + row)
    offs = tl.arange(0, BLOCK)
    m = -float("inf")
    total = 0.0
    best = 0  # the most likely token: the answer if rounding keeps the sum below u * S
    for start in range(0, vocab, BLOCK):
        x = tl.load(row_ptr + start + offs, mask=start + offs < vocab, other=-float("inf"))
        x = x.to(tl.float32) * inv_t
        block_max = tl.max(x, 0)
        best = tl.where(block_max > m, start + tl.argmax(x, 0), best)
        m_new = tl.maximum(m, block_max)
        total = total * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
        m = m_new
    target = tl.load(uniforms_ptr + row) * total
    running = 0.0
    token = -1
    for start in range(0, vocab, BLOCK):
        x = tl.load(row_ptr + start + offs, mask=start + offs < vocab, other=-float("inf"))
        p = tl.exp(x.to(tl.float32) * inv_t - m)
        reached = (running + tl.cumsum(p, 0) >= target) & (start + offs < vocab)
        first = tl.min(tl.where(reached, start + offs, vocab), 0)
        token = tl.where((token < 0) & (first < vocab), first, token)
        running += tl.sum(p, 0)
    tl.store(out_ptr + row, tl.where(token < 0, best, token).to(tl.int32))


def sample_temperature(
    logits: torch.Tensor, temperatures: torch.Tensor, uniforms: torch.Tensor
) -> torch.Tensor:
    """Sample one token per row of logits [bs, vocab] from softmax(logits / temperature), with
    the uniform numbers given per row (in (0, 1)). Returns [bs] int32."""
    bs, vocab = logits.shape
    out = torch.empty(bs, dtype=torch.int32, device=logits.device)
    block = min(_MAX_BLOCK, triton.next_power_of_2(vocab))
    _sample_kernel[(bs,)](
        logits, temperatures, uniforms, out, logits.stride(0), vocab, BLOCK=block, num_warps=8
    )
    return out
