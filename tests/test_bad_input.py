"""Bad input gets a clear ValueError, and the engine serves the next request normally."""

import pytest

from minisgl import LLM, SamplingParams

from .conftest import DEVICE

GOOD = [3, 14, 15, 92, 65]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(checkpoint) -> LLM:
    return LLM(
        str(checkpoint("llama")),
        device=DEVICE,
        dtype="float32",
        max_kv_tokens=256,
        max_model_len=256,
    )


@pytest.fixture(scope="module")
def expected(llm: LLM) -> list[int]:
    return llm.generate([GOOD], GREEDY, use_tqdm=False)[0]["token_ids"]


@pytest.mark.parametrize(
    ("prompts", "match"),
    [
        ([[]], "empty"),
        ([[1] * 256], "maximum context length is 256"),
        ([GOOD + [512]], "outside the vocabulary"),
        ([GOOD + [-1]], "outside the vocabulary"),
        ([GOOD, []], "empty"),  # one bad prompt in a list: nothing of the list runs
        ([3, 4], "list of lists"),
    ],
)
def test_bad_prompt_raises_and_engine_keeps_serving(
    llm: LLM, expected: list[int], prompts, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert not llm.scheduler.has_work
    assert llm.generate([GOOD], GREEDY, use_tqdm=False)[0]["token_ids"] == expected
    llm.scheduler.check_integrity()
    assert llm.scheduler.kv.used_pages == len(llm.scheduler.kv.prefix_cache.cached_pages())


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -5}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"logprobs": 50}, "logprobs"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"seed": 2**64}, "seed"),
    ],
)
def test_bad_sampling_params_raise(llm: LLM, expected: list[int], params: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**params)
    assert llm.generate([GOOD], GREEDY, use_tqdm=False)[0]["token_ids"] == expected


def test_mismatched_params_list_raises(llm: LLM) -> None:
    with pytest.raises(ValueError, match="2 sampling params for 1 prompts"):
        llm.generate([GOOD], [GREEDY, GREEDY], use_tqdm=False)
