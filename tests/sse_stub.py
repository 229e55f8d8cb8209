"""A stand-in for an OpenAI-compatible server, for the benchmark client's own tests: POST
/v1/completions waits the body's `wait_s`, then streams one event and [DONE]; GET /peak says how
many requests were in flight at most. Run as `python -m tests.sse_stub PORT`."""

import asyncio
import json
import sys

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

in_flight = peak = 0


async def completions(request: Request) -> StreamingResponse:
    body = await request.json()

    async def events():
        global in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        try:
            await asyncio.sleep(body["wait_s"])
            yield f"data: {json.dumps({'choices': [{'index': 0, 'text': 'x'}]})}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            in_flight -= 1

    return StreamingResponse(events(), media_type="text/event-stream")


async def peak_in_flight(request: Request) -> JSONResponse:
    return JSONResponse({"peak": peak})


app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                        Route("/peak", peak_in_flight)])  # fmt: skip

if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
