"""Every request field is honoured or refused with a 400 that names it: the request parameters of
the official `openai` package's completion and chat types, and vLLM's extra fields, walked one by
one against a real server. What each honoured field does is checked by its own tests."""

import re

import openai.types.chat.completion_create_params as chat_params
import openai.types.completion_create_params as completion_params
import orjson
import pytest

from minisgl.server.protocol import IGNORED_FIELDS, ChatCompletionRequest, parse_body

from .server_process import ServerProcess

MODEL = "stories"
BASE = {
    "/v1/completions": {"model": MODEL, "prompt": "Once", "max_tokens": 2},
    "/v1/chat/completions": {
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
    },
}  # fmt: skip
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
# honoured, with a value that changes something
HONOURED = {
    "model": MODEL, "prompt": "The dog", "messages": [{"role": "user", "content": "Hello"}],
    "max_tokens": 3, "max_completion_tokens": 3, "n": 2, "temperature": 0.5, "top_p": 0.9,
    "stop": ["x"], "seed": 3, "stream": True, "stream_options": {"include_usage": True},
    "top_k": 5, "min_p": 0.1, "ignore_eos": True, "stop_token_ids": [2], "echo": True,
    "frequency_penalty": 0.5, "presence_penalty": 0.5, "repetition_penalty": 1.2,
    "logit_bias": {"5": 1.0}, "min_tokens": 1, "include_stop_str_in_output": True,
    "response_format": {"type": "json_object"}, "structured_outputs": {"choice": ["a", "b"]},
    "guided_json": {"type": "object"}, "guided_regex": "a+", "guided_choice": ["yes", "no"],
    "guided_grammar": 'root ::= "x"',
    "tools": [TOOL], "tool_choice": "required", "parallel_tool_calls": False,
    "chat_template_kwargs": {"enable_thinking": False}, "add_special_tokens": False,
    "add_generation_prompt": False, "continue_final_message": True,
}  # fmt: skip
# honoured by chat, refused by completions (vLLM's extras)
CHAT_ONLY = {"chat_template_kwargs", "add_generation_prompt", "continue_final_message"}
# the other fields an honoured one needs
HONOURED_WITH = {
    "stream_options": {"stream": True},
    "max_completion_tokens": {"max_tokens": None},  # BASE's 2 differs: a 400
    "tool_choice": {"tools": [TOOL]},
    "parallel_tool_calls": {"tools": [TOOL], "tool_choice": "required"},
    "continue_final_message": {
        "add_generation_prompt": False,
        "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "A"}],
    },
}
# vLLM's extra request fields (those HONOURED names are implemented)
VLLM_EXTRAS = (
    "use_beam_search", "repetition_penalty", "length_penalty", "min_tokens",
    "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
    "truncate_prompt_tokens", "allowed_token_ids", "prompt_logprobs", "bad_words", "guided_json",
    "guided_regex", "guided_choice", "guided_grammar", "structured_outputs", "priority",
    "request_id", "return_tokens_as_token_ids", "add_generation_prompt", "continue_final_message",
    "add_special_tokens", "documents", "chat_template", "chat_template_kwargs", "logits_processors",
    "cache_salt",
)  # fmt: skip


def _fields(params: type) -> list[str]:
    return sorted(params.__annotations__) + ["stream"]


