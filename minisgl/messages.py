"""The wire between processes: small dataclasses, msgpack-encoded, over ZMQ PUSH/PULL sockets
(and from scheduler rank 0 to the other ranks over a torch.distributed gloo group).

                 ┌──────────────── tokenizer process ────────────────┐
  API server ─TokenizeRequest, AbortRequest─▶ tokenize thread ─AddRequests, AbortRequest─▶ scheduler
    ▲  ▲                                       │     ▲                                      rank 0
    │  └───────────── Ready ───────────────────┘     └──────────── Ready ───────────────────┘ │ │
    └─ Heartbeat, TextOutputs ─ detokenize thread ◀─ Heartbeat, StepOutputs ────────────────┘ │
  scheduler ranks 1..tp-1 ◀── each step's list[AddRequests | AbortRequest] (gloo) ────────────┘
  API server ─TokenizerQuery─▶ tokenize thread ─TokenizerAnswer─▶ API server (/tokenize, echo)
  offline LLM (in the scheduler's process) ─AddRequests, AbortRequest, FlushPrefixCache─▶ rank 0

Every socket is bound by the process that reads it; the processes that write to it connect. A
step's outputs travel as one message of columns (a row per request that got a token), and what
ends a request (`Finished`: reason, matched stop, counts) travels once, when it ends.

Imports nothing heavy: the API server and the tokenizer process run without torch.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq

from minisgl.core import (
    FieldError,
    FinishReason,
    PromptOptions,
    SamplingParams,
    StructuredOutput,
)

_WIRE_TYPES: dict[str, type] = {}


def _wire(cls: type) -> type:
    _WIRE_TYPES[cls.__name__] = cls
    return cls


_wire(SamplingParams)
_wire(StructuredOutput)
_wire(PromptOptions)


# ---------------------------------------------------------------------- API server -> tokenizer
@_wire
@dataclass
class TokenizeRequest:
    """One API request: each prompt (text or ids), or one chat rendered with the chat template
    (with the tools and the template's own variables, if any), computed len(params) times (its
    choices); rids[i * len(params) + j] is prompt i's choice j. It is served whole or not at all."""

    rids: list[int]
    params: list[SamplingParams]
    prompts: list[str | list[int]] | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    template_kwargs: dict[str, Any] | None = None
    options: PromptOptions = field(default_factory=PromptOptions)
    # the params' max_tokens is the route's default, not the client's: bounded by the room each
    # prompt leaves in the context (vLLM's), not refused for it
    default_max_tokens: bool = False
    # prompt logprobs the request's answer may hold at most, over its prompts: each token after a
    # prompt's first has its own and its prompt_logprobs likeliest (None: no bound), in each of
    # prompt_logprobs_copies (a completion's choices carry a copy each, a chat answer one)
    max_prompt_logprobs: int | None = None
    prompt_logprobs_copies: int = 1


@_wire
@dataclass
class AbortRequest:
    rids: list[int]


@_wire
@dataclass
class TokenizerQuery:
    """/tokenize (a text, or a chat through the template) or /detokenize (ids), answered by the
    tokenize thread with a TokenizerAnswer of the same qid."""

    qid: int
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    ids: list[int] | None = None
    tools: list[dict[str, Any]] | None = None  # a chat's, as TokenizeRequest's
    template_kwargs: dict[str, Any] | None = None
    options: PromptOptions = field(default_factory=PromptOptions)
    token_strs: bool = False  # the answer has each id's token string too (vLLM's)


@_wire
@dataclass
class TokenizerAnswer:
    qid: int
    ids: list[int] | None = None
    token_strs: list[str] | None = None
    text: str | None = None
    error: str | None = None


# ---------------------------------------------------------------------- tokenizer -> scheduler
@_wire
@dataclass
class FlushPrefixCache:
    """Evict every cached prefix no request holds (SGLang's /flush_cache, vLLM's
    reset_prefix_cache); sent by the offline LLM only, and run on every TP rank in the same
    turn, so their pools stay alike."""


@_wire
@dataclass
class AddRequests:
    """Requests to add, all or none: each prompt with the rids and params of its choices. They
    are one client's request, or (offline: a batch, not a client) each prompt's choices one."""

    prompts: list[list[int]]
    rids: list[list[int]]
    params: list[list[SamplingParams]]
    prompts_apart: bool = False


# ---------------------------------------------------------------------- scheduler rank 0 -> ranks
@_wire
@dataclass
class EndRequests:
    """Scheduler rank 0's: end these requests in error on every TP rank in the same turn (a
    matcher step past its limit: only rank 0 times them, as the ranks' own times would
    decide apart)."""

    rids: list[int]
    reasons: list[str]


# ---------------------------------------------------------------------- scheduler -> tokenizer
@_wire
@dataclass
class Ready:
    """Sent once by scheduler rank 0 when every rank is ready, to the tokenize thread, which
    forwards it to the API server."""

    max_seq_len: int  # prompt + output tokens of one request, at most
    vocab_size: int


@_wire
@dataclass
class Heartbeat:
    """Sent by the scheduler at least once a second, busy or idle; forwarded to the API server."""

    loop_age: float  # seconds since the scheduler's loop last went round


