"""/v1/chat/completions on a small random Qwen3 with the real Qwen3 tokenizer (chat template,
multi-byte text), checked against the offline engine with the same seed."""

import httpx
import pytest

from minisgl import LLM, SamplingParams
from minisgl.core import PromptOptions
from minisgl.tokenizer.loader import load_tokenizer, prompt_ids
from minisgl.utils import DEFAULT_MODEL_PATH

from .conftest import DEVICE
from .server_process import ServerProcess
from .stress.checks import assert_clean

MAX_KV_TOKENS = 512  # also the context: the random Qwen3 knows 1024 positions
MESSAGES = [
    {"role": "system", "content": "Answer in any language."},
    {"role": "user", "content": "你好, wörld 😀"},
]


@pytest.fixture(scope="module")
def server(qwen3_path: str, tmp_path_factory: pytest.TempPathFactory):
    s = ServerProcess(
        tmp_path_factory.mktemp("chat"),
        "--model",
        qwen3_path,
        "--max-kv-tokens",
        str(MAX_KV_TOKENS),
        "--max-model-len",
        str(MAX_KV_TOKENS),
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def llm(qwen3_path: str) -> LLM:
    return LLM(
        qwen3_path,
        device=DEVICE,
        dtype="float32",
        max_kv_tokens=MAX_KV_TOKENS,
        max_model_len=MAX_KV_TOKENS,
    )


def _chat_ids(llm: LLM) -> list[int]:
    return prompt_ids(llm.tokenizer, None, MESSAGES)


def test_chat_reply_equals_the_offline_engine_on_the_templated_prompt(
    server: ServerProcess, llm: LLM, qwen3_path: str
) -> None:
    params = SamplingParams(seed=11, max_tokens=20)
    want = llm.generate([_chat_ids(llm)], params, use_tqdm=False)[0]
    got = server.client().chat.completions.create(
        model=qwen3_path, messages=MESSAGES, seed=11, max_tokens=20
    )
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want["text"]
    assert got.choices[0].finish_reason == "length"
    assert got.usage.prompt_tokens == len(_chat_ids(llm))
    assert got.usage.completion_tokens == 20


def test_streamed_multibyte_text_equals_non_streamed_and_the_full_decode(
    server: ServerProcess, llm: LLM, qwen3_path: str
) -> None:
    want = llm.generate([_chat_ids(llm)], SamplingParams(seed=1, max_tokens=64), use_tqdm=False)[0]
    tokenizer = llm.tokenizer
    # the random model emits tokens that are part of a UTF-8 character on their own
    assert any("\ufffd" in tokenizer.decode([t]) for t in want["token_ids"])
    client = server.client()
    kwargs = dict(model=qwen3_path, messages=MESSAGES, seed=1, max_completion_tokens=64)
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert streamed == whole
    assert whole == tokenizer.decode(want["token_ids"], skip_special_tokens=True)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_n2_streams_two_choices_with_usage(server: ServerProcess, qwen3_path: str) -> None:
    client = server.client()
    kwargs = dict(model=qwen3_path, messages=MESSAGES, seed=5, max_tokens=12, n=2)
    whole = client.chat.completions.create(**kwargs)
    texts, usage = ["", ""], None
    stream = client.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **kwargs
    )
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
        usage = chunk.usage or usage
    assert texts == [c.message.content for c in whole.choices]
    assert texts[0] != texts[1]
    assert usage.completion_tokens == whole.usage.completion_tokens == 24


def test_chat_logprobs_and_top_logprobs(server: ServerProcess, qwen3_path: str) -> None:
    got = server.client().chat.completions.create(
        model=qwen3_path, messages=MESSAGES, max_tokens=4, logprobs=True, top_logprobs=3
    )
    content = got.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert bytes(entry.bytes).decode(errors="replace") == entry.token
        assert entry.logprob <= 0


def test_chat_without_max_tokens_runs_to_the_end_of_the_context(
    server: ServerProcess, qwen3_path: str
) -> None:
    got = server.client().chat.completions.create(model=qwen3_path, messages=MESSAGES)
    assert got.choices[0].finish_reason == "length"
    assert got.usage.total_tokens == MAX_KV_TOKENS


def test_chat_errors(server: ServerProcess, qwen3_path: str) -> None:
    def post(body: dict) -> httpx.Response:
        return server.post("/v1/chat/completions", json={"model": qwen3_path, **body})

    before = server.metrics()
    assert post({"messages": []}).status_code == 400
    assert post({"messages": [{"role": "wizard", "content": "hi"}]}).status_code == 400
    assert post({"messages": MESSAGES, "top_logprobs": 2}).status_code == 400
    too_long = [{"role": "user", "content": "猫 " * MAX_KV_TOKENS}]
    response = post({"messages": too_long, "stream": True})
    assert response.status_code == 400 and "context length" in response.json()["error"]["message"]
    # a template variable may not replace one of the template's globals
    shadow = post({"messages": MESSAGES, "chat_template_kwargs": {"namespace": 1}})
    assert shadow.status_code == 400 and "may not set namespace" in shadow.text
    assert shadow.json()["error"]["param"] == "chat_template_kwargs"
    assert post({"messages": MESSAGES, "max_tokens": 1}).status_code == 200
    assert_clean(server, before, qwen3_path)


CONTINUED = [*MESSAGES, {"role": "assistant", "content": "Hello, I am"}]


