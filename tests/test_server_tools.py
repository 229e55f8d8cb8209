"""Tool calls and reasoning through /v1/chat/completions, on a small random Qwen3 with the real
Qwen3 tokenizer and chat template, served with --tool-call-parser hermes and --reasoning-parser
qwen3. Random weights write no `<tool_call>` or `<think>` of their own: the replies that need them
are forced with a structured output (`structured_outputs: {"regex": …}`, vLLM's extra field) that
holds the thinking too (--structured-outputs-in-reasoning); `required` and named tool choices are
held to their calls' JSON by their own grammar. By default a structured output holds the reply
from the end of its thinking (`thinking_server`), where a `</think>` forced by logit_bias ends
the random weights' thinking."""

import json
from typing import Any

import jsonschema
import pytest
import xgrammar

from minisgl.core import SamplingParams
from minisgl.messages import TokenizeRequest, decode, encode
from minisgl.server.cli import parse_args
from minisgl.server.errors import ApiError
from minisgl.server.protocol import ChatCompletionRequest, ChatMessage, parse_body
from minisgl.server.tool_parser import HermesToolParser, merge_calls
from minisgl.tokenizer.loader import load_tokenizer, prompt_ids

from .conftest import QWEN3_TOKENIZER
from .server_process import ServerProcess
from .stress.checks import assert_clean

MAX_KV_TOKENS = 1024  # also the context: the random Qwen3 knows 1024 positions
NO_THINKING = {"enable_thinking": False}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Oslo"]},
                "unit": {"type": "string", "enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": 0, "maximum": 99},
                "b": {"type": "integer", "minimum": 0, "maximum": 99},
            },
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, ADD]
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'


def _serve(checkpoint, tmp_path_factory: pytest.TempPathFactory, *flags: str) -> ServerProcess:
    return ServerProcess(
        tmp_path_factory.mktemp("tools"), "--model", str(checkpoint("qwen3", tokenizer="qwen3")),
        "--served-model-name", "qwen", "--max-kv-tokens", str(MAX_KV_TOKENS), "--max-model-len",
        str(MAX_KV_TOKENS), "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3", *flags,
    )  # fmt: skip


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory: pytest.TempPathFactory):
    s = _serve(checkpoint, tmp_path_factory, "--structured-outputs-in-reasoning")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def thinking_server(checkpoint, tmp_path_factory: pytest.TempPathFactory):
    s = _serve(checkpoint, tmp_path_factory)
    yield s
    s.stop()


def _forced(text: str) -> dict[str, Any]:
    """The extra body that forces the reply to be `text`."""
    regex = "".join("\\" + c if c in "\\.^$*+?{}[]|()" else c for c in text)
    return {"structured_outputs": {"regex": regex.replace("\n", "\\n")}}


def _reply(server: ServerProcess, stream: bool, **kwargs) -> list[dict[str, Any]]:
    """Each choice's reply, the same shape streamed or not: reasoning, content (None when
    empty), calls (id, name, arguments) and finish_reason."""
    client = server.client()
    kwargs = {"model": "qwen", "max_tokens": 200, **kwargs}
    if "chat_template_kwargs" in kwargs:  # vLLM's field: the client sends it as an extra
        extra = {"chat_template_kwargs": kwargs.pop("chat_template_kwargs")}
        kwargs["extra_body"] = {**kwargs.get("extra_body", {}), **extra}
    if not stream:
        out = []
        for c in client.chat.completions.create(**kwargs).choices:
            calls = [
                (t.id, t.function.name, t.function.arguments) for t in c.message.tool_calls or []
            ]
            assert all(t.type == "function" for t in c.message.tool_calls or [])
            reasoning = getattr(c.message, "reasoning_content", None)
            out.append({"reasoning": reasoning, "content": c.message.content, "calls": calls,
                        "finish_reason": c.finish_reason})  # fmt: skip
        return out
    choices: dict[int, dict[str, Any]] = {}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            got = choices.setdefault(c.index, {"reasoning": "", "content": "", "calls": {}})
            got["reasoning"] += getattr(c.delta, "reasoning_content", None) or ""
            got["content"] += c.delta.content or ""
            indices = [t.index for t in c.delta.tool_calls or []]
            assert len(set(indices)) == len(indices), chunk  # one entry per call, as OpenAI's
            for t in c.delta.tool_calls or []:
                if t.index not in got["calls"]:  # a call's first delta: its id and name
                    assert t.id.startswith("call_") and t.type == "function" and t.function.name
                    got["calls"][t.index] = [t.id, t.function.name, t.function.arguments or ""]
                else:
                    assert t.id is None and t.function.name is None
                    got["calls"][t.index][2] += t.function.arguments
            got["finish_reason"] = c.finish_reason or got.get("finish_reason")
    return [
        {
            "reasoning": c["reasoning"] or None,
            "content": c["content"] or None,
            "calls": [tuple(v) for _, v in sorted(c["calls"].items())],
            "finish_reason": c["finish_reason"],
        }
        for _, c in sorted(choices.items())
    ]


