"""Offline TP: `LLM(tp_size=2)` is rank 0 in this process and starts rank 1 as the server's
follower process. Its greedy tokens equal TP 1's for each dense architecture (the near-tie rule:
fp32), requests a stop string ends stop on every rank, a prefix-cache flush reaches every rank, and ranks whose seeds differ still sample
the same tokens: each takes rank 0's. On the CPU (gloo), or on two GPUs when the suite runs on
CUDA and has them (NCCL: test_tp_cuda checks its CUDA graphs whatever the suite's device)."""

import multiprocessing
from typing import Any

import pytest

from minisgl import LLM, SamplingParams

from . import tp_rank
from .conftest import TP_DEVICE, assert_same_or_near_tie_as
from .server_process import free_port

DENSE = ("llama", "mistral", "qwen2", "qwen3")
# token ids: the random models' text is not worth reading
PROMPTS = [[1, 45, 300, 12, 7, 99], [2, 3], list(range(20, 70))]
MAX_TOKENS = 16
SETTINGS: dict[str, Any] = dict(
    device=TP_DEVICE, dtype="float32", max_kv_tokens=4096, max_running_requests=8
)
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module", params=DENSE)
def engines(request: pytest.FixtureRequest, checkpoint):
    """(TP 1, TP 2) offline engines of one architecture's small random checkpoint."""
    path = str(checkpoint(request.param))
    tp1 = LLM(path, **SETTINGS)
    with LLM(path, tp_size=2, **SETTINGS) as tp2:
        yield tp1, tp2


def test_tp2_greedy_tokens_equal_tp1(engines: tuple[LLM, LLM]) -> None:
    tp1, tp2 = engines
    want = tp1.generate(PROMPTS, GREEDY, use_tqdm=False)
    got = tp2.generate(PROMPTS, GREEDY, use_tqdm=False)
    for g, w in zip(got, want, strict=True):
        assert_same_or_near_tie_as(g["token_ids"], w)
    # a flush reaches rank 1 too: both recompute every prompt, in step
    tp2.reset_prefix_cache()
    again = tp2.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [a["cached_tokens"] for a in again] == [0] * len(PROMPTS)
    assert [a["token_ids"] for a in again] == [g["token_ids"] for g in got]


def test_tp2_prompt_logprobs_equal_tp1s(engines: tuple[LLM, LLM]) -> None:
    """Every rank computes the prompt's logits (a whole vocabulary's, gathered): rank 0's are
    the answer."""
    tp1, tp2 = engines
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)
    want, got = (llm.generate(PROMPTS, params, use_tqdm=False) for llm in (tp1, tp2))
    for g, w in zip(got, want, strict=True):
        assert g["prompt_logprobs"][0] is None and len(g["prompt_logprobs"]) == len(
            w["prompt_logprobs"]
        )
        for a, b in zip(g["prompt_logprobs"][1:], w["prompt_logprobs"][1:], strict=True):
            assert a["token_id"] == b["token_id"]
            assert a["logprob"] == pytest.approx(b["logprob"], abs=1e-4)


def test_a_stop_string_ends_the_request_on_every_rank(engines: tuple[LLM, LLM]) -> None:
    """The stop string ends the request in rank 0's detokenizer; the abort reaches rank 1 in the
    next step, and the ranks go on in step: the next requests still get TP 1's tokens."""
    tp1, tp2 = engines
    free = tp1.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0]
    stop = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop=[free["text"][3:5]])
    want = tp1.generate(PROMPTS[:1], stop, use_tqdm=False)[0]
    assert want["finish_reason"] == "stop" and len(want["token_ids"]) < MAX_TOKENS
    got = tp2.generate(PROMPTS[:1], stop, use_tqdm=False)[0]
    assert (got["text"], got["finish_reason"]) == (want["text"], want["finish_reason"])
    after = tp2.generate(PROMPTS, GREEDY, use_tqdm=False)
    for g, w in zip(after, tp1.generate(PROMPTS, GREEDY, use_tqdm=False), strict=True):
        assert_same_or_near_tie_as(g["token_ids"], w)


def test_ranks_whose_seeds_differ_sample_rank_0s_tokens() -> None:
    """Each rank's scheduler draws the requests' seeds from its own seed, so each would sample
    other tokens (as TP 1 does with those seeds); every rank takes rank 0's. Sampled in the step
    (temperature) and after it (top-k, top-p), with overlap."""
    params = [
        SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True),
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_tokens=MAX_TOKENS, ignore_eos=True),
    ]  # fmt: skip
    requests = [(i, PROMPTS[i % 2], params[i % 2]) for i in range(4)]
    by_seed = [
        LLM(device="cpu", dtype="float32", max_kv_tokens=4096, seed=seed).generate(
            [p for _, p, _ in requests], [p for _, _, p in requests], use_tqdm=False
        )
        for seed in (1, 2)
    ]
    assert [r["token_ids"] for r in by_seed[0]] != [r["token_ids"] for r in by_seed[1]]
    # both ranks spawned: a TP group is its process's, and this one may hold an LLM's
    spawn = multiprocessing.get_context("spawn")
    results = spawn.Queue()
    init = f"tcp://127.0.0.1:{free_port()}"
    ranks = [
        spawn.Process(
            target=tp_rank.sample_into, args=(results, rank, init, TP_DEVICE, 1 + rank, requests),
            daemon=True,
        )
        for rank in range(2)
    ]  # fmt: skip
    for proc in ranks:
        proc.start()
    tokens = dict(results.get(timeout=120) for _ in ranks)
    for proc in ranks:
        proc.join(30)
        assert proc.exitcode == 0
    assert tokens[1] == tokens[0]
    assert all(len(t) == MAX_TOKENS for t in tokens[0].values())
