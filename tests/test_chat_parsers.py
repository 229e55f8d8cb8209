"""The chat reply parsers (server/tool_parser.py, server/reasoning.py) on their own: a reply fed
whole and the same reply streamed, split at every character boundary, give the same result."""

import json
import random
import re
from collections.abc import Callable
from typing import Any

import pytest

from minisgl.messages import Finished
from minisgl.server.reasoning import Qwen3ReasoningParser
from minisgl.server.responses import ChatFormat, Choice, ReplyParser
from minisgl.server.tool_parser import (
    MAX_UNDECIDED,
    HermesToolParser,
    JsonArrayToolParser,
    NamedToolParser,
    merge_calls,
)

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, {"x": "}\\""}]}}'


def _splits(text: str) -> list[list[str]]:
    """The text whole, in two pieces at every boundary, one character a piece, and in random
    pieces."""
    rng = random.Random(0)
    out = [[text], list(text)] + [[text[:i], text[i:]] for i in range(len(text) + 1)]
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, 5)))
        out.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    return out


def _tools(make: Callable[[], Any], pieces: list[str]) -> tuple[str | None, list[dict]]:
    """The content (None when calls only) and the calls, ids checked and left out."""
    parser, content, deltas = make(), "", []
    for piece in pieces:
        text, new = parser.feed(piece)
        content, deltas = content + text, deltas + new
    text, new = parser.finish()
    content, deltas = content + text, deltas + new
    calls = merge_calls(deltas)
    for call in calls:
        assert re.fullmatch(r"call_[0-9a-f]{32}", call.pop("id")) and call.pop("type") == "function"
    return (content or None) if calls else content, [c["function"] for c in calls]


def _same_however_split(make: Callable[[], Any], text: str) -> tuple[str | None, list[dict]]:
    whole = _tools(make, [text])
    for pieces in _splits(text):
        assert _tools(make, pieces) == whole, pieces
    return whole


def test_hermes_blocks_become_calls_and_the_text_outside_them_content() -> None:
    text = f"Let me look.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n"
    text += '{"name": "now", "arguments": {}}\n</tool_call>\n'
    content, calls = _same_however_split(HermesToolParser, text)
    assert content == "Let me look."
    args = json.loads(WEATHER)["arguments"]
    assert calls == [
        {"name": "get_weather", "arguments": json.dumps(args)},
        {"name": "now", "arguments": "{}"},
    ]
    assert json.loads(calls[0]["arguments"]) == args


def test_a_reply_of_calls_only_has_no_content() -> None:
    text = f"<tool_call>\n{WEATHER}\n</tool_call>\n"
    assert _same_however_split(HermesToolParser, text)[0] is None


def test_a_reply_without_calls_is_its_content_unchanged() -> None:
    for text in ["", "  plain text \n", "a < b and <tool or <tool_cal", "</tool_call> x"]:
        assert _same_however_split(HermesToolParser, text) == (text, [])


@pytest.mark.parametrize(
    "block",
    [
        "not json",
        '{"name": oops}',
        '{"arguments": {}}',
        '{"name": 3, "arguments": {}}',
        '{"name": "f", "arguments": [1]}',
        '{"name": "f", "arguments": "[1]"}',
        '{"name": "f", "arguments": "{oops"}',
        '{"arguments": {"s": "\\ud83d"}, "name": "f"}',  # a lone surrogate: no reply carries it
        '{"name": "f"',
        '{"a": ' + "[" * 3000 + "]" * 3000 + "}",  # too deep for json.loads
    ],
)
def test_a_malformed_block_is_left_as_content(block: str) -> None:
    text = f"a <tool_call>{block}</tool_call> b <tool_call>{WEATHER}</tool_call>"
    content, calls = _same_however_split(HermesToolParser, text)
    assert content == f"a <tool_call>{block}</tool_call> b"
    assert [c["name"] for c in calls] == ["get_weather"]


@pytest.mark.parametrize(
    "block",
    [
        '{"arguments": {"city": "Paris", "days": [1]}, "name": "get_weather"}',
        '{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\", \\"days\\": [1]}"}',
        '{"parameters": "{\\"city\\": \\"Paris\\", \\"days\\": [1]}", "name": "get_weather"}',
    ],
)
def test_a_call_in_another_shape_is_read_whole_once_its_block_closes(block: str) -> None:
    text = f"a <tool_call>\n{block}\n</tool_call> b <tool_call>{block}"  # the second never closed
    content, calls = _same_however_split(HermesToolParser, text)
    assert content == "a  b"
    args = {"city": "Paris", "days": [1]}
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", args)] * 2
    parser = HermesToolParser()
    assert parser.feed(f"<tool_call>{block[:-1]}") == ("", [])  # nothing is sent before it closes
    assert [d.name for d in parser.feed("}</tool_call>")[1]] == ["get_weather"]


