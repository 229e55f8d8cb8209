"""The OpenAI-compatible HTTP server (FastAPI): validates requests, maps them onto the engine's
requests and answers in OpenAI's shapes. It holds no tokenizer and no model.

On SIGTERM it drains: new completions get 503, running ones may finish within --shutdown-timeout,
then each is answered with a 503 (a stream: an error event) and the process exits. On SIGUSR1
(another process of the server died) it answers them so at once."""

import asyncio
import contextlib
import importlib.metadata
import ipaddress
import json
import logging
import secrets
import signal
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import replace
from functools import partial
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from minisgl.config import ConfigError
from minisgl.core import SamplingParams, StructuredOutput, choice_params
from minisgl.messages import Addresses, Ready, TokenizerAnswer, TokenizeRequest, TokenizerQuery
from minisgl.utils import sampling_defaults
from minisgl.utils.process import stop_on_sigterm

from .args import ServerArgs
from .disconnect import ClientGone, until_disconnected
from .engine_client import SHUTTING_DOWN, EngineClient
from .errors import ApiError
from .generation import generate
from .metrics import Metrics
from .protocol import (
    Body,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeBody,
    TokenizeBody,
    parse_body,
    template_tools,
)
from .reasoning import REASONING_PARSERS
from .responses import ChatFormat, CompletionFormat, ReplyParser, json_response
from .tool_parser import TOOL_PARSERS, JsonArrayToolParser, NamedToolParser, ToolParser

# routes open without the API key: what load balancers and monitoring probe
_OPEN_ROUTES = ("/health", "/metrics")
# a body of more bytes is parsed on the body thread: 400,000 messages (12 MB) took ~3 s to
# validate, and on the event loop every other client waited for them
LONG_BODY_BYTES = 64 << 10


def _error_response(e: ApiError) -> Response:
    return json_response(e.body(), e.status, e.headers)


