"""The sampling and output fields through a real server and the official `openai` client, each
checked against the offline engine with the same parameters: penalties, logit_bias, min_tokens,
include_stop_str_in_output, echo; and /v1/responses answered with a 404 in OpenAI's shape."""

import json
import shutil
from pathlib import Path

import httpx
import openai
import pytest

from minisgl import LLM, SamplingParams
from minisgl.config import ConfigError
from minisgl.messages import TextLogprobs
from minisgl.server.responses import Choice, CompletionFormat
from minisgl.utils import DEFAULT_MODEL_PATH, sampling_defaults

from .server_process import ServerProcess
from .test_bad_input import nested_schema

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    s = ServerProcess(tmp_path_factory.mktemp("fields"), "--served-model-name", "m")
    yield s
    s.stop()


def _text(server: ServerProcess, **fields) -> openai.types.CompletionChoice:
    extra = {k: fields.pop(k) for k in list(fields) if k in _EXTRA}
    r = server.client().completions.create(
        model="m", prompt=PROMPT, temperature=0, extra_body=extra, **fields
    )
    return r.choices[0]


_EXTRA = {"repetition_penalty", "min_tokens", "include_stop_str_in_output", "top_k"}


@pytest.mark.parametrize(
    "fields",
    [
        {"presence_penalty": 1.5},
        {"frequency_penalty": 1.2},
        {"repetition_penalty": 1.4},
        {"presence_penalty": -0.5, "frequency_penalty": 0.7, "repetition_penalty": 0.8},
    ],
)
def test_penalties_change_the_text_as_offline(
    server: ServerProcess, stories_llm: LLM, fields
) -> None:
    want = stories_llm.generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=40, **fields), use_tqdm=False
    )[0]
    plain = stories_llm.generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=40), use_tqdm=False
    )
    assert want["token_ids"] != plain[0]["token_ids"]
    assert _text(server, max_tokens=40, **fields).text == want["text"]


def test_logit_bias_and_min_tokens_as_offline(server: ServerProcess, stories_llm: LLM) -> None:
    token = stories_llm.tokenizer.encode(" dog", add_special_tokens=False)[-1]
    forced = _text(server, max_tokens=5, logit_bias={str(token): 100})
    offline = SamplingParams(temperature=0, max_tokens=5, logit_bias={token: 100})
    want_forced = stories_llm.generate([PROMPT], offline, use_tqdm=False)[0]
    assert want_forced["token_ids"] == [token] * 5
    assert forced.text == want_forced["text"]
    eos = stories_llm.tokenizer.eos_token_id
    free = stories_llm.generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=300), use_tqdm=False
    )
    free_ids = free[0]["token_ids"]
    # eos is held back: with a stop token from the text instead, which would end it at once
    stop = free_ids[2]
    held = SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop], min_tokens=10)
    want = stories_llm.generate([PROMPT], held, use_tqdm=False)[0]
    got = server.client().completions.create(
        model="m", prompt=PROMPT, temperature=0, max_tokens=20,
        extra_body={"min_tokens": 10, "stop_token_ids": [stop]},
    ).choices[0]  # fmt: skip
    assert got.text == want["text"]
    assert len(want["token_ids"]) >= 10 and stop not in want["token_ids"][:10]
    assert eos not in want["token_ids"][:10]


def test_include_stop_str_in_output_keeps_the_stop_string(server: ServerProcess) -> None:
    without = _text(server, max_tokens=30, stop=[" was"])
    with_stop = _text(server, max_tokens=30, stop=[" was"], include_stop_str_in_output=True)
    assert with_stop.text == without.text + " was"
    assert with_stop.finish_reason == without.finish_reason == "stop"
    stream = server.client().completions.create(
        model="m", prompt=PROMPT, temperature=0, max_tokens=30, stop=[" was"], stream=True,
        extra_body={"include_stop_str_in_output": True},
    )  # fmt: skip
    assert "".join(c.choices[0].text for c in stream) == with_stop.text


def test_stop_strings_wait_for_min_tokens(server: ServerProcess) -> None:
    free = _text(server, max_tokens=30).text
    word = free.split()[1]
    early = _text(server, max_tokens=30, stop=[word])
    late = _text(server, max_tokens=30, stop=[word], min_tokens=25)
    assert len(early.text) < len(late.text)


def test_echo_prepends_the_prompt_text_and_token_prompts_decode(
    server: ServerProcess, stories_llm: LLM
) -> None:
    plain = _text(server, max_tokens=6)
    echoed = _text(server, max_tokens=6, echo=True)
    assert echoed.text == PROMPT + plain.text
    ids = stories_llm.tokenizer.encode(PROMPT)
    by_ids = server.client().completions.create(
        model="m", prompt=ids, temperature=0, max_tokens=6, echo=True
    )
    assert by_ids.choices[0].text.endswith(plain.text)
    assert PROMPT in by_ids.choices[0].text
    stream = server.client().completions.create(
        model="m", prompt=PROMPT, temperature=0, max_tokens=6, echo=True, stream=True
    )
    assert "".join(c.choices[0].text for c in stream) == echoed.text
    with_logprobs = _text(server, max_tokens=6, echo=True, logprobs=1)  # test_prompt_logprobs.py
    assert with_logprobs.text == echoed.text


