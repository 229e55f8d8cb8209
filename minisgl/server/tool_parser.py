"""Tool calls read out of a chat reply: the Hermes/Qwen `<tool_call>{"name": …, "arguments": {…}}
</tool_call>` blocks (--tool-call-parser hermes, for tool_choice auto), the JSON array a
`required` choice constrains the reply to, and the arguments object of a named choice.

A parser is fed the reply piece by piece, as it streams, and answers with the content that became
final and the call deltas to send (a call's first delta holds its id and name, the next ones
pieces of its arguments). Decisions depend only on the text, never on where it was split, so the
whole reply fed at once gives the same content and calls. A call's arguments are the model's own
JSON text (OpenAI warns that they may not be valid JSON); one cut short is closed with the brackets
it left open where that makes it JSON, and kept as written elsewhere (`{"a"`). A call object in
another shape (its arguments first, or as a string of JSON, as vLLM's and SGLang's parsers read
them too) is read whole once its block closes; a block that is no call object is content, its tags
included.
"""

import json
import math
import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar

import orjson

from .reasoning import partial_tag_len

_WS = " \t\n\r"
# a call's start is decided within this many characters, or it is no call: each token re-read
# the undecided text, and a reply of 40,000 (`<tool_call>` and spaces, which a client's own
# regex can ask for) took 14.8 s at 4 characters a token. OpenAI's function names are 64 at most
MAX_UNDECIDED = 1024


@dataclass
class CallDelta:
    """A piece of the call at `index`; its first one has the id and the name."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def as_json(self) -> dict[str, Any]:
        function: dict[str, Any] = {"arguments": self.arguments}
        if self.id is None:
            return {"index": self.index, "function": function}
        function = {"name": self.name, **function}
        return {"index": self.index, "id": self.id, "type": "function", "function": function}


def merge_calls(deltas: list[CallDelta], whole: bool = True) -> list[dict[str, Any]]:
    """One entry per call the deltas touch, in order: the whole calls (message.tool_calls), or
    with `whole` false a chunk's delta.tool_calls, each keeping its index (OpenAI sends one entry
    per index in a chunk)."""
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        if d.index in calls:
            calls[d.index]["function"]["arguments"] += d.arguments
        else:
            calls[d.index] = d.as_json()
            if whole:
                del calls[d.index]["index"]
    return list(calls.values())


class _Cursor:
    """Reads JSON tokens off a prefix of a text: each read answers True (read), False (the text
    cannot go on this way) or None (the text ends before it could tell)."""

    def __init__(self, text: str) -> None:
        self.text, self.pos = text, 0

    def skip_ws(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos] in _WS:
            self.pos += 1

    def one_of(self, *tokens: str) -> str | bool | None:
        """The token read (after whitespace), False or None."""
        self.skip_ws()
        rest = self.text[self.pos :]
        for token in tokens:
            if rest.startswith(token):
                self.pos += len(token)
                return token
        return None if any(t.startswith(rest) for t in tokens) else False

    def string(self) -> str | bool | None:
        """A JSON string's value (after whitespace), False or None."""
        if (found := self.one_of('"')) != '"':
            return found
        start, escaped = self.pos - 1, False
        while self.pos < len(self.text):
            c = self.text[self.pos]
            self.pos += 1
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                try:
                    return loads_exact(self.text[start : self.pos])
                except ValueError:  # a lone surrogate too, which no reply can carry
                    return False
        return None


def call_header(text: str, arg_keys: tuple[str, ...]) -> tuple[str, int] | bool | None:
    """The name of the call object `{"name": "…", "<arg key>": {…}}` that starts `text`, and the
    index of its arguments' `{` (or, for `{"name": "…"}`, of its closing `}`); False when the
    text starts no call, None when it is too short to tell."""
    c = _Cursor(text)
    for token in ("{", '"name"', ":"):
        if (found := c.one_of(token)) != token:
            return found  # type: ignore[return-value]
    name = c.string()
    if not isinstance(name, str):
        return name
    after = c.one_of(",", "}")
    if after == "}":
        return name, c.pos - 1
    if after != ",":
        return after  # type: ignore[return-value]
    keys = tuple(f'"{k}"' for k in arg_keys)
    for expected in (keys, (":",), ("{",)):
        if (found := c.one_of(*expected)) not in expected:
            return found  # type: ignore[return-value]
    return name, c.pos - 1


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    if not math.isfinite(value := float(text)):
        raise ValueError(f"{text} is past a double's range")
    return value