@_wire
@dataclass
class Finished:
    """How a request ended. matched_stop: the stop token id or stop string that ended it."""

    rid: int
    reason: FinishReason
    matched_stop: str | int | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@_wire
@dataclass
class ReqError:
    """A request that cannot be served; it holds no state anywhere any more."""

    rid: int
    message: str
    queued: bool = False  # False: refused before it was queued, so never counted as served
    param: str | None = None  # the field at fault, where one is (FieldError)

    @classmethod
    def refusing(cls, rid: int, error: Exception) -> ReqError:
        """Request rid refused for `error`, naming its field where one is at fault."""
        param = error.name if isinstance(error, FieldError) else None
        return cls(rid, str(error), param=param)


@_wire
@dataclass
class SchedulerLoad:
    """A snapshot of the scheduler's state for the metrics. KV pages: request + cached + free =
    all; request pages are held by requests (a running prompt's too), cached ones by the prefix
    cache alone."""

    num_running: int
    num_waiting: int
    request_pages: int
    cached_pages: int
    free_pages: int
    num_preemptions: int
    integrity_checks: int
    integrity_failures: int


@_wire
@dataclass
class TokenLogprobs:
    """The sampled token's logprob and the most likely tokens' (ids) at one step."""

    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]
    rank: int | None = None  # a prompt token's: how many tokens were at least as likely


@_wire
@dataclass
class StepOutputs:
    """One step: the token each of `rids` got (columns), then the requests that ended."""

    rids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] | None = None  # a row per rid, when some asked
    # a row per rid, when some asked: with a request's first token, its prompt's (entry p: of
    # prompt token p + 1, TokenLogprobs' "sampled" token)
    prompt_logprobs: list[list[TokenLogprobs | None] | None] | None = None
    finished: list[Finished] = field(default_factory=list)
    errors: list[ReqError] = field(default_factory=list)
    load: SchedulerLoad | None = None


# ---------------------------------------------------------------------- tokenizer -> API server
@_wire
@dataclass
class TextLogprobs:
    token: str
    logprob: float | None  # None: a prompt's first token, which nothing predicts
    top: list[tuple[str, float]]
    # a prompt token's, for vLLM's prompt_logprobs: its id and rank, and the top tokens' ids
    token_id: int | None = None
    rank: int | None = None
    top_ids: list[int] | None = None


@_wire
@dataclass
class TextOutputs:
    """What became final text this step: for each of `rids` the new text (empty while it is held
    back) and the tokens it came from: 1 a sampled token, 0 for text flushed when the request
    ended without one."""

    rids: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    logprobs: list[TextLogprobs | None] | None = None  # a row per rid, when some asked
    # a row per rid, when some asked: with a request's first text, each prompt token's
    prompt_logprobs: list[list[TextLogprobs] | None] | None = None
    finished: list[Finished] = field(default_factory=list)
    errors: list[ReqError] = field(default_factory=list)
    load: SchedulerLoad | None = None


# ---------------------------------------------------------------------- encoding
# a wire type's map names it under a bytes key: the maps of client JSON (tool schemas, template
# variables) have only str keys, so none is taken for a wire type
_TYPE_KEY = b"t"


def _to_map(obj: Any) -> dict[Any, Any]:
    name = type(obj).__name__
    if _WIRE_TYPES.get(name) is not type(obj):
        raise TypeError(f"{name} is not a wire type")
    return {_TYPE_KEY: name, **vars(obj)}


def _from_map(data: dict[Any, Any]) -> Any:
    name = data.pop(_TYPE_KEY, None)
    return data if name is None else _WIRE_TYPES[name](**data)


def encode(msg: Any) -> bytes:
    return msgpack.packb(msg, default=_to_map)


def decode(data: bytes) -> Any:
    return msgpack.unpackb(data, object_hook=_from_map, strict_map_key=False)


# ---------------------------------------------------------------------- sockets
@dataclass(frozen=True)
class Addresses:
    """The ZMQ endpoint each process reads from: Linux abstract sockets (`ipc://@name`), which
    leave no file behind, however the processes end."""

    api: str
    tokenizer: str  # its tokenize thread: requests from the API server
    detokenizer: str  # its detokenize thread: what the scheduler sends
    scheduler: str  # rank 0's; the other ranks get their messages from it (scheduler.lockstep)

    @classmethod
    def new(cls) -> Addresses:
        prefix = f"ipc://@minisgl-{uuid.uuid4().hex}-"
        return cls(*(prefix + name for name in ("api", "tokenizer", "detokenizer", "scheduler")))


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


def recv_all(sock: zmq.Socket, timeout_ms: int | None) -> list[Any]:
    """Every message waiting on `sock`; with a timeout (None: forever), waits for at least one
    that long first (an empty list if none came)."""
    return [decode(data) for data in recv_all_bytes(sock, timeout_ms)]


def recv_all_bytes(sock: zmq.Socket, timeout_ms: int | None) -> list[bytes]:
    """As recv_all, each message as it came, still encoded."""
    if timeout_ms != 0 and not sock.poll(timeout_ms):
        return []
    frames = []
    while True:
        try:
            frames.append(sock.recv(zmq.NOBLOCK))
        except zmq.Again:
            return frames
