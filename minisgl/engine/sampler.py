"""Batched sampling with per-request parameters.

Randomness is a pure function of (request seed, position): one uniform number per row, hashed on the
device, picks a token by inverse-CDF lookup. So a request samples the same tokens whatever else
shares its batch, and whether or not it was chunked or preempted.
"""

from dataclasses import dataclass

import torch

from minisgl.core import Batch
from minisgl.utils import to_device

_MASK32 = 0xFFFFFFFF


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's finaliser on int64 tensors holding uint32 values."""
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _MASK32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _MASK32
    return x ^ (x >> 16)


def hash_uniform(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """A uniform float in (0, 1) for each (seed, position) pair (int64 tensors)."""
    h = _fmix32((seeds >> 32) & _MASK32)
    h = _fmix32(h ^ (seeds & _MASK32))
    h = _fmix32((h + positions * 0x9E3779B9) & _MASK32)
    return ((h >> 8).double() + 0.5) / float(1 << 24)


@dataclass
class SamplingArgs:
    """One batch's sampling parameters, one row per request (device tensors)."""

    temperatures: torch.Tensor  # float32, 1.0 for greedy rows
    top_k: torch.Tensor  # int64, vocab size where disabled
    top_p: torch.Tensor  # float32
    min_p: torch.Tensor  # float32
    seeds: torch.Tensor  # int64
    positions: torch.Tensor  # int64: the position the new token will take
    greedy: torch.Tensor  # bool
    all_greedy: bool
    use_top_k_top_p: bool
    use_min_p: bool
    num_logprobs: int  # top logprobs to return per row (0: only the sampled token's), -1: none


@dataclass
class SampleOutput:
    tokens: torch.Tensor  # [bs] int32
    logprobs: torch.Tensor | None = None  # [bs] float32: log p(sampled token)
    top_ids: torch.Tensor | None = None  # [bs, n] int32
    top_logprobs: torch.Tensor | None = None  # [bs, n] float32


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device

    def prepare(self, batch: Batch) -> SamplingArgs:
        reqs = batch.reqs
        params = [r.params for r in reqs]
        greedy = [p.is_greedy for p in params]
        floats = torch.tensor(
            [
                [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)],
                [p.top_p for p in params],
                [p.min_p for p in params],
            ],
            dtype=torch.float32,
        )
        top_k = [p.top_k if p.top_k > 0 else self.vocab_size for p in params]
        ints = torch.tensor(
            [top_k, [r.seed for r in reqs], batch.seq_lens, greedy], dtype=torch.int64
        )
        floats, ints = to_device(floats, self.device), to_device(ints, self.device)
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        return SamplingArgs(
            temperatures=floats[0],
            top_p=floats[1],
            min_p=floats[2],
            top_k=ints[0],
            seeds=ints[1],
            positions=ints[2],
            greedy=ints[3].bool(),
            all_greedy=all(greedy),
            use_top_k_top_p=any(
                not g and (p.top_k > 0 or p.top_p < 1) for p, g in zip(params, greedy, strict=True)
            ),
            use_min_p=any(not g and p.min_p > 0 for p, g in zip(params, greedy, strict=True)),
            num_logprobs=max(wanted) if wanted else -1,
        )

    def sample(self, logits: torch.Tensor, args: SamplingArgs) -> SampleOutput:
        logits = logits.float()
        tokens = logits.argmax(dim=-1)
        if not args.all_greedy:
            sampled = self._sample_stochastic(logits, args)
            tokens = torch.where(args.greedy, tokens, sampled)
        out = SampleOutput(tokens.to(torch.int32))
        if args.num_logprobs >= 0:
            logprobs = torch.log_softmax(logits, dim=-1)
            out.logprobs = logprobs.gather(1, tokens[:, None].long())[:, 0]
            top = logprobs.topk(args.num_logprobs, dim=-1)
            out.top_ids, out.top_logprobs = top.indices.to(torch.int32), top.values
        return out

    def _sample_stochastic(self, logits: torch.Tensor, args: SamplingArgs) -> torch.Tensor:
        probs = torch.softmax(logits / args.temperatures[:, None], dim=-1)
        if args.use_top_k_top_p:
            probs = _top_k_top_p(probs, args.top_k, args.top_p)
        if args.use_min_p:
            threshold = args.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < threshold, 0.0)
        cdf = probs.double().cumsum(dim=-1)
        u = hash_uniform(args.seeds, args.positions)[:, None] * cdf[:, -1:]
        return torch.searchsorted(cdf, u).squeeze(1).clamp_(max=logits.shape[1] - 1)


def _top_k_top_p(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Zero every token outside the k most likely, and outside the smallest set whose mass
    reaches top_p (the most likely token always stays)."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(probs.shape[1], device=probs.device)[None, :]
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop = (rank >= top_k[:, None]) | (mass_before > top_p[:, None])
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(1, order, sorted_probs)
