"""The tokenizer process: text to token ids on the way in, token ids to text on the way out.

Three threads, each with its own tokenizer, so that a long prompt being tokenized never holds
back the text of running requests, nor a shorter request's prompt (the tokenizers library
releases the GIL while it encodes):

    API server ◀▶ [tokenize thread]   ─AddRequests, AbortRequest─▶ scheduler
                        │      ▲ Ready (then forwarded to the API server)
                        │ each new request's detokenizer, before the scheduler has it
    API server ◀─ [detokenize thread] ◀─StepOutputs, Heartbeat── scheduler
                        └─ AbortRequest (a stop string matched) ─▶ scheduler

The tokenize thread hands a request or query of more than BULK_BYTES to the bulk thread, whose
answer comes back to it to be sent on.

Prompts that cannot be served are answered with an error here, before they reach the scheduler.
"""

import queue
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import zmq

from minisgl.core import SamplingParams, check_min_tokens_room, check_prompt, check_token_ids
from minisgl.messages import (
    AbortRequest,
    AddRequests,
    Addresses,
    Finished,
    Heartbeat,
    Ready,
    ReqError,
    StepOutputs,
    TextLogprobs,
    TextOutputs,
    TokenizerAnswer,
    TokenizeRequest,
    TokenizerQuery,
    TokenLogprobs,
    bind_pull,
    connect_push,
    decode,
    recv_all,
    recv_all_bytes,
    send,
)

from .detokenizer import IncrementalDetokenizer
from .loader import Tokenizer, load_tokenizer, prompt_ids

# (rid, prompt ids, stop strings): a request the detokenize thread is to expect
NewRequest = tuple[int, list[int], SamplingParams]
# a request or query of more bytes is tokenized on the bulk thread: the Qwen3 tokenizer took
# 6.8 s for 4.5 MB of text on a 2-core CPU, and every request sent after it waited
BULK_BYTES = 256 << 10
_TOKENIZED = "inproc://tokenized"  # the bulk thread's answers, back to the tokenize thread


class Tokenize:
    """The tokenize thread's work: a request's prompts as ids for the scheduler."""

    def __init__(
        self, tokenizer: Tokenizer, chat_template: str | None, new: queue.SimpleQueue[NewRequest]
    ) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.limits: Ready | None = None  # the scheduler's, sent to this thread too
        self._new = new

    def __call__(self, request: TokenizeRequest) -> AddRequests | TextOutputs:
        """The request's prompts as ids, or an error for each of its rids."""
        assert self.limits is not None, "the API server admits requests only once ready"
        choices = len(request.params)
        try:
            prompts = [
                prompt_ids(
                    self.tokenizer,
                    prompt,
                    request.messages,
                    self.chat_template,
                    request.tools,
                    request.template_kwargs,
                    request.options,
                )
                for prompt in request.prompts or [None]
            ]
            params = [self._bounded(request, ids) for ids in prompts]
            self._check_prompt_logprobs(request, prompts)
            for ids, prompt_params in zip(prompts, params, strict=True):
                # rejected here, before queuing, by the scheduler's own rule
                check_prompt(ids, self.limits.max_seq_len, self.limits.vocab_size, prompt_params[0])
        except Exception as e:  # a template or a prompt that fails in any way fails this request
            return TextOutputs(errors=[ReqError.refusing(rid, e) for rid in request.rids])
        rids = [request.rids[i * choices : (i + 1) * choices] for i in range(len(prompts))]
        for ids, prompt_rids, prompt_params in zip(prompts, rids, params, strict=True):
            for rid, choice in zip(prompt_rids, prompt_params, strict=True):
                self._new.put((rid, ids, choice))
        return AddRequests(prompts, rids, params)

    @staticmethod
    def _check_prompt_logprobs(request: TokenizeRequest, prompts: list[list[int]]) -> None:
        """Raise ValueError for a request that asks for more prompt logprobs than it may."""
        top = request.params[0].prompt_logprobs  # a prompt's first choice asks for its prompt's
        bound = request.max_prompt_logprobs
        if top is None or bound is None:
            return
        copies = request.prompt_logprobs_copies
        asked = sum(len(ids) - 1 for ids in prompts) * (top + 1) * copies
        if asked > bound:
            raise ValueError(
                f"the request asks for {asked} prompt logprobs (its prompts' tokens after the "
                f"first x {top + 1}" + (f" x {copies} choices" if copies > 1 else "") + "), more "
                f"than the {bound} a request may (--max-prompt-logprobs)"
            )

    def _bounded(self, request: TokenizeRequest, ids: list[int]) -> list[SamplingParams]:
        """The choices' params for one prompt: a default max_tokens at most the room it leaves
        (at least one token: a prompt that fills the context is refused)."""
        assert self.limits is not None
        if not request.default_max_tokens:
            return request.params
        for params in request.params:
            check_min_tokens_room(len(ids), self.limits.max_seq_len, params)
        room = max(1, self.limits.max_seq_len - len(ids))
        return [
            p if p.max_tokens is None or p.max_tokens <= room else replace(p, max_tokens=room)
            for p in request.params
        ]

    def answer(self, query: TokenizerQuery) -> TokenizerAnswer:
        """Ids for a text or a chat, or the text of ids (special tokens included)."""
        assert self.limits is not None, "the API server admits queries only once ready"
        try:
            if query.ids is None:
                ids = prompt_ids(
                    self.tokenizer, query.prompt, query.messages, self.chat_template, query.tools,
                    query.template_kwargs, query.options,
                )  # fmt: skip
                strs = self.tokenizer.convert_ids_to_tokens(ids) if query.token_strs else None
                return TokenizerAnswer(query.qid, ids=ids, token_strs=strs)
            check_token_ids(query.ids, self.limits.vocab_size)
            return TokenizerAnswer(query.qid, text=self.tokenizer.decode(query.ids))
        except Exception as e:  # as a request's, a query's failure is its own
            return TokenizerAnswer(query.qid, error=str(e))


