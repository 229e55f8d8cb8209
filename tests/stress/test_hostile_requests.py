"""The issue "One request must never take the server down": one test per row of its table (D1-D12,
D10 in test_faults.py), scaled for CI. A hostile request gets a 4xx in OpenAI's error shape (or the
answer the contract gives it), another client's stream keeps going meanwhile, and the server is
clean afterwards."""

import json
import resource
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from ..conftest import DEVICE
from ..server_process import ABORT_ARRIVES_S, ServerProcess
from .checks import (
    FIRST_TOKENS,
    GENERATED,
    MODEL,
    PROMPT_TOKENS,
    assert_clean,
    assert_openai_error,
    check_error_body,
    delta,
    ended,
    finished,
    wait_for_metrics,
)
from .clients import RawRequest, bystander, closed_by_server
from .keeper import ServerKeeper

API_KEY = "hostile-key"
CONTEXT = 2048  # the embedded model's positions; the pool holds eight full contexts
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]
JSON = {"Content-Type": "application/json"}
INT64_MAX = 2**63 - 1


@pytest.fixture(scope="module")
def keeper(tmp_path_factory: pytest.TempPathFactory):
    k = ServerKeeper(
        lambda: ServerProcess(
            tmp_path_factory.mktemp("hostile"),
            "--max-kv-tokens",
            str(8 * CONTEXT),
            "--served-model-name",
            MODEL,
            api_key=API_KEY,
            open_files=1024,  # for D11; the server is to raise its own limit
        )
    )
    yield k
    k.stop()


@pytest.fixture
def server(keeper: ServerKeeper) -> ServerProcess:
    return keeper.get()


def _post_json(
    server: ServerProcess, route: str, body: dict, timeout: float = 60
) -> httpx.Response:
    """`body` as JSON the way Python writes it: lone surrogates as \\ud800 escapes, non-finite
    floats as NaN and Infinity, any integer in full."""
    return server.post(route, content=json.dumps(body).encode(), headers=JSON, timeout=timeout)


def _text(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


# ---------------------------------------------------------------------------------------- D1
@pytest.mark.parametrize(
    ("route", "body"),
    [
        (COMPLETIONS, {"prompt": "hi", "max_tokens": 3, "top_k": 2**63}),
        (CHAT, {"messages": HI, "max_tokens": 3, "top_k": 2**64 - 1}),
        (COMPLETIONS, {"prompt": "hi", "max_tokens": 3, "temperature": 0, "top_k": 2**63}),
    ],
    ids=["completion 2**63", "chat 2**64-1", "greedy in a batch with top_p"],
)
def test_top_k_beyond_int64_is_a_400_and_the_server_keeps_serving(
    server: ServerProcess, route: str, body: dict
) -> None:
    before = server.metrics()
    with bystander(server):  # a top_p stream: the hostile request shares its batches
        assert_openai_error(_post_json(server, route, {"model": MODEL, **body}), 400)
    assert_clean(server, before)


@pytest.mark.parametrize("top_k", [513, INT64_MAX])
def test_top_k_above_the_vocabulary_means_no_top_k(server: ServerProcess, top_k: int) -> None:
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 24, "seed": 5}
    before = server.metrics()
    with bystander(server):
        assert _text(_post_json(server, COMPLETIONS, {**body, "top_k": top_k})) == _text(
            _post_json(server, COMPLETIONS, body)
        )
    assert_clean(server, before)


# ---------------------------------------------------------------------------------------- D2
@pytest.mark.parametrize("temperature", [1e-38, 5e-38, 1e-44, 1e-6])
def test_temperature_below_1e_5_is_greedy_and_the_server_keeps_serving(
    server: ServerProcess, temperature: float
) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 16}
    before = server.metrics()
    with bystander(server):
        tiny = _text(_post_json(server, COMPLETIONS, {**body, "temperature": temperature}))
    assert tiny == _text(_post_json(server, COMPLETIONS, {**body, "temperature": 0}))
    assert_clean(server, before)


