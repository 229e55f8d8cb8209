"""A hypothesis fuzzer over request bodies: the table's hostile bodies, bodies built from the API's
fields with hostile values (huge and negative integers, NaN and infinities, wrong types, lone
surrogates, nested junk), random JSON and random bytes. Every answer is a 4xx in OpenAI's error
shape, or a 200 that the `openai` client's types parse, within max_tokens, each choice finished by
stop or length; the server is clean afterwards."""

import json
from typing import Any

import httpx
import openai
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from ..server_process import ServerProcess
from .checks import MODEL, assert_clean, assert_openai_error
from .keeper import ServerKeeper

CONTEXT = 2048  # the embedded model's, and the fuzzed server's pool
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    k = ServerKeeper(
        lambda: ServerProcess(
            tmp_path_factory.mktemp("fuzz"),
            "--max-kv-tokens",
            str(CONTEXT),
            "--served-model-name",
            MODEL,
        )
    )
    yield k.get()
    k.stop()


# ----------------------------------------------------------------------------- bodies
JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(st.characters(exclude_categories=()), max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)
TEXT = st.text(max_size=24)
SURROGATES = st.text(st.characters(exclude_categories=()), max_size=8).map(lambda t: t + "\udc80")
HUGE = st.sampled_from([2**63, -(2**63) - 1, 2**64 - 1, 2**64, 2**70, 10**30]) | st.integers(
    min_value=2**63
)
NON_FINITE = st.sampled_from([float("nan"), float("inf"), float("-inf")])
TOKEN_IDS = st.integers(0, 511)

# each field: (cheap valid values, hostile values); hostile values include any JSON at all
FIELDS: dict[str, tuple[st.SearchStrategy, st.SearchStrategy]] = {
    "model": (st.just(MODEL), SURROGATES | TEXT),
    "stream": (st.booleans(), st.integers()),
    "stream_options": (st.fixed_dictionaries({"include_usage": st.booleans()}), st.just({})),
    "n": (st.integers(1, 3), st.integers(max_value=0) | st.integers(129, 2**70) | HUGE),
    "max_tokens": (st.integers(1, 8), st.integers(max_value=0) | HUGE | st.floats()),
    "temperature": (
        st.floats(0, 2) | st.sampled_from([1e-38, 5e-38, 1e-44, 1e-6]),  # tiny is greedy
        NON_FINITE | st.floats(max_value=-1e-9) | st.just(1e999),
    ),
    "top_p": (st.floats(0.01, 1), st.floats(max_value=0) | st.floats(min_value=1.01) | NON_FINITE),
    "top_k": (
        st.sampled_from([-1, 0, 1, 512, 513, 2**63 - 1]) | st.integers(1, 600),
        st.integers(max_value=-2) | HUGE,
    ),
    "min_p": (st.floats(0, 1), st.floats(min_value=1.01) | NON_FINITE),
    "seed": (st.integers(-(2**63), 2**63 - 1), HUGE),
    "stop": (
        st.text(min_size=1, max_size=8) | st.lists(st.text(min_size=1, max_size=8), max_size=4),
        st.sampled_from([[""], ["x"] * 65, ["y" * 1025], [f"{i:04d}" * 25 for i in range(10_000)]])
        | SURROGATES,
    ),
    "stop_token_ids": (
        st.lists(st.integers(0, 2**63 - 1), max_size=4),
        st.lists(st.integers(max_value=-1) | HUGE, min_size=1, max_size=4),
    ),
    "ignore_eos": (st.booleans(), TEXT),
    "frequency_penalty": (st.floats(-2, 2), st.floats()),
    "presence_penalty": (st.floats(-2, 2), st.floats()),
    "repetition_penalty": (st.floats(0.01, 2), st.floats(max_value=0) | NON_FINITE),
    "logit_bias": (
        st.dictionaries(TOKEN_IDS.map(str), st.floats(-100, 100), max_size=4),
        st.dictionaries(TEXT, st.floats() | TEXT, min_size=1, max_size=4),
    ),
    "min_tokens": (st.integers(0, 4), st.integers(max_value=-1) | HUGE),
    "include_stop_str_in_output": (st.booleans(), TEXT),
    "structured_outputs": (
        st.fixed_dictionaries({"regex": st.sampled_from(["[ab]{1,4}", "(yes|no)"])})
        | st.fixed_dictionaries({"choice": st.lists(TEXT.filter(bool), min_size=1, max_size=3)}),
        st.fixed_dictionaries({"regex": TEXT | SURROGATES})
        | st.fixed_dictionaries({"grammar": TEXT})
        | st.fixed_dictionaries({"json": JSON_VALUES}),
    ),
    "response_format": (
        st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
        st.fixed_dictionaries(
            {
                "type": st.just("json_schema"),
                "json_schema": st.fixed_dictionaries({"schema": JSON_VALUES}),
            }
        ),
    ),
    "user": (TEXT, SURROGATES),
}
PROMPTS = (
    st.text(min_size=1, max_size=24)
    | st.lists(TOKEN_IDS, min_size=1, max_size=8)
    | st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=3)
    | st.lists(st.lists(TOKEN_IDS, min_size=1, max_size=6), min_size=1, max_size=3)
)
COMPLETION_FIELDS = {
    **FIELDS,
    "prompt": (
        PROMPTS,
        SURROGATES
        | st.lists(st.integers(max_value=-1) | st.integers(512, 2**70), min_size=1, max_size=3)
        | st.sampled_from(
            [[], [[]], [[1, 2, 3], [2**70]], [[1, 2, 3], [1, 512]], ["Once"] * 2049, [[1]] * 2049]
        ),
    ),
    "logprobs": (st.integers(0, 20), st.integers(21, 2**70) | st.integers(max_value=-1) | HUGE),
    "echo": (st.just(False), st.just(True)),
}
MESSAGES = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["system", "developer", "user", "assistant"]),
            "content": TEXT
            | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}), max_size=2),
        }
    ),
    min_size=1,
    max_size=3,
)
CHAT_FIELDS = {
    **FIELDS,
    "messages": (
        MESSAGES,
        st.just([])
        | st.lists(st.fixed_dictionaries({"role": TEXT, "content": SURROGATES}), min_size=1),
    ),
    "max_completion_tokens": FIELDS["max_tokens"],
    "logprobs": (st.booleans(), st.integers()),
    "top_logprobs": (st.integers(0, 20), st.integers(21, 2**70) | HUGE),
}


