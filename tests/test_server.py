"""The OpenAI-compatible server, as real processes (`python -m minisgl`) driven by real clients
(the official `openai` package and httpx), on the embedded stories260K model."""

import asyncio
import json
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import openai
import pytest

from minisgl import LLM, SamplingParams
from minisgl.server.cli import build_parser, parse_args
from minisgl.utils import DEFAULT_MODEL_PATH

from .conftest import tokenizer_library_imports_torch
from .server_process import ABORT_ARRIVES_S, ServerProcess, process_name, wait_for
from .stress.checks import assert_clean, ended

API_KEY = "test-key"
MODEL = "stories"
PROMPT = "Once upon a time, there was a little"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    s = ServerProcess(
        tmp_path_factory.mktemp("server"),
        "--max-kv-tokens",
        "16384",
        "--served-model-name",
        MODEL,
        api_key=API_KEY,
    )
    yield s
    s.stop(signal.SIGINT)


def test_console_script_help_explains_every_option() -> None:
    """Every option the parser defines has an entry in --help, with words after it."""
    flags = [
        option
        for action in build_parser()._actions
        for option in action.option_strings
        if option.startswith("--") and option != "--help"
    ]
    assert "--max-model-len" in flags and len(flags) > 30
    script = Path(sys.executable).parent / "minisgl"
    out = subprocess.run([script, "--help"], capture_output=True, text=True, check=True).stdout
    for flag in flags:
        entry = re.search(rf"^  (\S+, )*{flag}\b.*(\n {{10,}}.*)*", out, re.MULTILINE)
        assert entry is not None, flag
        assert re.search(r"[a-z]+ [a-z]+", entry.group(0).replace(flag, "")), entry.group(0)


def test_models_lists_the_served_model_and_health_is_ok(server: ServerProcess) -> None:
    models = server.client().models.list().data
    assert [m.id for m in models] == [MODEL]
    assert httpx.get(server.url + "/health").status_code == 200


def test_greedy_completion_equals_the_offline_engine(
    server: ServerProcess, stories_llm: LLM
) -> None:
    want = stories_llm.generate(
        PROMPT, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False
    )[0]
    got = server.client().completions.create(
        model=MODEL, prompt=PROMPT, temperature=0, max_tokens=24
    )
    assert got.choices[0].text == want["text"]
    assert got.choices[0].finish_reason == want["finish_reason"]


def test_streamed_text_equals_non_streamed_text(server: ServerProcess) -> None:
    client = server.client()
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=40, seed=7, temperature=1.0)
    whole = client.completions.create(**kwargs).choices[0]
    pieces = list(client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in pieces) == whole.text
    assert pieces[-1].choices[0].finish_reason == whole.finish_reason == "length"


def test_n_choices_use_distinct_seeds_derived_from_the_seed(server: ServerProcess) -> None:
    client = server.client()
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=30, seed=3, temperature=1.0)
    two = client.completions.create(n=2, **kwargs)
    one = client.completions.create(n=1, **kwargs)
    assert [c.index for c in two.choices] == [0, 1]
    assert two.choices[0].text == one.choices[0].text
    assert two.choices[0].text != two.choices[1].text
    assert two.usage.completion_tokens == 60
    assert two.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counts once

    streamed = ["", ""]
    for chunk in client.completions.create(n=2, stream=True, **kwargs):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == [c.text for c in two.choices]


def test_batch_of_prompts_gives_one_choice_per_prompt(server: ServerProcess) -> None:
    client = server.client()
    prompts = [PROMPT, "The dog"]
    got = client.completions.create(model=MODEL, prompt=prompts, temperature=0, max_tokens=8)
    alone = [
        client.completions.create(model=MODEL, prompt=p, temperature=0, max_tokens=8)
        for p in prompts
    ]
    assert [c.text for c in got.choices] == [a.choices[0].text for a in alone]
    assert got.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)