def _without_ids(reply: dict[str, Any]) -> dict[str, Any]:
    for call_id, _, _ in reply["calls"]:
        assert call_id.startswith("call_") and len(call_id) > 8
    return {**reply, "calls": [(name, json.loads(args)) for _, name, args in reply["calls"]]}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_scripted_tool_conversation(server: ServerProcess, stream: bool) -> None:
    """Call -> the tool's result -> an answer, the history going back through the template."""
    first = _reply(server, stream, messages=QUESTION, tools=TOOLS,
                   chat_template_kwargs=NO_THINKING, extra_body=_forced(CALL_TEXT))  # fmt: skip
    assert _without_ids(first[0]) == {
        "reasoning": None,
        "content": None,
        "calls": [("get_weather", {"city": "Paris", "unit": "c"})],
        "finish_reason": "tool_calls",
    }
    call_id, name, arguments = first[0]["calls"][0]
    history = QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
        ]},
        {"role": "tool", "tool_call_id": call_id, "content": '{"temperature": 21}'},
    ]  # fmt: skip
    answer = "It is 21 degrees in Paris."
    second = _reply(server, stream, messages=history, tools=TOOLS,
                    chat_template_kwargs=NO_THINKING, extra_body=_forced(answer))  # fmt: skip
    assert second == [{"reasoning": None, "content": answer, "calls": [], "finish_reason": "stop"}]