def test_a_call_read_whole_keeps_its_integers_exact_and_refuses_what_is_no_json() -> None:
    """orjson read an integer past 64 bits as a float (1.2345678901234569e+23); json's NaN is
    no JSON: that block is content."""
    block = '{"arguments": {"id": 123456789012345678901234}, "name": "f"}'
    _, calls = _same_however_split(HermesToolParser, f"<tool_call>{block}</tool_call>")
    assert calls == [{"name": "f", "arguments": '{"id": 123456789012345678901234}'}]
    for value in ("NaN", "1e400", '"\\ud800"'):  # 1e400 was inf, written back as Infinity
        text = f'<tool_call>{{"arguments": {{"a": {value}}}, "name": "f"}}</tool_call>'
        assert _same_however_split(HermesToolParser, text) == (text, [])
    # a name no reply can carry (a lone surrogate) was a 500, in either key order
    for block in ('{"arguments": {}, "name": "f\\ud800"}', '{"name": "f\\ud800", "arguments": {}}'):
        text = f"<tool_call>{block}</tool_call>"
        assert _same_however_split(HermesToolParser, text) == (text, [])


def test_a_call_start_undecided_past_the_limit_is_content_however_streamed() -> None:
    """A call's start is decided within MAX_UNDECIDED characters: each token re-read the text
    held so far (40,000 characters of `<tool_call>` and spaces: 14.8 s), and a streamed reply
    showed none of it until its end."""
    spaces = " " * (MAX_UNDECIDED + 1)
    text = f"<tool_call>{spaces}{WEATHER}</tool_call>"
    assert _same_however_split(HermesToolParser, text) == (text, [])
    parser = HermesToolParser()
    shown = "".join(parser.feed(text[i : i + 4])[0] for i in range(0, 2 * MAX_UNDECIDED, 4))
    assert shown.startswith("<tool_call>   ")
    array = f"[{spaces}{WEATHER}]".replace('"arguments"', '"parameters"')
    assert _same_however_split(JsonArrayToolParser, array) == (array, [])


def test_a_call_cut_short_is_closed() -> None:
    for parser, text in (
        (HermesToolParser, '<tool_call>{"name": "f", "arguments": {"q": ["a", "b'),
        # a named choice's as well (its arguments were left open)
        (lambda: NamedToolParser("f"), '{"q": ["a", "b'),
    ):
        content, calls = _same_however_split(parser, text)
        assert content is None and json.loads(calls[0]["arguments"]) == {"q": ["a", "b"]}
    # a block with no arguments at all is a call without arguments
    content, calls = _same_however_split(HermesToolParser, '<tool_call>{"name": "g"}</tool_call>')
    assert calls == [{"name": "g", "arguments": "{}"}]


@pytest.mark.parametrize("cut", ['{"a"', '{"a":', '{"a": 1,', '{"a": [1, ', '{"a": tr', '{"a": 1.'])
def test_a_call_cut_where_no_closing_makes_json_keeps_its_text(cut: str) -> None:
    """Closed up, `{"a"` was `{"a"}`: text the model never wrote, and no JSON either."""
    for parser, text in (
        (HermesToolParser, f'<tool_call>{{"name": "f", "arguments": {cut}'),
        (JsonArrayToolParser, f'[{{"name": "f", "parameters": {cut}'),
        (lambda: NamedToolParser("f"), cut),
    ):
        assert _same_however_split(parser, text) == (None, [{"name": "f", "arguments": cut}])


def test_text_after_the_arguments_is_dropped_up_to_the_closing_tag() -> None:
    text = '<tool_call>{"name": "f", "arguments": {"a": 1}} junk</tool_call>after'
    assert _same_however_split(HermesToolParser, text) == (
        "after",
        [{"name": "f", "arguments": '{"a": 1}'}],
    )


def test_without_parallel_calls_only_the_first_is_kept() -> None:
    text = f"<tool_call>{WEATHER}</tool_call>\n<tool_call>" + '{"name": "b"}</tool_call> end'
    content, calls = _same_however_split(lambda: HermesToolParser(parallel=False), text)
    assert content == "\n end" and [c["name"] for c in calls] == ["get_weather"]


def test_streamed_call_deltas_have_the_id_and_name_first_then_argument_pieces() -> None:
    parser = HermesToolParser()
    deltas = []
    for c in f"<tool_call>{WEATHER}</tool_call>":
        deltas += parser.feed(c)[1]
    deltas += parser.finish()[1]
    first, *rest = [d.as_json() for d in deltas]
    assert first["index"] == 0 and first["type"] == "function" and first["id"].startswith("call_")
    assert first["function"]["name"] == "get_weather"
    assert len(rest) > 10 and all(set(d) == {"index", "function"} for d in rest)
    assert all(set(d["function"]) == {"arguments"} for d in rest)


