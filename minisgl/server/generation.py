"""The machinery completions and chat share: send an API request's engine requests, wait for their
first items (a rejected request gets its 400 then), then stream or collect the choices.

A request ends early when its client goes away (streaming or not: its engine requests are
aborted), when it runs past --request-timeout, or when the server shuts down."""

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.responses import Response

from minisgl.core import SamplingParams
from minisgl.messages import Finished, ReqError, TextLogprobs, TokenizeRequest
from minisgl.utils import init_logger

from .disconnect import ClientGone, until_disconnected
from .engine_client import Delta, EngineClient, Interrupted, Item, ReqGroup
from .errors import ApiError
from .responses import Choice, ReplyFormat, json_response, usage, vllm_prompt_logprobs

Items = list[tuple[int, Item]]
# a line per request as it ends, at INFO where --enable-log-requests is given (else WARNING)
_request_log = init_logger("minisgl.requests")


async def generate(
    request: Request,
    client: EngineClient,
    fmt: ReplyFormat,
    model: str,
    tokenize: TokenizeRequest,
    want_logprobs: bool,
    stream: bool,
    include_usage: bool,
    timeout: float | None,
    request_field: Callable[[str], str],
    echo: list[str] | None = None,
    prompt_only: bool = False,
) -> Response:
    """Run `tokenize`'s requests (its choices consecutive per prompt) and answer with one response.
    Its first items come before anything is answered: a request the engine refused (they are
    admitted all or none) still gets its 400. echo: a text each choice's starts with (sent with
    its first token, and its prompt's logprobs where they were asked); prompt_only: the echo
    alone, each choice ending at its length with no token (its one token left out).
    request_field: the request's name for a sampling field, which a refusal names. The reply's
    id is made of the request's id (its X-Request-Id, as vLLM's: `_RequestIdMiddleware`)."""
    request_id = request.state.request_id
    name = f"request {request_id} ({request.url.path})"
    try:
        group = client.submit(tokenize)
    except ApiError as e:  # refused before it runs: a full queue (429), a drain (503)
        _request_log.info("%s: %s %s", name, e.status, e)
        raise
    reply_id = f"{fmt.id_prefix}-{request_id}"
    run = _Run(
        client, group, fmt, model, reply_id, tokenize.params, want_logprobs, timeout,
        request_field, echo, prompt_only, name,
    )  # fmt: skip
    streaming = False
    try:
        first = await until_disconnected(request, run.next_items())
        if stream:
            streaming = True  # the stream ends the run when it ends
            return StreamingResponse(
                run.stream(first, include_usage), media_type="text/event-stream"
            )
        reply = await until_disconnected(request, run.collect(first))
        run.log_end("200")
        return json_response(reply)
    except ApiError as e:
        run.log_end(f"{e.status} {e}")
        raise
    except ClientGone:
        run.log_end("the client left")
        raise
    finally:
        if not streaming:
            run.end()


@dataclass(frozen=True)
class _Prompt:
    """A prompt's logprobs, shared by its choices: as vLLM's prompt_logprobs (formatted once),
    and as the echoed prompt's logprobs."""

    vllm: list[dict[str, Any] | None] | None
    echoed: list[TextLogprobs]


_NO_PROMPT = _Prompt(None, [])