def create_app(args: ServerArgs, client: EngineClient, exit: Callable[[], None]) -> FastAPI:
    """The app; on SIGTERM it drains, on SIGUSR1 it answers what is open at once, then calls
    `exit` (which stops the HTTP server)."""

    async def drain(timeout: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        # the body being parsed ends first (those queued behind it are refused): its request is
        # answered, not cut off by the exit
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(loop.run_in_executor(body_thread, lambda: None), timeout)
        await client.wait_idle(max(0.0, deadline - loop.time()))
        client.interrupt_all(SHUTTING_DOWN)
        await asyncio.sleep(0.1)  # the handlers answer their requests
        exit()

    def start_draining(timeout: float) -> None:
        if not client.draining:  # a second signal changes nothing
            client.draining = True
            drains.append(asyncio.get_running_loop().create_task(drain(timeout)))

    def on_engine_lost() -> None:
        """SIGUSR1, from the launcher: a process of this server exited, and no open request
        can finish (a drain under way ends too)."""
        client.interrupt_all("the engine stopped: a server process exited")
        start_draining(0)

    drains: list[asyncio.Task[None]] = []  # held: a task nobody holds may be collected
    # one thread: long bodies wait for each other there, never for the event loop's clients
    body_thread = ThreadPoolExecutor(1, thread_name_prefix="body")

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        listener = asyncio.create_task(client.run())
        loop = asyncio.get_running_loop()
        # installed after uvicorn's own handlers (the lifespan starts inside uvicorn's serve):
        # SIGTERM, from the launcher, drains instead of stopping at once; a terminal's Ctrl-C
        # reaches the launcher too, which stops the processes in order
        loop.add_signal_handler(signal.SIGTERM, start_draining, args.shutdown_timeout)
        loop.add_signal_handler(signal.SIGUSR1, on_engine_lost)
        loop.add_signal_handler(signal.SIGINT, lambda: None)
        yield
        listener.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await listener
        client.close()
        body_thread.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="minisgl", lifespan=lifespan)
    created = int(time.time())
    defaults = sampling_defaults(args.generation_config, args.engine.model_path)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> Response:
        return _error_response(e)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> Response:  # 404, 405, ...
        return _error_response(ApiError(e.status_code, str(e.detail), headers=e.headers))

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, e: ClientGone) -> Response:
        return Response(status_code=499)  # nginx's "client closed request": nobody reads it

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> Response:
        return _error_response(ApiError(500, f"internal error: {type(e).__name__}"))

    if args.api_key is not None:
        app.add_middleware(_ApiKeyMiddleware, api_key=args.api_key)
    app.add_middleware(_RequestIdMiddleware)
    # added last, so outermost: a browser's preflight carries no key, and is answered here
    app.add_middleware(
        CORSMiddleware,
        allow_origins=list(args.allowed_origins),
        allow_methods=["*"],
        allow_headers=["*"],
    )

    async def read_body(request: Request, schema: type[Body]) -> Body:
        """The body as `schema`, for the served model once the engine is ready; refused with a 413
        past the size limit, before it is all read."""
        limit = args.limits.max_request_bytes
        too_large = ApiError(413, f"the request body is over {limit} bytes")
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            raise too_large
        body = bytearray()
        parts = request.stream()
        while True:
            try:  # a client whose body stalls would hold its connection for ever
                part = await asyncio.wait_for(anext(parts, None), args.timeout_keep_alive)
            except asyncio.TimeoutError:  # TimeoutError from Python 3.11 on
                raise ApiError(
                    408, f"the request body stalled for {args.timeout_keep_alive} s"
                ) from None
            except ClientDisconnect:  # an answer nobody reads, not a traceback in the log
                raise ApiError(400, "the client left before its body was read") from None
            if part is None:
                break
            body += part
            if len(body) > limit:
                raise too_large
        if len(body) > LONG_BODY_BYTES:  # a body whose client left before its turn is not parsed
            parse = asyncio.get_running_loop().run_in_executor(
                body_thread, parse_unless_draining, body, schema
            )
            parsed = await until_disconnected(request, parse)
        else:
            parsed = parse_body(body, schema)
        check_model(parsed.model)
        engine_limits()
        return parsed

    def parse_unless_draining(body: bytearray, schema: type[Body]) -> Body:
        """On the body thread: a body whose turn comes once the server drains is not read."""
        client.check_open()
        return parse_body(body, schema)

    def engine_limits() -> Ready:
        if client.limits is None:
            raise ApiError(503, "the engine is still starting")
        return client.limits

    names = (args.served_model_name, *args.served_model_aliases)

    def check_model(model: str | None) -> None:
        if model is not None and model not in names:
            raise ApiError(404, f"the model `{model}` does not exist", "model_not_found")

    @app.get("/health")
    async def health() -> Response:
        if not client.healthy(args.health_timeout):
            raise ApiError(503, "the engine is not serving: starting, stopping or unresponsive")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(client.metrics.render(), media_type="text/plain; version=0.0.4")

    def model_card(name: str) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "minisgl",
            "root": str(args.engine.model_path),  # as vLLM's card: the weights it serves
            "parent": None,
            "max_model_len": engine_limits().max_seq_len,
        }

    @app.get("/v1/models")
    async def models() -> Response:
        return json_response({"object": "list", "data": [model_card(name) for name in names]})

    @app.get("/v1/models/{model:path}")
    async def model_by_id(model: str) -> Response:
        check_model(model)
        return json_response(model_card(model))

    @app.get("/version")
    async def version() -> Response:
        return json_response({"version": importlib.metadata.version("minisgl")})

    async def ask(request: Request, query: TokenizerQuery) -> TokenizerAnswer:
        """The tokenizer's answer; a query whose client left is not run (if not begun)."""
        answer = await until_disconnected(request, client.ask(query))
        if answer.error is not None:
            raise ApiError(400, answer.error)
        return answer

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        """vLLM's shape; answered by the tokenizer process, as the prompts of requests are."""
        body = await read_body(request, TokenizeBody)
        messages = None if body.messages is None else [m.as_template_input() for m in body.messages]
        query = TokenizerQuery(
            client.new_rids(1)[0], body.prompt, messages, tools=template_tools(body.tools),
            template_kwargs=body.chat_template_kwargs, options=body.prompt_options(),
            token_strs=body.return_token_strs,
        )  # fmt: skip
        answer = await ask(request, query)
        assert answer.ids is not None
        limit = engine_limits().max_seq_len
        reply = {"count": len(answer.ids), "max_model_len": limit, "tokens": answer.ids}
        if answer.token_strs is not None:
            reply["token_strs"] = answer.token_strs
        return json_response(reply)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        body = await read_body(request, DetokenizeBody)
        answer = await ask(request, TokenizerQuery(client.new_rids(1)[0], ids=body.tokens))
        return json_response({"prompt": answer.text})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await read_body(request, CompletionRequest)
        prompts, params = body.prompts(), body.sampling_params(defaults)
        args.limits.check(body.n, len(prompts), params)
        choices = choice_params(params, body.n)
        tokenize = TokenizeRequest(
            client.new_rids(len(prompts) * body.n), choices, prompts,
            options=body.prompt_options(), default_max_tokens=body.max_tokens is None,
            max_prompt_logprobs=args.limits.max_prompt_logprobs, prompt_logprobs_copies=body.n,
        )  # fmt: skip
        echo = None
        if body.echo:  # each choice's text starts with its prompt's
            texts = [p if isinstance(p, str) else await prompt_text(request, p) for p in prompts]
            echo = [text for text in texts for _ in range(body.n)]
        return await generate(
            request, client, CompletionFormat(), args.served_model_name, tokenize,
            want_logprobs=body.logprobs is not None, stream=body.stream,
            include_usage=body.include_usage, timeout=args.request_timeout,
            request_field=body.request_field, echo=echo, prompt_only=body.echo_only,
        )  # fmt: skip

    async def prompt_text(request: Request, ids: list[int]) -> str:
        answer = await ask(request, TokenizerQuery(client.new_rids(1)[0], ids=ids))
        assert answer.text is not None
        return answer.text

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await read_body(request, ChatCompletionRequest)
        params = body.sampling_params(defaults)
        args.limits.check(body.n, 1, params)
        params = _held_after_thinking(args, body, _strict_calls(args, body, params))
        fmt = ChatFormat(_reply_parser(args, body, params), body.include_reasoning)
        messages = [m.as_template_input() for m in body.messages]
        choices = choice_params(params, body.n)
        tokenize = TokenizeRequest(
            client.new_rids(body.n), choices, messages=messages, tools=template_tools(body.tools),
            template_kwargs=body.chat_template_kwargs, options=body.prompt_options(),
            default_max_tokens=params.max_tokens is None,
            max_prompt_logprobs=args.limits.max_prompt_logprobs,
        )  # fmt: skip
        return await generate(
            request, client, fmt, args.served_model_name, tokenize, want_logprobs=body.logprobs,
            stream=body.stream, include_usage=body.include_usage, timeout=args.request_timeout,
            request_field=body.request_field,
        )  # fmt: skip

    # every call the openai client makes to it (create, retrieve, delete, cancel...), not a 405
    @app.api_route("/v1/responses{rest:path}", methods=["GET", "POST", "DELETE"])
    async def responses(request: Request) -> Response:
        raise ApiError(404, "the Responses API is not served here; use /v1/chat/completions")

    return app