def test_stop_string_ends_the_text_before_it(server: ServerProcess) -> None:
    client = server.client()
    kwargs = dict(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=30)
    full = client.completions.create(**kwargs).choices[0].text
    stop = full.split()[4]
    cut = client.completions.create(stop=[stop], **kwargs).choices[0]
    assert cut.text == full[: full.index(stop)]
    assert cut.finish_reason == "stop"
    streamed = list(client.completions.create(stop=stop, stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in streamed) == cut.text


def test_finish_reason_is_length_at_max_tokens_and_stop_at_a_stop_token(
    server: ServerProcess, stories_llm: LLM
) -> None:
    ids = stories_llm.generate(
        PROMPT, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False
    )[0]["token_ids"]
    client = server.client()
    kwargs = dict(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=10)
    length = client.completions.create(**kwargs)
    assert length.choices[0].finish_reason == "length"
    assert length.usage.completion_tokens == 10
    stop = client.completions.create(extra_body={"stop_token_ids": [ids[5]]}, **kwargs)
    assert stop.choices[0].finish_reason == "stop"
    assert stop.usage.completion_tokens == ids.index(ids[5]) + 1
    # vLLM's stop_reason: the stop token, and None at the length limit or the tokenizer's eos
    assert stop.choices[0].stop_reason == ids[5] and length.choices[0].stop_reason is None
    story = client.completions.create(
        model=MODEL, prompt="Once upon a time", temperature=0, max_tokens=500
    )  # the embedded model's story ends on <s> after 342 tokens (test_models.py)
    assert story.choices[0].finish_reason == "stop" and story.usage.completion_tokens == 342
    assert story.choices[0].stop_reason == 1  # generation_config's second eos: a stop token
    # offline, the same reasons
    offline = stories_llm.generate(
        [PROMPT, PROMPT, "Once upon a time"],
        [SamplingParams(temperature=0, max_tokens=10),
         SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[ids[5]]),
         SamplingParams(temperature=0, max_tokens=500)],
        use_tqdm=False,
    )  # fmt: skip
    assert [r["stop_reason"] for r in offline] == [None, ids[5], 1]
    assert offline[2]["finish_reason"] == "stop"


def test_usage_counts_prompt_and_completion_tokens(server: ServerProcess, stories_llm: LLM) -> None:
    got = server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=12)
    prompt_tokens = len(stories_llm.tokenizer.encode(PROMPT))
    assert got.usage.prompt_tokens == prompt_tokens
    assert got.usage.completion_tokens == 12
    assert got.usage.total_tokens == prompt_tokens + 12


def test_stream_options_include_usage_adds_a_final_usage_chunk(server: ServerProcess) -> None:
    chunks = list(
        server.client().completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 6
    assert all(c.usage is None for c in chunks[:-1])


def test_logprobs_give_the_top_tokens_of_each_step(server: ServerProcess) -> None:
    got = server.client().completions.create(
        model=MODEL, prompt=PROMPT, temperature=0, max_tokens=8, logprobs=3
    )
    lp = got.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    assert "".join(lp.tokens) == got.choices[0].text
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 3 and logprob <= 0
        assert top[token] == pytest.approx(max(top.values()))  # greedy takes the top token
    assert lp.text_offset == sorted(lp.text_offset)


def test_logprobs_0_give_the_sampled_token_as_its_step_top(server: ServerProcess) -> None:
    """As in OpenAI's legacy completions: the sampled token is among each step's top_logprobs,
    so logprobs=0 gives it alone."""
    got = server.client().completions.create(
        model=MODEL, prompt=PROMPT, temperature=1.5, seed=3, max_tokens=8, logprobs=0
    )
    lp = got.choices[0].logprobs
    assert lp.top_logprobs == [
        {token: logprob} for token, logprob in zip(lp.tokens, lp.token_logprobs, strict=True)
    ]


def test_streamed_logprobs_equal_the_whole_reply_while_a_stop_string_holds_text_back(
    server: ServerProcess,
) -> None:
    fields = dict(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=12, logprobs=1)
    fields["stop"] = ["qqqqqqqq"]  # never matched: each piece's last 7 characters wait
    whole = server.client().completions.create(**fields).choices[0]
    chunks = [c.choices[0] for c in server.client().completions.create(stream=True, **fields)]
    pieces = [c.logprobs for c in chunks if c.logprobs]
    assert [t for lp in pieces for t in lp.tokens] == whole.logprobs.tokens
    assert [o for lp in pieces for o in lp.text_offset] == whole.logprobs.text_offset
    # the second request reads the prompt's KV from the prefix cache: the last bits may differ
    streamed_logprobs = [p for lp in pieces for p in lp.token_logprobs]
    assert streamed_logprobs == pytest.approx(whole.logprobs.token_logprobs, abs=1e-4)
    assert whole.logprobs.text_offset == [
        sum(map(len, whole.logprobs.tokens[:i])) for i in range(len(whole.logprobs.tokens))
    ]


BAD_BODIES = {
    "wrong type: temperature": {"temperature": "hot"},
    "wrong type: max_tokens": {"max_tokens": "ten"},
    "wrong type: n": {"n": True},
    "wrong type: prompt": {"prompt": 5},
    "bad value: temperature": {"temperature": -1},
    "bad value: top_p": {"top_p": 0},
    "bad value: max_tokens": {"max_tokens": 0},
    "bad value: n": {"n": 0},
    "bad value: logprobs": {"logprobs": 50},
    "bad value: stop": {"stop": [""]},
    "bad value: seed": {"seed": 2**64},
    "empty prompt list": {"prompt": []},
    "token id outside the vocabulary": {"prompt": [1, 100000]},
    "over-long prompt": {"prompt": "the cat sat " * 1000},
    "over-long prompt, streamed": {"prompt": "the cat sat " * 1000, "stream": True},
    "bad value: echo with logprobs": {"echo": True, "logprobs": 21},
    "bad value: penalty": {"presence_penalty": 2.5},
    "bad value: repetition_penalty": {"repetition_penalty": 0},
    "bad value: min_tokens above max_tokens": {"min_tokens": 20, "max_tokens": 10},
    "bad value: min_tokens with echo and max_tokens 0": {
        "echo": True,
        "max_tokens": 0,
        "min_tokens": 1,
    },
    "bad value: logit_bias key": {"logit_bias": {"dog": 1}},
    "bad value: logit_bias key with a space": {"logit_bias": {" 5": 1}},
    "bad value: logit_bias key with an underscore": {"logit_bias": {"5_0": 1}},
    "bad value: logit_bias key in other digits": {"logit_bias": {"٥": 1}},
    "bad value: logit_bias id twice": {"logit_bias": {"5": 1, "05": -1}},
    "bad value: logit_bias token": {"logit_bias": {"100000": 1}},
    "bad value: logit_bias value": {"logit_bias": {"5": 101}},
    "bad value: response_format json_schema without one": {
        "response_format": {"type": "json_schema"}
    },
    "two output constraints": {"guided_regex": "a", "structured_outputs": {"choice": ["a"]}},
    "one constraint twice": {"guided_regex": "a", "structured_outputs": {"regex": "b"}},
}


@pytest.mark.parametrize("override", BAD_BODIES.values(), ids=BAD_BODIES.keys())
def test_bad_request_is_a_400_and_the_next_request_is_served(
    server: ServerProcess, override: dict
) -> None:
    before = server.metrics()
    response = server.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, **override})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert_clean(server, before, MODEL)  # served next, and no page is held