# ---------------------------------------------------------------------------------------- D3
@pytest.mark.parametrize("pipelined", [False, True], ids=["alone", "pipelined"])
def test_non_streaming_request_whose_client_left_is_aborted(
    server: ServerProcess, pipelined: bool
) -> None:
    """Pipelined, a second request sent behind it on the connection: uvicorn told only that one
    (queued) that the client left, and the first ran to the end of the context."""
    before = server.metrics()
    # no max_tokens and eos ignored: it would run to the end of the context
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Once"}], "ignore_eos": True}
    behind = {"model": MODEL, "messages": HI, "max_tokens": 1} if pipelined else None
    client = RawRequest(server, CHAT, body, behind=behind)
    with server.scheduler_stopped(until=lambda m: delta(before, m, FIRST_TOKENS) == 1):
        client.leave()  # as curl -m gives up, with nothing received: the answer is not streamed
        time.sleep(ABORT_ARRIVES_S)
    after = wait_for_metrics(server, lambda m: ended(before, m) >= 1, 60)
    assert delta(before, after, finished("abort")) == 1
    assert delta(before, after, finished("length")) == 0
    assert delta(before, after, GENERATED) < CONTEXT - 100
    assert_clean(server, before)


# ---------------------------------------------------------------------------------------- D4
@pytest.mark.parametrize(
    ("route", "body"),
    [
        (COMPLETIONS, {"prompt": "Once", "max_tokens": 1, "n": 100_000}),
        (COMPLETIONS, {"prompt": ["Once"] * 100_000, "max_tokens": 1}),
        (COMPLETIONS, {"prompt": "Once", "max_tokens": 1, "n": 1_000_000}),
        (COMPLETIONS, {"prompt": "Once", "max_tokens": 1, "n": 129}),
        (CHAT, {"messages": HI, "max_tokens": 1, "n": 129}),
        (COMPLETIONS, {"prompt": ["Once"] * 2049, "max_tokens": 1}),
        (COMPLETIONS, {"prompt": [[1, 2]] * 2049, "max_tokens": 1}),
    ],
    ids=[
        "n 100000",
        "100000 prompts",
        "n 1000000",
        "n 129",
        "chat n 129",
        "2049 prompts",
        "2049 id prompts",
    ],
)
def test_n_or_prompts_beyond_the_limits_are_a_400_that_runs_nothing(
    server: ServerProcess, route: str, body: dict
) -> None:
    before = server.metrics()
    with bystander(server, max_tokens=256):
        assert_openai_error(_post_json(server, route, {"model": MODEL, **body}, timeout=30), 400)
    # the other client's tokens, and not one more
    assert delta(before, server.metrics(), GENERATED) == 256
    assert_clean(server, before)


@pytest.mark.parametrize(
    ("body", "choices"),
    [({"prompt": "Once", "n": 128}, 128), ({"prompt": ["Once"] * 2048}, 2048)],
    ids=["n 128", "2048 prompts"],
)
def test_n_128_and_2048_prompts_are_served(server: ServerProcess, body: dict, choices: int) -> None:
    before = server.metrics()
    response = _post_json(server, COMPLETIONS, {"model": MODEL, "max_tokens": 1, **body})
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == choices
    assert response.json()["usage"]["completion_tokens"] == choices
    assert_clean(server, before)


@pytest.mark.skipif(
    DEVICE == "cuda", reason="on the H200 the 128 requests end within the small one's round trip"
)
def test_another_client_is_served_while_a_128_choice_request_runs(start_server) -> None:
    # 128 x 500 tokens fit the pool: nothing is preempted, the small request only shares batches
    server = start_server("--max-kv-tokens", str(128 * 512))
    before = server.metrics()
    body = {
        "model": MODEL,
        "prompt": "Once",
        "n": 128,
        "max_tokens": 500,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", server.url + COMPLETIONS, json=body, timeout=60) as hostile:
        assert hostile.status_code == 200  # every one of its 128 requests has started
        small = server.post(COMPLETIONS, json={"model": MODEL, "prompt": "Once", "max_tokens": 8})
        assert small.json()["usage"]["completion_tokens"] == 8
        # the small request is the only one that ended: the 128 were still running
        with server.scheduler_stopped():
            time.sleep(0.5)  # for outputs on their way to the API server
            assert ended(before, server.metrics()) == 1
    wait_for_metrics(server, lambda m: ended(before, m) == 1 + 128, 120)
    assert_clean(server, before)
    server.stop()


# ---------------------------------------------------------------------------------------- D5
@pytest.mark.parametrize(
    "stop",
    [
        [f"{i:05d}" + "x" * 995 for i in range(10_000)],
        [f"s{i}" for i in range(65)],
        ["x" * 1025],
    ],
    ids=["10000 stops of 1000 chars", "65 stops", "a stop of 1025 chars"],
)
def test_too_many_or_too_long_stop_strings_are_a_400(server: ServerProcess, stop: list) -> None:
    before = server.metrics()
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 64, "stop": stop, "ignore_eos": True}
    with bystander(server, max_tokens=512):
        assert_openai_error(_post_json(server, COMPLETIONS, body, timeout=30), 400)
    assert_clean(server, before)