def loads_exact(text: str) -> Any:
    """JSON text as Python values, integers exact (orjson reads one past 64 bits as a float:
    18446744073709551616 became 1.8446744073709552e+19); raises ValueError, as orjson does, for
    text that is no JSON (json's NaN and Infinity), a number past a double's range (1e400), or a
    lone surrogate (an escape no UTF-8 can carry), and RecursionError if nested too deep."""
    value = json.loads(text, parse_constant=_no_constant, parse_float=_finite)
    if "\\u" in text:  # an escape may name a lone surrogate: UnicodeEncodeError, a ValueError
        json.dumps(value, ensure_ascii=False).encode()
    return value


def whole_call(text: str) -> tuple[str, str] | None:
    """The name and the arguments' JSON of a call object in any key order, its arguments an
    object or a string holding one; None when `text` is no such object."""
    try:
        call = loads_exact(text)
        arguments = call.get("arguments", call.get("parameters", {}))
        if isinstance(arguments, str):
            arguments = loads_exact(arguments)
        if not isinstance(call.get("name"), str) or not isinstance(arguments, dict):
            return None
        return call["name"], json.dumps(arguments, ensure_ascii=False)
    except (ValueError, AttributeError, RecursionError):  # not JSON, no object, nested too deep
        return None


@dataclass
class _ValueEnd:
    """Finds where a JSON object or array ends, fed its text from its first bracket on."""

    closers: list[str] = field(default_factory=list)
    in_string: bool = False
    escaped: bool = False
    written: list[str] = field(default_factory=list)  # the value's text so far

    def feed(self, text: str) -> int | None:
        """The index in `text` just past the value's end, or None if it goes on."""
        self.written.append(text)
        for i, c in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.closers.append("}" if c == "{" else "]")
            elif c in "}]" and self.closers:
                self.closers.pop()
                if not self.closers:
                    return i + 1
        return None

    def closing(self) -> str:
        """What closes a value cut short into JSON, or "" where no closing would (`{"a"`, `[1,`):
        the value then stays as it was written, as OpenAI's."""
        closing = ('"' if self.in_string else "") + "".join(reversed(self.closers))
        try:
            orjson.loads("".join(self.written) + closing)
        except orjson.JSONDecodeError:
            return ""
        return closing


class _Reply:
    """What a parser gives back: content pieces and call deltas. Trailing whitespace of the
    content is held until more content follows: a reply with calls drops it (a reply of calls
    only has no content: null), one without keeps it."""

    def __init__(self) -> None:
        self.num_calls = 0
        self.cut = False  # a call's arguments were closed for it: it did not end on its own
        self._ws = ""
        self._out: list[str] = []
        self._deltas: list[CallDelta] = []

    def content(self, text: str) -> None:
        kept = text.rstrip(_WS)
        if kept:
            self._out.append(self._ws + kept)
            self._ws = ""
        self._ws += text[len(kept) :]

    def new_call(self, name: str, arguments: str = "") -> None:
        call_id = f"call_{uuid.uuid4().hex}"
        self._deltas.append(CallDelta(self.num_calls, arguments, call_id, name))
        self.num_calls += 1

    def arguments(self, text: str) -> None:
        if text:
            self._deltas.append(CallDelta(self.num_calls - 1, text))

    def close(self, args: "_ValueEnd") -> None:
        """Closes the arguments of the call cut short (by the reply's end or a closing tag)."""
        self.arguments(args.closing())
        self.cut = True

    def take(self, final: bool = False) -> tuple[str, list[CallDelta]]:
        if final and not self.num_calls:  # held whitespace was the content after all
            self._out.append(self._ws)
            self._ws = ""
        out, deltas = "".join(self._out), self._deltas
        self._out, self._deltas = [], []
        return out, deltas