def _strict_calls(
    args: ServerArgs, body: ChatCompletionRequest, params: SamplingParams
) -> SamplingParams:
    """As vLLM's: with tool_choice auto, the calls of a strict tool are held to its parameters
    where the model writes them (the tool parser's structural tag); the text around is free."""
    tools = body.strict_calls()
    if tools is None or args.tool_call_parser is None:  # _reply_parser names the missing parser
        return params
    if params.structured is not None:
        raise ApiError(400, "strict tools with tool_choice auto cannot be combined with another "
                       "structured output", param="tools")  # fmt: skip
    tag = TOOL_PARSERS[args.tool_call_parser].structural_tag(tools, body.parallel)
    return replace(params, structured=StructuredOutput(structural_tag=tag))


def _held_after_thinking(
    args: ServerArgs, body: ChatCompletionRequest, params: SamplingParams
) -> SamplingParams:
    """As vLLM's: with a reasoning parser, a structured output holds the reply from the end of its
    thinking, where the template lets the model think (--structured-outputs-in-reasoning: from
    its first token)."""
    if (
        params.structured is None
        or args.reasoning_parser is None
        or args.structured_outputs_in_reasoning
    ):
        return params
    parser = REASONING_PARSERS[args.reasoning_parser]
    if not parser.thinks(body.chat_template_kwargs or {}):
        return params
    if body.continue_final_message or not body.add_generation_prompt:
        # the prompt's last message may have closed the thinking already (Qwen3's template
        # closes it in the message continued): the constraint would wait for a `</think>` that
        # never comes, and the reply would be read as thinking
        raise ApiError(
            400, "with --reasoning-parser a structured output holds the reply from the end of its "
            "thinking, which the prompt's last message may already have closed: start a new turn "
            "(add_generation_prompt true, continue_final_message false) or turn thinking off "
            "(chat_template_kwargs enable_thinking false)",
            param=(
                "continue_final_message" if body.continue_final_message
                else "add_generation_prompt"
            ),
        )  # fmt: skip
    return replace(params, structured=replace(params.structured, after=parser.end))