def test_responses_api_is_a_404_in_openais_shape(server: ServerProcess) -> None:
    """Any method and path of it: the openai client's retrieve (GET .../{id}) was a 405."""
    for method, path in [("POST", ""), ("GET", ""), ("GET", "/resp_1"), ("DELETE", "/resp_1")]:
        body = {"model": "m", "input": "hi"} if method == "POST" else None
        r = httpx.request(method, server.url + "/v1/responses" + path, json=body, timeout=10)
        assert r.status_code == 404, (method, path, r.text)
        assert "chat/completions" in r.json()["error"]["message"]


def test_min_tokens_with_a_stop_id_past_the_vocabulary_is_served(server: ServerProcess) -> None:
    """Found by the fuzzer: holding back a stop id the model cannot sample crashed the mask."""
    c = server.client().completions.create(
        model="m",
        prompt=PROMPT,
        max_tokens=4,
        extra_body={"min_tokens": 2, "stop_token_ids": [10**6]},
    )
    assert c.usage.completion_tokens == 4
    assert _text(server, max_tokens=2).text


# what vllm-router writes into every body it forwards (test_data_parallel.py serves through it)
SGLANG_FIELDS = {"no_stop_trim": False, "skip_special_tokens": True, "return_hidden_states": False}
SGLANG_CHAT_FIELDS = {**SGLANG_FIELDS, "separate_reasoning": True, "stream_reasoning": True}
ROUTER_CHAT_FIELDS = {"continue_final_message": False}  # vLLM's too: honoured either way


def test_sglangs_fields_are_served_with_minisgls_values_and_refused_with_others(
    server: ServerProcess,
) -> None:
    completion = {"model": "m", "prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    chat = {**completion, "messages": [{"role": "user", "content": PROMPT}]}
    del chat["prompt"]
    for route, body, fields, also in [
        ("/v1/completions", completion, SGLANG_FIELDS, {}),
        ("/v1/chat/completions", chat, SGLANG_CHAT_FIELDS, ROUTER_CHAT_FIELDS),
    ]:
        plain = server.post(route, json=body).json()["choices"]
        assert server.post(route, json={**body, **fields, **also}).json()["choices"] == plain
        for name, value in fields.items():
            refused = server.post(route, json={**body, name: not value})
            assert refused.status_code == 400 and name in refused.json()["error"]["message"]


def test_chat_min_tokens_without_max_tokens_runs_past_the_completions_default(
    server: ServerProcess,
) -> None:
    """An omitted chat max_tokens is the rest of the context, so min_tokens may exceed 16."""
    r = server.post(
        "/v1/chat/completions",
        json={
            "model": "m", "messages": [{"role": "user", "content": PROMPT}], "min_tokens": 40,
            "temperature": 0,
        },
    )  # fmt: skip
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 40


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"stream": False, "stream_options": {"include_usage": False}}, "stream_options"),
        ({"response_format": {"type": "text", "json_schema": {"schema": {}}}}, "json_schema"),
        (
            {"response_format": {"type": "json_object", "json_schema": {"schema": {}}}},
            "json_schema",
        ),
    ],
)
def test_fields_that_would_be_ignored_are_refused(server: ServerProcess, fields, named) -> None:
    """OpenAI refuses stream_options without streaming; a schema only counts for json_schema."""
    r = server.post("/v1/completions", json={"model": "m", "prompt": PROMPT, **fields})
    assert r.status_code == 400 and named in r.json()["error"]["message"], r.text


DEEP = {"type": "array", "items": nested_schema(300)}  # past orjson's 254 levels when written


@pytest.mark.parametrize(
    "fields",
    [
        {"structured_outputs": {"json": DEEP}},
        {"guided_json": DEEP},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "d", "schema": DEEP}}},
        {
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {"type": "object", "properties": {"a": DEEP}},
                    },
                }
            ],
            "tool_choice": "required",
        },
    ],
)
def test_a_schema_nested_past_the_limit_is_a_400(server: ServerProcess, fields) -> None:
    chat = "messages" in fields
    body = {"model": "m", **fields} if chat else {"model": "m", "prompt": PROMPT, **fields}
    r = server.post("/v1/chat/completions" if chat else "/v1/completions", json=body)
    assert r.status_code == 400 and "nests deeper than" in r.json()["error"]["message"], r.text
    assert _text(server, max_tokens=4).text  # served on


