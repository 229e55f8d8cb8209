"""Token masks, logit_bias, penalties and min_tokens: the sampler against a reference computed on
the logits in plain Python, row by row; then the engine end to end (repetition_penalty against
Hugging Face's own, min_tokens and logit_bias against the unprocessed run's top logprobs)."""

from collections import Counter

import numpy as np
import torch

from minisgl import LLM, SamplingParams
from minisgl.core import EngineLayout, Req, TokenMasks, choice_params
from minisgl.engine.sampler import Sampler, hash_uniform
from minisgl.kernel.torch_ops import inverse_cdf
from minisgl.scheduler.batch_builder import build_batch
from minisgl.utils import DEFAULT_MODEL_PATH

from .conftest import hf_model

VOCAB = 50
LAYOUT = EngineLayout(
    num_pages=64, page_size=1, num_slots=8, page_table_width=32, token_table_width=32,
    max_seq_len=32, vocab_size=VOCAB,
)  # fmt: skip


def _decode_batch(
    rows: list[tuple[list[int], list[int], SamplingParams]], masks: TokenMasks | None = None
) -> tuple:
    """A decode batch of (prompt, output, params) rows, with its token table."""
    table = torch.zeros(LAYOUT.num_slots + 1, LAYOUT.token_table_width, dtype=torch.int32)
    reqs = []
    for slot, (prompt, output, params) in enumerate(rows):
        req = Req(slot, list(prompt), params, seed=100 + slot, slot=slot)
        req.token_ids += output
        table[slot, : len(req.token_ids)] = torch.tensor(req.token_ids)
        reqs.append(req)
    prefix = [len(r.token_ids) - 1 for r in reqs]
    processed = {i for i, r in enumerate(reqs) if r.params.processes_logits}
    processed |= set(masks.rows if masks is not None else ())  # as the scheduler marks them
    batch = build_batch(
        reqs, prefix, [1] * len(reqs), LAYOUT, processed_rows=sorted(processed), token_masks=masks
    )
    return batch, table


def _reference(
    logits: torch.Tensor, prompt: list[int], output: list[int], p: SamplingParams, allowed=None
) -> torch.Tensor:
    x = logits.clone()
    if allowed is not None:
        x[[t for t in range(VOCAB) if t not in allowed]] = float("-inf")
    for token, bias in p.logit_bias:
        x[token] += bias
    for token in set(prompt) | set(output):
        penalty = p.repetition_penalty
        x[token] = x[token] / penalty if x[token] > 0 else x[token] * penalty
    for token, count in Counter(output).items():
        x[token] -= p.frequency_penalty * count + p.presence_penalty
    return x


