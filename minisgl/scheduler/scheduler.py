"""The scheduler: owns every request, decides each step's batch, and applies the results.

One step (`step()`):
    schedule  -> pick decodes, prefill chunks and new requests under the token budget,
                 reserve their KV pages (preempting the newest request when pages run out),
                 advance their lengths, and build the batch's inputs (on the host)
    launch    -> engine.forward(batch), which uploads them and writes the sampled ids into the
                 token table on the device, where the next step reads them
    process   -> read the sampled ids on the host, check stop rules, finish requests

With overlap on, step k+1 is scheduled and launched before step k's results are processed, so
the CPU work of one step hides behind the GPU work of the other. A step with a constrained
request (structured output) is processed before the next is scheduled: that request's next token
mask needs the token the step samples. It enters the queue once its grammar has compiled on every
rank: the worker settles that before each step (`grammar_flags`, `settle_grammars`).
"""

import random
import time
from collections import deque
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, wait
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from minisgl.config import SchedulerConfig
from minisgl.core import Batch, FinishReason, Req, SamplingParams, TokenMasks, check_prompt
from minisgl.engine.engine import Engine, ForwardOutput
from minisgl.engine.sampler import SampleOutput
from minisgl.kvcache.manager import KVCacheManager
from minisgl.messages import EndRequests, Finished, ReqError, StepOutputs, TokenLogprobs
from minisgl.utils import init_logger
from minisgl.utils.interrupts import interrupt_pending, interruptible

from .batch_builder import build_batch
from .grammar import Grammars
from .token_table import TokenTable

logger = init_logger(__name__)
# prompt tokens per step whose logprobs are computed: each needs a row of logits, 512 rows of
# Qwen3's 151,936 ids are 311 MB in fp32
PROMPT_LOGPROBS_CHUNK = 512


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    steps: int = 0


class _Compiling(NamedTuple):
    """A request waiting for its grammar."""

    req: Req
    grammar: Future[Any]
    submitted: float  # time.monotonic() when it asked for it
    request: int  # the client request it is a row of (its first row's rid)