def test_a_chat_nested_as_deep_as_a_body_may_is_served_or_refused_and_the_server_serves_on(
    server: ServerProcess,
) -> None:
    """A tool call's arguments, JSON text read apart from the body, may nest past what the message
    to the tokenizer process packs (a 500 and a request held open for good, then a 400): they
    reach the template as the text they were sent as. A template variable nests as deep as the
    body may (1,024), which the template's rendering refuses."""
    deep = '{"a":' * 1020 + "1" + "}" * 1020
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": deep}}
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c", "content": "ok"},
    ]
    chat = {"model": "m", "messages": messages}
    for path, body in [("/v1/chat/completions", {**chat, "max_tokens": 2}), ("/tokenize", chat)]:
        assert server.post(path, json=body).status_code == 200
        nested = json.dumps({**body, "messages": messages[:1], "chat_template_kwargs": {"x": 0}})
        nested = nested.replace('{"x": 0}', '{"x": ' + deep + "}")
        r = server.post(path, content=nested, headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and "recursion" in r.json()["error"]["message"], r.text
    assert _text(server, max_tokens=4).text  # served on


def test_top_logprobs_of_tokens_that_render_alike_keep_the_likeliest() -> None:
    """A completion's top_logprobs are keyed by text: the pieces of a multi-byte character all
    render as U+FFFD."""
    top = [("\ufffd", -0.1), ("\ufffd", -2.3), ("a", -3.0)]
    piece = Choice("x", [TextLogprobs("\ufffd", -0.1, top)])
    choice = CompletionFormat().choice(0, piece, 0, True, False, True)
    assert choice["logprobs"]["top_logprobs"] == [{"\ufffd": -0.1, "a": -3.0}]


def test_a_completions_top_logprobs_hold_the_sampled_token_too() -> None:
    """Up to logprobs + 1 entries, as OpenAI's legacy completions give, likeliest first."""
    piece = Choice("c", [TextLogprobs("c", -4.0, [("a", -0.2), ("b", -1.9)])])
    choice = CompletionFormat().choice(0, piece, 0, True, False, True)
    assert list(choice["logprobs"]["top_logprobs"][0].items()) == [
        ("a", -0.2),
        ("b", -1.9),
        ("c", -4.0),
    ]


@pytest.fixture(scope="module")
def greedy_by_default(tmp_path_factory: pytest.TempPathFactory):
    """The embedded model with a generation_config.json whose sampling defaults are greedy."""
    path = tmp_path_factory.mktemp("greedy-by-default") / "model"
    shutil.copytree(DEFAULT_MODEL_PATH, path)
    config = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**config, "top_k": 1}))
    return path


def test_the_models_generation_config_sets_the_sampling_defaults(
    greedy_by_default: Path, server: ServerProcess, tmp_path: Path
) -> None:
    """As vLLM's --generation-config auto: a field the request leaves out takes the model's
    default, one it gives wins."""
    greedy = _text(server, max_tokens=24).text
    s = ServerProcess(tmp_path, "--model", str(greedy_by_default), "--served-model-name", "m")
    try:
        client = s.client()
        defaulted = client.completions.create(model="m", prompt=PROMPT, max_tokens=24, seed=5)
        own = client.completions.create(
            model="m", prompt=PROMPT, max_tokens=24, seed=5, extra_body={"top_k": -1}
        )
        chat = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 24}
        chats = [client.chat.completions.create(**chat, seed=seed) for seed in (1, 2)]
    finally:
        s.stop()
    assert defaulted.choices[0].text == greedy
    assert own.choices[0].text != greedy
    assert chats[0].choices[0].message.content == chats[1].choices[0].message.content


def test_sampling_defaults_come_from_the_folder_the_flag_names(
    greedy_by_default: Path, tmp_path: Path
) -> None:
    assert sampling_defaults("auto", greedy_by_default) == {"top_k": 1}
    assert sampling_defaults("vllm", greedy_by_default) == {}
    assert sampling_defaults(str(greedy_by_default), DEFAULT_MODEL_PATH) == {"top_k": 1}
    assert sampling_defaults("auto", DEFAULT_MODEL_PATH) == {}  # eos ids only
    with pytest.raises(ConfigError, match=r"no generation_config\.json"):
        sampling_defaults(str(tmp_path), greedy_by_default)
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    with pytest.raises(ConfigError, match=r"temperature must be in \[0, 2\]"):
        sampling_defaults(str(tmp_path), greedy_by_default)
    (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 32}))
    assert sampling_defaults(str(tmp_path), greedy_by_default) == {}  # not taken (README)


def test_the_offline_llm_takes_the_models_sampling_defaults(greedy_by_default: Path) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=24)
    with LLM(str(greedy_by_default), dtype="float32", max_kv_tokens=2048) as llm:
        assert llm.get_default_sampling_params() == SamplingParams(top_k=1)
        want = llm.generate(PROMPT, greedy, use_tqdm=False)[0]["token_ids"]
        defaulted = llm.generate(PROMPT, use_tqdm=False)[0]["token_ids"]
    assert defaulted == want[:16]  # SamplingParams' max_tokens, 16
    with LLM(str(greedy_by_default), generation_config="vllm", max_kv_tokens=2048) as llm:
        assert llm.get_default_sampling_params() == SamplingParams()