class HermesToolParser:
    """`<tool_call>{"name": …, "arguments": {…}}</tool_call>` blocks, any number in a reply
    (one with parallel_tool_calls false: later blocks are dropped); the text outside them is the
    content. Text after a call's arguments, up to `</tool_call>`, is dropped."""

    open, close = "<tool_call>", "</tool_call>"
    calls_finish_reason: ClassVar[str] = "tool_calls"

    def __init__(self, parallel: bool = True) -> None:
        self.parallel = parallel
        self.reply = _Reply()
        self._state = "text"  # text -> header -> arguments -> after -> text, or header -> whole
        self._held = ""  # text not yet decided on
        self._searched = 0  # how much of it holds no closing tag, in a call read whole
        self._args = _ValueEnd()

    @classmethod
    def structural_tag(cls, tools: list[tuple[str, dict[str, Any]]], parallel: bool) -> str:
        """xgrammar's structural tag that holds each call, as the chat template writes it, to
        its tool's parameters (name, schema); the text outside the calls is free."""
        tags = [
            {
                "type": "tag",
                "begin": f'{cls.open}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": ',
                # one whitespace character at most between tokens (a structural tag has no
                # compact JSON): sampled whitespace otherwise runs to the token limit
                "content": {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 1},
                "end": f"}}\n{cls.close}",
            }
            for name, schema in tools
        ]
        triggered = {"type": "triggered_tags", "triggers": [cls.open], "tags": tags,
                     "stop_after_first": not parallel}  # fmt: skip
        return json.dumps({"type": "structural_tag", "format": triggered})

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        """The content and the call deltas that `text`, the reply's next piece, makes final."""
        self._step(self._held + text, final=False)
        return self.reply.take()

    def finish(self) -> tuple[str, list[CallDelta]]:
        """What was held back, once the reply has ended."""
        self._step(self._held, final=True)
        return self.reply.take(final=True)

    def _step(self, text: str, final: bool) -> None:
        self._held = ""
        while True:
            if self._state == "text":
                before, tag, text = text.partition(self.open)
                if not tag:
                    keep = 0 if final else partial_tag_len(before, self.open)
                    self.reply.content(before[: len(before) - keep])
                    self._held = before[len(before) - keep :]
                    return
                self.reply.content(before)
                self._state = "header"
            elif self._state == "header":
                end = text.find(self.close)
                window = text if end < 0 else text[:end]
                head = window[:MAX_UNDECIDED]
                header = call_header(head, ("arguments", "parameters"))
                if header is None and end < 0 and not final and len(window) <= MAX_UNDECIDED:
                    self._held = text
                    return
                if not isinstance(header, tuple):
                    if head.lstrip(_WS).startswith("{"):  # perhaps a call in another shape
                        self._state = "whole"
                    else:  # not a call: its tag is plain text
                        self.reply.content(self.open)
                        self._state = "text"
                    continue
                name, start = header
                skip = self._skipped()
                if not skip:
                    self.reply.new_call(name, "{}" if text[start] == "}" else "")
                if text[start] == "}" or skip:
                    self._state = "after"
                    continue
                self._state, self._args = "arguments", _ValueEnd()
                text = text[start:]
            elif self._state == "whole":
                end = text.find(self.close, self._searched)
                if end < 0 and not final:
                    # held whole, each piece searched once: 32,000 pieces took 1.64 s otherwise
                    self._held, self._searched = text, max(0, len(text) - len(self.close) + 1)
                    return
                before, rest = (
                    (text, "") if end < 0 else (text[:end], text[end + len(self.close) :])
                )
                self._searched = 0
                if (call := whole_call(before)) is None:  # its tag is plain text
                    self.reply.content(self.open)
                    self._state = "text"
                    continue
                if not self._skipped():
                    self.reply.new_call(*call)
                self._state, text = "text", rest
            elif self._state == "arguments":
                before, tag, rest = text.partition(self.close)
                keep = 0 if tag or final else partial_tag_len(before, self.close)
                piece = before[: len(before) - keep]
                end = self._args.feed(piece)
                if end is not None:
                    self.reply.arguments(piece[:end])
                    self._state, text = "after", text[end:]
                    continue
                self.reply.arguments(piece)
                if tag and self._args.in_string:  # the tag is text of a string argument
                    self._args.feed(self.close)
                    self.reply.arguments(self.close)
                    text = rest
                    continue
                if not tag and not final:
                    self._held = before[len(before) - keep :]
                    return
                self.reply.close(self._args)
                self._state, text = "text", rest
            else:  # after a call's arguments: up to the closing tag
                before, tag, text = text.partition(self.close)
                if not tag:
                    keep = 0 if final else partial_tag_len(before, self.close)
                    self._held = before[len(before) - keep :]
                    return
                self._state = "text"

    def _skipped(self) -> bool:
        """Whether a call found now is dropped: one past the first without parallel calls."""
        return not self.parallel and self.reply.num_calls > 0