@dataclass
class _InFlight:
    batch: Batch
    output: ForwardOutput


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        engine: Engine,
        eos_ids: tuple[int, ...],
        wait_for_grammars: bool = False,
    ) -> None:
        """wait_for_grammars: `grammar_flags` waits for every grammar compiling (each up to its
        deadline), so that an offline run is the same every time; else a server's requests wait
        for theirs on the side while other requests run."""
        self.config = config
        self.engine = engine
        self.layout = layout = engine.layout
        self.kv = KVCacheManager(
            layout.num_pages, layout.page_size, layout.page_table_width, config.cache
        )
        self.tokens = TokenTable(layout)
        self.eos_ids = frozenset(eos_ids)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []  # admitted requests, oldest first
        self.stats = SchedulerStats()
        self._reqs: dict[int, Req] = {}
        self._in_flight: _InFlight | None = None
        self._rng = random.Random(config.seed)
        self.grammars = Grammars(
            engine.config.model_path,
            layout.vocab_size,
            eos_ids,
            timed=engine.config.tp_rank == 0,
            alone=engine.config.tp_size == 1,
        )
        self._compiling: dict[int, _Compiling] = {}  # by rid
        self._wait_for_grammars = wait_for_grammars
        self._errors: list[ReqError] = []  # requests whose grammar failed, for the next outputs
        self._processing_logits: set[int] = set()  # requests whose params process the logits
        # requests whose prompt logprobs are still to send: one entry per prompt position after
        # the first, filled as each chunk's step is processed
        self._prompt_logprobs: dict[int, list[TokenLogprobs | None]] = {}

    # ------------------------------------------------------------------ requests in and out
    def add_requests(
        self,
        requests: Sequence[tuple[int, list[int], SamplingParams]],
        owners: Sequence[int] | None = None,
    ) -> None:
        """Add the requests, all or none: the first bad one raises ValueError before any is.
        owners: the client request each is a row of (by its first row's rid; default: one
        client request, the first's), whose rows' matcher time is bounded together."""
        rids: set[int] = set()
        for rid, prompt_ids, params in requests:
            if not isinstance(params, SamplingParams):
                raise ValueError("sampling params must be a SamplingParams")
            check_prompt(prompt_ids, self.layout.max_seq_len, self.layout.vocab_size, params)
            if rid in self._reqs or rid in rids:
                raise ValueError(f"request id {rid} is already in use")
            rids.add(rid)
        now = time.monotonic()
        for k, (rid, prompt_ids, params) in enumerate(requests):
            seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
            req = Req(rid=rid, token_ids=list(prompt_ids), params=params, seed=seed)
            self._reqs[rid] = req
            if params.processes_logits:
                self._processing_logits.add(rid)
            if params.prompt_logprobs is not None:
                self._prompt_logprobs[rid] = [None] * (req.num_prompt_tokens - 1)
            if params.structured is None:
                self.waiting.append(req)
            else:
                grammar = self.grammars.compile(params.structured)
                owner = owners[k] if owners is not None else requests[0][0]
                self._compiling[rid] = _Compiling(req, grammar, now, owner)

    def abort_request(self, rid: int) -> Finished | None:
        """Stop a request now; None if it is unknown or already finished."""
        req = self._reqs.get(rid)
        if req is None:
            return None
        return self._finish(req, "abort", None)

    def flush_prefix_cache(self) -> None:
        """Evict every cached prefix no request holds."""
        self.kv.flush_prefix_cache()

    def warm_up(self) -> None:
        """Compute, before serving, a prefill of each kind the kernels tell apart: Triton
        specializes a kernel on whether its integer arguments are 1 or multiples of 16, the row
        count picks split-K or not (at 224 and 512 rows) and the fused MoE's tile (at 128, 256
        and 512 rows for 128 experts of top-8). Kernels compiled inside the server's loop took
        1.2 s of the online benchmark's run (py-spy, H200). They run in the padding request's
        slot, which holds no request, and leave nothing behind."""
        pad = self.layout.sink_slot
        rows = (16, 17, 240, 241, 300, 528, 529)
        for prefix_lens, extend_lens in [([0], [n]) for n in rows] + [
            ([0, 0], [9, 30]),
            ([8], [17]),
        ]:
            seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
            if max(seq_lens) < self.layout.max_seq_len and len(seq_lens) <= self.layout.num_slots:
                reqs = [Req(-1, [0] * n, SamplingParams(temperature=0), 0, pad) for n in seq_lens]
                batch = build_batch(reqs, prefix_lens, extend_lens, self.layout)
                self.engine.forward(batch).wait()

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._in_flight or self._compiling)

    # ------------------------------------------------------------------ the loop
    @torch.inference_mode()
    def step(self) -> StepOutputs:
        self.grammars.new_step()
        done = None
        if (
            self._in_flight is not None
            and self.grammars.active
            and any(self.grammars.has(r.rid) for r in self._in_flight.batch.reqs)
        ):
            done, self._in_flight = self._in_flight, None
        out = self._process(done) if done else StepOutputs()
        self._end_failed_matchers()  # before their next masks are filled
        batch = self._schedule()
        launched = None
        if batch is not None:
            self.stats.steps += 1
            # on one rank a Ctrl-C may cut the forward: the abort that follows undoes it
            with interruptible() if self.engine.config.tp_size == 1 else nullcontext():
                launched = _InFlight(batch, self.engine.forward(batch))
        self._end_failed_matchers()  # a mask of the launched step: its token is not taken
        if not self.config.overlap:
            out = self._process(launched) if launched else out
        else:
            finished_step, self._in_flight = self._in_flight, launched
            out = self._process(finished_step) if finished_step else out
        out.errors, self._errors = self._errors, []
        return out

    def _end_failed_matchers(self) -> None:
        """End in error each request whose matcher cannot go on."""
        self._end_in_error(self.grammars.take_failed())

    def _end_in_error(self, ended: Iterable[tuple[int, str]], queued: bool = True) -> None:
        """End each request (rid, why) in error for its structured output, whatever its stage
        (its Finished is not sent: the error is); one that ended already is skipped. queued:
        False for a refusal (a constraint that does not compile), which no metric counts."""
        for rid, message in ended:
            if (req := self._reqs.get(rid)) is not None:
                self._finish(req, "abort", None)
                self._errors.append(ReqError(rid, message, queued=queued, param="structured"))

    def take_too_slow(self) -> EndRequests | None:
        """Rank 0's (or the only rank's): the requests whose matcher took a step past
        MAX_MATCH_SECONDS, for every rank to end (only rank 0 times them)."""
        found = self.grammars.take_too_slow()
        return EndRequests(*map(list, zip(*found, strict=True))) if found else None

    def end_requests(self, msg: EndRequests) -> None:
        self._end_in_error(zip(msg.rids, msg.reasons, strict=True))

    @property
    def compiling(self) -> int:
        """Requests waiting for their grammar (the same on every TP rank)."""
        return len(self._compiling)

    def grammar_flags(self, leader: bool) -> list[int]:
        """This rank's word on each request waiting for its grammar, in an order every rank
        shares: 3 x `compiling` ints that the TP ranks combine by their minimum
        (`settle_grammars` reads them): 1 where its compile has ended here, else 0; then, from
        the leader (rank 0) only, -1 where its compile failed there; then -1 where it is past
        its deadline (a compile begun goes on: nothing can stop it). First waits: with
        wait_for_grammars for each compile here up to its deadline; else, where nothing else
        is to do, up to 50 ms for one still compiling here."""
        entries = list(self._compiling.values())
        if self._wait_for_grammars:
            for entry in entries:
                while not (
                    entry.grammar.done()
                    or self._overdue(entry, time.monotonic())
                    or interrupt_pending()
                ):
                    wait([entry.grammar], timeout=0.05)
        elif not (self.waiting or self.running or self._in_flight) and (
            pending := [e.grammar for e in entries if not e.grammar.done()]
        ):
            wait(pending, timeout=0.05, return_when="FIRST_COMPLETED")
        now = time.monotonic()
        done = [int(e.grammar.done()) for e in entries]
        failed, overdue = [0] * len(entries), [0] * len(entries)
        if leader:
            for i, entry in enumerate(entries):
                failed[i] = -int(self._failure(entry) is not None)
                overdue[i] = -int(self._overdue(entry, now))
        return done + failed + overdue

    def _failure(self, entry: _Compiling) -> str | None:
        """Why its compile failed here; None while it runs, or if it compiled."""
        if not entry.grammar.done():
            return None
        try:
            self.grammars.check(entry.req.params.structured, entry.grammar)
        except ValueError as e:
            return str(e)
        return None

    def _overdue(self, entry: _Compiling, now: float) -> bool:
        """Past grammar_timeout, counted from its request's arrival or, if later, from when the
        compiler was built (its tokenizer tables take seconds)."""
        built = self.grammars.compiler_built_at
        return (
            built is not None and now - max(entry.submitted, built) >= self.config.grammar_timeout
        )

    def settle_grammars(self, flags: list[int]) -> None:
        """Given every rank's `grammar_flags` combined by their minimum: end in error a request
        whose compile failed on the leader; queue one compiled on every rank; end one past its
        deadline (on the leader's clock) that some rank has not compiled; the rest wait on."""
        entries = list(self._compiling.items())
        n = len(entries)
        done, failed, overdue = flags[:n], flags[n : 2 * n], flags[2 * n :]
        for (rid, entry), ready, fail, late in zip(entries, done, failed, overdue, strict=True):
            if fail:  # only the leader knows why, and only its errors are sent
                why = self._failure(entry) or "its grammar failed"
                self._end_in_error([(rid, why)], queued=False)  # the client's: vLLM refuses it
            elif ready:
                del self._compiling[rid]
                self.grammars.start(rid, entry.req.params.structured, entry.grammar, entry.request)
                self.waiting.append(entry.req)
            elif late:
                why = "compile" if entry.grammar.running() else "get a grammar thread (all busy)"
                message = (
                    f"structured output too costly to compile: its grammar did not {why} within "
                    f"{self.config.grammar_timeout:g} s (--grammar-timeout)"
                )
                self._end_in_error([(rid, message)])

    def _process(self, step: _InFlight) -> StepOutputs:
        host = step.output.wait()
        tokens = host.tokens.tolist()
        out = StepOutputs()
        if host.logprobs is not None:
            out.logprobs = []
        if step.batch.prompt_spans:
            self._take_prompt_logprobs(step.batch, host)
        if self._prompt_logprobs:  # a request's first token may come in a step without them
            out.prompt_logprobs = []
        for i in step.batch.sample_rows:
            req = step.batch.reqs[i]
            if req.finished:  # aborted, or finished by the previous step while this one ran
                continue
            req.token_ids.append(tokens[i])
            out.rids.append(req.rid)
            out.token_ids.append(tokens[i])
            if out.logprobs is not None:
                out.logprobs.append(_logprobs(host, i, req.params.logprobs))
            if out.prompt_logprobs is not None:  # its prompt's, with its first token
                out.prompt_logprobs.append(self._prompt_logprobs.pop(req.rid, None))
            finish = self._token_finish(req)
            if (
                self.grammars.active
                and self.grammars.has(req.rid)
                and self.grammars.accept(req.rid, tokens[i])
            ):
                # complete: no stop token ended it (ignore_eos made the eos none), so none is named
                finish = finish or ("stop", None)
            if finish is not None:
                out.finished.append(self._finish(req, *finish))
        return out

    def _take_prompt_logprobs(self, batch: Batch, host: SampleOutput) -> None:
        """Note the prompt logprobs a prefill step computed, by position (a chunk computed again
        after a preemption gives the same ones)."""
        assert host.prompt_logprobs is not None and host.prompt_top_ids is not None
        assert host.prompt_top_logprobs is not None and host.prompt_ranks is not None
        chosen, ranks = host.prompt_logprobs.tolist(), host.prompt_ranks.tolist()
        top_ids, top_logprobs = host.prompt_top_ids.tolist(), host.prompt_top_logprobs.tolist()
        row = 0
        for i, start, count in batch.prompt_spans:
            req = batch.reqs[i]
            noted = self._prompt_logprobs.get(req.rid)
            if noted is not None and not req.finished:
                wanted = req.params.prompt_logprobs
                for k in range(row, row + count):
                    noted[start + k - row] = TokenLogprobs(
                        chosen[k], top_ids[k][:wanted], top_logprobs[k][:wanted], ranks[k]
                    )
            row += count

    def _token_finish(self, req: Req) -> tuple[FinishReason, int | None] | None:
        """(reason, the stop token) if the token just appended ends `req`: an eos or stop
        token, else max_tokens or the end of the context (that order, as vLLM's: a last allowed
        token that is a stop token ends the request as a stop, its text left out). Stop strings
        are matched where the text is decoded (the detokenizer), which then aborts the request
        here."""
        token, params = req.token_ids[-1], req.params
        if token in req.stop_ids or (not params.ignore_eos and token in self.eos_ids):
            return "stop", token
        # the tokens the host has seen (an in-flight step may have sampled one more already)
        if (
            req.num_output_tokens == params.max_tokens
            or len(req.token_ids) >= self.layout.max_seq_len
        ):
            return "length", None
        return None

    # ------------------------------------------------------------------ scheduling
    def _wants_token(self, req: Req) -> bool:
        max_tokens = req.params.max_tokens
        return (max_tokens is None or req.num_sampled < max_tokens) and (
            req.device_len < self.layout.max_seq_len
        )

    def _schedule(self) -> Batch | None:
        self.kv.move_duplicates()
        picked: list[tuple[Req, int]] = []
        preempted: set[Req] = set()
        # 1. decodes first, so they never starve behind prefills
        decodes = [r for r in self.running if not r.is_prefilling and self._wants_token(r)]
        if self.kv.reserve_all([(r.slot, r.device_len) for r in decodes]):
            picked = [(req, 1) for req in decodes]
            decodes = []  # all reserved: no one to preempt for
        for req in decodes:
            if req in preempted:
                continue
            while not self.kv.reserve(req.slot, req.device_len):
                victim = self.running[-1]  # the newest: it has the least work to lose
                self._preempt(victim)
                preempted.add(victim)
                if victim is req:
                    break
            else:
                picked.append((req, 1))
        # 2. prompts in progress, then new requests, in what the decodes leave of the step's
        # token budget (as vLLM's max_num_batched_tokens): every full step has chunk_size tokens,
        # so its matmuls meet one row count, not a new one per step
        budget = max(self.config.chunk_size - len(picked), 0)
        # each prompt token whose logprob is asked for takes a row of logits: a few per step
        prompt_rows = PROMPT_LOGPROBS_CHUNK
        for req in [r for r in self.running if r.is_prefilling]:
            if budget == 0:
                break
            asks = req.rid in self._prompt_logprobs
            if asks and prompt_rows == 0:
                continue
            extend = self._reserve_chunk(req, min(budget, prompt_rows) if asks else budget)
            if extend == 0:
                break
            picked.append((req, extend))
            budget -= extend
            prompt_rows -= extend if asks else 0
        passed = 0  # requests at the queue's head whose prompt logprobs wait for the next step
        while len(self.waiting) > passed and budget > 0 and not preempted:
            req = self.waiting[passed]
            asks = req.rid in self._prompt_logprobs
            if asks and prompt_rows == 0:
                passed += 1
                continue
            extend = self._admit(req, min(budget, prompt_rows) if asks else budget)
            if extend == 0:
                break
            del self.waiting[passed]
            self.running.append(req)
            picked.append((req, extend))
            budget -= extend
            prompt_rows -= extend if asks else 0
        if not picked and self.running and not self._in_flight:
            # every running request is stuck mid-prompt without pages: make room, try next step
            self._preempt(self.running[-1])
        return self._build_batch(picked) if picked else None

    def _reserve_chunk(self, req: Req, budget: int) -> int:
        """Reserve pages for the next chunk of req's prompt; returns its length (0: no pages)."""
        extend = min(
            req.device_len - req.cached_len, budget, self.kv.capacity(req.slot) - req.cached_len
        )
        if extend <= 0:
            return 0
        if not self.kv.reserve(req.slot, req.cached_len + extend):  # capacity says it fits
            raise RuntimeError(f"request {req.rid}: no pages for a chunk that fits the capacity")
        return extend

    def _admit(self, req: Req, budget: int) -> int:
        """Give a waiting request a slot and its cached prefix, and reserve its first chunk."""
        new_slot = req.slot < 0
        if new_slot:
            if self.tokens.num_free_slots == 0:
                return 0
            req.slot = self.tokens.alloc_slot()
        # the last token is always computed: its logits give the next token; a prompt whose
        # logprobs are asked for is computed whole (a cached prefix has no logits)
        computed = [] if req.rid in self._prompt_logprobs else req.token_ids[: req.device_len - 1]
        req.cached_len = self.kv.admit(req.slot, computed)
        extend = self._reserve_chunk(req, budget)
        if extend == 0:
            self.kv.release(req.slot, req.token_ids[: req.cached_len])
            req.cached_len = 0
            if new_slot:
                self.tokens.free_slot(req.slot)
                req.slot = -1
            return 0
        if new_slot:
            self.tokens.write(req.slot, 0, req.token_ids[: req.num_prompt_tokens])
        if req.num_preemptions == 0:
            req.cached_tokens = req.cached_len
        return extend

    def _preempt(self, req: Req) -> None:
        """Free a running request's KV (its computed prefix stays in a radix cache) and put it
        back at the head of the queue. It keeps its slot, so its token row stays intact."""
        logger.info("preempting request %d at %d tokens", req.rid, req.device_len)
        self.kv.release(req.slot, req.token_ids[: req.cached_len])
        req.cached_len = 0
        req.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.running.remove(req)
        self.waiting.appendleft(req)

    def _forget(self, req: Req) -> None:
        """Drop every record of the request but its place in the queues and its KV."""
        del self._reqs[req.rid]
        compiling = self._compiling.pop(req.rid, None)
        if compiling is not None and all(
            other.grammar is not compiling.grammar for other in self._compiling.values()
        ):
            self.grammars.abandon(req.params.structured, compiling.grammar)
        self._processing_logits.discard(req.rid)
        self._prompt_logprobs.pop(req.rid, None)
        self.grammars.drop(req.rid)

    def _finish(self, req: Req, reason: FinishReason, matched: int | None) -> Finished:
        req.finish_reason = reason
        self._forget(req)
        if req in self.running:
            self.running.remove(req)
            self.kv.release(req.slot, req.token_ids[: req.cached_len])
        elif req in self.waiting:
            self.waiting.remove(req)
        if req.slot >= 0:
            self.tokens.free_slot(req.slot)
        return Finished(
            rid=req.rid,
            reason=reason,
            matched_stop=matched,
            prompt_tokens=req.num_prompt_tokens,
            completion_tokens=req.num_output_tokens,
            cached_tokens=req.cached_tokens,
        )

    def _build_batch(self, picked: list[tuple[Req, int]]) -> Batch:
        reqs = [req for req, _ in picked]
        extend_lens = [extend for _, extend in picked]
        prefix_lens = [req.cached_len for req in reqs]
        sample_rows = []
        for i, (req, extend) in enumerate(picked):
            req.cached_len += extend
            if req.cached_len == req.device_len:  # the whole known sequence is computed: sample
                sample_rows.append(i)
                # a prompt just finished (if only by one token), or a recomputation by more than
                # one: share its pages with later requests
                if extend > 1 or prefix_lens[i] < req.num_prompt_tokens:
                    self.kv.cache_prefix(req.slot, req.token_ids[: req.cached_len])
                req.device_len += 1
        # scanned only while some request processes its logits: it costs each step's host time
        processed = (
            [i for i in sample_rows if reqs[i].rid in self._processing_logits]
            if self._processing_logits
            else []
        )
        prompt_rows = (
            [i for i, req in enumerate(reqs) if req.rid in self._prompt_logprobs]
            if self._prompt_logprobs
            else []
        )
        return build_batch(
            reqs, prefix_lens, extend_lens, self.layout, sample_rows,
            self.kv.take_page_writes(), self.tokens.take_writes(), processed,
            self._token_masks(reqs, processed), prompt_rows,
        )  # fmt: skip

    def _token_masks(self, reqs: list[Req], processed: list[int]) -> TokenMasks | None:
        """The masks of the rows that sample under a grammar, or before min_tokens (which holds
        back eos and stop tokens while anything else may follow: a grammar that can only end
        ends)."""
        rows = [
            i
            for i in processed
            if self.grammars.holds(reqs[i].rid) or reqs[i].num_sampled <= reqs[i].params.min_tokens
        ]
        if not rows:
            return None
        bits = np.full((len(rows), -(-self.layout.vocab_size // 32)), -1, dtype=np.int32)
        words = bits.view(np.uint32)
        for j, i in enumerate(rows):
            req = reqs[i]
            if self.grammars.holds(req.rid):
                assert len(req.token_ids) == req.device_len - 1, "its last token is on the host"
                self.grammars.fill_mask(req.rid, bits, j)
            if req.num_sampled <= req.params.min_tokens:
                stops = req.stop_ids if req.params.ignore_eos else req.stop_ids | self.eos_ids
                ids = np.fromiter(stops, dtype=np.int64, count=len(stops))
                ids = ids[ids < self.layout.vocab_size]  # stop ids past it are never sampled
                held = words[j].copy()
                np.bitwise_and.at(held, ids >> 5, ~(np.uint32(1) << (ids & 31).astype(np.uint32)))
                if held.any():
                    words[j] = held
        return TokenMasks(rows, bits)

    def check_integrity(self) -> None:
        """Raise IntegrityError unless the KV cache's accounting holds."""
        self.kv.check_integrity()


def _logprobs(host: SampleOutput, row: int, wanted: int | None) -> TokenLogprobs | None:
    if wanted is None:
        return None
    assert host.logprobs is not None and host.top_ids is not None
    assert host.top_logprobs is not None
    return TokenLogprobs(
        float(host.logprobs[row]),
        host.top_ids[row, :wanted].tolist(),
        host.top_logprobs[row, :wanted].tolist(),
    )