CASES = [
    (route, field)
    for route, params in (
        ("/v1/completions", completion_params.CompletionCreateParamsBase),
        ("/v1/chat/completions", chat_params.CompletionCreateParamsBase),
    )
    for field in sorted({*_fields(params), *VLLM_EXTRAS})
    if not (field == "messages" and route == "/v1/completions")
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    s = ServerProcess(
        tmp_path_factory.mktemp("fields"), "--served-model-name", MODEL, "--tool-call-parser",
        "hermes",
    )  # fmt: skip
    yield s
    s.stop()


@pytest.mark.parametrize(("route", "field"), CASES, ids=[f"{r[4:]}:{f}" for r, f in CASES])
def test_each_field_is_honoured_or_refused_by_name(server: ServerProcess, route, field) -> None:
    body = dict(BASE[route])
    honoured = field in HONOURED and (route == "/v1/chat/completions" or field not in CHAT_ONLY)
    if honoured:
        body |= {field: HONOURED[field], **HONOURED_WITH.get(field, {})}
    elif field in IGNORED_FIELDS:
        body[field] = {"metadata": {"k": "v"}, "store": True}.get(field, "x")
    else:
        body[field] = {"any": "value"}
    response = server.post(route, json=body)
    if honoured or field in IGNORED_FIELDS:
        assert response.status_code == 200, response.text
    else:
        assert response.status_code == 400, (field, response.text)
        assert field in response.json()["error"]["message"]


def test_an_unknown_field_in_a_nested_object_is_refused_by_name(server: ServerProcess) -> None:
    body = dict(BASE["/v1/chat/completions"])
    body["messages"] = [{"role": "user", "content": "Hi", "mood": "curious"}]
    response = server.post("/v1/chat/completions", json=body)
    assert response.status_code == 400 and "mood" in response.json()["error"]["message"]


def test_a_body_field_ignored_is_refused_inside_a_nested_object(server: ServerProcess) -> None:
    body = dict(BASE["/v1/chat/completions"])
    body["messages"] = [{"role": "user", "content": "Hi", "store": True}]
    response = server.post("/v1/chat/completions", json=body)
    assert response.status_code == 400 and "store" in response.json()["error"]["message"]


NULLS = {
    "/v1/completions": ("n", "stream", "echo", "logprobs", "stop", "seed", "temperature", "user"),
    "/v1/chat/completions": (
        "n", "stream", "logprobs", "top_logprobs", "tools", "tool_choice", "response_format",
        "max_completion_tokens",
    ),
}  # fmt: skip


@pytest.mark.parametrize("route", list(NULLS))
def test_a_field_sent_as_null_counts_as_not_sent(server: ServerProcess, route: str) -> None:
    """OpenAI's schemas allow null for these ("or null"): the default applies."""
    response = server.post(route, json=BASE[route] | dict.fromkeys(NULLS[route]))
    assert response.status_code == 200, response.text
    reply = response.json()
    assert len(reply["choices"]) == 1 and reply["usage"]["completion_tokens"] == 2


def test_a_null_inside_an_object_counts_as_not_sent(server: ServerProcess) -> None:
    """Clients send back the nulls of the replies they got."""
    body = BASE["/v1/chat/completions"] | {
        "stream": True,
        "stream_options": {"include_usage": None},
        "messages": [
            {"role": "user", "content": "Hi", "name": None, "tool_calls": None},
            {"role": "assistant", "content": "Hello", "refusal": None, "reasoning_content": None},
            {"role": "user", "content": "More"},
        ],
    }
    response = server.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    events = [line for line in response.text.splitlines() if line.startswith("data: {")]
    assert all('"usage"' not in event for event in events)  # include_usage: the default


@pytest.mark.parametrize(
    ("message", "error"),
    [
        ({"role": "user", "content": "Hi", "reasoning_content": "x"}, "reasoning_content is an"),
        ({"role": "user", "content": "Hi", "refusal": "no"}, "refusal is an assistant"),
        ({"role": "assistant", "content": "a", "refusal": "no"}, "content or refusal"),
        ({"role": "assistant", "content": "a", "reasoning": "x", "reasoning_content": "y"},
         "reasoning_content or reasoning"),
    ],
)  # fmt: skip
def test_reply_fields_only_in_an_assistant_message(server: ServerProcess, message, error) -> None:
    body = BASE["/v1/chat/completions"] | {"messages": [message]}
    response = server.post("/v1/chat/completions", json=body)
    assert response.status_code == 400 and error in response.json()["error"]["message"]


def test_a_reply_cut_short_while_thinking_may_be_sent_back(server: ServerProcess) -> None:
    """Its content is null: all it wrote was reasoning."""
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": None, "reasoning_content": "Let me"},
        {"role": "user", "content": "Go on"},
    ]
    body = BASE["/v1/chat/completions"] | {"messages": messages}
    response = server.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text