def test_64_stop_strings_of_1024_chars_are_served(server: ServerProcess) -> None:
    body = {"model": MODEL, "prompt": "Once", "max_tokens": 32, "seed": 1, "ignore_eos": True}
    stop = [f"{i:02d}" + "Ω" * 1022 for i in range(64)]  # text the model never writes
    before = server.metrics()
    assert _text(_post_json(server, COMPLETIONS, {**body, "stop": stop})) == _text(
        _post_json(server, COMPLETIONS, body)
    )
    assert_clean(server, before)


# ---------------------------------------------------------------------------------------- D6
@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_body_over_32_mib_is_a_413(server: ServerProcess, chunked: bool) -> None:
    before = server.metrics()
    body = json.dumps({"model": MODEL, "prompt": "a" * 2**25, "max_tokens": 1}).encode()
    content = (body[i : i + 2**20] for i in range(0, len(body), 2**20)) if chunked else body
    with bystander(server, max_tokens=512):
        response = server.post(COMPLETIONS, content=content, headers=JSON, timeout=60)
    assert_openai_error(response, 413)
    assert_clean(server, before)


def test_a_long_prompt_being_tokenized_holds_back_no_other_request(server: ServerProcess) -> None:
    """12.6 MB of text takes the tokenizer ~8 s on a 2-core CPU: a request sent meanwhile is
    served (it waited for the whole of it), and the long one is then refused as too long."""
    before = server.metrics()
    long = {"model": MODEL, "prompt": "Once upon a time there was a girl. " * 360_000}
    with ThreadPoolExecutor(1) as pool:
        refused = pool.submit(_post_json, server, COMPLETIONS, long)
        time.sleep(1)  # its body sent, read and passed on (~0.3 s here)
        assert not refused.done()
        assert _text(_post_json(server, COMPLETIONS, {"model": MODEL, "prompt": "Once"}))
        assert not refused.done()
        assert_openai_error(refused.result(), 400)
    assert_clean(server, before)


def test_a_client_that_leaves_while_its_long_prompts_are_tokenized_is_aborted(
    server: ServerProcess,
) -> None:
    """Its requests reach the scheduler after the abort: they are aborted then, not run."""
    before = server.metrics()
    prompts = ["Once upon a time there was a girl. " * 100] * 2048  # 7 MB, ~5 s to tokenize
    body = {"model": MODEL, "prompt": prompts, "max_tokens": 64, "ignore_eos": True}
    client = RawRequest(server, COMPLETIONS, body)
    time.sleep(1)  # read and passed on to the tokenizer (~0.3 s here)
    client.leave()
    after = wait_for_metrics(server, lambda m: ended(before, m) >= len(prompts), 120)
    assert delta(before, after, finished("abort")) == len(prompts)
    assert_clean(server, before)


def test_a_client_that_leaves_before_its_long_prompts_are_tokenized_is_never_tokenized(
    server: ServerProcess,
) -> None:
    """Queued behind another long request, its requests end unread: no prompt token of theirs
    is counted (before, all 7 MB were tokenized, ~5 s, and then aborted)."""
    before = server.metrics()
    first = {"model": MODEL, "prompt": "Once upon a time there was a girl. " * 130_000}  # ~3 s
    prompts = ["Once upon a time there was a girl. " * 100] * 2048
    left = {"model": MODEL, "prompt": prompts, "max_tokens": 64, "ignore_eos": True}
    with ThreadPoolExecutor(1) as pool:
        refused = pool.submit(_post_json, server, COMPLETIONS, first)
        time.sleep(0.5)  # the first is read and passed on (~0.2 s here)
        client = RawRequest(server, COMPLETIONS, left)
        time.sleep(0.5)
        assert not refused.done()  # the bulk thread still tokenizes the first
        client.leave()
        assert_openai_error(refused.result(), 400)  # too long for the context
    after = wait_for_metrics(server, lambda m: ended(before, m) >= len(prompts), 120)
    assert delta(before, after, finished("abort")) == len(prompts)
    assert delta(before, after, PROMPT_TOKENS) == 0
    assert_clean(server, before)