def _reply_parser(
    args: ServerArgs, body: ChatCompletionRequest, params: SamplingParams
) -> Callable[[], ReplyParser] | None:
    """What reads each choice's reply: the server's reasoning parser, and the tool parser that
    fits the request's tool_choice (auto: the server's --tool-call-parser; required and named:
    the JSON their grammar holds the reply to)."""
    mode, name = body.tool_use()
    if mode == "auto" and args.tool_call_parser is None:
        raise ApiError(400, "tools with tool_choice auto need the server started with "
                       "--tool-call-parser", param="tool_choice")  # fmt: skip
    tools: Callable[[], ToolParser] | None = {
        "none": None,
        "auto": lambda: TOOL_PARSERS[args.tool_call_parser](body.parallel),  # type: ignore[index]
        "required": lambda: JsonArrayToolParser(body.parallel),
        "named": lambda: NamedToolParser(name),  # type: ignore[arg-type]
    }[mode]
    if args.reasoning_parser is None and tools is None:
        return None
    reasoning = None if args.reasoning_parser is None else REASONING_PARSERS[args.reasoning_parser]
    kwargs = body.chat_template_kwargs or {}
    constrained = params.structured is not None and params.structured.after is None
    return lambda: ReplyParser(
        None if reasoning is None else reasoning(kwargs, constrained, body.continue_final_message),
        None if tools is None else tools(),
    )


class _ApiKeyMiddleware:
    """Every route but the open ones needs `Authorization: Bearer <key>` (the scheme in any case).
    Plain ASGI: Starlette's BaseHTTPMiddleware wraps each streamed response in one more stream,
    13 % of the API server's time under the offline benchmark's workload (py-spy, H200)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in _OPEN_ROUTES:
            header = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, given = header.partition(b" ")
            if scheme.lower() != b"bearer" or not secrets.compare_digest(given, self._key):
                error = ApiError(401, "invalid or missing API key", "invalid_api_key")
                await _error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _RequestIdMiddleware:
    """Every answer carries X-Request-Id, an error's too: the client's, or one made here (vLLM's
    --enable-request-id-headers); the handlers read it as `request.state.request_id`, the reply's
    id and the request log's line are made of it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"x-request-id")
        request_id = given.decode("latin-1") if given else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        header = (b"x-request-id", request_id.encode("latin-1"))

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), header]}
            await send(message)

        await self.app(scope, receive, send_with_id)