@pytest.mark.parametrize(
    ("messages", "fields"),
    [
        (MESSAGES, {}),
        (CONTINUED, {"add_generation_prompt": False}),
        (CONTINUED, {"add_generation_prompt": False, "continue_final_message": True}),
    ],
)
def test_vllms_chat_ends_shape_the_prompt_of_chat_tokenize_and_llm_chat(
    server: ServerProcess, llm: LLM, qwen3_path: str, messages: list, fields: dict
) -> None:
    """The reply is the offline engine's on the prompt the fields give: the assistant's turn
    opened (the default), not, or the final message left open for the model to go on with;
    /tokenize counts the same prompt, and LLM.chat takes the same fields (add_special_tokens:
    test_server.py, on a tokenizer that adds a BOS)."""
    options = PromptOptions(**fields)
    ids = prompt_ids(llm.tokenizer, None, messages, options=options)
    text = llm.tokenizer.decode(ids)
    ends = {
        (): "<|im_start|>assistant\n",
        ("add_generation_prompt",): "Hello, I am<|im_end|>\n",
        ("add_generation_prompt", "continue_final_message"): "Hello, I am",
    }
    assert text.endswith(ends[tuple(fields)]), text
    params = SamplingParams(seed=5, max_tokens=6)
    want = llm.generate([ids], params, use_tqdm=False)[0]
    got = server.client().chat.completions.create(
        model=qwen3_path, messages=messages, seed=5, max_tokens=6, extra_body=fields
    )
    assert (got.choices[0].message.content, got.usage.prompt_tokens) == (want["text"], len(ids))
    tokenized = server.post("/tokenize", json={"messages": messages, **fields}).json()
    assert tokenized["tokens"] == ids
    offline = llm.chat(messages, params, use_tqdm=False, **fields)[0]
    assert offline["token_ids"] == want["token_ids"]


def test_the_chat_ends_are_refused_together_and_on_a_text_prompt(server: ServerProcess) -> None:
    both = {"add_generation_prompt": True, "continue_final_message": True}
    for route in ("/v1/chat/completions", "/tokenize"):
        refused = server.post(route, json={"messages": CONTINUED, **both})
        assert refused.status_code == 400 and "not compatible" in refused.text
        assert refused.json()["error"]["param"] == "continue_final_message"
    on_text = server.post("/tokenize", json={"prompt": "Hi", "add_generation_prompt": False})
    assert on_text.status_code == 400 and "add_generation_prompt: a chat's" in on_text.text


def test_tokenize_gives_token_strings_on_request(server: ServerProcess, llm: LLM) -> None:
    got = server.post("/tokenize", json={"prompt": "你好 world", "return_token_strs": True}).json()
    assert got["token_strs"] == llm.tokenizer.convert_ids_to_tokens(got["tokens"])
    assert "token_strs" not in server.post("/tokenize", json={"prompt": "Hi"}).json()


def test_chat_template_bos_is_not_doubled() -> None:
    """A template that writes the BOS itself gets exactly one."""
    tokenizer = load_tokenizer(DEFAULT_MODEL_PATH)
    template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    ids = prompt_ids(tokenizer, None, [{"role": "user", "content": "Hi"}], template)
    assert ids[0] == tokenizer.bos_token_id and tokenizer.bos_token_id not in ids[1:]


_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [_TOOL]}, "tool_choice"),  # auto without --tool-call-parser
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [_TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}},
         "tool_choice"),
        ({"tools": [_TOOL], "tool_choice": "required",
          "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format.json_schema.schema"),
        # the second constraint given; it named response_format whichever two they were
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
        ({"structured_outputs": {"regex": "a"}, "guided_choice": ["a"]}, "guided_choice"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),  # it was null
    ],
)  # fmt: skip
def test_a_refused_tool_or_output_constraint_names_its_field(
    server: ServerProcess, fields: dict, param: str
) -> None:
    response = server.post(
        "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2, **fields}
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == param


@pytest.mark.parametrize(
    ("fields", "param", "named"),
    [
        # the rule names max_tokens, which this request did not send
        ({"max_completion_tokens": 3, "min_tokens": 5}, "min_tokens", "max_completion_tokens (3)"),
        # a bad max_tokens beside max_completion_tokens was not read (200)
        ({"max_tokens": -5, "max_completion_tokens": 3}, "max_tokens", "differ"),
        # checked by the tokenizer process, whose refusals had no param
        ({"logit_bias": {"200000": 1}}, "logit_bias", "outside the vocabulary"),
        ({"max_completion_tokens": 3000}, "max_completion_tokens", "maximum context length"),
    ],
)
def test_a_refused_sampling_field_is_named_as_the_request_names_it(
    server: ServerProcess, fields: dict, param: str, named: str
) -> None:
    response = server.post("/v1/chat/completions", json={"messages": MESSAGES, **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and named in error["message"], error
    assert "max_tokens (" not in error["message"]
    same = {"messages": MESSAGES, "max_tokens": 2, "max_completion_tokens": 2, "ignore_eos": True}
    assert server.post("/v1/chat/completions", json=same).json()["usage"]["completion_tokens"] == 2


def test_tools_with_tool_choice_auto_need_a_tool_call_parser(server: ServerProcess) -> None:
    """As vLLM: auto needs --tool-call-parser; none needs no parser."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    body = {"messages": MESSAGES, "max_tokens": 2, "tools": [tool]}
    response = server.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    assert "--tool-call-parser" in response.json()["error"]["message"]
    response = server.post("/v1/chat/completions", json={**body, "tool_choice": "none"})
    assert response.status_code == 200 and response.json()["choices"][0]["message"]["content"]
