"""OpenAI response shapes. Completions and chat differ only in how a choice is written; the
envelope, usage and the streaming machinery (generation.py) are shared."""

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from starlette.responses import Response

from minisgl.messages import Finished, TextLogprobs

from .reasoning import Qwen3ReasoningParser
from .tool_parser import CallDelta, ToolParser, merge_calls


def json_response(body: dict[str, Any], status: int = 200, headers: Any = None) -> Response:
    return Response(orjson.dumps(body), status, headers, media_type="application/json")


@dataclass
class Choice:
    """One choice's text and logprobs so far, and how it ended."""

    text: str = ""
    logprobs: list[TextLogprobs] = field(default_factory=list)
    end: Finished | None = None
    # its prompt's tokens', where asked, as vLLM's prompt_logprobs: shared by the prompt's choices
    prompt_logprobs: list[dict[str, Any] | None] | None = None
    # the logprobs' token texts, in characters: where the next token's text_offset is (the text
    # lags behind while a possible stop string is held back)
    logprobs_chars: int = 0

    def add(self, text: str, logprobs: list[TextLogprobs]) -> None:
        self.text += text
        self.logprobs += logprobs
        self.logprobs_chars += sum(len(t.token) for t in logprobs)

    @property
    def finish_reason(self) -> str | None:
        return None if self.end is None else self.end.reason

    @property
    def matched_stop(self) -> str | int | None:
        return None if self.end is None else self.end.matched_stop


def usage(choices: list[Choice], n: int) -> dict[str, Any]:
    """Token counts of a response (its choices have ended); each prompt's tokens count once,
    however many choices it has."""
    ends = [c.end for c in choices]
    assert all(e is not None for e in ends), "usage is counted when every choice has ended"
    prompt = sum(e.prompt_tokens for e in ends[::n])  # type: ignore[union-attr]
    completion = sum(e.completion_tokens for e in ends)  # type: ignore[union-attr]
    cached = sum(e.cached_tokens for e in ends[::n])  # type: ignore[union-attr]
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


class ReplyFormat(ABC):
    id_prefix: str
    object: str  # a whole response
    chunk_object: str  # one streamed chunk

    @abstractmethod
    def choice(
        self,
        index: int,
        piece: Choice,
        text_offset: int,
        want_logprobs: bool,
        delta: bool,
        first: bool,
    ) -> dict[str, Any] | None:
        """A response's (or with delta, a chunk's) choice holding `piece`, which starts
        `text_offset` characters into the choice's text; `first`: the choice's first chunk.
        None: a chunk with nothing to send yet."""

    def envelope(
        self, rid: str, created: int, model: str, choices: list[dict[str, Any]], chunk: bool
    ) -> dict[str, Any]:
        return {
            "id": rid,
            "object": self.chunk_object if chunk else self.object,
            "created": created,
            "model": model,
            "choices": choices,
        }

    def prompt_logprobs(self, choices: list[Choice]) -> dict[str, Any]:
        """What a whole response adds of its prompt's logprobs besides its choices'."""
        return {}


def vllm_prompt_logprobs(entries: list[TextLogprobs]) -> list[dict[str, Any] | None]:
    """vLLM's prompt_logprobs: None for the prompt's first token, then for each one a map from
    token id to its logprob, rank and text: the prompt's token, then the likeliest ones."""
    out: list[dict[str, Any] | None] = [None]
    for e in entries[1:]:
        ids = [e.token_id, *(e.top_ids or [])]
        ranks = [e.rank, *range(1, len(e.top) + 1)]
        texts = [(e.token, e.logprob), *e.top]
        by_id: dict[str, Any] = {}
        for token_id, rank, (text, logprob) in zip(ids, ranks, texts, strict=True):
            # JSON has no -inf: vLLM's stand-in for it
            entry = {"logprob": max(logprob, -9999.0), "rank": rank, "decoded_token": text}
            by_id.setdefault(str(token_id), entry)
        out.append(by_id)
    return out


def _top_by_text(
    sampled: tuple[str, float | None], top: list[tuple[str, float]]
) -> dict[str, float] | None:
    """A completion's top_logprobs: the likeliest tokens and the sampled one (so up to
    logprobs + 1 of them, as OpenAI's legacy completions give), keyed by token text; of tokens
    that render alike (the pieces of a multi-byte character are each U+FFFD) the likeliest is
    kept. None for an echoed prompt's first token, which nothing predicts."""
    if sampled[1] is None:
        return None
    by_text: dict[str, float] = {}
    for token, logprob in sorted([*top, sampled], key=lambda entry: -entry[1]):
        by_text.setdefault(token, logprob)
    return by_text


