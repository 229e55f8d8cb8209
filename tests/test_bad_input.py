"""Bad input gets a clear ValueError, and the engine serves the next request normally."""

import json
import signal
import sys
import threading
import time
from types import FrameType

import numpy as np
import pytest

from minisgl import LLM, SamplingParams
from minisgl.core import MAX_SCHEMA_DEPTH, StructuredOutput
from minisgl.kvcache.manager import KVCacheManager

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
        (None, "not NoneType"),
        (5, "not int"),
        ("a \ud800", "surrogates not allowed"),  # the tokenizer's TypeError before
        ([{"prompt": GOOD}], '"prompt" is a str'),  # it was read as token ids
        ([{"prompt_token_ids": "Once"}], '"prompt_token_ids" is a list'),  # read as text
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


def test_min_tokens_past_the_room_left_raises(llm: LLM, expected: list[int]) -> None:
    """With max_tokens None (the rest of the context), a min_tokens the context cannot hold is
    refused, as the server refuses it; it ran to the context's end before, short of it."""
    too_many = SamplingParams(temperature=0, max_tokens=None, min_tokens=252)
    with pytest.raises(ValueError, match="min_tokens must be at most the 251 tokens"):
        llm.generate([GOOD], too_many, use_tqdm=False)
    fits = SamplingParams(temperature=0, max_tokens=None, min_tokens=251)
    assert len(llm.generate([GOOD], fits, use_tqdm=False)[0]["token_ids"]) == 251
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
        ({"logit_bias": [1, 2]}, "logit_bias"),
        ({"logit_bias": {1: 1.0, "a": 2.0}}, "logit_bias"),
        ({"stop": 123}, "stop"),
        ({"stop_token_ids": 5}, "stop_token_ids"),
        ({"structured": StructuredOutput(json_object=True), "n": 0}, "n must"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"temperature": 1e39}, r"temperature must be in \[0, 2\]"),  # a float32's inf
        ({"n": 2**70}, r"n must be in \[1, 16384\]"),
        ({"logit_bias": [(5, 60.0), (5, 60.0)]}, "names a token id twice"),
    ],
)
def test_bad_sampling_params_raise(llm: LLM, expected: list[int], params: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**params)
    assert llm.generate([GOOD], GREEDY, use_tqdm=False)[0]["token_ids"] == expected


