"""`--tp 2` on CPU (gloo): two scheduler processes, rank 0 forwarding each step's messages to
rank 1. Each rank holds half of every layer's weights, so right answers need both ranks to run
every step together; greedy tokens must equal the single-process engine's, for a dense model and
for a mixture of experts (each rank holding a slice of every expert)."""

import signal

import pytest

from minisgl import LLM, SamplingParams

from .server_process import ServerProcess
from .test_moe import MOE

PROMPTS = ["Once upon a time", "The little dog", "Lily and Tom went to the park. They"]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    # the CPU twin of TP (gloo), whatever the test device: one GPU cannot hold two ranks
    s = ServerProcess(
        tmp_path_factory.mktemp("tp"), "--device", "cpu", "--dtype", "float32", "--tp", "2",
        "--max-kv-tokens", "4096",
    )  # fmt: skip
    yield s
    s.stop()


def test_tp2_greedy_tokens_equal_tp1(server: ServerProcess) -> None:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=0)
    want = LLM(device="cpu", dtype="float32", max_kv_tokens=4096).generate(
        PROMPTS, params, use_tqdm=False
    )
    client = server.client()
    for prompt, reference in zip(PROMPTS, want, strict=True):
        got = client.completions.create(
            model="stories260K", prompt=prompt, temperature=0, max_tokens=MAX_TOKENS, logprobs=0
        )
        assert got.choices[0].text == reference["text"]
        assert got.choices[0].logprobs.token_logprobs == pytest.approx(
            [lp["logprob"] for lp in reference["logprobs"]], abs=1e-4
        )
    # concurrent requests share batches across both ranks
    batch = client.completions.create(
        model="stories260K", prompt=PROMPTS, temperature=0, max_tokens=MAX_TOKENS
    )
    assert [c.text for c in batch.choices] == [r["text"] for r in want]


def test_tp2_moe_greedy_tokens_equal_tp1(checkpoint, tmp_path_factory) -> None:
    """Compared by each token's logprob: the random model's byte tokens are invalid UTF-8, whose
    text the streaming detokenizer and a whole decode may render differently."""
    path = str(checkpoint("qwen3_moe", **MOE))
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=0)
    want = LLM(path, device="cpu", dtype="float32", max_kv_tokens=4096).generate(
        PROMPTS, params, use_tqdm=False
    )
    s = ServerProcess(
        tmp_path_factory.mktemp("tp-moe"), path, "--device", "cpu", "--dtype", "float32",
        "--tp", "2", "--max-kv-tokens", "4096",
    )  # fmt: skip
    try:
        batch = s.client().completions.create(
            model=path, prompt=PROMPTS, temperature=0, max_tokens=MAX_TOKENS, logprobs=0
        )
    finally:
        s.stop()
    for choice, reference in zip(batch.choices, want, strict=True):
        assert choice.logprobs.token_logprobs == pytest.approx(
            [lp["logprob"] for lp in reference["logprobs"]], abs=1e-4
        )


def test_sigterm_stops_every_rank_and_removes_the_ipc_files(server: ServerProcess) -> None:
    assert len(server.children) >= 4  # two ranks, the tokenizer and the API server
    server.stop(signal.SIGTERM)