def test_malformed_json_is_a_400(server: ServerProcess) -> None:
    response = server.post(
        "/v1/completions", content=b'{"prompt": "x",', headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 400
    assert "error" in response.json()


def test_openai_client_sees_bad_request_errors(server: ServerProcess) -> None:
    with pytest.raises(openai.BadRequestError, match="context length"):
        server.client().completions.create(model=MODEL, prompt="the cat sat " * 1000)


@pytest.mark.parametrize("key", [None, "wrong-key"])
def test_wrong_or_missing_api_key_is_a_401(server: ServerProcess, key: str | None) -> None:
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    response = httpx.post(server.url + "/v1/completions", json={"prompt": PROMPT}, headers=headers)
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong").models.list()
    assert httpx.get(server.url + "/health").status_code == 200  # not behind the key


def test_browser_pages_may_call_the_api_as_in_vllm(server: ServerProcess) -> None:
    """CORS: a preflight (which carries no key) is answered, and a call from a page may read
    its answer; any origin by default, as vLLM's --allowed-origins."""
    origin = {"Origin": "https://chat.example"}
    preflight = httpx.options(
        server.url + "/v1/completions",
        headers={**origin, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"},
    )  # fmt: skip
    assert preflight.status_code == 200, preflight.text
    assert preflight.headers["access-control-allow-origin"] == "*"
    assert "POST" in preflight.headers["access-control-allow-methods"]
    call = httpx.get(server.url + "/v1/models", headers={**origin, **server.headers})
    assert call.status_code == 200 and call.headers["access-control-allow-origin"] == "*"
    assert httpx.get(server.url + "/v1/models", headers=origin).status_code == 401  # still


@pytest.mark.parametrize(
    ("flag", "origins"), [('["https://a.example"]', ("https://a.example",)), ("[]", ())]
)
def test_allowed_origins_take_vllms_json_list(flag: str, origins: tuple[str, ...]) -> None:
    assert parse_args(["--allowed-origins", flag]).allowed_origins == origins


@pytest.mark.parametrize("flag", ["https://a.example", '"*"', "[1]"])
def test_allowed_origins_that_are_no_json_list_are_refused(flag: str) -> None:
    with pytest.raises(ValueError, match="--allowed-origins must be a JSON list"):
        parse_args(["--allowed-origins", flag])


def test_the_routers_cors_cannot_refuse_every_origin() -> None:
    with pytest.raises(ValueError, match="vllm-router cannot refuse every origin"):
        parse_args(["--dp", "2", "--allowed-origins", "[]"])


@pytest.mark.parametrize("stream", [False, True])
def test_a_clients_request_id_names_the_reply(server: ServerProcess, stream: bool) -> None:
    """As vLLM's: the reply's id is made of the client's X-Request-Id, which comes back too."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "stream": stream}
    headers = {**server.headers, "X-Request-Id": "trace-42"}
    r = httpx.post(server.url + "/v1/completions", json=body, headers=headers)
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-42"
    first = r.text.split("\n")[0].removeprefix("data: ") if stream else r.text
    assert json.loads(first)["id"] == "cmpl-trace-42"
    plain = httpx.post(server.url + "/v1/completions", json=body, headers=server.headers)
    assert plain.headers["x-request-id"] and plain.headers["x-request-id"] != "trace-42"


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ({"model": MODEL, "prompt": PROMPT, "max_tokens": 10**6}, 400),  # the tokenizer's
        ({"model": MODEL, "prompt": PROMPT, "temperature": -1}, 400),  # the API server's
        ({"model": "gpt-5", "prompt": PROMPT}, 404),
    ],
    ids=["after submit", "before submit", "unknown model"],
)
def test_an_error_answer_carries_the_request_id_too(
    server: ServerProcess, body: dict, status: int
) -> None:
    """A refused request can be matched to its line in the request log (it had no header)."""
    headers = {**server.headers, "X-Request-Id": "trace-43"}
    r = httpx.post(server.url + "/v1/completions", json=body, headers=headers)
    assert r.status_code == status and r.headers["x-request-id"] == "trace-43", r.text
    plain = httpx.post(server.url + "/v1/completions", json=body, headers=server.headers)
    assert plain.status_code == status and len(plain.headers["x-request-id"]) == 32


def test_unknown_model_is_a_404(server: ServerProcess) -> None:
    with pytest.raises(openai.NotFoundError):
        server.client().completions.create(model="gpt-5", prompt=PROMPT)


def test_64_concurrent_streams_each_equal_the_non_streamed_text_for_the_same_seed(
    server: ServerProcess,
) -> None:
    """64 seeded streams at once (their text batched per step into as few events as arrived),
    then the same 64 requests whole: each stream's text and token count are the other's."""

    async def one(client: openai.AsyncOpenAI, i: int, stream: bool) -> tuple[str, int]:
        kwargs = dict(
            model=MODEL, prompt=f"{PROMPT} {i}", max_tokens=10 + i % 23, seed=i, temperature=1.0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        if not stream:
            whole = await client.completions.create(**kwargs)
            return whole.choices[0].text, whole.usage.completion_tokens
        chunks = await client.completions.create(
            stream=True, stream_options={"include_usage": True}, **kwargs
        )
        text, usage = "", None
        async for chunk in chunks:
            if chunk.choices:
                text += chunk.choices[0].text
            usage = chunk.usage or usage
        return text, usage.completion_tokens

    async def run_all(stream: bool) -> list[tuple[str, int]]:
        client = server.async_client()
        return await asyncio.gather(*(one(client, i, stream) for i in range(64)))

    streamed, whole = asyncio.run(run_all(True)), asyncio.run(run_all(False))
    assert [n for _, n in streamed] == [10 + i % 23 for i in range(64)]
    assert streamed == whole
    assert len({text for text, _ in streamed}) == 64


_KILLED_CLIENT_MAX_TOKENS = 1500
_KILLED_CLIENT_PROMPT = "Once upon a time, " * 60
_KILLED_CLIENT = textwrap.dedent(
    """
    import sys, httpx
    url, key, max_tokens, prompt = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                print("streaming", flush=True)
    """
)


def test_killed_client_aborts_its_request_and_frees_its_pages(server: ServerProcess) -> None:
    before = server.metrics()
    aborted = 'minisgl_requests_total{finish_reason="abort"}'
    client = subprocess.Popen(
        [
            sys.executable,
            "-c",
            _KILLED_CLIENT,
            server.url,
            API_KEY,
            str(_KILLED_CLIENT_MAX_TOKENS),
            _KILLED_CLIENT_PROMPT,
        ],
        stdout=subprocess.PIPE,
    )
    assert client.stdout is not None
    assert client.stdout.readline() == b"streaming\n"
    with server.scheduler_stopped(until=lambda m: m["minisgl_running_requests"] == 1) as running:
        # its prompt's pages count as its own, though the prefix cache holds them too (they
        # counted as cached: a full pool read as nearly empty)
        prompt = server.post("/tokenize", json={"prompt": _KILLED_CLIENT_PROMPT}).json()["count"]
        assert running['minisgl_kv_pages{state="request"}'] >= prompt
        client.kill()
        client.wait()
        time.sleep(ABORT_ARRIVES_S)

    wait_for(lambda: server.metrics().get(aborted, 0) == before.get(aborted, 0) + 1)
    wait_for(lambda: server.metrics()["minisgl_running_requests"] == 0)
    after = server.metrics()
    assert after['minisgl_kv_pages{state="request"}'] == 0
    assert after["minisgl_kv_integrity_checks_total"] > before["minisgl_kv_integrity_checks_total"]
    assert after["minisgl_kv_integrity_failures_total"] == 0
    # the stream was cut before its max_tokens
    assert (
        after["minisgl_generation_tokens_total"] - before["minisgl_generation_tokens_total"]
        < _KILLED_CLIENT_MAX_TOKENS
    )


def test_metrics_report_requests_tokens_latency_and_kv_pages(server: ServerProcess) -> None:
    for _ in range(2):  # the second finds the first's prompt in the prefix cache
        server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=4)
    m = server.metrics()
    assert m['minisgl_requests_total{finish_reason="length"}'] >= 1
    assert m["minisgl_prompt_tokens_total"] > 0 and m["minisgl_generation_tokens_total"] >= 4
    assert m["minisgl_time_to_first_token_seconds_count"] >= 1
    assert m["minisgl_inter_token_latency_seconds_count"] >= 3
    assert m["minisgl_queued_requests"] == 0
    pages = [m[f'minisgl_kv_pages{{state="{s}"}}'] for s in ("request", "cached", "free")]
    assert sum(pages) == 16384 and pages[1] > 0
    assert m["minisgl_kv_cache_usage"] == pages[0] / sum(pages)
    assert 0 < m["minisgl_prefix_cache_hit_rate"] < 1
    assert m["minisgl_e2e_request_latency_seconds_count"] >= 1
    assert m['minisgl_e2e_request_latency_seconds_bucket{le="2400.0"}'] >= 1
    kinds = dict(
        line.split()[2:4]
        for line in httpx.get(server.url + "/metrics").text.splitlines()
        if line.startswith("# TYPE")
    )
    assert (
        kinds["minisgl_preemptions_total"]
        == kinds["minisgl_kv_integrity_checks_total"]
        == "counter"
    )
    assert m["minisgl_preemptions_total"] >= 0


def test_only_the_scheduler_process_loads_torch(server: ServerProcess) -> None:
    """The API server and the tokenizer start in a second, without torch: read off the libraries
    each running child has mapped."""
    maps = {process_name(pid): Path(f"/proc/{pid}/maps").read_text() for pid in server.children}
    assert {"api-server", "tokenizer", "scheduler-0"} <= set(maps)
    assert "libtorch" in maps["scheduler-0"]
    assert "libtorch" not in maps["api-server"]
    # an older transformers imports torch for its tokenizers, through no import of ours
    assert "libtorch" not in maps["tokenizer"] or tokenizer_library_imports_torch()


def test_a_stop_string_in_the_first_token_ends_the_reply_there(server: ServerProcess) -> None:
    """The embedded model continues "Once upon a time," with " there was": the stop string is
    found in the text as it is decoded, in context, and nothing past it is counted."""
    kwargs = dict(model=MODEL, prompt="Once upon a time,", temperature=0, max_tokens=12)
    for stream in (False, True):
        got = server.client().completions.create(stop=[" there"], stream=stream, **kwargs)
        chunks = list(got) if stream else [got]
        assert "".join(c.choices[0].text for c in chunks if c.choices) == ""
        assert chunks[-1].choices[0].finish_reason == "stop"
    done = server.client().completions.create(stop=" was", **kwargs)
    assert done.choices[0].text == " there" and done.usage.completion_tokens == 2


def test_add_special_tokens_gives_or_leaves_out_the_bos(server: ServerProcess) -> None:
    """vLLM's field: the embedded model's tokenizer adds a BOS to a text (the default for a
    completion), and its chat template writes one itself (none added: the default for a chat)."""
    chat = {"messages": [{"role": "user", "content": "Hi"}]}
    counts = {}
    for route, body in (("/v1/completions", {"prompt": PROMPT}), ("/v1/chat/completions", chat)):
        for special in (True, False):
            fields = {"model": MODEL, "max_tokens": 1, "add_special_tokens": special, **body}
            reply = server.post(route, json=fields).json()
            counts[route, special] = reply["usage"]["prompt_tokens"]
            tokens = server.post("/tokenize", json={**body, "add_special_tokens": special}).json()
            assert tokens["count"] == counts[route, special]
            assert (tokens["tokens"][:2] == [1, 1]) == (
                special and route.endswith("chat/completions")
            )
    assert counts["/v1/completions", True] == counts["/v1/completions", False] + 1
    assert counts["/v1/chat/completions", True] == counts["/v1/chat/completions", False] + 1


def test_a_max_tokens_that_cannot_fit_is_a_400_with_the_numbers(server: ServerProcess) -> None:
    """The embedded model's context is 2,048 tokens: an explicit max_tokens past it is refused
    with vLLM's words, for completions and chat alike; omitted, chat's runs to the end."""
    prompt_tokens = server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=1)
    n = prompt_tokens.usage.prompt_tokens
    before = server.metrics()
    for route, body in (
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 100000, "n": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                  "max_completion_tokens": 100000}),
    ):  # fmt: skip
        response = server.post(route, json={"model": MODEL, **body})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert "maximum context length is 2048 tokens. However, you requested" in error["message"]
        assert error["param"] == next(name for name in body if name.startswith("max_"))
    # refused before they were queued: no request ended (each choice counted as an error)
    assert ended(before, server.metrics()) == 0
    fits = server.post(
        "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2048 - n}
    )
    assert fits.status_code == 200


def test_completions_default_max_tokens_is_bounded_by_the_context(server: ServerProcess) -> None:
    """As vLLM's: 16 tokens when the prompt leaves room, else the room it leaves (given, 16 is a
    400)."""
    long = {"model": MODEL, "prompt": [5] * 2040, "temperature": 0, "ignore_eos": True}
    bounded = server.post("/v1/completions", json=long)
    assert bounded.status_code == 200, bounded.text
    assert bounded.json()["usage"]["completion_tokens"] == 8
    assert bounded.json()["choices"][0]["finish_reason"] == "length"
    assert server.post("/v1/completions", json={**long, "max_tokens": 16}).status_code == 400


def test_chat_min_tokens_past_the_room_left_is_a_400(server: ServerProcess) -> None:
    """A chat's omitted max_tokens is the rest of the context: a min_tokens past it cannot be
    met (it ended at the context's end with a 200 before), as for completions and in vLLM."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "temperature": 0}
    refused = server.post("/v1/chat/completions", json={**chat, "min_tokens": 3000})
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "min_tokens"
    assert "tokens that the prompt leaves in this model's context of 2048" in refused.text
    served = server.post("/v1/chat/completions", json={**chat, "min_tokens": 5, "max_tokens": 8})
    assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] >= 5


def test_tokenize_detokenize_version_and_a_model_by_id(
    server: ServerProcess, stories_llm: LLM
) -> None:
    post = lambda path, body: server.post(path, json=body)
    ids = stories_llm.tokenizer.encode(PROMPT)
    got = post("/tokenize", {"model": MODEL, "prompt": PROMPT}).json()
    assert got == {"count": len(ids), "max_model_len": 2048, "tokens": ids}
    chat = post("/tokenize", {"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["tokens"] == stories_llm.tokenizer.encode(
        stories_llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
        ),
        add_special_tokens=False,
    )
    assert post("/detokenize", {"tokens": ids}).json() == {
        "prompt": stories_llm.tokenizer.decode(ids)
    }
    assert post("/detokenize", {"tokens": [10**6]}).status_code == 400
    assert post("/tokenize", {"prompt": "x", "messages": []}).status_code == 400
    headers = server.headers
    assert httpx.get(server.url + "/version", headers=headers).json()["version"]
    card = httpx.get(server.url + f"/v1/models/{MODEL}", headers=headers).json()
    assert card["id"] == MODEL and card["max_model_len"] == 2048
    assert card["root"] == str(DEFAULT_MODEL_PATH) and card["parent"] is None  # as vLLM's card
    missing = httpx.get(server.url + "/v1/models/gpt-5", headers=headers)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