def _bits(allowed: set[int]) -> np.ndarray:
    bits = np.zeros(-(-VOCAB // 32), dtype=np.uint32)
    for t in allowed:
        bits[t // 32] |= np.uint32(1 << (t % 32))
    return bits.view(np.int32)


ROWS = [
    ([1, 2, 3, 2], [5, 5, 7, 3], SamplingParams(
        temperature=0, repetition_penalty=1.7, frequency_penalty=0.4, presence_penalty=-0.3)),
    ([4, 4], [9], SamplingParams(temperature=0, logit_bias={9: 3.5, 11: -100, 40: 0.25})),
    ([6], [8, 8], SamplingParams(temperature=0)),  # the masked row
    ([1, 2, 3, 2], [5, 5, 7, 3], SamplingParams(temperature=0)),  # no processor at all
    ([3, 1], [2, 2, 2], SamplingParams(temperature=0.8, seed=1, repetition_penalty=0.6,
                                      frequency_penalty=1.1, logit_bias={0: 2.0})),
]  # fmt: skip
ALLOWED = {3, 17, 31, 32, 49}


def test_processed_logits_and_tokens_equal_the_reference_row_by_row() -> None:
    masks = TokenMasks([2], _bits(ALLOWED)[None, :])
    batch, table = _decode_batch(ROWS, masks)
    torch.manual_seed(0)
    logits = torch.randn(len(ROWS), VOCAB) * 3
    sampler = Sampler(VOCAB, torch.device("cpu"), table)
    args = sampler.prepare(batch)
    assert args.after_step and args.processors is not None
    processed = logits.clone()
    args.processors.apply(processed, table)
    want = torch.stack(
        [
            _reference(logits[i], prompt, output, params, ALLOWED if i == 2 else None)
            for i, (prompt, output, params) in enumerate(ROWS)
        ]
    )
    torch.testing.assert_close(processed, want, rtol=0, atol=1e-6)
    assert torch.equal(processed[3], logits[3])  # a row without processors is left alone
    tokens = sampler.sample(logits, logits.argmax(-1).to(torch.int32), args).tokens
    assert tokens[:4].tolist() == want[:4].argmax(-1).tolist()
    assert int(tokens[2]) in ALLOWED
    # the sampled row draws from softmax(processed / T) with its own uniform number
    position = len(ROWS[4][0]) + len(ROWS[4][1])
    uniform = torch.from_numpy(hash_uniform([104], [position])).float()
    probs = torch.softmax(want[4:5] / 0.8, dim=-1)
    assert int(tokens[4]) == int(inverse_cdf(probs, uniform, want[4:5].argmax(-1))[0])


def test_a_batch_without_processors_keeps_the_in_step_sampling() -> None:
    batch, _ = _decode_batch([r for r in ROWS if not r[2].logit_bias and not r[2].has_penalties])
    args = Sampler(VOCAB, torch.device("cpu"), torch.zeros(1, 1)).prepare(batch)
    assert args.processors is None and not args.after_step


def test_repetition_penalty_equals_hugging_faces(stories_llm: LLM) -> None:
    model = hf_model(DEFAULT_MODEL_PATH)
    prompt = stories_llm.tokenizer.encode("Once upon a time, there was a little")
    with torch.no_grad():
        hf = model.generate(
            torch.tensor([prompt], device=model.device), max_new_tokens=40, do_sample=False,
            repetition_penalty=1.3, eos_token_id=None, pad_token_id=0,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=model.device),
        )[0, len(prompt):].tolist()  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, repetition_penalty=1.3)
    plain = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    got, unpenalised = stories_llm.generate([prompt, prompt], [params, plain], use_tqdm=False)
    assert got["token_ids"] == hf
    assert got["token_ids"] != unpenalised["token_ids"]


def test_min_tokens_holds_back_stop_tokens_and_logit_bias_moves_the_argmax(
    stories_llm: LLM,
) -> None:
    prompt = stories_llm.tokenizer.encode("Once upon a time")
    greedy = SamplingParams(temperature=0, max_tokens=12, logprobs=2)
    free = stories_llm.generate([prompt], greedy, use_tqdm=False)[0]
    stop = free["token_ids"][5]
    k = free["token_ids"].index(stop)  # where that stop token would end the text
    held = SamplingParams(
        temperature=0, max_tokens=12, stop_token_ids=[stop], min_tokens=k + 3, logprobs=2
    )
    first = free["token_ids"][0]
    bias = SamplingParams(temperature=0, max_tokens=3, logit_bias={first: -100})
    stopped = SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop])
    got_held, got_bias, got_stopped = stories_llm.generate(
        [prompt] * 3, [held, bias, stopped], use_tqdm=False
    )
    assert len(got_stopped["token_ids"]) == k + 1 and got_stopped["finish_reason"] == "stop"
    assert got_held["token_ids"][:k] == free["token_ids"][:k]
    second = free["logprobs"][k]["top_logprobs"][1]["token_id"]  # the best token after the stop
    assert got_held["token_ids"][k] == second
    assert stop not in got_held["token_ids"][: k + 3]
    assert got_bias["token_ids"][0] == free["logprobs"][0]["top_logprobs"][1]["token_id"]
    stories_llm.scheduler.check_integrity()


def test_n_gives_a_choice_per_derived_seed_offline(stories_llm: LLM) -> None:
    params = SamplingParams(n=3, seed=5, max_tokens=16, temperature=1.5)
    results = stories_llm.generate(["Once", "Lily"], params, use_tqdm=False)
    assert len(results) == 6
    for j, choice in enumerate(choice_params(params, 3)):
        alone = stories_llm.generate(["Lily"], choice, use_tqdm=False)[0]
        assert results[3 + j]["token_ids"] == alone["token_ids"]
    assert choice_params(params, 3)[0].seed == 5  # choice 0 keeps the seed
    assert len({tuple(r["token_ids"]) for r in results[3:]}) > 1


def test_seed_minus_one_asks_for_no_seed(stories_llm: LLM) -> None:
    """vLLM's: -1 is no seed (two calls gave the same tokens); a seed derived for a later choice
    is never -1."""
    params = SamplingParams(seed=-1, max_tokens=16, temperature=2.0)
    assert params.seed is None
    runs = [stories_llm.generate(["Once"], params, use_tqdm=False)[0] for _ in range(2)]
    assert runs[0]["token_ids"] != runs[1]["token_ids"]
    derived = choice_params(SamplingParams(seed=-3, n=4), 4)
    assert [c.seed for c in derived] == [-3, 2**63 - 2, 2**63 - 1, 0]