class JsonArrayToolParser:
    """The reply of tool_choice `required`: a JSON array of `{"name": …, "parameters": {…}}`
    objects (the grammar makes it one), each a call; what follows the array is dropped. A reply
    that is not such an array (no grammar held it) is all content, up to its first call."""

    calls_finish_reason: ClassVar[str] = "tool_calls"

    def __init__(self, parallel: bool = True) -> None:
        self.parallel = parallel
        self.reply = _Reply()
        self._state = "start"  # start -> header -> arguments -> end -> next -> header ... done
        self._held = ""
        self._seen = ""  # the reply so far, while it has no call
        self._args = _ValueEnd()
        self._wanted = True  # the call being read is returned (not past the first one alone)

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        self._step(text, final=False)
        return self.reply.take()

    def finish(self) -> tuple[str, list[CallDelta]]:
        self._step("", final=True)
        return self.reply.take(final=True)

    def _step(self, text: str, final: bool) -> None:
        if not self.reply.num_calls:
            self._seen += text
        text, self._held = self._held + text, ""
        while True:
            if self._state == "content":
                self.reply.content(text)
                return
            if self._state == "done":
                return
            if self._state == "arguments":
                end = self._args.feed(text)
                if self._wanted:
                    self.reply.arguments(text if end is None else text[:end])
                if end is None:
                    if final and self._wanted:
                        self.reply.close(self._args)
                    return
                self._state, text = "end", text[end:]
                continue
            if self._state == "header":
                header = call_header(text[:MAX_UNDECIDED], ("parameters",))
                if isinstance(header, tuple):
                    name, start = header
                    self._wanted = self.parallel or not self.reply.num_calls
                    if self._wanted:
                        self.reply.new_call(name, "{}" if text[start] == "}" else "")
                    if text[start] == "}":
                        self._state, text = "next", text[start + 1 :]
                    else:
                        self._state, self._args, text = "arguments", _ValueEnd(), text[start:]
                    continue
                found: str | bool | None = header
            else:
                c = _Cursor(text[:MAX_UNDECIDED])
                expected = {"start": ("[",), "end": ("}",), "next": (",", "]")}[self._state]
                found = c.one_of(*expected)
            if found is None and not final and len(text) <= MAX_UNDECIDED:
                self._held = text
                return
            if not isinstance(found, str) or found == "]":  # the array broke off, or ended
                self._state = "done" if self.reply.num_calls else "content"
                text = "" if found == "]" else self._seen
                continue
            self._state = {"start": "header", "end": "next", "next": "header"}[self._state]
            text = text[c.pos :]


class NamedToolParser:
    """The reply of a named tool_choice: the arguments of that one call (the grammar makes it
    an object of the function's parameters)."""

    # OpenAI ends a named choice's call with finish_reason stop
    calls_finish_reason: ClassVar[str] = "stop"

    def __init__(self, name: str) -> None:
        self.name = name
        self.reply = _Reply()
        self._args = _ValueEnd()

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        """The call begins with the reply's first text: none comes while the model thinks."""
        self._args.feed(text)
        if not self.reply.num_calls:
            if text:
                self.reply.new_call(self.name, text)
        else:
            self.reply.arguments(text)
        return self.reply.take()

    def finish(self) -> tuple[str, list[CallDelta]]:
        """A reply cut short before its arguments began (while thinking) made no call: OpenAI
        never returns one the model did not write."""
        if self.reply.num_calls and self._args.closers:
            self.reply.close(self._args)
        return self.reply.take(final=True)


ToolParser = HermesToolParser | JsonArrayToolParser | NamedToolParser

# --tool-call-parser name -> the parser of one reply (tool_choice auto), given parallel_tool_calls
TOOL_PARSERS: dict[str, type[HermesToolParser]] = {"hermes": HermesToolParser}
