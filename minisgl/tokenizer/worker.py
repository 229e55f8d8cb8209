"""The tokenizer process: text to token ids on the way in, token ids to text on the way out.

It owns the tokenizer and every request's IncrementalDetokenizer. Prompts that cannot fit the
context are answered with an error here, before they reach the scheduler's queue.
"""

from pathlib import Path
from typing import Any

import jinja2
import zmq
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from minisgl.core import check_prompt
from minisgl.messages import (
    AbortRequest,
    AddRequest,
    Addresses,
    ReqChunk,
    ReqError,
    SchedulerLimits,
    SchedulerOutputs,
    TextOutputs,
    TokenizeRequest,
    TokenLogprob,
    bind_pull,
    connect_push,
    recv_all,
    send,
)
from minisgl.scheduler import ReqOutput

from .detokenizer import IncrementalDetokenizer


def prompt_ids(tokenizer: PreTrainedTokenizerBase, request: TokenizeRequest) -> list[int]:
    """The request's prompt as token ids; raises ValueError if it cannot be built."""
    if request.messages is not None:
        if tokenizer.chat_template is None:
            raise ValueError("the model has no chat template; use /v1/completions")
        try:
            text = tokenizer.apply_chat_template(
                request.messages, tokenize=False, add_generation_prompt=True
            )
        except jinja2.TemplateError as e:
            raise ValueError(f"cannot apply the chat template: {e}") from e
        # the template writes any BOS itself; encoding must not add a second one
        return tokenizer.encode(text, add_special_tokens=False)
    if isinstance(request.prompt, str):
        return tokenizer.encode(request.prompt)
    assert request.prompt is not None
    return list(request.prompt)


class TokenizerWorker:
    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, to_scheduler: zmq.Socket, to_api: zmq.Socket
    ) -> None:
        self.tokenizer = tokenizer
        self.to_scheduler = to_scheduler
        self.to_api = to_api
        self.limits: SchedulerLimits | None = None
        self._detoks: dict[int, IncrementalDetokenizer] = {}
        # token texts are decoded after an anchor token: SentencePiece drops a word's leading
        # space at the start of a text, but the token's text includes it
        self._anchor = tokenizer.encode("a", add_special_tokens=False)[-1:]
        self._anchor_len = len(self._decode(self._anchor))

    def handle(self, msg: Any) -> None:
        if isinstance(msg, TokenizeRequest):
            self._tokenize(msg)
        elif isinstance(msg, AbortRequest):
            # the detokenizer goes with the scheduler's abort output, like any finished request's
            send(self.to_scheduler, msg)
        elif isinstance(msg, SchedulerOutputs):
            self._detokenize(msg)
        elif isinstance(msg, SchedulerLimits):
            self.limits = msg
            send(self.to_api, msg)
        else:
            raise TypeError(f"unexpected message {type(msg).__name__}")

    def _tokenize(self, request: TokenizeRequest) -> None:
        assert self.limits is not None, "the API server admits requests only once ready"
        try:
            ids = prompt_ids(self.tokenizer, request)
            # rejected here, before queuing, by the scheduler's own rule
            check_prompt(ids, self.limits.max_seq_len, self.limits.vocab_size)
        except ValueError as e:
            send(self.to_api, TextOutputs([], [ReqError(request.rid, str(e))]))
            return
        self._detoks[request.rid] = IncrementalDetokenizer(self.tokenizer, ids, request.params.stop)
        send(self.to_scheduler, AddRequest(request.rid, ids, request.params))

    def _detokenize(self, msg: SchedulerOutputs) -> None:
        chunks = [self._chunk(out) for out in msg.outputs]
        for error in msg.errors:
            del self._detoks[error.rid]
        send(self.to_api, TextOutputs(chunks, msg.errors, msg.load))

    def _chunk(self, out: ReqOutput) -> ReqChunk:
        finished = out.finish_reason is not None
        detok = self._detoks.pop(out.rid) if finished else self._detoks[out.rid]
        new = [] if out.token_id is None else [out.token_id]
        text = detok.step(new, finished, isinstance(out.matched_stop, int))
        logprob = None
        if out.logprob is not None:
            value, top = out.logprob
            assert out.token_id is not None
            logprob = TokenLogprob(
                self._token_text(out.token_id),
                value,
                [(self._token_text(t), lp) for t, lp in top],
            )
        return ReqChunk(
            rid=out.rid,
            text=text,
            token_id=out.token_id,
            finish_reason=out.finish_reason,
            matched_stop=out.matched_stop,
            logprob=logprob,
            prompt_tokens=out.prompt_tokens,
            completion_tokens=out.completion_tokens,
            cached_tokens=out.cached_tokens,
        )

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def _token_text(self, token_id: int) -> str:
        return self._decode([*self._anchor, token_id])[self._anchor_len :]


def run_tokenizer(model_path: Path, addresses: Addresses) -> None:
    """The process entry point; runs until the process is terminated."""
    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    ctx = zmq.Context()
    inbox = bind_pull(ctx, addresses.tokenizer)
    worker = TokenizerWorker(
        tokenizer, connect_push(ctx, addresses.scheduler), connect_push(ctx, addresses.api)
    )
    while True:
        for msg in recv_all(inbox, block=True):
            worker.handle(msg)