def test_tokenize_queries_whose_clients_left_before_their_turn_are_never_run(
    server: ServerProcess,
) -> None:
    """Three long /tokenize queries queued behind a fourth, their clients gone, cost a fifth
    query nothing (before, it waited for all four: ~4 x the first's time)."""
    text = {"prompt": "Once upon a time there was a girl. " * 100_000}  # 3.5 MB
    start = time.monotonic()
    assert server.post("/tokenize", json=text, timeout=60).status_code == 200
    alone = time.monotonic() - start
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(server.post, "/tokenize", json=text, timeout=60)
        time.sleep(0.3)  # read and passed on
        for _ in range(3):
            RawRequest(server, "/tokenize", text).leave()
        time.sleep(0.3)
        start = time.monotonic()
        last = server.post("/tokenize", json={"prompt": "Once " * 60_000}, timeout=60)
        waited = time.monotonic() - start
        assert first.result().status_code == 200 and last.status_code == 200
    assert waited < alone + 0.5 * alone, (waited, alone)


# ---------------------------------------------------------------------------------------- D7
LONE_SURROGATE = "\ud800"


@pytest.mark.parametrize(
    ("route", "body"),
    [
        (COMPLETIONS, {"model": MODEL, "prompt": LONE_SURROGATE}),
        (COMPLETIONS, {"model": MODEL, "prompt": ["hi", "a\udfffb"]}),
        (COMPLETIONS, {"model": LONE_SURROGATE, "prompt": "hi"}),
        (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": LONE_SURROGATE}]}),
        (
            CHAT,
            {
                "model": MODEL,
                "messages": [
                    {"role": "user", "content": [{"type": "text", "text": LONE_SURROGATE}]}
                ],
            },
        ),
        (COMPLETIONS, {"model": MODEL, "prompt": "hi", "stop": [LONE_SURROGATE]}),
        (COMPLETIONS, {"model": MODEL, "prompt": "hi", "user": LONE_SURROGATE}),
    ],
    ids=["prompt", "prompt list", "model", "chat content", "chat text part", "stop", "user"],
)
def test_lone_surrogate_in_any_string_field_is_a_400(
    server: ServerProcess, route: str, body: dict
) -> None:
    before = server.metrics()
    with bystander(server):
        assert_openai_error(_post_json(server, route, {"max_tokens": 3, **body}), 400)
    assert_clean(server, before)


@pytest.mark.parametrize(
    ("route", "body"),
    [
        (COMPLETIONS, {"max_tokens": 2**64}),
        (COMPLETIONS, {"max_tokens": 2**63}),
        (CHAT, {"max_tokens": 2**64}),
        (CHAT, {"max_completion_tokens": 2**63}),
        (COMPLETIONS, {"n": 2**63}),
        (COMPLETIONS, {"seed": 2**63}),
        (COMPLETIONS, {"seed": -(2**63) - 1}),
        (COMPLETIONS, {"stop_token_ids": [2**64]}),
        (COMPLETIONS, {"prompt": [1, 2**64]}),
        (COMPLETIONS, {"prompt": [[1], [-(2**63) - 1]]}),
        (COMPLETIONS, {"top_k": 2**64}),
        (COMPLETIONS, {"logprobs": 2**63}),
        (CHAT, {"logprobs": True, "top_logprobs": 2**63}),
    ],
    ids=[
        "max_tokens 2**64",
        "max_tokens 2**63",
        "chat max_tokens 2**64",
        "max_completion_tokens 2**63",
        "n 2**63",
        "seed 2**63",
        "seed -2**63-1",
        "stop_token_ids 2**64",
        "prompt id 2**64",
        "prompt id -2**63-1",
        "top_k 2**64",
        "logprobs 2**63",
        "top_logprobs 2**63",
    ],
)
def test_integer_beyond_int64_is_a_400(server: ServerProcess, route: str, body: dict) -> None:
    base = {"prompt": "hi"} if route == COMPLETIONS else {"messages": HI}
    before = server.metrics()
    with bystander(server):
        response = _post_json(server, route, {"model": MODEL, "max_tokens": 3, **base, **body})
    assert_openai_error(response, 400)
    assert_clean(server, before)


def test_max_tokens_at_the_int64_bound_is_a_400_that_gives_the_context(
    server: ServerProcess,
) -> None:
    body = {"model": MODEL, "prompt": [100] * 8, "max_tokens": INT64_MAX}
    response = _post_json(server, COMPLETIONS, body)
    assert_openai_error(response, 400)
    assert f"maximum context length is {CONTEXT} tokens" in response.json()["error"]["message"]


@pytest.mark.parametrize(
    "body",
    [
        {"seed": INT64_MAX},
        {"seed": -(2**63)},
        {"stop_token_ids": [INT64_MAX]},
        {"top_k": INT64_MAX},
    ],
    ids=["seed", "seed -2**63", "stop_token_ids", "top_k"],
)
def test_integers_at_the_int64_bounds_are_served(server: ServerProcess, body: dict) -> None:
    # 8 tokens of the context left: max_tokens 8 ends there
    prompt = [100] * (CONTEXT - 8)
    base = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "ignore_eos": True}
    response = _post_json(server, COMPLETIONS, {**base, **body})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 8
    assert response.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    "body",
    [{"logprobs": 21}, {"n": 0}, {"top_k": -2}, {"max_tokens": -(2**63)}],
    ids=["logprobs 21", "n 0", "top_k -2", "max_tokens -2**63"],
)
def test_integer_outside_its_range_is_a_400(server: ServerProcess, body: dict) -> None:
    before = server.metrics()
    response = _post_json(server, COMPLETIONS, {"model": MODEL, "prompt": "hi", **body})
    assert_openai_error(response, 400)
    assert_clean(server, before)


