"""Batched sampling with per-request parameters.

Randomness is a pure function of (request seed, position): one uniform number per row, hashed on the
host, picks a token by inverse-CDF lookup. So a request samples the same tokens whatever else
shares its batch, and whether or not it was chunked or preempted.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from minisgl.core import Batch
from minisgl.kernel.torch_ops import inverse_cdf, row_cumsum
from minisgl.utils.torch_utils import pack_to_device

from .logits_processors import LogitsProcessors

_U32 = np.uint32


def _fmix32(x: np.ndarray) -> np.ndarray:
    """MurmurHash3's finaliser on uint32 arrays (their products wrap around, as it needs)."""
    x = x ^ (x >> _U32(16))
    x = x * _U32(0x85EBCA6B)
    x = x ^ (x >> _U32(13))
    x = x * _U32(0xC2B2AE35)
    return x ^ (x >> _U32(16))


def hash_uniform(
    seeds: Sequence[int] | np.ndarray, positions: Sequence[int] | np.ndarray
) -> np.ndarray:
    """A uniform float in (0, 1) for each (seed, position) pair; seeds are signed 64-bit. In numpy:
    1-256 pairs took 20-31 us on a 2-core CPU, against 85-116 for the same ops on torch tensors,
    where each op's overhead outweighs its arithmetic."""
    bits = np.asarray(seeds, dtype=np.int64).view(np.uint64)
    h = _fmix32((bits >> np.uint64(32)).astype(_U32))
    h = _fmix32(h ^ bits.astype(_U32))
    h = _fmix32(h + np.asarray(positions).astype(_U32) * _U32(0x9E3779B9))
    return ((h >> _U32(8)) + 0.5) / float(1 << 24)