class Detokenize:
    """The detokenize thread's work: each step's token ids as text. It alone holds the requests'
    detokenizers, from the tokenize thread's word that a request comes to its end."""

    def __init__(self, tokenizer: Tokenizer, new: queue.SimpleQueue[NewRequest]) -> None:
        self.tokenizer = tokenizer
        self.detoks: dict[int, IncrementalDetokenizer] = {}
        self._prompts: dict[int, list[int]] = {}  # of the requests whose prompt logprobs come
        self._new = new
        # token texts are decoded after an anchor token: SentencePiece drops a word's leading
        # space at the start of a text, but the token's text includes it
        self._anchor = tokenizer.encode("a", add_special_tokens=False)[-1:]
        self._anchor_len = len(tokenizer.decode(self._anchor))

    def __call__(self, out: StepOutputs) -> tuple[TextOutputs, list[int]]:
        """The step's text, and the requests a stop string ended (to stop in the scheduler)."""
        while not self._new.empty():
            rid, ids, params = self._new.get_nowait()
            self.detoks[rid] = IncrementalDetokenizer(self.tokenizer, ids, params)
            if params.prompt_logprobs is not None:
                self._prompts[rid] = ids
        ended = {f.rid: f for f in out.finished}
        text = TextOutputs(errors=out.errors, load=out.load)
        if out.logprobs is not None:
            text.logprobs = []
        if out.prompt_logprobs is not None:
            text.prompt_logprobs = []
        to_stop = []
        for i, (rid, token) in enumerate(zip(out.rids, out.token_ids, strict=True)):
            detok = self.detoks.get(rid)
            if detok is None or detok.stopped:  # past its stop string, or already ended
                continue
            piece, stop = detok.step([token], ended.get(rid))
            text.rids.append(rid)
            text.texts.append(piece)
            text.num_tokens.append(1)
            if text.logprobs is not None:
                assert out.logprobs is not None
                text.logprobs.append(self._logprobs(token, out.logprobs[i]))
            if text.prompt_logprobs is not None:
                assert out.prompt_logprobs is not None
                text.prompt_logprobs.append(self._prompt_logprobs(rid, out.prompt_logprobs[i]))
            if stop:
                to_stop.append(rid)
        stepped = set(out.rids)
        for finish in out.finished:
            detok = self.detoks.pop(finish.rid, None)
            if detok is None:
                continue
            if finish.rid not in stepped:  # ended without a token this step (aborted)
                piece, _ = detok.step([], finish)
                if piece:
                    text.rids.append(finish.rid)
                    text.texts.append(piece)
                    text.num_tokens.append(0)
                    if text.logprobs is not None:
                        text.logprobs.append(None)
                    if text.prompt_logprobs is not None:
                        text.prompt_logprobs.append(None)
            self._prompts.pop(finish.rid, None)
            text.finished.append(detok.end(finish))
        for error in out.errors:
            self.detoks.pop(error.rid, None)
            self._prompts.pop(error.rid, None)
        return text, to_stop

    def _prompt_logprobs(
        self, rid: int, logprobs: list[TokenLogprobs | None] | None
    ) -> list[TextLogprobs] | None:
        """Each prompt token with its logprob (the first with none)."""
        prompt = self._prompts.pop(rid, None)
        if prompt is None or logprobs is None:
            return None
        entries = [TextLogprobs(self._token_text(prompt[0]), None, [], token_id=prompt[0])]
        for token, lp in zip(prompt[1:], logprobs, strict=True):
            entry = self._logprobs(token, lp)
            assert entry is not None and lp is not None, "every prompt position is computed first"
            entries.append(replace(entry, token_id=token, rank=lp.rank, top_ids=lp.top_ids))
        return entries

    def _logprobs(self, token: int, logprobs: TokenLogprobs | None) -> TextLogprobs | None:
        if logprobs is None:
            return None
        top = zip(logprobs.top_ids, logprobs.top_logprobs, strict=True)
        return TextLogprobs(
            self._token_text(token), logprobs.logprob, [(self._token_text(t), lp) for t, lp in top]
        )

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([*self._anchor, token_id])[self._anchor_len :]