# ---------------------------------------------------------------------------------------- D8
@pytest.mark.parametrize(
    "bad",
    [[1180591620717411303424], [1, 512], []],
    ids=["id 2**70", "id outside the vocabulary", "empty"],
)
def test_request_with_one_bad_prompt_runs_none_of_its_prompts(
    server: ServerProcess, bad: list[int]
) -> None:
    before = server.metrics()
    body = {"model": MODEL, "prompt": [[1, 2, 3], bad], "max_tokens": 1500, "ignore_eos": True}
    assert_openai_error(_post_json(server, COMPLETIONS, body), 400)
    assert_clean(server, before)
    # assert_clean's own small completion made 2 tokens; the good prompt made none
    assert delta(before, server.metrics(), GENERATED) == 2


# ---------------------------------------------------------------------------------------- D9
MALFORMED = {
    "invalid UTF-8": b'{"prompt": "\xff\xfe\xfd", "max_tokens": 1}',
    "nested 10**5 deep": b'{"prompt": ' + b"[" * 10**5 + b"]" * 10**5 + b"}",
    "4301-digit integer": b'{"prompt": "hi", "max_tokens": 1' + b"0" * 4300 + b"}",
    "truncated": b'{"prompt": "hi",',
    "not an object": b'["prompt", "hi"]',
    "null": b"null",
    "empty": b"",
}


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        (CHAT, {"model": MODEL, "messages": [1] * 1_000_000}, "messages.0"),
        (COMPLETIONS, {"model": MODEL, "prompt": [[-1]] * 1_000_000}, "prompt"),
        (COMPLETIONS, {"model": MODEL, "prompt": "hi", "stop": ["a", 1] * 500_000}, "stop"),
        (
            COMPLETIONS,
            {
                "model": MODEL,
                "prompt": "hi",
                "logit_bias": dict.fromkeys(map(str, range(10**6)), "x"),
            },
            "logit_bias",
        ),
        # every unknown name was listed: a 4.4 MB body gave a 3.5 MB error
        (
            COMPLETIONS,
            {"model": MODEL, "prompt": "hi", **dict.fromkeys(map(str, range(300_000)), 1)},
            "0",
        ),
        (
            COMPLETIONS,
            {"model": MODEL, "prompt": "hi", **{f"{i}{'y' * 10_000}": 1 for i in range(100)}},
            "0" + "y" * 63 + "...",
        ),
    ],
    ids=["messages", "prompt ids", "stop", "logit_bias", "unknown fields", "long unknown fields"],
)
def test_a_million_bad_items_are_one_short_400(
    server: ServerProcess, route: str, body: dict, param: str
) -> None:
    """A list's (or logit_bias's) first bad item is its error: a 2 MB body of a million bad
    messages held the API server's event loop 6.3 s, and its 400 was 80 MB (the API process
    peaked at 1.8 GB); a million bad biases took 5.0 s to a 44 MB error."""
    before = server.metrics()
    response = server.post(route, content=json.dumps(body), headers=JSON)
    assert assert_openai_error(response, 400)["param"] == param
    assert len(response.content) < 1024
    assert_clean(server, before)