def test_the_required_array_gives_one_call_per_item() -> None:
    text = '[{"name": "a", "parameters": {"x": [1, 2]}} ,\n{"name":"b","parameters":{}}]'
    content, calls = _same_however_split(JsonArrayToolParser, text)
    assert content is None
    assert calls == [{"name": "a", "arguments": '{"x": [1, 2]}'}, {"name": "b", "arguments": "{}"}]
    one = _same_however_split(lambda: JsonArrayToolParser(parallel=False), text)
    assert one == (None, calls[:1])
    # cut short in the second call's arguments: closed; in its header: no second call
    assert _same_however_split(JsonArrayToolParser, text[:-3]) == (None, calls)
    assert _same_however_split(JsonArrayToolParser, text[:-8]) == (None, calls[:1])
    cut = _same_however_split(lambda: JsonArrayToolParser(parallel=False), text[:-3])
    assert cut == (None, calls[:1])


def test_a_required_reply_that_is_no_array_is_content() -> None:
    for text in ["hello", '[{"name": 1}]', "  "]:
        assert _same_however_split(JsonArrayToolParser, text) == (text, [])


def test_a_named_choice_reply_is_that_call_s_arguments() -> None:
    text = '{"city": "Paris"}'
    assert _same_however_split(lambda: NamedToolParser("get_weather"), text) == (
        None,
        [{"name": "get_weather", "arguments": text}],
    )


def _reply(make: Callable[[], ReplyParser], pieces: list[str]) -> list[tuple[str, str, list]]:
    parser = make()
    return [parser.feed(piece, False) for piece in pieces] + [parser.feed("", True)]


def test_a_named_call_begins_after_the_thinking() -> None:
    """Its id and name come with the reply's first text, not while the model thinks; a reply
    cut short while thinking makes no call (it made f({}), which the model never wrote)."""

    def make() -> ReplyParser:
        return ReplyParser(Qwen3ReasoningParser({}, constrained=True), NamedToolParser("f"))

    steps = _reply(make, ["<think>a", "b</think>", '{"x": 1}'])
    assert [calls for _, _, calls in steps[:2]] == [[], []]
    assert "".join(reasoning for reasoning, _, _ in steps) == "ab"
    calls = merge_calls([d for _, _, deltas in steps for d in deltas])
    assert [c["function"] for c in calls] == [{"name": "f", "arguments": '{"x": 1}'}]
    assert not [d for _, _, deltas in _reply(make, ["<think>a"]) for d in deltas]


def _reasoning(kwargs: dict, pieces: list[str], constrained: bool = False) -> tuple[str, str]:
    parser, reasoning, content = Qwen3ReasoningParser(kwargs, constrained), "", ""
    for piece in [*pieces, None]:
        r, c = parser.feed(piece) if piece is not None else parser.finish()
        reasoning, content = reasoning + r, content + c
    return reasoning, content


@pytest.mark.parametrize(
    ("text", "kwargs", "want"),
    [
        ("<think>x</think>y", {}, ("x", "y")),
        ("<think>\nlet me see\n</think>\n\nYes.", {}, ("\nlet me see\n", "\n\nYes.")),
        ("x</think>y", {}, ("x", "y")),  # the template opened the block in the prompt
        ("<think>still thinking</thi", {}, ("still thinking</thi", "")),  # cut short
        ("<thi", {}, ("<thi", "")),
        ("no tags", {}, ("no tags", "")),
        ("<think>a</think>b</think>c<think>", {}, ("a", "b</think>c<think>")),
        ("Hi <think>x</think>y", {"enable_thinking": False}, ("", "Hi <think>x</think>y")),
        ("", {}, ("", "")),
    ],
)
def test_qwen3_reasoning_split_however_streamed(text: str, kwargs: dict, want: tuple) -> None:
    for pieces in _splits(text):
        assert _reasoning(kwargs, pieces) == want, pieces


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ('{"answer": 42}', ("", '{"answer": 42}')),  # JSON mode
        ("yes", ("", "yes")),  # a choice
        ("<thi", ("", "<thi")),  # a regex's text that only starts like the tag
        ("<think>x</think>y", ("x", "y")),  # the constraint wrote the block itself
        ("<think>still thinking", ("still thinking", "")),
    ],
)
def test_a_constrained_reply_is_reasoning_only_in_a_block_it_opens(text: str, want: tuple) -> None:
    """A structured output holds the reply from its first token: with thinking on, a reply
    that does not open `<think>` is the answer, not thinking cut short."""
    for pieces in _splits(text):
        assert _reasoning({}, pieces, constrained=True) == want, pieces