def run_tokenizer(model_path: Path, addresses: Addresses, chat_template: str | None) -> None:
    """The process entry point; runs until the process is terminated."""
    new: queue.SimpleQueue[NewRequest] = queue.SimpleQueue()
    ctx = zmq.Context()
    detokenize = Detokenize(load_tokenizer(model_path), new)
    outputs = bind_pull(ctx, addresses.detokenizer)
    threading.Thread(
        target=_detokenize_loop, args=(detokenize, ctx, outputs, addresses), daemon=True
    ).start()
    bulk = Tokenize(load_tokenizer(model_path), chat_template, new)
    bulk_jobs: queue.SimpleQueue[TokenizeRequest | TokenizerQuery] = queue.SimpleQueue()
    tokenized = bind_pull(ctx, _TOKENIZED)
    lanes = _Lanes(
        Tokenize(load_tokenizer(model_path), chat_template, new),
        bulk,
        bulk_jobs,
        connect_push(ctx, addresses.scheduler),
        connect_push(ctx, addresses.api),
    )
    threading.Thread(
        target=_bulk_loop, args=(bulk, bulk_jobs, ctx, lanes.all_aborted), daemon=True
    ).start()
    requests = bind_pull(ctx, addresses.tokenizer)
    poller = zmq.Poller()
    poller.register(requests, zmq.POLLIN)
    poller.register(tokenized, zmq.POLLIN)
    while True:
        for sock in dict(poller.poll()):
            for data in recv_all_bytes(sock, timeout_ms=0):
                if sock is tokenized:
                    lanes.forward(decode(data))
                else:
                    lanes.take(decode(data), len(data))