def test_a_long_body_being_parsed_holds_back_no_other_request(server: ServerProcess) -> None:
    """400,000 messages (12 MB) take ~3 s to validate on a 2-core CPU, and the last one is bad:
    a request sent meanwhile is answered first. On the event loop it waited for all of it."""
    before = server.metrics()
    messages = [{"role": "user", "content": "a"}] * 400_000 + [{"role": "tool", "content": "a"}]
    long = {"model": MODEL, "messages": messages}
    with ThreadPoolExecutor(1) as pool:
        refused = pool.submit(_post_json, server, CHAT, long)
        time.sleep(1)  # its body sent and read (~0.2 s here), and its parse begun
        assert not refused.done()
        assert _text(_post_json(server, COMPLETIONS, {"model": MODEL, "prompt": "Once"}))
        assert not refused.done()
        assert assert_openai_error(refused.result(), 400)["param"] == "messages.400000"
    assert_clean(server, before)


def test_long_bodies_whose_clients_left_before_their_turn_are_never_parsed(
    server: ServerProcess,
) -> None:
    """Three long bodies queued behind a fourth, their clients gone, cost a fifth nothing
    (parsed, it would wait ~4 x the first's time)."""

    def body(messages: int) -> dict:
        bad = [{"role": "tool", "content": "a"}]  # refused once all before it are read
        return {"model": MODEL, "messages": [{"role": "user", "content": "a"}] * messages + bad}

    long, short = body(200_000), body(5_000)  # 6 MB and 150 KB, both for the body thread
    start = time.monotonic()
    assert_openai_error(_post_json(server, CHAT, long), 400)
    alone = time.monotonic() - start
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(_post_json, server, CHAT, long)
        time.sleep(0.3)  # read and passed on
        for _ in range(3):
            RawRequest(server, CHAT, long).leave()
        time.sleep(0.3)
        start = time.monotonic()
        last = _post_json(server, CHAT, short)
        waited = time.monotonic() - start
        assert_openai_error(first.result(), 400)
        assert_openai_error(last, 400)
    assert waited < alone + 0.5 * alone, (waited, alone)


@pytest.mark.parametrize("route", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("content", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_body_is_a_400_in_openai_shape(
    server: ServerProcess, route: str, content: bytes
) -> None:
    before = server.metrics()
    with bystander(server):
        assert_openai_error(server.post(route, content=content, headers=JSON), 400)
    assert_clean(server, before)


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("GET", "/nope", 404),
        ("POST", "/v1/nope", 404),
        ("GET", "/v1/completions", 405),
        ("DELETE", "/v1/models", 405),
        ("POST", "/health", 405),
    ],
)
def test_unknown_route_or_method_is_an_openai_error(
    server: ServerProcess, method: str, path: str, status: int
) -> None:
    response = httpx.request(method, server.url + path, headers=server.headers, timeout=10)
    assert_openai_error(response, status)