def test_an_assistant_message_may_be_a_refusal(server: ServerProcess) -> None:
    history = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "refusal": "I cannot."},
        {"role": "user", "content": "Why?"},
    ]
    as_content = [*history[:1], {"role": "assistant", "content": "I cannot."}, history[2]]
    usage = [
        server.post(
            "/v1/chat/completions", json=BASE["/v1/chat/completions"] | {"messages": m}
        ).json()["usage"]["prompt_tokens"]
        for m in (history, as_content)
    ]
    assert usage[0] == usage[1]


def test_text_parts_are_joined_by_newlines() -> None:
    """As vLLM joins them."""
    body = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]}]}  # fmt: skip
    request = parse_body(orjson.dumps(body), ChatCompletionRequest)
    assert request.messages[0].as_template_input()["content"] == "Hello\nworld"


@pytest.mark.parametrize(
    ("route", "fields", "param", "says"),
    [
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 25}, "top_logprobs",
         "top_logprobs must be an integer in [0, 20]"),
        ("/v1/chat/completions", {"max_tokens": None, "max_completion_tokens": 5,
                                  "min_tokens": 50}, "min_tokens",
         "min_tokens must be at most max_completion_tokens (5)"),
        ("/v1/completions", {"max_tokens": 0}, "max_tokens", "max_tokens must be >= 1"),
        ("/v1/completions", {"temperature": "hot"}, "temperature", "temperature:"),
        ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages.0", "content"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]},
         "messages.0.content", "valid string"),
        ("/v1/completions", {"n": 129}, "n", "n must be at most 128"),
        # an unknown field (its param was null, its message began "body: Value error, ")
        ("/v1/completions", {"best_of": 2}, "best_of", "body: unsupported field(s): best_of"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "mood": 1}]},
         "messages.0.mood", "messages.0: unsupported field(s): mood"),
        ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": "a",
                                                "refusal": "no"}]},
         "messages.0", "messages.0: give content or refusal, not both"),
        ("/v1/completions", {"stop_token_ids": list(range(1025))}, "stop_token_ids",
         "at most 1024 stop_token_ids"),
        ("/v1/completions", {"logit_bias": {str(i): 1.0 for i in range(1025)}}, "logit_bias",
         "at most 1024 tokens"),
    ],
)  # fmt: skip
def test_an_error_names_its_field_in_param(
    server: ServerProcess, route: str, fields: dict, param: str, says: str
) -> None:
    response = server.post(route, json=BASE[route] | fields)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and says in error["message"], error


def test_choices_that_would_carry_too_many_params_are_a_400(server: ServerProcess) -> None:
    """88 KB of body, 262,144 engine requests each with its own copy of 80 KB of params: refused
    before the tokenizer copies them, and the server serves on."""
    body = BASE["/v1/completions"] | {
        "prompt": [[1]] * 2048, "n": 128, "max_tokens": 1, "stop": ["x" * 1024] * 64,
        "stop_token_ids": list(range(1024)), "logit_bias": {str(i): 1.0 for i in range(1024)},
    }  # fmt: skip
    response = server.post("/v1/completions", json=body)
    assert response.status_code == 400, response.text
    # in bytes, as the flag: "0 MiB; at most 0 MiB" was the message under a 1 MiB limit
    assert re.search(
        r"would carry [\d,]{9,} bytes of sampling parameters to the engine; at most [\d,]+ "
        r"\(--max-params-bytes\)",
        response.json()["error"]["message"],
    ), response.text
    assert server.post("/v1/completions", json=BASE["/v1/completions"]).status_code == 200