class _Lanes:
    """The tokenize thread's messages: requests and queries answered here, or, past BULK_BYTES,
    on the bulk thread, whose answers come back to `forward`. A request aborted while the bulk
    thread holds it is aborted right after it is sent on (the scheduler ends it as any other),
    or, if the bulk thread had not begun it, ended unread."""

    def __init__(
        self,
        tokenize: Tokenize,
        bulk: Tokenize,
        bulk_jobs: queue.SimpleQueue[TokenizeRequest | TokenizerQuery],
        to_scheduler: zmq.Socket,
        to_api: zmq.Socket,
    ) -> None:
        self._tokenize, self._bulk, self._bulk_jobs = tokenize, bulk, bulk_jobs
        self._to_scheduler, self._to_api = to_scheduler, to_api
        self._in_bulk: set[int] = set()  # rids of the requests the bulk thread holds
        self._aborted: set[int] = set()  # of those, the ones aborted meanwhile

    def take(self, msg: object, size: int) -> None:
        """A message from the API server, `size` bytes as sent."""
        if isinstance(msg, (TokenizeRequest, TokenizerQuery)) and size > BULK_BYTES:
            self._in_bulk.update(msg.rids if isinstance(msg, TokenizeRequest) else [msg.qid])
            self._bulk_jobs.put(msg)
        elif isinstance(msg, TokenizeRequest):
            self.forward(self._tokenize(msg))
        elif isinstance(msg, TokenizerQuery):
            self.forward(self._tokenize.answer(msg))
        elif isinstance(msg, Ready):  # then the API server admits requests
            self._tokenize.limits = self._bulk.limits = msg
            send(self._to_api, msg)
        else:
            assert isinstance(msg, AbortRequest)
            self._aborted.update(rid for rid in msg.rids if rid in self._in_bulk)
            # the detokenizer goes with the scheduler's end of the request, like any other
            send(self._to_scheduler, msg)

    def all_aborted(self, rids: list[int]) -> bool:
        """Every one of these bulk requests was aborted (read by the bulk thread: one set
        lookup at a time, each whole under the GIL)."""
        return all(rid in self._aborted for rid in rids)

    def forward(self, result: AddRequests | TextOutputs | TokenizerAnswer) -> None:
        """A request's prompts on to the scheduler (then its abort, if it came meanwhile), or
        its error, its end unread, or a query's answer back to the API server."""
        if isinstance(result, TokenizerAnswer):
            self._in_bulk.discard(result.qid)
            self._aborted.discard(result.qid)
            send(self._to_api, result)
            return
        if isinstance(result, TextOutputs):
            rids = [error.rid for error in result.errors] + [end.rid for end in result.finished]
        else:
            rids = [rid for prompt_rids in result.rids for rid in prompt_rids]
        self._in_bulk.difference_update(rids)
        aborted = sorted(self._aborted.intersection(rids))
        self._aborted.difference_update(aborted)
        send(self._to_scheduler if isinstance(result, AddRequests) else self._to_api, result)
        if aborted and isinstance(result, AddRequests):
            send(self._to_scheduler, AbortRequest(aborted))


def _bulk_loop(
    tokenize: Tokenize,
    jobs: queue.SimpleQueue[TokenizeRequest | TokenizerQuery],
    ctx: zmq.Context,
    all_aborted: Callable[[list[int]], bool],
) -> None:
    """The bulk thread's loop. A request whose client left before its turn ends unread: 12.6 MB
    of text took 9 s to tokenize, which the requests queued behind it would wait for."""
    answers = connect_push(ctx, _TOKENIZED)
    while True:
        job = jobs.get()
        if isinstance(job, TokenizerQuery):
            gone = all_aborted([job.qid])
            send(
                answers, TokenizerAnswer(job.qid, error="aborted") if gone else tokenize.answer(job)
            )
        elif all_aborted(job.rids):
            send(
                answers,
                TextOutputs(finished=[Finished(r, "abort", None, 0, 0, 0) for r in job.rids]),
            )
        else:
            send(answers, tokenize(job))


def _detokenize_loop(
    detokenize: Detokenize, ctx: zmq.Context, outputs: zmq.Socket, addresses: Addresses
) -> None:
    to_scheduler, to_api = connect_push(ctx, addresses.scheduler), connect_push(ctx, addresses.api)
    while True:
        for msg in recv_all(outputs, timeout_ms=None):
            if isinstance(msg, StepOutputs):
                text, to_stop = detokenize(msg)
                send(to_api, text)
                if to_stop:
                    send(to_scheduler, AbortRequest(to_stop))
            else:
                assert isinstance(msg, Heartbeat)
                send(to_api, msg)