# --------------------------------------------------------------------------------------- D11
@pytest.fixture
def many_open_files() -> Iterator[None]:
    """The test's own side of a flood of connections: its soft open-file limit raised."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_flood_of_idle_connections_leaves_the_server_reachable(
    server: ServerProcess, many_open_files
) -> None:
    before = server.metrics()
    log_size = server.log_path.stat().st_size
    flood = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(1100)]
    try:
        small = {"model": MODEL, "prompt": "Once", "max_tokens": 4}
        assert server.post(COMPLETIONS, json=small, timeout=10).status_code == 200
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
        log = server.log_path.read_bytes()[log_size:]
        assert b"Too many open files" not in log and len(log) < 64 * 1024, log[-2000:]
        # idle connections are closed after --timeout-keep-alive (default 5 s)
        assert closed_by_server(flood, timeout=5 + 10)
    finally:
        for s in flood:
            s.close()
    limits = Path(f"/proc/{server.child('api-server')}/limits").read_text()
    line = next(line for line in limits.splitlines() if line.startswith("Max open files"))
    assert line.split()[3] == line.split()[4]  # the server raised its soft limit to the hard one
    assert_clean(server, before)


def test_an_idle_keep_alive_connection_is_closed_after_the_timeout(server: ServerProcess) -> None:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    with sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        assert closed_by_server([sock], timeout=5 + 5)


@pytest.mark.parametrize(
    "sent",
    [b"P", f"POST {COMPLETIONS} HTTP/1.1\r\nHost: 127.0.0.1\r\n".encode()],
    ids=["a byte", "half the headers"],
)
def test_a_request_whose_headers_stall_is_closed_after_the_timeout(
    server: ServerProcess, sent: bytes
) -> None:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    with sock:
        sock.sendall(sent)
        assert closed_by_server([sock], timeout=5 + 5)


def test_a_request_whose_body_stalls_gets_a_408_and_is_closed(server: ServerProcess) -> None:
    head = (
        f"POST {COMPLETIONS} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {API_KEY}\r\n"
        "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    )
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=5 + 5)
    with sock:
        sock.sendall(head.encode() + b'{"model": ')
        assert sock.recv(65536).startswith(b"HTTP/1.1 408")
        assert closed_by_server([sock], timeout=5 + 5)
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


@pytest.mark.parametrize(
    ("route", "length", "key", "status"),
    [
        (COMPLETIONS, 1000, False, b"401"),
        ("/v1/responses", 1000, True, b"404"),
        (COMPLETIONS, 10**9, True, b"413"),
    ],
    ids=["401", "404", "413"],
)
def test_a_body_that_goes_on_after_its_answer_then_stalls_is_closed(
    server: ServerProcess, route: str, length: int, key: bool, status: bytes
) -> None:
    """Answered before its body came (no key, a route not served, a Content-Length over the
    limit), a request whose body goes on arriving, then stops, is closed after the timeout as an
    idle connection: the next bytes stopped the keep-alive timer, and the connection was held
    for ever, key or not (300 of them held 300 file descriptors)."""
    auth = f"Authorization: Bearer {API_KEY}\r\n" if key else ""
    head = (
        f"POST {route} HTTP/1.1\r\nHost: 127.0.0.1\r\n{auth}"
        f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
    )
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=5 + 5)
    with sock:
        sock.sendall(head.encode() + b"{")
        assert sock.recv(65536).startswith(b"HTTP/1.1 " + status)
        sock.sendall(b'"a')
        assert closed_by_server([sock], timeout=5 + 5)


def test_clients_that_leave_mid_body_leave_no_traceback(server: ServerProcess) -> None:
    head = (
        f"POST {COMPLETIONS} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {API_KEY}\r\n"
        "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    )
    log_size = server.log_path.stat().st_size
    for _ in range(20):
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(head.encode() + b'{"model": ')
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    time.sleep(1)  # the last ones' log lines
    log = server.log_path.read_bytes()[log_size:]
    assert b"Traceback" not in log and len(log) < 20 * 512, log[-2000:]


def _raw_answer(server: ServerProcess, *sent: bytes) -> bytes:
    """What the server answers the pieces `sent` (0.3 s apart) with, up to its closing the
    connection."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        for i, piece in enumerate(sent):
            time.sleep(0.3 if i else 0)
            sock.sendall(piece)
        answer = b""
        while data := sock.recv(65536):
            answer += data
    return answer


def _assert_431(answer: bytes) -> None:
    status, _, body = answer.partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 431"), answer[:300]
    check_error_body(json.loads(body), repr(answer[:300]))


@pytest.mark.parametrize(
    "sent",
    [
        b"GARBAGE\r\n\r\n",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",  # a TLS ClientHello's start
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
        b"Content-Length: 3\r\n\r\n{}",
    ],
    ids=["garbage", "TLS", "two lengths"],
)
def test_what_http_cannot_parse_is_a_400_in_openai_shape(
    server: ServerProcess, sent: bytes
) -> None:
    """It was plain text ("Invalid HTTP request received.")."""
    status, _, body = _raw_answer(server, sent).partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 400"), status
    check_error_body(json.loads(body), repr(body))
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_a_long_url_writes_a_short_access_log_line(server: ServerProcess) -> None:
    """50 requests of a 60 KB URL without the key grew the log by 3.0 MB."""
    log_size = server.log_path.stat().st_size
    for _ in range(50):
        assert httpx.get(f"{server.url}/v1/models?{'q' * 60_000}", timeout=10).status_code == 401
    time.sleep(0.5)  # the last lines
    assert server.log_path.stat().st_size - log_size < 50 * 512


