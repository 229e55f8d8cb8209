"""`--tp 2` through the server: rank 0's scheduler process sends each step's messages to rank
1's. Each rank holds half of every layer's weights, so right answers need both ranks to run every
step together; greedy tokens must equal the single-process engine's for each dense architecture
and for a mixture of experts (each rank holding a slice of every expert). On the CPU (gloo), or on
two GPUs when the suite runs on CUDA and has them.

The random models' byte tokens are invalid UTF-8, whose text the streaming detokenizer and a
whole decode may render differently: their tokens are compared by logprob."""

import signal

import pytest

from minisgl import LLM, SamplingParams

from .conftest import TP_DEVICE
from .server_process import ServerProcess
from .test_moe import MOE

DENSE = ("llama", "mistral", "qwen2", "qwen3")
PROMPTS = ["Once upon a time", "The little dog", "Lily and Tom went to the park. They"]
MAX_TOKENS = 24
SETTINGS = ("--device", TP_DEVICE, "--dtype", "float32", "--max-kv-tokens", "4096")
REFERENCE = dict(device=TP_DEVICE, dtype="float32", max_kv_tokens=4096)
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)


def assert_same_or_near_tie_by_logprob(choice, reference: dict) -> None:
    """The server's tokens are the reference's (`LLM.generate` with logprobs=2), seen through
    their logprobs; or they part after a near tie in the reference's logits (its top two within
    1e-4), which leaves the tied token's own logprob unchanged: the first to differ is then the
    tie's or the next one's."""
    got = choice.logprobs.token_logprobs
    want = [lp["logprob"] for lp in reference["logprobs"]]
    assert len(got) == len(want)
    i = next((i for i, (g, w) in enumerate(zip(got, want, strict=True)) if abs(g - w) > 1e-4), None)
    if i is None:
        return
    gaps = [
        (top[0]["logprob"] - top[1]["logprob"])
        for top in (reference["logprobs"][j]["top_logprobs"] for j in (i - 1, i) if j >= 0)
    ]
    assert min(gaps) < 1e-4, f"logprob {got[i]} at token {i}, want {want[i]}; top-2 gaps {gaps}"


@pytest.fixture(scope="module", params=DENSE)
def served(request: pytest.FixtureRequest, checkpoint, tmp_path_factory: pytest.TempPathFactory):
    """(the TP 2 server of one architecture's small random checkpoint, TP 1's results)."""
    path = str(checkpoint(request.param))
    want = LLM(path, **REFERENCE).generate(PROMPTS, GREEDY, use_tqdm=False)
    s = ServerProcess(tmp_path_factory.mktemp("tp"), path, *SETTINGS, "--tp", "2")
    yield s, path, want
    s.stop()


def test_tp2_greedy_tokens_equal_tp1(served: tuple[ServerProcess, str, list[dict]]) -> None:
    server, model, want = served
    client = server.client()
    for prompt, reference in zip(PROMPTS, want, strict=True):
        got = client.completions.create(
            model=model, prompt=prompt, temperature=0, max_tokens=MAX_TOKENS, logprobs=2,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert_same_or_near_tie_by_logprob(got.choices[0], reference)
    # concurrent requests share batches across both ranks
    batch = client.completions.create(
        model=model, prompt=PROMPTS, temperature=0, max_tokens=MAX_TOKENS, logprobs=2,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    for choice, reference in zip(batch.choices, want, strict=True):
        assert_same_or_near_tie_by_logprob(choice, reference)


def test_sigterm_stops_every_rank_and_removes_the_ipc_files(
    served: tuple[ServerProcess, str, list[dict]],
) -> None:
    server = served[0]
    assert len(server.children) >= 4  # two ranks, the tokenizer and the API server
    server.stop(signal.SIGTERM)


def test_tp2_moe_greedy_tokens_equal_tp1(checkpoint, tmp_path_factory) -> None:
    path = str(checkpoint("qwen3_moe", **MOE))
    want = LLM(path, **REFERENCE).generate(PROMPTS, GREEDY, use_tqdm=False)
    s = ServerProcess(tmp_path_factory.mktemp("tp-moe"), path, *SETTINGS, "--tp", "2")
    try:
        batch = s.client().completions.create(
            model=path, prompt=PROMPTS, temperature=0, max_tokens=MAX_TOKENS, logprobs=2,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
    finally:
        s.stop()
    for choice, reference in zip(batch.choices, want, strict=True):
        assert_same_or_near_tie_by_logprob(choice, reference)