def _bodies(fields: dict, *required: str) -> st.SearchStrategy[dict[str, Any]]:
    """A valid body, or one with a field made hostile, or with every field any JSON at all."""
    valid = st.fixed_dictionaries(
        {k: fields[k][0] for k in required},
        optional={k: valid for k, (valid, _) in fields.items() if k not in required},
    )

    def spoil(body: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
        return st.sampled_from(sorted(fields)).flatmap(
            lambda k: (fields[k][1] | JSON_VALUES).map(lambda value: {**body, k: value})
        )

    junk = st.dictionaries(st.sampled_from(sorted(fields)), JSON_VALUES, max_size=6)
    return valid | valid.flatmap(spoil) | junk


ROUTES = st.sampled_from([COMPLETIONS, CHAT])
CASES = st.one_of(
    _bodies(COMPLETION_FIELDS, "prompt").map(lambda body: (COMPLETIONS, json.dumps(body).encode())),
    # chat runs to the end of the context without max_tokens: valid chats give it
    _bodies(CHAT_FIELDS, "messages", "max_tokens").map(
        lambda body: (CHAT, json.dumps(body).encode())
    ),
    st.tuples(ROUTES, JSON_VALUES.map(lambda value: json.dumps(value).encode())),
    st.tuples(ROUTES, st.binary(max_size=64)),
)

# the table's bodies (D1-D9, D12), as raw bytes
TABLE = [
    (COMPLETIONS, b'{"prompt":"hi","max_tokens":3,"top_k":9223372036854775808}'),
    (CHAT, b'{"messages":[{"role":"user","content":"hi"}],"max_tokens":3,'
           b'"top_k":18446744073709551615}'),
    (COMPLETIONS, b'{"prompt":"hi","max_tokens":3,"temperature":0,"top_k":9223372036854775808}'),
    (COMPLETIONS, b'{"prompt":"hi","max_tokens":4,"temperature":1e-38}'),
    (COMPLETIONS, b'{"prompt":"hi","max_tokens":4,"temperature":5e-38}'),
    (COMPLETIONS, b'{"prompt":"hi","max_tokens":4,"temperature":1e-44}'),
    (COMPLETIONS, b'{"prompt":"Once","max_tokens":1,"n":100000}'),
    (COMPLETIONS, b'{"prompt":"Once","max_tokens":1,"n":1000000}'),
    (COMPLETIONS, json.dumps({"prompt": ["Once"] * 100_000, "max_tokens": 1}).encode()),
    (COMPLETIONS, json.dumps({"prompt": "hi", "stop": ["s" * 1000] * 10_000}).encode()),
    (COMPLETIONS, b'{"prompt":"\\ud800"}'),
    (COMPLETIONS, b'{"model":"\\ud800","prompt":"hi"}'),
    (CHAT, b'{"messages":[{"role":"user","content":"\\ud800"}]}'),
    (COMPLETIONS, b'{"prompt":"hi","stop":["\\ud800"]}'),
    (COMPLETIONS, b'{"prompt":"hi","max_tokens":18446744073709551616}'),
    (COMPLETIONS, b'{"prompt":"hi","stop_token_ids":[18446744073709551616]}'),
    (COMPLETIONS, b'{"prompt":[1,18446744073709551616]}'),
    (COMPLETIONS, b'{"prompt":"hi","top_k":18446744073709551616}'),
    (COMPLETIONS, b'{"prompt":[[1,2,3],[1180591620717411303424]],"max_tokens":1500}'),
    (COMPLETIONS, b'{"prompt":"\xff\xfe"}'),
    (COMPLETIONS, b'{"prompt":' + b"[" * 10**5 + b"]" * 10**5 + b"}"),
    (COMPLETIONS, b'{"prompt":"hi","max_tokens":1' + b"0" * 4300 + b"}"),
    (COMPLETIONS, b'{"prompt":"hi","max_tokens":3,"temperature":Infinity}'),
    (COMPLETIONS, b'{"prompt":"hi","max_tokens":3,"temperature":NaN}'),
]  # fmt: skip


# ----------------------------------------------------------------------------- the check
def _request(content: bytes) -> dict[str, Any]:
    """The body of a request the server answered 200: a JSON object, necessarily."""
    body = json.loads(content)
    assert isinstance(body, dict), body
    return body


def _given(body: dict[str, Any], *keys: str) -> Any:
    """The first of `keys` the body gives a value (JSON null leaves the default)."""
    return next((body[k] for k in keys if body.get(k) is not None), None)


def _max_tokens(route: str, body: dict[str, Any]) -> int:
    if route == COMPLETIONS:
        return _given(body, "max_tokens") or 16
    return _given(body, "max_completion_tokens", "max_tokens") or CONTEXT


def _choices(route: str, body: dict[str, Any]) -> int:
    prompt = body.get("prompt")
    batch = isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list))
    return (len(prompt) if route == COMPLETIONS and batch else 1) * (_given(body, "n") or 1)


