"""The OpenAI-compatible HTTP server (FastAPI): validates requests, maps them onto the engine's
requests and answers in OpenAI's shapes. It holds no tokenizer and no model."""

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.responses import Response

from minisgl.messages import Addresses, SchedulerLimits, TokenizeRequest

from .args import ServerArgs
from .engine_client import EngineClient
from .generation import generate
from .metrics import Metrics
from .protocol import ChatCompletionRequest, CompletionRequest, choice_params
from .responses import ApiError, ChatFormat, CompletionFormat


def create_app(args: ServerArgs, client: EngineClient) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        listener = asyncio.create_task(client.run())
        yield
        listener.cancel()

    app = FastAPI(title="minisgl", lifespan=lifespan)
    created = int(time.time())

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, e: RequestValidationError) -> JSONResponse:
        details = "; ".join(
            f"{'.'.join(str(p) for p in err['loc'][1:]) or 'body'}: {err['msg']}"
            for err in e.errors()
        )
        return await api_error(request, ApiError(400, details))

    @app.middleware("http")
    async def check_api_key(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        if args.api_key is not None and request.url.path.startswith("/v1"):
            scheme, _, given = request.headers.get("Authorization", "").partition(" ")
            if scheme != "Bearer" or not secrets.compare_digest(
                given.encode(), args.api_key.encode()
            ):
                error = ApiError(401, "invalid or missing API key", "invalid_api_key")
                return JSONResponse(error.body(), status_code=401)
        return await call_next(request)

    def engine_limits() -> SchedulerLimits:
        if client.limits is None:
            raise ApiError(503, "the engine is still starting")
        return client.limits

    def check_model(model: str | None) -> None:
        if model is not None and model != args.served_model_name:
            raise ApiError(404, f"the model `{model}` does not exist", "model_not_found")

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if client.limits is not None else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(client.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {
            "id": args.served_model_name,
            "object": "model",
            "created": created,
            "owned_by": "minisgl",
            "max_model_len": engine_limits().max_seq_len,
        }
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest) -> Response:
        check_model(body.model)
        engine_limits()
        try:
            prompts, params = body.prompts(), body.sampling_params()
        except ValueError as e:
            raise ApiError(400, str(e)) from e
        requests = [
            TokenizeRequest(client.new_rid(), p, prompt=prompt)
            for prompt in prompts
            for p in choice_params(params, body.n)
        ]
        return await generate(
            client,
            CompletionFormat(),
            args.served_model_name,
            requests,
            body.n,
            want_logprobs=body.logprobs is not None,
            stream=body.stream,
            include_usage=body.include_usage,
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest) -> Response:
        check_model(body.model)
        try:
            params = body.sampling_params(engine_limits().max_seq_len)
        except ValueError as e:
            raise ApiError(400, str(e)) from e
        messages = [m.as_template_input() for m in body.messages]
        requests = [
            TokenizeRequest(client.new_rid(), p, messages=messages)
            for p in choice_params(params, body.n)
        ]
        return await generate(
            client,
            ChatFormat(),
            args.served_model_name,
            requests,
            body.n,
            want_logprobs=body.logprobs,
            stream=body.stream,
            include_usage=body.include_usage,
        )

    return app


def run_api_server(args: ServerArgs, addresses: Addresses) -> None:
    """The process entry point; serves until terminated."""
    client = EngineClient(addresses, Metrics())
    uvicorn.run(
        create_app(args, client),
        host=args.host,
        port=args.port,
        log_level="warning" if args.shell else "info",
        timeout_graceful_shutdown=2,
    )
