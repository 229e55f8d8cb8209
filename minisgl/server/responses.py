"""OpenAI response shapes. Completions and chat differ only in how a choice is written; the
envelope, usage, errors and the streaming machinery (generation.py) are shared."""

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from minisgl.core import FinishReason
from minisgl.messages import ReqChunk, TokenLogprob


class ApiError(Exception):
    """Answered in OpenAI's error shape with this HTTP status."""

    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code

    def body(self) -> dict[str, Any]:
        error_type = "invalid_request_error" if self.status < 500 else "server_error"
        return {
            "error": {"message": self.message, "type": error_type, "param": None, "code": self.code}
        }


@dataclass
class Choice:
    """One choice: the text and logprobs of the chunks given to `add`, and the latest counts."""

    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    matched_stop: str | int | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def add(self, chunk: ReqChunk) -> None:
        self.text += chunk.text
        if chunk.logprob is not None:
            self.logprobs.append(chunk.logprob)
        self.finish_reason, self.matched_stop = chunk.finish_reason, chunk.matched_stop
        self.prompt_tokens = chunk.prompt_tokens
        self.completion_tokens = chunk.completion_tokens
        self.cached_tokens = chunk.cached_tokens


def usage(choices: list[Choice], n: int) -> dict[str, Any]:
    """Token counts of a response; each prompt's tokens count once, however many choices it has."""
    per_prompt = choices[::n]
    prompt = sum(c.prompt_tokens for c in per_prompt)
    completion = sum(c.completion_tokens for c in choices)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(c.cached_tokens for c in per_prompt)},
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


def _chat_logprob(t: TokenLogprob) -> dict[str, Any]:
    def entry(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return {**entry(t.token, t.logprob), "top_logprobs": [entry(tok, lp) for tok, lp in t.top]}
