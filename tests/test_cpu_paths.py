"""The CPU's fast paths give the reference's tokens in fp32: batched attention (the CPU default)
against the torch backend."""

import pytest

from minisgl import LLM, SamplingParams

from .conftest import DEVICE

pytestmark = pytest.mark.skipif(DEVICE != "cpu", reason="the CPU's own paths")

# lengths that mix one-token rows with prompt chunks in a step (chunk_size 48), around page edges
PROMPT_LENS = [1, 15, 16, 17, 40, 90, 33, 5]
MAX_TOKENS = [9, 4, 12, 7, 10, 3, 8, 11]


@pytest.fixture(scope="module")
def model_path(checkpoint):
    return checkpoint("qwen3", max_position_embeddings=256)


def prompts() -> list[list[int]]:
    first = [[(7 * i + n) % 500 for i in range(n)] for n in PROMPT_LENS]
    # then the first prompt again, and prompts that extend cached ones by one and three tokens
    return first + [first[0], first[4] + [3], first[5] + [3, 1, 4]]


def generate(path, **settings) -> list[list[int]]:
    ids = prompts()
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]
    llm = LLM(str(path), device="cpu", dtype="float32", max_kv_tokens=2048, **settings)
    first = llm.generate(ids[: len(PROMPT_LENS)], params, use_tqdm=False)
    again = llm.generate(ids[len(PROMPT_LENS) :], params[:3], use_tqdm=False)
    return [r["token_ids"] for r in first + again]


@pytest.mark.parametrize(
    "options",
    [{}, {"page_size": 16}, {"chunk_size": 48}, {"cuda_graph_max_bs": 8}, {"overlap": False}],
    ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default",
)
def test_batched_attention_gives_the_torch_backends_tokens(model_path, options) -> None:
    """Decode rows attend in one call per layer, prompt chunks one request at a time; with
    cuda_graph_max_bs the graph runner's padded static batches run (uncaptured on the CPU)."""
    want = generate(model_path, attention_backend="torch", **options)
    assert generate(model_path, attention_backend="batched", **options) == want