def test_tools_and_the_history_reach_the_template(server: ServerProcess) -> None:
    """The prompt is the template's rendering of the messages, the tools and its variables."""
    call = {"id": "call_1", "type": "function",
            "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}  # fmt: skip
    history = QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3"},
    ]
    got = server.client().chat.completions.create(
        model="qwen", messages=history, tools=TOOLS, max_tokens=1, tool_choice="none",
        extra_body={"chat_template_kwargs": NO_THINKING},
    )  # fmt: skip
    tokenizer = load_tokenizer(QWEN3_TOKENIZER)  # the served model's
    template_history = [*QUESTION, {**history[1], "content": "", "tool_calls": [
        {**call, "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]}, history[2]]  # fmt: skip
    want = prompt_ids(tokenizer, None, template_history, None, TOOLS, NO_THINKING)
    assert got.usage.prompt_tokens == len(want)
    # /tokenize counts the same prompt, given what the chat request gave the template
    chat = {"messages": history, "tools": TOOLS, "chat_template_kwargs": NO_THINKING}
    assert server.post("/tokenize", json=chat).json()["tokens"] == want
    refused = server.post("/tokenize", json={"prompt": "Hi", "tools": TOOLS})
    assert refused.status_code == 400 and "give messages" in refused.text
    text = tokenizer.decode(want)
    assert '"name": "get_weather"' in text and "<tool_response>\n3\n</tool_response>" in text
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>' in text
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_reasoning_is_split_from_the_answer(server: ServerProcess, stream: bool) -> None:
    got = _reply(server, stream, messages=QUESTION, extra_body=_forced("<think>x</think>y"))
    assert got == [{"reasoning": "x", "content": "y", "calls": [], "finish_reason": "stop"}]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_reasoning_then_a_tool_call(server: ServerProcess, stream: bool) -> None:
    """Reasoning is split off first; the calls are read from the rest."""
    text = f"<think>\nI should look it up.\n</think>\n\n{CALL_TEXT}"
    got = _reply(server, stream, messages=QUESTION, tools=TOOLS, extra_body=_forced(text))
    assert [_without_ids(r) for r in got] == [
        {
            "reasoning": "\nI should look it up.\n",
            "content": None,
            "calls": [("get_weather", {"city": "Paris", "unit": "c"})],
            "finish_reason": "tool_calls",
        }
    ]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_without_thinking_the_reply_is_all_content(server: ServerProcess, stream: bool) -> None:
    kwargs = dict(messages=QUESTION, seed=3, max_tokens=12, chat_template_kwargs=NO_THINKING)
    got = _reply(server, stream, **kwargs)
    assert got[0]["reasoning"] is None and got[0]["content"] and got[0]["calls"] == []
    # thinking on (the default), a reply that never closes its thinking is all reasoning
    thinking = _reply(server, stream, messages=QUESTION, seed=3, max_tokens=12)
    assert thinking[0]["content"] is None and thinking[0]["reasoning"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_json_mode_held_from_the_first_token_is_all_content(
    server: ServerProcess, stream: bool
) -> None:
    """With thinking on, the grammar holds the reply from its first token: it opens no thinking
    block, so its JSON is the content."""
    got = _reply(server, stream, messages=QUESTION, seed=5, max_tokens=40,
                 response_format={"type": "json_object"})  # fmt: skip
    assert got[0]["reasoning"] is None and got[0]["content"], got
    assert got[0]["content"].lstrip().startswith("{"), got


def test_a_reply_sent_back_brings_its_reasoning_to_the_template(server: ServerProcess) -> None:
    """The client appends the reply it got (with its reasoning_content) to the conversation; the
    template renders that reasoning where it shows it (after the last question)."""
    client = server.client()
    first = client.chat.completions.create(
        model="qwen", messages=QUESTION, max_tokens=50, extra_body=_forced("<think>x</think>y")
    )
    message = first.choices[0].message
    assert (message.reasoning_content, message.content) == ("x", "y")  # type: ignore[attr-defined]
    second = client.chat.completions.create(model="qwen", messages=[*QUESTION, message],
                                            max_tokens=1)  # fmt: skip
    history = [*QUESTION, {"role": "assistant", "content": "y", "reasoning_content": "x"}]
    want = prompt_ids(load_tokenizer(QWEN3_TOKENIZER), None, history, None, None, {})
    assert second.usage.prompt_tokens == len(want)
    assert "<think>\nx\n</think>" in load_tokenizer(QWEN3_TOKENIZER).decode(want)


def test_include_reasoning_false_leaves_the_reasoning_out(server: ServerProcess) -> None:
    """As vLLM's (vllm-router adds `include_reasoning: true` to every chat body; false was a 400)."""
    client = server.client()
    forced = {**_forced("<think>x</think>y"), "include_reasoning": False}
    whole = (
        client.chat.completions.create(
            model="qwen", messages=QUESTION, max_tokens=50, extra_body=forced
        )
        .choices[0]
        .message
    )
    assert (whole.reasoning_content, whole.content) == (None, "y")  # type: ignore[attr-defined]
    chunks = client.chat.completions.create(
        model="qwen", messages=QUESTION, max_tokens=50, extra_body=forced, stream=True
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert not any(getattr(d, "reasoning_content", None) for d in deltas)
    assert "".join(d.content or "" for d in deltas) == "y"


END_OF_THINKING = {"logit_bias": {"151668": 100}}  # `</think>` in Qwen3's vocabulary


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_structured_output_holds_the_reply_from_the_end_of_its_thinking(
    thinking_server: ServerProcess, stream: bool
) -> None:
    """As vLLM's: the thinking is free (random weights never close it within 12 tokens, and no
    grammar made them write JSON), the answer after `</think>` is held; with thinking off, from
    the first token."""
    json_mode = {"type": "json_object"}
    free = _reply(thinking_server, stream, messages=QUESTION, seed=5, max_tokens=12,
                  response_format=json_mode)  # fmt: skip
    assert free[0]["content"] is None and free[0]["finish_reason"] == "length", free
    assert not free[0]["reasoning"].lstrip().startswith("{")
    ended = _reply(thinking_server, stream, messages=QUESTION, seed=5, max_tokens=40,
                   response_format=json_mode, extra_body=END_OF_THINKING)  # fmt: skip
    assert ended[0]["reasoning"] is None and ended[0]["content"].startswith("{"), ended
    off = _reply(thinking_server, stream, messages=QUESTION, seed=5, max_tokens=40,
                 response_format=json_mode, chat_template_kwargs=NO_THINKING)  # fmt: skip
    assert off[0]["reasoning"] is None and off[0]["content"].startswith("{"), off


@pytest.mark.parametrize(
    ("rendering", "param"),
    [
        (
            {"add_generation_prompt": False, "continue_final_message": True},
            "continue_final_message",
        ),
        ({"add_generation_prompt": False}, "add_generation_prompt"),
    ],
)
def test_a_structured_output_after_thinking_needs_a_new_turn(
    thinking_server: ServerProcess, rendering: dict[str, bool], param: str
) -> None:
    """Qwen3's template closes the thinking of the message continued: held after a `</think>`
    that never came, the reply was free text, all of it read as reasoning (a review found)."""
    messages = [*QUESTION, {"role": "assistant", "content": "Here:"}]
    body = {"model": "qwen", "messages": messages, "max_tokens": 8,
            "response_format": {"type": "json_object"}}  # fmt: skip
    refused = thinking_server.post("/v1/chat/completions", json={**body, **rendering})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == param
    off = {**body, **rendering, "chat_template_kwargs": NO_THINKING}
    held = thinking_server.post("/v1/chat/completions", json=off)
    assert held.status_code == 200 and held.json()["choices"][0]["message"]["content"].startswith(
        "{"
    )


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_required_tool_calls_follow_the_thinking(
    thinking_server: ServerProcess, stream: bool
) -> None:
    got = _reply(thinking_server, stream, messages=QUESTION, tools=TOOLS, tool_choice="required",
                 parallel_tool_calls=False, seed=7, extra_body=END_OF_THINKING)  # fmt: skip
    reply = _without_ids(got[0])
    assert reply["finish_reason"] == "tool_calls" and reply["content"] is None, reply
    assert len(reply["calls"]) == 1
    _check_arguments(*reply["calls"][0])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_tool_choice_none_leaves_calls_as_content(server: ServerProcess, stream: bool) -> None:
    """Strict tools too (no call is made, so none breaks its schema): OpenAI's Agents SDK sends
    strict on every tool."""
    tools = [TOOLS[0], {**ADD, "function": {**ADD["function"], "strict": True}}]
    got = _reply(server, stream, messages=QUESTION, tools=tools, tool_choice="none",
                 chat_template_kwargs=NO_THINKING, extra_body=_forced(CALL_TEXT))  # fmt: skip
    assert got == [{"reasoning": None, "content": CALL_TEXT, "calls": [], "finish_reason": "stop"}]


def _check_arguments(name: str, arguments: dict[str, Any]) -> None:
    """The arguments follow the tool's schema (enums, ranges, no other keys)."""
    if name == "get_weather":
        assert arguments.keys() == {"city", "unit"}
        assert arguments["city"] in ("Paris", "Oslo") and arguments["unit"] in ("c", "f")
    else:
        assert name == "add" and arguments.keys() == {"a", "b"}
        assert all(isinstance(v, int) and 0 <= v <= 99 for v in arguments.values())


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_tool_choice_required_always_gives_a_call(server: ServerProcess, stream: bool) -> None:
    """Random weights, held to an array of one call (parallel_tool_calls false bounds it)."""
    got = _reply(server, stream, messages=QUESTION, tools=TOOLS, tool_choice="required",
                 parallel_tool_calls=False, n=4, seed=7)  # fmt: skip
    assert len(got) == 4
    for reply in got:
        reply = _without_ids(reply)
        assert reply["finish_reason"] == "tool_calls" and reply["content"] is None, reply
        assert reply["reasoning"] is None and len(reply["calls"]) == 1
        _check_arguments(*reply["calls"][0])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_named_tool_choice_always_gives_that_call(server: ServerProcess, stream: bool) -> None:
    choice = {"type": "function", "function": {"name": "add"}}
    got = _reply(server, stream, messages=QUESTION, tools=TOOLS, tool_choice=choice, n=4, seed=1)
    for reply in got:
        reply = _without_ids(reply)
        # OpenAI's finish_reason for the call a named choice forced
        assert reply["finish_reason"] == "stop" and reply["content"] is None, reply
        assert [name for name, _ in reply["calls"]] == ["add"]
        _check_arguments(*reply["calls"][0])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_call_cut_by_a_stop_string_does_not_finish_as_tool_calls(
    server: ServerProcess, stream: bool
) -> None:
    """A stop string inside a call's arguments cuts it (its brackets closed for it, as at
    max_tokens): finish_reason stays stop, with the string as stop_reason; it was tool_calls,
    a call the model never finished returned as one it had. One after the arguments ended cuts
    nothing."""
    forced = {"messages": QUESTION, "tools": TOOLS, "chat_template_kwargs": NO_THINKING,
              "extra_body": _forced(CALL_TEXT)}  # fmt: skip
    cut = _without_ids(_reply(server, stream, stop=["Par"], **forced)[0])
    assert cut["calls"] == [("get_weather", {"city": ""})] and cut["finish_reason"] == "stop"
    whole = _without_ids(_reply(server, stream, stop=["</tool_call>"], **forced)[0])
    assert whole["calls"] == [("get_weather", {"city": "Paris", "unit": "c"})]
    assert whole["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_continued_message_is_the_answer(thinking_server: ServerProcess, stream: bool) -> None:
    """Qwen3's template closes the thinking of the message continued: the reply is content (it
    came back as reasoning_content, and a call in it went unparsed)."""
    said = {"role": "assistant", "content": "<think>\nEasy.\n</think>\n\nThe answer is"}
    got = _reply(thinking_server, stream, messages=[*QUESTION, said], max_tokens=6, seed=2,
                 extra_body={"continue_final_message": True, "add_generation_prompt": False})  # fmt: skip
    assert got[0]["reasoning"] is None and got[0]["content"], got


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_named_choice_cut_while_thinking_makes_no_call(
    thinking_server: ServerProcess, stream: bool
) -> None:
    """Random weights do not close the thinking within 8 tokens: no call was written, and none
    comes back (it was add({}), which breaks the tool's schema)."""
    choice = {"type": "function", "function": {"name": "add"}}
    got = _reply(thinking_server, stream, messages=QUESTION, tools=TOOLS, tool_choice=choice,
                 max_tokens=8, seed=1)  # fmt: skip
    assert got[0]["calls"] == [] and got[0]["finish_reason"] == "length", got
    assert got[0]["reasoning"], got


def test_a_tool_whose_parameters_are_not_an_object_is_refused(server: ServerProcess) -> None:
    """As OpenAI's (tool_choice required gave no call for it, only content)."""
    echo = {"type": "function", "function": {"name": "echo", "parameters": {"type": "string"}}}
    body = {"messages": QUESTION, "max_tokens": 2, "tools": [echo], "tool_choice": "required"}
    response = server.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "tools.0.function.parameters"


def test_tool_requests_that_cannot_be_served_are_refused(server: ServerProcess) -> None:
    before = server.metrics()

    def error(**body: Any) -> str:
        response = server.post(
            "/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 2, **body}
        )
        assert response.status_code == 400, response.text
        return response.json()["error"]["message"]

    named = {"type": "function", "function": {"name": "nope"}}
    assert "nope" in error(tools=TOOLS, tool_choice=named)
    assert "tool_choice" in error(tool_choice="required")
    assert "tool_call_id" in error(messages=[{"role": "tool", "content": "3"}])
    assert "content" in error(messages=[{"role": "assistant", "content": None}])
    assert "tokenize" in error(chat_template_kwargs={"tokenize": True})
    strict = {**WEATHER, "function": {**WEATHER["function"], "strict": True}}
    json_mode = {"type": "json_object"}
    assert "strict" in error(tools=[strict], response_format=json_mode)
    assert "tools" in error(tools=[{"type": "custom", "custom": {"name": "x"}}])
    # a strict tool is held to its schema when the grammar holds the reply
    response = server.post("/v1/chat/completions", json={
        "messages": QUESTION, "max_tokens": 200, "tools": [strict], "tool_choice": "required",
    })  # fmt: skip
    assert response.status_code == 200, response.text
    assert_clean(server, before, None)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_strict_tools_calls_are_held_to_its_parameters_under_tool_choice_auto(
    server: ServerProcess, stream: bool
) -> None:
    """As vLLM's (what OpenAI's Agents SDK sends): the model is free until it writes
    `<tool_call>` (forced here by logit_bias), then held to the call's format and the tool's
    parameters; the reply ends after the one call parallel_tool_calls false allows."""
    tools = [{**tool, "function": {**tool["function"], "strict": True}} for tool in TOOLS]
    call_token = load_tokenizer(QWEN3_TOKENIZER).convert_tokens_to_ids("<tool_call>")
    got = _reply(server, stream, messages=QUESTION, tools=tools, tool_choice="auto",
                 parallel_tool_calls=False, n=3, seed=5, chat_template_kwargs=NO_THINKING,
                 logit_bias={call_token: 100})  # fmt: skip
    for reply in got:
        reply = _without_ids(reply)
        assert reply["finish_reason"] == "tool_calls" and len(reply["calls"]) == 1, reply
        _check_arguments(*reply["calls"][0])


def test_under_auto_a_tool_that_is_not_strict_takes_any_object() -> None:
    strict = {**WEATHER, "function": {**WEATHER["function"], "strict": True}}
    request = ChatCompletionRequest(messages=QUESTION, tools=[strict, ADD], tool_choice="auto")
    assert request.strict_calls() == [
        ("get_weather", WEATHER["function"]["parameters"]),
        ("add", {"type": "object"}),
    ]
    assert ChatCompletionRequest(messages=QUESTION, tools=TOOLS).strict_calls() is None
    tag = json.loads(HermesToolParser.structural_tag(request.strict_calls(), parallel=True))
    grammar = xgrammar.Grammar.from_structural_tag(tag)
    for text, ok in [(f"Sure. {CALL_TEXT}", True), ("no call", True),
                     (CALL_TEXT.replace("Paris", "Rome"), False),
                     ('<tool_call>\n{"name": "add", "arguments": {"x": []}}\n</tool_call>', True)]:  # fmt: skip
        assert xgrammar.testing._is_grammar_accept_string(grammar, text) == ok, text


@pytest.mark.parametrize("piece", [1, 3, 1000])
def test_a_closing_tag_inside_a_string_argument_is_its_text(piece: int) -> None:
    """The block ended at the first `</tool_call>`, inside the string: the call's arguments
    were `{"city": "a"}` and the rest of the block came back as content."""
    text = f"{CALL_TEXT.replace('Paris', 'a</tool_call>b')}\nDone."
    parser = HermesToolParser()
    content, deltas = "", []
    for i in range(0, len(text), piece):
        more, calls = parser.feed(text[i : i + piece])
        content, deltas = content + more, deltas + calls
    more, calls = parser.finish()
    [call] = merge_calls(deltas + calls)
    assert json.loads(call["function"]["arguments"]) == {"city": "a</tool_call>b", "unit": "c"}
    assert content + more == "\nDone." and not parser.reply.cut


def _tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def test_required_calls_keep_the_tools_references_where_they_point() -> None:
    """Each tool's parameters stand inside the array's schema, their references into themselves
    (`#/$defs/...` as pydantic writes a nested model, `#`, `#/properties/...`) pointing there: two
    tools may define one name differently. `#` bound to the array before, and the arguments of a
    recursive tool broke its parameters."""
    location = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    at = {"type": "object", "properties": {"at": {"$ref": "#/$defs/Loc"}}, "required": ["at"],
          "$defs": {"Loc": location}}  # fmt: skip
    stay = {**at, "$defs": {"Loc": {"type": "integer"}}}
    tree = {"type": "object", "properties": {"children": {"type": "array", "items": {"$ref": "#"},
                                                          "maxItems": 1},
                                             "same": {"$ref": "#/properties/children"}},
            "required": ["children"], "additionalProperties": False}  # fmt: skip
    tools = [_tool("go", at), _tool("stay", stay), _tool("tree", tree)]
    request = ChatCompletionRequest(messages=QUESTION, tools=tools, tool_choice="required")
    schema = json.loads(request.sampling_params({}).structured.json_schema)
    grammar = xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    for calls, valid in [
        ([{"name": "go", "parameters": {"at": {"city": "Paris"}}}], True),
        ([{"name": "go", "parameters": {"at": 3}}], False),
        ([{"name": "stay", "parameters": {"at": 3}}], True),
        ([{"name": "stay", "parameters": {"at": {"city": "Paris"}}}], False),
        ([{"name": "tree", "parameters": {"children": [{"children": []}], "same": []}}], True),
        ([{"name": "tree", "parameters": {"children": [[{"name": "tree"}]]}}], False),
        ([{"name": "tree", "parameters": {"children": [], "same": [{"name": "go"}]}}], False),
    ]:
        assert jsonschema.Draft202012Validator(schema).is_valid(calls) == valid, calls
        text = json.dumps(calls)
        assert xgrammar.testing._is_grammar_accept_string(grammar, text) == valid, text
    # a value that holds "$ref" is no reference
    const = {"type": "object", "properties": {"r": {"const": {"$ref": "#"}}}}
    request = ChatCompletionRequest(
        messages=QUESTION, tools=[_tool("c", const)], tool_choice="required"
    )
    schema = json.loads(request.sampling_params({}).structured.json_schema)
    assert schema["items"]["anyOf"][0]["properties"]["parameters"] == const


@pytest.mark.parametrize(
    "fields", [{"tool_choice": "required"}, {"tool_choice": "auto", "strict": True}]
)
def test_tool_parameters_nested_past_the_schema_bound_are_a_400(fields: dict) -> None:
    """Held to them, a tool's parameters are a schema: 1,000 levels were a RecursionError (a 500)
    where a structured output's schema past 128 is a 400."""
    deep = '{"x":' * 1000 + "{}" + "}" * 1000
    strict = ', "strict": true' if fields.pop("strict", False) else ""
    tool = f'{{"type": "function", "function": {{"name": "f", "parameters": {deep}{strict}}}}}'
    body = f'{{"messages": {json.dumps(QUESTION)}, "tools": [{tool}], "tool_choice": '
    body += f'"{fields["tool_choice"]}"}}'
    request = parse_body(body.encode(), ChatCompletionRequest)
    with pytest.raises(
        ApiError, match="its parameters schema nests deeper than 128 levels"
    ) as refused:
        request.sampling_params({})
        request.strict_calls()
    assert refused.value.status == 400


@pytest.mark.parametrize(
    ("arguments", "given"),
    [
        ('{"a": 1, "b": [2.5, "x"]}', {"a": 1, "b": [2.5, "x"]}),
        # as vLLM's: none written is an empty object (the template wrote `"arguments": }`)
        ("", {}),
        ("  ", {}),
        ("[1, 2]", "[1, 2]"),  # no object: as written
        ("{oops", "{oops"),
        # an integer past 64 bits went in as a float; as text the template writes it as sent
        ('{"a": 18446744073709551616}', '{"a": 18446744073709551616}'),
        ('{"a": NaN}', '{"a": NaN}'),
        ('{"a": 1e400}', '{"a": 1e400}'),  # past a double: inf, which tojson wrote as Infinity
    ],
)
def test_the_template_gets_an_earlier_calls_arguments_as_an_object_where_json_allows(
    arguments: str, given: object
) -> None:
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}
    message = ChatMessage(role="assistant", content=None, tool_calls=[call])
    assert message.as_template_input()["tool_calls"][0]["function"]["arguments"] == given


def test_client_json_keys_cross_the_wire_unchanged() -> None:
    """A tool schema or template variable may use any key, even one the wire's encoding uses."""
    tools = [{"__t": "SamplingParams", "t": 1, "function": {"parameters": {"__t": "x"}}}]
    request = TokenizeRequest([0], [SamplingParams()], messages=[{"role": "user", "content": "x"}],
                              tools=tools, template_kwargs={"__t": "Ready", "t": [1]})  # fmt: skip
    assert decode(encode(request)) == request


def test_chat_parsers_are_chosen_by_name_at_start() -> None:
    with pytest.raises(SystemExit):
        parse_args(["--tool-call-parser", "nope"])
    args = parse_args(["--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"])
    assert (args.tool_call_parser, args.reasoning_parser) == ("hermes", "qwen3")