def _check_stream(
    client: openai.OpenAI, route: str, response: httpx.Response, max_tokens: int, choices: int
) -> None:
    chunk_type = Completion if route == COMPLETIONS else ChatCompletionChunk
    assert response.text.rstrip().endswith("data: [DONE]"), response.text[-300:]
    events_of = [0] * choices
    finish_reasons: list[str | None] = [None] * choices
    # the client's own stream parser (it raises APIError on an error event)
    for chunk in openai.Stream(cast_to=chunk_type, response=response, client=client):
        for c in chunk.choices:
            events_of[c.index] += 1  # one event per token at most
            assert finish_reasons[c.index] is None, "an event after the choice finished"
            finish_reasons[c.index] = c.finish_reason
        if chunk.usage is not None:
            assert chunk.usage.completion_tokens <= max_tokens * choices
    assert all(reason in ("stop", "length") for reason in finish_reasons), finish_reasons
    assert max(events_of) <= max_tokens


def _echo_nulls_filled(route: str, body: dict[str, Any], answer: dict[str, Any]) -> dict[str, Any]:
    """The answer with the nulls OpenAI's echo gives the prompt's first token (no logprob: nothing
    comes before it) checked and filled, which openai's types (as of 3.x) do not allow."""
    if route != COMPLETIONS or not body.get("echo") or _given(body, "logprobs") is None:
        return answer
    for choice in answer["choices"]:
        logprobs = choice["logprobs"]
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        logprobs["token_logprobs"][0], logprobs["top_logprobs"][0] = 0.0, {}
    return answer


def check_answer(
    client: openai.OpenAI, route: str, content: bytes, response: httpx.Response
) -> None:
    """A 4xx in OpenAI's error shape, or a valid 200 within the request's limits."""
    if response.status_code != 200:
        assert_openai_error(response)
        return
    body = _request(content)
    max_tokens, choices = _max_tokens(route, body), _choices(route, body)
    if body.get("stream"):
        _check_stream(client, route, response, max_tokens, choices)
        return
    answer = (Completion if route == COMPLETIONS else ChatCompletion).model_validate(
        _echo_nulls_filled(route, body, response.json())
    )
    assert len(answer.choices) == choices
    assert all(c.finish_reason in ("stop", "length") for c in answer.choices)
    assert answer.usage is not None
    assert answer.usage.completion_tokens <= max_tokens * choices


def test_fuzzed_bodies_get_a_4xx_error_or_a_valid_answer(server: ServerProcess, size) -> None:
    before = server.metrics()
    headers = {"Content-Type": "application/json"}
    client = server.client()

    def fuzz(case: tuple[str, bytes]) -> None:
        route, content = case
        response = httpx.post(server.url + route, content=content, headers=headers, timeout=120)
        check_answer(client, route, content, response)

    for case in TABLE:
        fuzz = example(case=case)(fuzz)
    settings(
        max_examples=size(300, 3000),
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )(given(case=CASES)(fuzz))()
    assert_clean(server, before)
