"""The wire between processes: small dataclasses, msgpack-encoded, over ZMQ PUSH/PULL sockets.

  API server ─TokenizeRequest, AbortRequest─▶ tokenizer ─AddRequest, AbortRequest─▶ scheduler rank 0
      ▲                                        │   ▲                                      │      │
      └───── SchedulerLimits, TextOutputs ─────┘   └─ SchedulerLimits, SchedulerOutputs ──┘      │
                     scheduler ranks 1..tp-1 ◀── each step's list[AddRequest | AbortRequest] ────┘

Every socket is bound by the process that reads it; the processes that write to it connect.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq

from minisgl.core import FinishReason, SamplingParams
from minisgl.scheduler import ReqOutput

_WIRE_TYPES: dict[str, type] = {}


def _wire(cls: type) -> type:
    _WIRE_TYPES[cls.__name__] = cls
    return cls


_wire(SamplingParams)
_wire(ReqOutput)


# ---------------------------------------------------------------------- API server -> tokenizer
@_wire
@dataclass
class TokenizeRequest:
    """A prompt to tokenize (text or ids) or a chat to render with the chat template."""

    rid: int
    params: SamplingParams
    prompt: str | list[int] | None = None
    messages: list[dict[str, str]] | None = None


@_wire
@dataclass
class AbortRequest:
    rid: int


# ---------------------------------------------------------------------- tokenizer -> scheduler
@_wire
@dataclass
class AddRequest:
    rid: int
    prompt_ids: list[int]
    params: SamplingParams


# ---------------------------------------------------------------------- scheduler -> tokenizer
@_wire
@dataclass
class SchedulerLimits:
    """Sent once by scheduler rank 0 when every rank is ready; forwarded to the API server."""

    max_seq_len: int  # prompt + output tokens of one request, at most
    vocab_size: int


@_wire
@dataclass
class ReqError:
    """A request that cannot be served; it holds no state anywhere any more."""

    rid: int
    message: str


@_wire
@dataclass
class SchedulerLoad:
    """A snapshot of the scheduler's state for the metrics. KV pages: request + cached + free =
    all; request pages are held privately by requests, cached ones by the prefix cache."""

    num_running: int
    num_waiting: int
    request_pages: int
    cached_pages: int
    free_pages: int
    prompt_tokens: int
    cached_prompt_tokens: int
    num_preemptions: int
    integrity_checks: int
    integrity_failures: int


@_wire
@dataclass
class SchedulerOutputs:
    outputs: list[ReqOutput]
    errors: list[ReqError]
    load: SchedulerLoad | None = None


# ---------------------------------------------------------------------- tokenizer -> API server
@_wire
@dataclass
class TokenLogprob:
    token: str
    logprob: float
    top: list[tuple[str, float]]


@_wire
@dataclass
class ReqChunk:
    """One step of one request, as text. Token counts are totals so far."""

    rid: int
    text: str
    token_id: int | None
    finish_reason: FinishReason | None
    matched_stop: str | int | None
    logprob: TokenLogprob | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@_wire
@dataclass
class TextOutputs:
    chunks: list[ReqChunk]
    errors: list[ReqError]
    load: SchedulerLoad | None = None


# ---------------------------------------------------------------------- encoding
def _to_map(obj: Any) -> dict[str, Any]:
    name = type(obj).__name__
    if _WIRE_TYPES.get(name) is not type(obj):
        raise TypeError(f"{name} is not a wire type")
    return {"__t": name, **vars(obj)}


def _from_map(data: dict[str, Any]) -> Any:
    name = data.pop("__t", None)
    return data if name is None else _WIRE_TYPES[name](**data)


def encode(msg: Any) -> bytes:
    return msgpack.packb(msg, default=_to_map)


def decode(data: bytes) -> Any:
    return msgpack.unpackb(data, object_hook=_from_map, strict_map_key=False)


# ---------------------------------------------------------------------- sockets
@dataclass(frozen=True)
class Addresses:
    """The ZMQ endpoint each process reads from; ipc files in one per-launch directory."""

    api: str
    tokenizer: str
    scheduler: str
    followers: tuple[str, ...]  # scheduler ranks 1..tp-1

    @classmethod
    def in_dir(cls, directory: str, tp_size: int) -> Addresses:
        def ipc(name: str) -> str:
            return "ipc://" + os.path.join(directory, name)

        followers = tuple(ipc(f"rank{r}") for r in range(1, tp_size))
        return cls(ipc("api"), ipc("tokenizer"), ipc("scheduler"), followers)


def bind_pull(ctx: zmq.Context, address: str) -> zmq.Socket:
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.RCVHWM, 0)  # unbounded: a full queue would block a sender mid-step
    sock.bind(address)
    return sock


def connect_push(ctx: zmq.Context, address: str) -> zmq.Socket:
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


def send(sock: zmq.Socket, msg: Any) -> None:
    sock.send(encode(msg), copy=False)


def recv(sock: zmq.Socket) -> Any:
    return decode(sock.recv())


def recv_all(sock: zmq.Socket, block: bool) -> list[Any]:
    """Every message waiting on `sock`; with block, waits for at least one."""
    messages = [recv(sock)] if block else []
    while True:
        try:
            messages.append(decode(sock.recv(zmq.NOBLOCK)))
        except zmq.Again:
            return messages
