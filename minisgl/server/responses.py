"""OpenAI response shapes. Completions and chat differ only in how a choice is written; the
envelope, usage and the streaming machinery (generation.py) are shared."""

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import orjson
from starlette.responses import Response

from minisgl.messages import Finished, TextLogprobs


def json_response(body: dict[str, Any], status: int = 200, headers: Any = None) -> Response:
    return Response(orjson.dumps(body), status, headers, media_type="application/json")


@dataclass
class Choice:
    """One choice's text, logprobs and token count so far, and how it ended."""

    text: str = ""
    logprobs: list[TextLogprobs] = field(default_factory=list)
    num_tokens: int = 0
    end: Finished | None = None

    def add(self, text: str, num_tokens: int, logprobs: TextLogprobs | None) -> None:
        self.text += text
        self.num_tokens += num_tokens
        if logprobs is not None:
            self.logprobs.append(logprobs)

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


class ResponseFormat(ABC):
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
    ) -> dict[str, Any]:
        """A response's (or with delta, a chunk's) choice holding `piece`, which starts
        `text_offset` characters into the choice's text; `first`: the choice's first chunk."""

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


class CompletionFormat(ResponseFormat):
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
                "top_logprobs": [dict(t.top) for t in piece.logprobs],
                "text_offset": offsets,
            }
        return {
            "index": index,
            "text": piece.text,
            "logprobs": logprobs,
            "finish_reason": piece.finish_reason,
            "stop_reason": piece.matched_stop,
        }


class ChatFormat(ResponseFormat):
    id_prefix = "chatcmpl"
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def choice(
        self,
        index: int,
        piece: Choice,
        text_offset: int,
        want_logprobs: bool,
        delta: bool,
        first: bool,
    ) -> dict[str, Any]:
        out: dict[str, Any] = {"index": index}
        if delta:
            out["delta"] = (
                {"role": "assistant", "content": piece.text} if first else {"content": piece.text}
            )
        else:
            out["message"] = {"role": "assistant", "content": piece.text}
        out["logprobs"] = None
        if want_logprobs:
            out["logprobs"] = {
                "content": [_chat_logprob(t) for t in piece.logprobs],
                "refusal": None,
            }
        out["finish_reason"] = piece.finish_reason
        out["stop_reason"] = piece.matched_stop
        return out


def _chat_logprob(t: TextLogprobs) -> dict[str, Any]:
    def entry(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return {**entry(t.token, t.logprob), "top_logprobs": [entry(tok, lp) for tok, lp in t.top]}
