"""The sampler (per-request parameters and seeds) and the stop rules."""

import numpy as np
import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.engine.sampler import Sampler, SamplingArgs, hash_uniform
from minisgl.kernel import sample_tokens
from minisgl.kernel.torch_ops import row_cumsum

from .conftest import DEVICE, hf_model

PROBS = torch.tensor([0.4, 0.3, 0.2, 0.1])
N = 20000


def sample_many(probs: torch.Tensor, **params: float) -> torch.Tensor:
    """Frequencies of N draws (N distinct seeds) from one fixed distribution, as the engine
    draws them: plain temperature sampling in the step's kernel, filtered sampling after it."""
    rows = N
    filtered = any(name in params for name in ("top_k", "top_p", "min_p"))
    temperatures = torch.full((rows,), float(params.get("temperature", 1.0)))
    uniforms = torch.from_numpy(hash_uniform(range(0, rows * 7919, 7919), [3] * rows)).float()
    logits = probs.log().expand(rows, -1).clone()
    counters = torch.zeros(rows, dtype=torch.int32)
    table, entries = torch.zeros(rows, dtype=torch.int32), torch.arange(rows)
    in_step = None if filtered else (temperatures, uniforms)
    step_tokens = sample_tokens(logits, table, entries, counters, *(in_step or ()))
    args = SamplingArgs(
        temperatures=temperatures,
        top_k=torch.full((rows,), int(params.get("top_k", len(probs))), dtype=torch.int64),
        top_p=torch.full((rows,), float(params.get("top_p", 1.0))),
        min_p=torch.full((rows,), float(params.get("min_p", 0.0))),
        uniforms=uniforms,
        greedy=torch.zeros(rows, dtype=torch.bool),
        all_greedy=False,
        use_top_k_top_p="top_k" in params or "top_p" in params,
        use_min_p="min_p" in params,
        num_logprobs=-1,
    )
    tokens = (
        Sampler(len(probs), torch.device("cpu"), torch.zeros(1, 1, dtype=torch.int32))
        .sample(logits, step_tokens, args)
        .tokens
    )
    return torch.bincount(tokens.long(), minlength=len(probs)).float() / rows


@pytest.mark.parametrize(
    ("params", "expected", "probs"),
    [
        ({}, [0.4, 0.3, 0.2, 0.1], PROBS),
        ({"temperature": 0.5}, [16 / 30, 9 / 30, 4 / 30, 1 / 30], PROBS),  # p^2, renormalised
        ({"top_k": 2}, [4 / 7, 3 / 7, 0, 0], PROBS),
        ({"top_p": 0.75}, [4 / 9, 3 / 9, 2 / 9, 0], PROBS),  # smallest set reaching 0.75
        ({"top_p": 0.35}, [1.0, 0, 0, 0], PROBS),
        ({"min_p": 0.6}, [4 / 7, 3 / 7, 0, 0], PROBS),  # keep p >= 0.6 * max
        ({"top_k": 3, "top_p": 0.5}, [4 / 7, 3 / 7, 0, 0], PROBS),
        # vLLM's order: top-p over what top-k or min-p kept, renormalised (4/7 >= 0.5)
        ({"top_k": 2, "top_p": 0.5}, [1.0, 0, 0, 0], PROBS),
        ({"min_p": 0.6, "top_p": 0.5}, [1.0, 0, 0, 0], PROBS),
        # a set that reaches top_p exactly is the set; tokens tied with the k-th all stay
        ({"top_p": 0.5}, [1.0, 0, 0], torch.tensor([0.5, 0.25, 0.25])),
        ({"top_k": 2}, [0.4, 0.2, 0.2, 0.2], torch.tensor([0.4, 0.2, 0.2, 0.2])),
    ],
)
def test_filtered_distribution_is_sampled_faithfully(
    params: dict, expected: list[float], probs: torch.Tensor
) -> None:
    freq = sample_many(probs, **params)
    # 20000 draws: the standard error of a frequency is <= 0.0036, so 0.02 is > 5 sigma
    assert torch.allclose(freq, torch.tensor(expected), atol=0.02), freq.tolist()
    assert all(f == 0 for f, e in zip(freq.tolist(), expected, strict=True) if e == 0)