@dataclass
class SamplingArgs:
    """One batch's sampling parameters, one row per request (device tensors). Greedy rows and
    plain temperature sampling are done inside the step (`in_step`: one kernel, which a CUDA
    graph holds); when a row's logits are processed (token masks, logit_bias, penalties) or its
    probabilities filtered (top-k, top-p, min-p), the whole batch is drawn after the step
    (`after_step`). The tensors are only built when some request samples (an all-greedy batch
    needs just the argmax)."""

    all_greedy: bool
    num_logprobs: int = -1  # top logprobs to return per row (0: only the sampled token's), -1: none
    processors: LogitsProcessors | None = None
    use_top_k_top_p: bool = False
    use_min_p: bool = False
    # float32; greedy rows: 0.0 when sampled in the step (its kernel's greedy mark), else 1.0
    temperatures: torch.Tensor | None = None
    top_k: torch.Tensor | None = None  # int64, vocab size where disabled
    top_p: torch.Tensor | None = None  # float32
    min_p: torch.Tensor | None = None  # float32
    uniforms: torch.Tensor | None = None  # float32 in (0, 1): hash of (seed, new token's position)
    greedy: torch.Tensor | None = None  # bool, when some rows of a filtered batch are greedy

    @property
    def filtered(self) -> bool:
        """Some row has top-k, top-p or min-p."""
        return self.use_top_k_top_p or self.use_min_p

    @property
    def after_step(self) -> bool:
        """The batch's tokens are drawn after the step, and replace the ones the step wrote."""
        return self.filtered or self.processors is not None

    @property
    def in_step(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(temperatures, uniforms) for the step's sampling kernel; None: all rows greedy, or
        drawn after the step."""
        if self.all_greedy or self.after_step:
            return None
        assert self.temperatures is not None and self.uniforms is not None
        return self.temperatures, self.uniforms


@dataclass
class SampleOutput:
    tokens: torch.Tensor  # [bs] int32
    logprobs: torch.Tensor | None = None  # [bs] float32: log p(sampled token)
    top_ids: torch.Tensor | None = None  # [bs, n] int32
    top_logprobs: torch.Tensor | None = None  # [bs, n] float32
    # a prefill's prompt logprobs, a row per Batch.inputs.prompt_rows: log p(next prompt token)
    prompt_logprobs: torch.Tensor | None = None  # [rows] float32
    prompt_top_ids: torch.Tensor | None = None  # [rows, n] int32
    prompt_top_logprobs: torch.Tensor | None = None  # [rows, n] float32
    prompt_ranks: torch.Tensor | None = None  # [rows] int64: tokens at least as likely


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, num_top: int, ranks: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(log p(tokens[i]) under row i's logits, the ids and logprobs of its num_top likeliest,
    with `ranks` tokens[i]'s rank: how many tokens are at least as likely, as vLLM counts)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    top = logprobs.topk(min(num_top, logprobs.shape[-1]), dim=-1)  # a vocabulary under 20 tokens
    chosen = logprobs.gather(1, tokens[:, None].long())[:, 0]
    rank = (logprobs >= chosen[:, None]).sum(dim=-1) if ranks else None
    return chosen, top.indices.to(torch.int32), top.values, rank


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device, token_table: torch.Tensor) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.token_table = token_table  # the engine's; read by the penalties

    def prepare(self, batch: Batch) -> SamplingArgs:
        params = [r.params for r in batch.reqs]
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        num_logprobs = max(wanted) if wanted else -1
        processors = LogitsProcessors.prepare(batch, self.device)
        greedy = [p.is_greedy for p in params]
        if all(greedy):
            return SamplingArgs(True, num_logprobs, processors)
        sampling = [p for p, g in zip(params, greedy, strict=True) if not g]
        any_greedy = any(greedy)
        use_top_k_top_p = any(p.top_k > 0 or p.top_p < 1 for p in sampling)
        use_min_p = any(p.min_p > 0 for p in sampling)
        filtered = use_top_k_top_p or use_min_p
        after_step = filtered or processors is not None
        greedy_temperature = 1.0 if after_step else 0.0
        # the new token's position: prefix + extend length
        positions = np.add(batch.prefix_lens, batch.extend_lens)
        temperatures = [
            greedy_temperature if g else p.temperature for p, g in zip(params, greedy, strict=True)
        ]
        uniforms = hash_uniform([r.seed for r in batch.reqs], positions)
        columns = {"temperatures": temperatures, "uniforms": uniforms}
        if filtered:  # the filters' columns travel only when read
            columns |= {"top_p": [p.top_p for p in params], "min_p": [p.min_p for p in params]}
        floats = pack_to_device(self.device, torch.float32, **columns)
        if not after_step:  # each copy here is host time in every step of a small sampled batch
            return SamplingArgs(all_greedy=False, num_logprobs=num_logprobs, **floats)
        ints: dict[str, torch.Tensor] = {}
        if use_top_k_top_p or any_greedy:  # the integer columns travel only when read
            ints = pack_to_device(
                self.device,
                torch.int64,
                top_k=[
                    min(p.top_k, self.vocab_size) if p.top_k > 0 else self.vocab_size
                    for p in params
                ],
                greedy=greedy,
            )
        return SamplingArgs(
            all_greedy=False,
            num_logprobs=num_logprobs,
            processors=processors,
            use_top_k_top_p=use_top_k_top_p,
            use_min_p=use_min_p,
            top_k=ints.get("top_k"),
            greedy=ints["greedy"].bool() if any_greedy else None,
            **floats,
        )

    def sample(
        self, logits: torch.Tensor, step_tokens: torch.Tensor, args: SamplingArgs
    ) -> SampleOutput:
        """step_tokens: the tokens the step sampled (int32), already in the token table: the
        batch's tokens unless `args.after_step`, when they are each row's argmax and the batch
        is drawn here (greedy rows too, when their logits are processed)."""
        tokens = step_tokens
        scores = logits
        if args.processors is not None:
            scores = logits.to(torch.float32, copy=True)  # the logprobs are the model's own
            args.processors.apply(scores, self.token_table)
            step_tokens = scores.argmax(dim=-1).to(torch.int32)
            tokens = step_tokens
        if args.after_step and not args.all_greedy:
            tokens = self._sample_after_step(scores, args).to(torch.int32)
            if args.greedy is not None:
                tokens = torch.where(args.greedy, step_tokens, tokens)
        out = SampleOutput(tokens)
        if args.num_logprobs >= 0:
            out.logprobs, out.top_ids, out.top_logprobs, _ = token_logprobs(
                logits, tokens, args.num_logprobs
            )
        return out

    def _sample_after_step(self, logits: torch.Tensor, args: SamplingArgs) -> torch.Tensor:
        """vLLM's order: temperature, min-p, top-k, then top-p over what is left."""
        probs = torch.softmax(logits.float() / args.temperatures[:, None], dim=-1)
        if args.use_min_p:
            threshold = args.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < threshold, 0.0)
        if args.use_top_k_top_p:
            probs = _top_k_top_p(probs, args.top_k, args.top_p)
        return inverse_cdf(probs, args.uniforms, logits.argmax(dim=-1))


def _top_k_top_p(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Zero every token less likely than the k-th most likely (tokens tied with it stay), then
    every token whose more likely ones already hold top_p of the mass left: the smallest set
    that reaches top_p (the most likely token always stays). As vLLM filters."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    kth = sorted_probs.gather(1, top_k[:, None] - 1)
    sorted_probs = sorted_probs.masked_fill(sorted_probs < kth, 0.0)
    cumsum = row_cumsum(sorted_probs)
    reached = cumsum - sorted_probs >= top_p[:, None] * cumsum[:, -1:]
    # top_p 1 drops nothing: the rounding of a long sum must not drop the least likely tokens
    sorted_probs = sorted_probs.masked_fill(reached & (top_p[:, None] < 1), 0.0)
    return torch.zeros_like(probs).scatter_(1, order, sorted_probs)