def test_numpy_numbers_are_taken_as_pythons() -> None:
    params = SamplingParams(
        temperature=np.float32(0.5), top_k=np.int64(5), max_tokens=np.int32(7), seed=np.uint8(3),
        top_p=np.float64(0.5), repetition_penalty=np.float16(2.5),
        logit_bias={np.int32(9): np.float64(1.5)}, stop_token_ids=[np.int64(4)],
    )  # fmt: skip
    plain = SamplingParams(
        temperature=0.5, top_k=5, max_tokens=7, seed=3, top_p=0.5, repetition_penalty=2.5,
        logit_bias={9: 1.5}, stop_token_ids=[4],
    )  # fmt: skip
    assert params == plain
    names = ("temperature", "top_k", "max_tokens", "seed", "top_p", "repetition_penalty")
    numbers = [getattr(params, name) for name in names]
    numbers += [*params.logit_bias[0], *params.stop_token_ids]
    assert {type(x) for x in numbers} == {int, float}


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"choice": "yes"}, "choice"),  # a string would be its letters
        ({"regex": 3}, "regex"),
        ({"json_object": 1}, "json_object"),
        ({"json_schema": {"type": "object"}, "regex": "a"}, "exactly one"),
        ({"json_schema": {"enum": [{1, 2}]}}, "json_schema is not JSON"),
    ],
)
def test_bad_structured_outputs_raise(fields: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        StructuredOutput(**fields)


def nested_schema(depth: int) -> dict:
    """A schema whose objects nest `depth` levels: arrays of arrays of ... of integers."""
    schema: dict = {"type": "integer"}
    for _ in range(depth - 1):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize("as_text", [False, True])
def test_a_schema_nested_past_the_limit_raises(as_text: bool) -> None:
    def given(depth: int) -> str | dict:
        if not as_text:
            return nested_schema(depth)
        levels = depth - 1  # written out: json.dumps itself stops at ~1,000
        return '{"type": "array", "items": ' * levels + '{"type": "integer"}' + "}" * levels

    assert StructuredOutput(json_schema=given(MAX_SCHEMA_DEPTH)).json_schema
    for depth in (MAX_SCHEMA_DEPTH + 1, 100_000):  # past json's recursion limit too
        with pytest.raises(ValueError, match=f"nests deeper than {MAX_SCHEMA_DEPTH} levels"):
            StructuredOutput(json_schema=given(depth))


def test_a_schema_given_as_an_object_is_taken_as_its_json() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert json.loads(StructuredOutput(json_schema=schema).json_schema) == schema


def test_mismatched_params_list_raises(llm: LLM, expected: list[int]) -> None:
    with pytest.raises(ValueError, match="2 sampling params for 1 prompts"):
        llm.generate([GOOD], [GREEDY, GREEDY], use_tqdm=False)
    assert not llm.scheduler.has_work
    assert llm.generate([GOOD], GREEDY, use_tqdm=False)[0]["token_ids"] == expected
    llm.scheduler.check_integrity()


@pytest.mark.parametrize("params", [{"max_tokens": 4}, [{"max_tokens": 4}], [GREEDY, None]])
def test_params_that_are_no_sampling_params_raise(llm: LLM, expected: list[int], params) -> None:
    prompts = [GOOD] * (len(params) if isinstance(params, list) else 1)
    with pytest.raises(ValueError, match="must be a SamplingParams"):
        llm.generate(prompts, params, use_tqdm=False)
    assert not llm.scheduler.has_work
    assert llm.generate([GOOD], GREEDY, use_tqdm=False)[0]["token_ids"] == expected


def _interrupt_after(llm: LLM, steps: int, done: threading.Event) -> threading.Thread:
    """A thread that sends SIGINT once the scheduler has launched `steps` more steps, unless
    `done` is set first."""
    target = llm.scheduler.stats.steps + steps

    def watch() -> None:
        while not done.is_set():
            if llm.scheduler.stats.steps >= target:
                signal.raise_signal(signal.SIGINT)
                return
            time.sleep(0.0005)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("steps", [1, 2, 5, 40])
def test_an_interrupted_generate_aborts_its_requests_and_forgets_their_pages(
    llm: LLM, expected: list[int], steps: int
) -> None:
    """Ctrl-C in generate leaves nothing running (the next call does not first finish it) and
    nothing cached: the step it cut off may have published pages it had not yet written."""
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    prompts = [GOOD * 3, GOOD * 3 + [7], GOOD, GOOD * 2]  # prefixes shared with each other
    done = threading.Event()
    watcher = _interrupt_after(llm, steps, done)
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate(prompts, long, use_tqdm=False)  # ~1 s on 2 cores: 200 steps and more
    finally:
        done.set()
        watcher.join()
    assert not llm.scheduler.has_work
    llm.scheduler.check_integrity()
    assert llm.scheduler.kv.used_pages == 0
    assert llm.generate([GOOD], GREEDY, use_tqdm=False)[0]["token_ids"] == expected


def test_a_ctrl_c_inside_the_schedulers_bookkeeping_takes_effect_at_the_turns_end(
    llm: LLM, expected: list[int]
) -> None:
    """A Ctrl-C that came while a slot was being admitted (its cached prefix taken, its pages
    not yet assigned) left the KV manager half done on one rank: every later generate failed
    an assert. The SIGINT is raised as the admission assigns the slot's pages."""
    assign = KVCacheManager._assign.__code__
    raised = threading.Event()

    def interrupt_in_assign(frame: FrameType, event: str, arg: object) -> None:
        if event == "call" and frame.f_code is assign and not raised.is_set():
            raised.set()
            signal.raise_signal(signal.SIGINT)

    sys.setprofile(interrupt_in_assign)
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate([GOOD * 2], GREEDY, use_tqdm=False)
    finally:
        sys.setprofile(None)
    assert raised.is_set()
    assert not llm.scheduler.has_work
    llm.scheduler.kv.check_idle_counts()
    llm.scheduler.check_integrity()
    assert llm.generate([GOOD], GREEDY, use_tqdm=False)[0]["token_ids"] == expected


def test_the_model_path_is_the_first_argument_only(checkpoint) -> None:
    with pytest.raises(ValueError, match="model_path"):
        LLM(str(checkpoint("llama")), model_path=str(checkpoint("llama")), device=DEVICE)


@pytest.mark.parametrize(
    ("settings", "match"),
    [({"cache": "radx"}, "unknown prefix cache"), ({"overlap": "false"}, "overlap"),
     ({"seed": 1.5}, "seed"), ({"grammar_timeout": 0}, "grammar_timeout must be"),
     ({"grammar_timeout": float("inf")}, "grammar_timeout"), ({"grammar_timeout": True}, "grammar")],
)  # fmt: skip
def test_bad_scheduler_settings_fail_before_the_model_loads(checkpoint, settings, match) -> None:
    with pytest.raises(ValueError, match=match):
        LLM(str(checkpoint("llama")), device=DEVICE, **settings)


def test_gpu_memory_utilization_sizes_the_kv_cache_on_the_cpu_too(checkpoint) -> None:
    """On the CPU it was read nowhere: a share too small to hold one request built anyway."""
    with pytest.raises(ValueError, match="the KV cache holds"):
        LLM(str(checkpoint("llama")), device="cpu", gpu_memory_utilization=1e-9)