class _Run:
    def __init__(
        self,
        client: EngineClient,
        group: ReqGroup,
        fmt: ReplyFormat,
        model: str,
        reply_id: str,
        params: list[SamplingParams],
        want_logprobs: bool,
        timeout: float | None,
        request_field: Callable[[str], str],
        echo: list[str] | None,
        prompt_only: bool,
        name: str,
    ) -> None:
        self.client, self.group, self.fmt = client, group, fmt
        self._name = name  # who the request log's line is about
        self._start = time.monotonic()
        self._logged = False
        self._request_field = request_field
        self._prompt_only = prompt_only
        self._echo = echo  # by choice: the text it starts with
        self._echo_top = params[0].logprobs or 0
        self.model, self.n, self.want_logprobs = model, len(params), want_logprobs
        self.id = reply_id
        self.created = int(time.time())
        self.deadline = None if timeout is None else time.monotonic() + timeout
        # the deadline holds while a stream waits to write to a client that stopped reading,
        # where no next_items runs: 16 choices ran to their 1,400 tokens past a 4 s limit
        self._deadline_abort = (
            None
            if timeout is None
            else asyncio.get_running_loop().call_later(timeout, client.abort, group)
        )
        self.choices = [Choice() for _ in group.rids]
        self._batches = group.batches()
        # only a prompt's first choice asks for its prompt's logprobs (choice_params), which
        # come with that choice's first item; its siblings share them
        self._asks_prompt = params[0].prompt_logprobs is not None
        self._prompts: dict[int, _Prompt] = {}  # by the prompt's first choice, once it has them
        self._held: dict[int, Items] = {}  # by the prompt's first choice: its siblings' items
        self._started: set[int] = set()  # choices that got an item

    async def next_items(self) -> Items:
        """The next items; raises ApiError for an error or an interruption, and at the deadline."""
        left = None if self.deadline is None else self.deadline - time.monotonic()
        try:
            batch = await asyncio.wait_for(anext(self._batches), left)
        except asyncio.TimeoutError:  # TimeoutError from Python 3.11 on
            self.client.abort(self.group)
            # not a 408 or a 5xx, which vllm-router and OpenAI's client retry: the same
            # request would only run to the same limit again
            raise ApiError(
                400, "the request took longer than the server's --request-timeout",
                code="request_timeout",
            ) from None  # fmt: skip
        for _, item in batch:
            if isinstance(item, ReqError):
                param = None if item.param is None else self._request_field(item.param)
                raise ApiError(400, item.message, param=param)
            if isinstance(item, Interrupted):
                raise ApiError(503, item.message)
        return batch

    def _apply(self, batch: Items) -> dict[int, Choice]:
        """Add the items to the choices; returns what each choice got, merged per choice. Where
        the prompt's logprobs were asked, a sibling's items wait for them (they come before its
        own: echoed, and in its first chunk), which come with its prompt's first choice's first
        item. The wait never outlasts the request: every engine request's items end with a
        Finished, or an error, an interruption or the deadline fails the whole request."""
        pieces: dict[int, Choice] = {}
        for index, item in batch:
            first = index - index % self.n
            if index == first and first not in self._prompts:
                self._prompts[first] = self._prompt(item)
                self._add(pieces, index, first, item)
                for sibling, held in self._held.pop(first, []):
                    self._add(pieces, sibling, first, held)
            elif self._asks_prompt and first not in self._prompts:
                self._held.setdefault(first, []).append((index, item))
            else:
                self._add(pieces, index, first, item)
        return pieces

    def _prompt(self, item: Item) -> _Prompt:
        """A prompt's logprobs from its first choice's first item: with its first token (a
        Finished before any token has none)."""
        entries = item.prompt_logprobs if isinstance(item, Delta) else None
        if entries is None:
            return _NO_PROMPT
        # as many likeliest tokens as the logprobs' (prompt_logprobs may ask more)
        echoed = (
            [replace(t, top=t.top[: self._echo_top]) for t in entries]
            if self._echo is not None
            else []
        )
        return _Prompt(vllm_prompt_logprobs(entries), echoed)

    def _add(self, pieces: dict[int, Choice], index: int, first: int, item: Item) -> None:
        """Add an item to choice `index`, of the prompt whose first choice is `first`."""
        piece = pieces.setdefault(index, Choice())
        choice = self.choices[index]
        if index not in self._started:  # its prompt, and the prompt's logprobs, come first
            self._started.add(index)
            prompt = self._prompts.get(first, _NO_PROMPT)
            choice.prompt_logprobs = piece.prompt_logprobs = prompt.vllm
            if self._echo is not None:
                for c in (choice, piece):
                    c.add(self._echo[index], prompt.echoed)
        if isinstance(item, Delta):
            if not self._prompt_only:
                logprobs = [] if item.logprobs is None else [item.logprobs]
                choice.add(item.text, logprobs)
                piece.add(item.text, logprobs)
        else:
            assert isinstance(item, Finished)
            if self._prompt_only:
                item = replace(item, reason="length", matched_stop=None, completion_tokens=0)
            choice.end = piece.end = item

    def _ended(self) -> bool:
        return all(c.end is not None for c in self.choices)

    def log_end(self, outcome: str) -> None:
        """The request log's line (--enable-log-requests): how the request ended, its tokens and
        its seconds."""
        if self._logged or not _request_log.isEnabledFor(logging.INFO):
            return
        self._logged = True
        if self._ended():
            counts = usage(self.choices, self.n)
            finishes = ",".join(str(c.finish_reason) for c in self.choices)
            outcome += (
                f", prompt {counts['prompt_tokens']} tokens "
                f"({counts['prompt_tokens_details']['cached_tokens']} cached), "
                f"{counts['completion_tokens']} generated, finish {finishes}"
            )
        _request_log.info("%s: %s, %.3f s", self._name, outcome, time.monotonic() - self._start)

    def end(self) -> None:
        """Abort what is left of the group (a no-op unless the request was cut short)."""
        if self._deadline_abort is not None:
            self._deadline_abort.cancel()
        self.client.abort(self.group)

    async def collect(self, first: Items) -> dict[str, Any]:
        self._apply(first)
        while not self._ended():
            self._apply(await self.next_items())
        choices = [
            self.fmt.choice(i, c, 0, self.want_logprobs, delta=False, first=True)
            for i, c in enumerate(self.choices)
        ]
        return {
            **self._envelope(choices, chunk=False),
            **self.fmt.prompt_logprobs(self.choices),
            "usage": usage(self.choices, self.n),
        }

    async def stream(self, first: Items, include_usage: bool) -> AsyncIterator[bytes]:
        """Server-sent events, one per choice for all it got since the last; a client that goes
        away cancels this, which aborts its requests. An error after the start is an error
        event, then [DONE]."""
        sent: set[int] = set()
        batch = first
        try:
            while True:
                offsets = {i: c.logprobs_chars for i, c in enumerate(self.choices)}
                for index, piece in self._apply(batch).items():
                    is_first = index not in sent
                    if is_first or piece.text or piece.logprobs or piece.end:
                        data = self.fmt.choice(
                            index, piece, offsets[index], self.want_logprobs, True, is_first
                        )
                        if data is not None:
                            sent.add(index)
                            yield _event(self._envelope([data], chunk=True))
                if self._ended():
                    break
                batch = await self.next_items()
            if include_usage:
                yield _event(
                    {**self._envelope([], chunk=True), "usage": usage(self.choices, self.n)}
                )
        except ApiError as e:
            self.log_end(f"{e.status} {e} (streamed)")
            yield _event(e.body())
        else:
            self.log_end("200 (streamed)")
        finally:
            self.log_end("the client left (streamed)")  # unless it ended otherwise
            self.end()
        yield b"data: [DONE]\n\n"

    def _envelope(self, choices: list[dict[str, Any]], chunk: bool) -> dict[str, Any]:
        return self.fmt.envelope(self.id, self.created, self.model, choices, chunk)


def _event(data: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"