def _format(
    reasoning: bool, tools: Callable[[], Any] | None, include_reasoning: bool = True
) -> ChatFormat:
    return ChatFormat(
        lambda: ReplyParser(Qwen3ReasoningParser({}) if reasoning else None, tools and tools()),
        include_reasoning,
    )


def _end(reason: str = "stop") -> Finished:
    return Finished(0, reason, None, 1, 1, 0)  # type: ignore[arg-type]


def test_a_chat_message_holds_reasoning_content_and_tool_calls() -> None:
    text = f"<think>hmm</think>\n\n<tool_call>{WEATHER}</tool_call>"
    whole = _format(True, HermesToolParser).choice(
        0, Choice(text, end=_end()), 0, False, False, True
    )
    message = whole["message"]  # type: ignore[index]
    assert message["content"] is None and message["reasoning_content"] == "hmm"
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]
    assert whole["finish_reason"] == "tool_calls"  # type: ignore[index]
    # cut short by max_tokens, the reply keeps its own reason
    cut = _format(False, HermesToolParser).choice(
        0, Choice(f"<tool_call>{WEATHER[:30]}", end=_end("length")), 0, False, False, True
    )
    assert cut["finish_reason"] == "length"  # type: ignore[index]


def test_include_reasoning_false_leaves_the_reasoning_out() -> None:
    """As vLLM's: the reasoning is still split off the content, and not sent (the field was
    refused but for true)."""
    text = "<think>hmm</think>ok"
    whole = _format(True, None, include_reasoning=False).choice(
        0, Choice(text, end=_end()), 0, False, False, True
    )
    assert whole["message"] == {"role": "assistant", "content": "ok", "reasoning_content": None}  # type: ignore[index]
    fmt = _format(True, None, include_reasoning=False)
    chunks = [fmt.choice(0, Choice(c), 0, False, True, i == 0) for i, c in enumerate(text)]
    deltas = [c["delta"] for c in chunks if c is not None]
    assert not any("reasoning_content" in d for d in deltas)
    assert "".join(d.get("content", "") for d in deltas) == "ok"


@pytest.mark.parametrize("delta", [False, True], ids=["whole", "streamed"])
def test_a_named_tool_choice_s_call_finishes_with_stop(delta: bool) -> None:
    """As OpenAI's: `tool_calls` for calls the model chose to make (auto, required), `stop` for
    the call a named choice forced."""
    fmt = _format(False, lambda: NamedToolParser("get_weather"))
    out = fmt.choice(0, Choice('{"city": "Paris"}', end=_end()), 0, False, delta, True)
    message = out["delta" if delta else "message"]  # type: ignore[index]
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]
    assert out["finish_reason"] == "stop"  # type: ignore[index]
    required = _format(False, JsonArrayToolParser).choice(
        0, Choice('[{"name": "f", "parameters": {}}]', end=_end()), 0, False, delta, True
    )
    assert required["finish_reason"] == "tool_calls"  # type: ignore[index]


def test_streamed_chat_chunks_hold_only_what_they_got() -> None:
    fmt = _format(True, HermesToolParser)
    text = f"<think>hmm</think>ok<tool_call>{WEATHER}</tool_call>"
    chunks = [fmt.choice(0, Choice(c), 0, False, True, i == 0) for i, c in enumerate(text)]
    chunks.append(fmt.choice(0, Choice(end=_end()), 0, False, True, False))
    sent = [c for c in chunks if c is not None]
    assert sent[0]["delta"] == {"role": "assistant", "content": ""}  # held back: '<'
    assert len(sent) < len(chunks)  # chunks with nothing in them are not sent
    deltas = [c["delta"] for c in sent]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "hmm"
    assert "".join(d.get("content", "") for d in deltas) == "ok"
    calls = [t for d in deltas for t in d.get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    arguments = "".join(t["function"]["arguments"] for t in calls)
    assert json.loads(arguments) == json.loads(WEATHER)["arguments"]
    assert sent[-1]["finish_reason"] == "tool_calls" and sent[-1]["delta"] == {}
    assert all(c["finish_reason"] is None for c in sent[:-1])


def test_without_parsers_the_chat_format_is_unchanged() -> None:
    fmt = ChatFormat()
    assert fmt.choice(0, Choice("<think>x", end=_end()), 0, False, False, True)["message"] == {
        "role": "assistant",
        "content": "<think>x",
    }  # type: ignore[index]
    assert fmt.choice(0, Choice(""), 0, False, True, False)["delta"] == {"content": ""}  # type: ignore[index]


def test_text_that_only_starts_like_a_tag_is_kept() -> None:
    args = '{"q": "a <b </tool_ x"}'
    text = f'<tool_calls <tool_call>{{"name": "f", "arguments": {args}}}</tool_call>'
    assert _same_however_split(HermesToolParser, text) == (
        "<tool_calls",
        [{"name": "f", "arguments": args}],
    )