def test_hash_uniform_is_uniform() -> None:
    u = hash_uniform(range(100000), [0] * 100000)
    assert u.min() > 0 and u.max() < 1
    hist = np.histogram(u, bins=10, range=(0, 1))[0] / len(u)
    assert np.abs(hist - 0.1).max() < 0.01


def _fmix32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & 0xFFFFFFFF
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_hash_uniform_equals_the_formula_on_python_integers() -> None:
    """The numpy arrays wrap around where the hash needs it, for any signed 64-bit seed."""
    seeds = [0, 1, -1, 2**63 - 1, -(2**63), 1234567890123]
    positions = [0, 5, 7, 100, 2**20, 3]
    want = []
    for seed, position in zip(seeds, positions, strict=True):
        bits = seed % 2**64
        h = _fmix32(_fmix32(bits >> 32) ^ (bits & 0xFFFFFFFF))
        h = _fmix32((h + position * 0x9E3779B9) & 0xFFFFFFFF)
        want.append(((h >> 8) + 0.5) / 2**24)
    assert hash_uniform(seeds, positions).tolist() == want


@pytest.fixture(scope="module")
def llm(checkpoint) -> LLM:
    return LLM(str(checkpoint("llama")), device=DEVICE, dtype="float32", max_kv_tokens=8192)


PROMPT = [3, 14, 15, 92, 65, 35, 89, 79]


def test_seed_reproduces_alone_and_in_a_batch(llm: LLM) -> None:
    sp = SamplingParams(temperature=1.0, max_tokens=16, seed=1234, ignore_eos=True)
    alone = llm.generate([PROMPT], sp, use_tqdm=False)[0]["token_ids"]
    assert llm.generate([PROMPT], sp, use_tqdm=False)[0]["token_ids"] == alone
    others = [[i, i + 1, i + 2] for i in range(5)]
    batch = others + [PROMPT] + others
    params = [SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)] * 5
    params = [*params, sp, *params]
    outs = llm.generate(batch, params, use_tqdm=False)
    assert outs[5]["token_ids"] == alone
    different = SamplingParams(temperature=1.0, max_tokens=16, seed=4321, ignore_eos=True)
    assert llm.generate([PROMPT], different, use_tqdm=False)[0]["token_ids"] != alone


def test_graph_runner_samples_the_tokens_of_the_plain_forward(checkpoint) -> None:
    """Greedy rows and temperature sampling run inside the step (inside the CUDA graph on a GPU,
    through its static buffers on the CPU), filtered rows after it. Mixed batches, then a greedy
    batch (the static temperatures zeroed) and a sampled one again, give the tokens of the plain
    forward."""
    prompts = [[(7 * i + n) % 500 for i in range(n)] for n in range(3, 13)]
    kinds = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True, seed=5),
        SamplingParams(temperature=1.2, top_p=0.9, max_tokens=12, ignore_eos=True, seed=6),
    ]
    mixed = [kinds[i % 3] for i in range(len(prompts))]
    tokens = {}
    for max_bs in (0, 16):
        llm = LLM(
            str(checkpoint("llama")), device=DEVICE, dtype="float32", max_kv_tokens=4096,
            cuda_graph_max_bs=max_bs,
        )  # fmt: skip
        assert (llm.engine.graph_runner is not None) == (max_bs > 0)
        runs = [
            llm.generate(prompts, mixed, use_tqdm=False),
            llm.generate(prompts[:4], mixed[:2] * 2, use_tqdm=False),  # no filtered row
            llm.generate(prompts[:4], kinds[0], use_tqdm=False),
            llm.generate(prompts[:4], kinds[1], use_tqdm=False),
        ]
        tokens[max_bs] = [[r["token_ids"] for r in run] for run in runs]
    assert tokens[16] == tokens[0]
    greedy, sampled = tokens[0][2], tokens[0][3]
    assert greedy != sampled