FILLER = "x" * (70 << 10)
TRAILED = (  # a chunked body, its last chunk sent: its trailers come next
    f"POST /tokenize HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {API_KEY}\r\n"
    'Transfer-Encoding: chunked\r\nContent-Type: application/json\r\n\r\n10\r\n{"prompt": "hi"}'
    "\r\n0\r\n"
)


@pytest.mark.parametrize(
    "pieces",
    [
        [f"GET /health?{FILLER} HTTP/1.1\r\nHost: 127.0.0.1\r\n"],  # never ended
        [f"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Filler: {FILLER}\r\n"],
        [TRAILED, f"X-Trailer: {FILLER}\r\n"],
    ],
    ids=["request line", "header", "trailer"],
)
def test_headers_over_64_kib_are_a_431_and_the_connection_closed(
    server: ServerProcess, pieces: list[str]
) -> None:
    _assert_431(_raw_answer(server, *(piece.encode() for piece in pieces)))
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_a_pipelined_request_after_a_long_body_is_no_431(server: ServerProcess) -> None:
    """The first request's body is no part of the second's headers, though one read holds both."""
    body = json.dumps({"prompt": "Once upon a time " * 6000}).encode()  # 102 KB
    first = (
        f"POST /tokenize HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {API_KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    second = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    answer = _raw_answer(server, first + second[:20])  # the second's end never comes ...
    assert answer.startswith(b"HTTP/1.1 200"), answer[:300]  # ... and it times out, unanswered
    assert b"431" not in answer
    # a read that ends the first's headers, holds its body and begins the second's
    answer = _raw_answer(server, first[:40], first[40:] + second[:30], second[30:])
    assert answer.startswith(b"HTTP/1.1 200") and answer.count(b"HTTP/1.1 200") == 2, answer[:300]


def test_headers_under_64_kib_are_served(server: ServerProcess) -> None:
    headers = {"X-Filler": "x" * (60 << 10)}
    assert httpx.get(server.url + "/health", headers=headers, timeout=10).status_code == 200


# --------------------------------------------------------------------------------------- D12
@pytest.mark.parametrize("value", ["Infinity", "-Infinity", "NaN", "1e999"])
def test_non_finite_temperature_is_a_400(server: ServerProcess, value: str) -> None:
    content = f'{{"model": "{MODEL}", "prompt": "hi", "max_tokens": 3, "temperature": {value}}}'
    before = server.metrics()
    with bystander(server):
        assert_openai_error(server.post(COMPLETIONS, content=content.encode(), headers=JSON), 400)
    assert_clean(server, before)


def test_authorization_scheme_is_case_insensitive(server: ServerProcess) -> None:
    for scheme in ("bearer", "BEARER", "Bearer"):
        headers = {"Authorization": f"{scheme} {API_KEY}"}
        assert httpx.get(server.url + "/v1/models", headers=headers).status_code == 200, scheme
        wrong = {"Authorization": f"{scheme} not-the-key"}
        assert_openai_error(httpx.get(server.url + "/v1/models", headers=wrong), 401)


@pytest.mark.parametrize("path", ["/docs", "/openapi.json"])
def test_docs_and_openapi_need_the_api_key(server: ServerProcess, path: str) -> None:
    assert_openai_error(httpx.get(server.url + path), 401)
    assert httpx.get(server.url + path, headers=server.headers).status_code == 200
    assert httpx.get(server.url + "/health").status_code == 200  # never behind the key


def test_api_key_from_the_environment_is_enforced_and_on_no_command_line(start_server) -> None:
    key = "env-secret-5b1f0c"
    server = start_server("--max-kv-tokens", "2048", api_key=key, env={"MINISGL_API_KEY": key})
    assert_openai_error(httpx.get(server.url + "/v1/models"), 401)
    assert httpx.get(server.url + "/v1/models", headers=server.headers).status_code == 200
    for pid in [server.proc.pid, *server.children]:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            assert key.encode() not in f.read(), f"the key is on the command line of {pid}"
    server.stop()


def test_kill_9_of_the_launcher_leaves_no_process_and_no_ipc_file(start_server) -> None:
    server = start_server("--max-kv-tokens", "2048")
    on_disk = server.ipc_files()
    server.proc.kill()
    assert server.wait_exit(timeout=10) == -9  # every child gone, no ipc file left
    assert not on_disk, "ipc files on disk while serving (abstract sockets have none)"