class _HeadersTooLarge(Exception):
    """Raised from a parser callback: httptools stops, uvicorn answers (send_400_response)."""


class _IdleTimeoutProtocol(HttpToolsProtocol):
    """uvicorn times a connection out only after a response, and stops the timer at a request's
    first byte: one that never sends a whole request (a byte, half its headers) would hold its
    file descriptor for ever, and 20,000 of them left the server unreachable. The keep-alive
    timer runs from the start here, until a request's headers are complete (read_body times the
    body). httptools bounds no header's size, and gathers a long one piece by piece (a 100 MB
    one took 12 s of the event loop): past max_header_bytes of request line, headers and
    trailers, a request is a 431. Each piece (request line, header, trailer) counts as it is
    complete in the read the request begins in or in its body; a read of nothing but unfinished
    headers (or trailers) counts whole instead; the read that ends headers begun in an earlier
    one does not count. And a client that leaves is told to the request being served, not only to
    the newest one: uvicorn marks only a pipelined request queued behind it, and a non-streamed
    one ran on to its end. The body of a request answered before it came (a 401, a 404, a 413)
    is idle-timed too: its bytes stopped the timer uvicorn starts at the answer. And a client
    that takes none of its response for a whole timeout (its writes paused) is cut off: a stream
    to one that stopped reading held its connection for ever, and its requests ran to their
    max_tokens (nginx's send_timeout)."""

    def __init__(self, *args: Any, max_header_bytes: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._max_header_bytes = max_header_bytes

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._in_headers = False  # a request has begun and its headers are not complete
        self._in_body = False  # its headers are complete and it is not
        self._began_in_read = False  # it began in the read being parsed
        self._body_in_read = False  # the read being parsed held some of its body
        self._ended_in_read = False  # a request ended in the read being parsed
        self._header_bytes = 0
        self._serving: RequestResponseCycle | None = None  # the request whose app runs
        self._write_timer: asyncio.TimerHandle | None = None  # while writes are paused
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler
        )

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        self._serving = cycle
        super()._start_asgi_task(cycle, app)

    def pause_writing(self) -> None:
        super().pause_writing()
        self._watch_writes(self.transport.get_write_buffer_size())

    def resume_writing(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None
        super().resume_writing()

    def _watch_writes(self, waiting: int) -> None:
        self._write_timer = self.loop.call_later(
            self.timeout_keep_alive, self._writes_stalled, waiting
        )

    def _writes_stalled(self, waiting: int) -> None:
        """A timeout after `waiting` bytes were left for the client: it took some, or is cut off
        (abort: close would wait for bytes it never takes)."""
        left = self.transport.get_write_buffer_size()
        if left < waiting:
            self._watch_writes(left)
        else:
            self._write_timer = None
            self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
        super().connection_lost(exc)
        serving = self._serving
        if serving is not None and serving is not self.cycle and not serving.response_complete:
            serving.disconnected = True
            serving.message_event.set()

    def data_received(self, data: bytes) -> None:
        timer, self.timeout_keep_alive_task = self.timeout_keep_alive_task, None
        in_headers, in_body = self._in_headers, self._in_body
        self._began_in_read = self._body_in_read = self._ended_in_read = False
        super().data_received(data)  # which would stop the timer at any byte
        if self._in_headers and (
            (in_headers and not self._began_in_read)  # headers begun before the read go on
            or not (in_headers or in_body or self._ended_in_read)  # begun at the read's start
        ):  # the whole read is the head of a request that goes on past it
            self._header_bytes = len(data) + (self._header_bytes if in_headers else 0)
        elif in_body and self._in_body and not self._body_in_read:  # the whole read is trailers
            self._header_bytes += len(data)
        if self._header_bytes > self._max_header_bytes and not self.transport.is_closing():
            self.send_400_response("")
        if timer is not None and self._in_headers:
            self.timeout_keep_alive_task = timer
        elif timer is not None:
            timer.cancel()
        answered = self.cycle is not None and self.cycle.response_complete
        if answered and not self._in_headers and not self.transport.is_closing():
            # the body of a request answered before it came (401, 404, 413) goes on: idle
            # from its last byte, as read_body times a body
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler
            )

    def _count(self, size: int) -> None:
        if self._began_in_read or self._in_body:
            self._header_bytes += size
            if self._header_bytes > self._max_header_bytes:
                raise _HeadersTooLarge

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to what httptools cannot parse (past max_header_bytes: a 431), in
        OpenAI's error shape: it was plain text."""
        self._in_headers = self._in_body = False
        if self._header_bytes > self._max_header_bytes:
            status = b"431 Request Header Fields Too Large"
            why = f"the request line, headers and trailers are over {self._max_header_bytes} bytes"
            error = ApiError(431, why)
        else:
            status, error = b"400 Bad Request", ApiError(400, msg)
        body = json.dumps(error.body()).encode()
        self.transport.write(
            b"HTTP/1.1 %s\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: %d\r\n\r\n%s" % (status, len(body), body)
        )
        self.transport.close()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_headers = self._began_in_read = True
        self._header_bytes = 0

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value))
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_headers, self._in_body = False, True
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        self._body_in_read = True
        self._header_bytes = 0  # trailers count from the body's last bytes (a chunk's framing too)
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._in_body = False
        self._ended_in_read = True
        super().on_message_complete()