class CompletionFormat(ReplyFormat):
    id_prefix = "cmpl"
    object = chunk_object = "text_completion"

    def choice(
        self,
        index: int,
        piece: Choice,
        text_offset: int,
        want_logprobs: bool,
        delta: bool,
        first: bool,
    ) -> dict[str, Any]:
        logprobs = None
        if want_logprobs:
            offsets, offset = [], text_offset
            for t in piece.logprobs:
                offsets.append(offset)
                offset += len(t.token)
            logprobs = {
                "tokens": [t.token for t in piece.logprobs],
                "token_logprobs": [t.logprob for t in piece.logprobs],
                "top_logprobs": [_top_by_text((t.token, t.logprob), t.top) for t in piece.logprobs],
                "text_offset": offsets,
            }
        out = {
            "index": index,
            "text": piece.text,
            "logprobs": logprobs,
            "finish_reason": piece.finish_reason,
            "stop_reason": piece.matched_stop,
        }
        if piece.prompt_logprobs is not None:
            out["prompt_logprobs"] = piece.prompt_logprobs
        return out


class ReplyParser:
    """One chat choice's reply read as it streams (or whole): the reasoning split off first, then
    tool calls read out of the rest."""

    def __init__(self, reasoning: Qwen3ReasoningParser | None, tools: ToolParser | None) -> None:
        self.reasoning, self.tools = reasoning, tools
        self.num_calls = 0

    def feed(self, text: str, end: bool) -> tuple[str, str, list[CallDelta]]:
        """The reasoning, the content and the call deltas that `text`, the reply's next piece,
        makes final (with `end`: the rest too)."""
        reasoning, content = self.reasoning.feed(text) if self.reasoning else ("", text)
        if end and self.reasoning:
            more = self.reasoning.finish()
            reasoning, content = reasoning + more[0], content + more[1]
        if self.tools is None:
            return reasoning, content, []
        content, calls = self.tools.feed(content)
        if end:
            more_content, more_calls = self.tools.finish()
            content, calls = content + more_content, calls + more_calls
        self.num_calls += sum(c.id is not None for c in calls)
        return reasoning, content, calls


class ChatFormat(ReplyFormat):
    """With a `new_parser` (the server's --reasoning-parser, the request's tools), each choice's
    reply is parsed: reasoning_content (null without `include_reasoning`, as vLLM's), content
    (null when empty), tool_calls, and the finish_reason `tool_calls` for a reply whose calls
    ended on their own (`stop` for a named tool_choice's, as OpenAI's; a call cut short by a stop
    string keeps `stop`, with the string as stop_reason)."""

    id_prefix = "chatcmpl"
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(
        self, new_parser: Callable[[], ReplyParser] | None = None, include_reasoning: bool = True
    ) -> None:
        self.new_parser = new_parser
        self.include_reasoning = include_reasoning
        self._parsers: dict[int, ReplyParser] = {}  # a streamed choice's, by index

    def prompt_logprobs(self, choices: list[Choice]) -> dict[str, Any]:
        """As vLLM's chat response: the prompt's logprobs beside the choices (one prompt)."""
        entries = choices[0].prompt_logprobs if choices else None
        return {} if entries is None else {"prompt_logprobs": entries}

    def choice(
        self,
        index: int,
        piece: Choice,
        text_offset: int,
        want_logprobs: bool,
        delta: bool,
        first: bool,
    ) -> dict[str, Any] | None:
        out: dict[str, Any] = {"index": index}
        finish_reason = piece.finish_reason
        if self.new_parser is None:
            message: dict[str, Any] = {"content": piece.text}
        else:
            if not delta:
                parser = self.new_parser()
            elif (parser := self._parsers.get(index)) is None:
                parser = self._parsers[index] = self.new_parser()
            reasoning, content, calls = parser.feed(piece.text, end=piece.end is not None)
            if not self.include_reasoning:
                reasoning = ""
            message = self._message(reasoning, content, calls, parser, delta)
            if delta and not message and not first and not piece.logprobs and not piece.end:
                return None  # all held back: nothing to send yet
            tools = parser.tools
            # not for calls a stop string cut short: they were returned as finished ones
            if (
                tools is not None
                and parser.num_calls
                and not tools.reply.cut
                and finish_reason == "stop"
            ):
                finish_reason = tools.calls_finish_reason
        if delta:
            out["delta"] = {"role": "assistant", **message} if first else message
            if first and not message:
                out["delta"]["content"] = ""
        else:
            out["message"] = {"role": "assistant", **message}
        out["logprobs"] = None
        if want_logprobs:
            out["logprobs"] = {
                "content": [_chat_logprob(t) for t in piece.logprobs],
                "refusal": None,
            }
        out["finish_reason"] = finish_reason
        out["stop_reason"] = piece.matched_stop
        return out

    @staticmethod
    def _message(
        reasoning: str, content: str, calls: list[CallDelta], parser: ReplyParser, delta: bool
    ) -> dict[str, Any]:
        """A message's (or with delta, a chunk's) parsed fields; a chunk has only those it got."""
        if delta:
            message: dict[str, Any] = {}
            if reasoning:
                message["reasoning_content"] = reasoning
            if content:
                message["content"] = content
            if calls:
                message["tool_calls"] = merge_calls(calls, whole=False)
            return message
        message = {"content": content or None}
        if parser.reasoning is not None:
            message["reasoning_content"] = reasoning or None
        if calls:
            message["tool_calls"] = merge_calls(calls)
        return message


def _chat_logprob(t: TextLogprobs) -> dict[str, Any]:
    def entry(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return {**entry(t.token, t.logprob), "top_logprobs": [entry(tok, lp) for tok, lp in t.top]}