def test_top_k_1_equals_greedy(llm: LLM) -> None:
    greedy = llm.generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False
    )
    top1 = llm.generate(
        [PROMPT],
        SamplingParams(temperature=1.3, top_k=1, max_tokens=16, ignore_eos=True, seed=9),
        use_tqdm=False,
    )
    assert top1[0]["token_ids"] == greedy[0]["token_ids"]


def test_logprobs_are_the_models_log_softmax(llm: LLM, checkpoint) -> None:
    out = llm.generate(
        [PROMPT],
        SamplingParams(temperature=0, max_tokens=3, logprobs=5, ignore_eos=True),
        use_tqdm=False,
    )[0]
    hf = hf_model(checkpoint("llama"))
    with torch.no_grad():
        want = torch.log_softmax(
            hf(torch.tensor([PROMPT], device=hf.device)).logits[0, -1], -1
        ).cpu()
    first = out["logprobs"][0]
    assert first["token_id"] == out["token_ids"][0] == first["top_logprobs"][0]["token_id"]
    assert abs(first["logprob"] - want[first["token_id"]].item()) < 1e-4
    top = [t["logprob"] for t in first["top_logprobs"]]
    assert len(top) == 5 and top == sorted(top, reverse=True)
    assert [t["token_id"] for t in first["top_logprobs"]] == want.topk(5).indices.tolist()


GREEDY_TEXT = ", there was a little girl named Lily. She loved to play outside in the park."


def test_stop_string_ends_generation_and_is_not_in_the_text(stories_llm: LLM) -> None:
    out = stories_llm.generate(
        "Once upon a time",
        SamplingParams(temperature=0, max_tokens=64, stop=["Lily", "zebra"]),
        use_tqdm=False,
    )[0]
    assert out["finish_reason"] == "stop"
    assert out["text"] == ", there was a little girl named "


def test_stop_token_id_ends_generation(stories_llm: LLM) -> None:
    full = stories_llm.generate(
        "Once upon a time", SamplingParams(temperature=0, max_tokens=32), use_tqdm=False
    )[0]
    stop_id = full["token_ids"][6]  # first occurrence is at index 6
    assert stop_id not in full["token_ids"][:6]
    out = stories_llm.generate(
        "Once upon a time",
        SamplingParams(temperature=0, max_tokens=32, stop_token_ids=[stop_id]),
        use_tqdm=False,
    )[0]
    assert out["finish_reason"] == "stop" and out["token_ids"] == full["token_ids"][:7]
    assert full["text"].startswith(out["text"]) and len(out["text"]) < len(full["text"])


def test_any_eos_id_stops_unless_ignored(checkpoint) -> None:
    path = checkpoint("llama")
    greedy = LLM(str(path), device=DEVICE, dtype="float32", max_kv_tokens=1024).generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False
    )[0]["token_ids"]
    eos = greedy[9]
    first = greedy.index(eos)
    with_eos = checkpoint("llama", eos_token_id=[511, eos])  # same weights: same seed
    llm = LLM(str(with_eos), device=DEVICE, dtype="float32", max_kv_tokens=1024)
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0]
    assert out["finish_reason"] == "stop" and out["token_ids"] == greedy[: first + 1]
    ignored = llm.generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False
    )
    assert ignored[0]["token_ids"] == greedy and ignored[0]["finish_reason"] == "length"


def test_the_cdf_of_one_row_has_the_same_bits_on_every_run() -> None:
    """A lone request's CDF must not change between runs: CUDA's one-row float scan depends on
    timing (pytorch/pytorch#75240), which made a seeded request sample two continuations."""
    torch.manual_seed(0)
    probs = torch.rand(1, 151_936, device=DEVICE)
    first = row_cumsum(probs)
    assert torch.allclose(first, probs.double().cumsum(dim=-1).float(), rtol=1e-4)
    assert all(torch.equal(row_cumsum(probs), first) for _ in range(50))