def run_api_server(args: ServerArgs, addresses: Addresses) -> None:
    """The process entry point; serves until SIGTERM, then drains (SIGUSR1: answers at once)."""
    stop_on_sigterm()
    client = EngineClient(addresses, Metrics(), args.limits.max_queued_requests)
    config = uvicorn.Config(
        # the server is bound below, before the app can call this
        create_app(args, client, lambda: setattr(server, "should_exit", True)),
        host=args.host,
        port=args.port,
        loop="uvloop",
        http=partial(_IdleTimeoutProtocol, max_header_bytes=args.limits.max_header_bytes),
        log_level="warning" if args.shell else args.log_level,
        access_log=not args.shell,
        timeout_keep_alive=args.timeout_keep_alive,
        timeout_graceful_shutdown=1,
    )
    logging.getLogger("uvicorn.access").addFilter(_AccessLines())  # after uvicorn's own set-up
    logging.getLogger("minisgl.requests").setLevel(
        logging.INFO if args.enable_log_requests else logging.WARNING
    )
    server = uvicorn.Server(config)
    server.run(sockets=_ipv6_socket(args.host, args.port))


def _ipv6_socket(host: str, port: int) -> list[socket.socket] | None:
    """An IPv6 host's listening socket, bound here with the system's IPV6_V6ONLY (off on Linux,
    as vLLM binds it): `--host ::` takes IPv4 clients too, where asyncio's socket, IPv6-only,
    refused them. None for an IPv4 host or a name: uvicorn binds those."""
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None
    if address.version != 6:
        return None
    sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((str(address), port))
    except OSError as e:
        sock.close()
        raise ConfigError(f"cannot listen at [{address}]:{port}: {e}") from None
    return [sock]


class _AccessLines(logging.Filter):
    """The launcher polls /health until the engine is ready, and routers probe it all day: no
    access-log line for those. A long path is cut short: a client without the key wrote 60 KB
    a line (its URL) into the log."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if not (isinstance(args, tuple) and len(args) > 2 and isinstance(args[2], str)):
            return True
        if args[2] == "/health":
            return False
        if len(args[2]) > _LOGGED_PATH_CHARS:
            record.args = (*args[:2], args[2][:_LOGGED_PATH_CHARS] + "...", *args[3:])
        return True


_LOGGED_PATH_CHARS = 256
