"""The scheduler process: one per TP rank, each running the same `Scheduler` in lockstep.

Rank 0 reads requests from the tokenizer and, before applying them, sends each step's messages to
ranks 1..tp-1 (`lockstep`), so every rank adds and aborts the same requests in the same order and
runs identical `step()`s (their forwards meet in the TP collectives). Each rank compiles the
grammars of its structured outputs on threads of its own; a request starts once every rank has
its grammar (their flags combined in one all-reduce a turn while any compiles), and only rank 0
refuses one (past its deadline) or ends one (a matcher step too long), so no rank's own clock
decides apart. Only rank 0 sends outputs, and a thread of its own sends a heartbeat every half
second, however long a step takes. The offline LLM is rank 0 itself, and starts the other ranks
as these processes.
"""

import dataclasses
import threading
import time

import torch.distributed as dist
import zmq

from minisgl.config import EngineConfig, SchedulerConfig
from minisgl.engine.engine import Engine
from minisgl.kvcache import PREFIX_CACHES, IntegrityError
from minisgl.messages import (
    AddRequests,
    Addresses,
    EndRequests,
    Finished,
    FlushPrefixCache,
    Heartbeat,
    Ready,
    ReqError,
    SchedulerLoad,
    StepOutputs,
    bind_pull,
    connect_push,
    recv_all,
    send,
)
from minisgl.utils import init_logger, load_eos_token_ids
from minisgl.utils.process import exit_now

from .lockstep import Lockstep, Message
from .scheduler import Scheduler

logger = init_logger(__name__)

# how often a busy scheduler reports its load (and always when it idles): how stale the load
# gauges of /metrics may be
LOAD_INTERVAL_S = 0.1
HEARTBEAT_INTERVAL_S = 0.5
IDLE_TURN_MS = 500  # an idle loop still turns this often, so its heartbeat proves it is not stuck
# the whole KV check at every idle moment walks every cached page: 58-147 ms for 0.6-1M cached
# pages on a 2-core CPU, which the last outputs of a burst and the next request would wait for.
# Past this pool size (~2 ms) an idle scheduler checks the totals only (11 us)
FULL_CHECK_MAX_PAGES = 32_768


class SchedulerWorker:
    def __init__(self, scheduler: Scheduler, rank: int, lockstep: Lockstep | None) -> None:
        self.scheduler = scheduler
        self.rank = rank
        self.lockstep = lockstep  # None: the only rank
        self.integrity_checks = 0
        self.integrity_failures = 0
        self._last_load = 0.0
        self.last_turn = time.monotonic()  # when the serving loop last went round (the heartbeat's)

    def apply(self, messages: list[Message]) -> tuple[list[Finished], list[ReqError]]:
        """Add, abort and end requests, flush the prefix cache; returns the aborted requests'
        ends and the rejected ones."""
        finished: list[Finished] = []
        errors: list[ReqError] = []
        for msg in messages:
            if isinstance(msg, AddRequests):
                requests = [
                    (rid, prompt, params)
                    for prompt, rids, choices in zip(msg.prompts, msg.rids, msg.params, strict=True)
                    for rid, params in zip(rids, choices, strict=True)
                ]
                owners = [  # the first rid of the client request each is a row of
                    rids[0] if msg.prompts_apart else msg.rids[0][0]
                    for rids in msg.rids
                    for _ in rids
                ]
                try:
                    self.scheduler.add_requests(requests, owners)
                except ValueError as e:
                    errors += [ReqError.refusing(rid, e) for rid, _, _ in requests]
            elif isinstance(msg, FlushPrefixCache):
                self.scheduler.flush_prefix_cache()
            elif isinstance(msg, EndRequests):
                self.scheduler.end_requests(msg)
            else:
                for rid in msg.rids:
                    aborted = self.scheduler.abort_request(rid)
                    if aborted is not None:
                        finished.append(aborted)
        return finished, errors

    def check_integrity(self) -> None:
        """The whole check for a pool of up to FULL_CHECK_MAX_PAGES pages, the totals above."""
        self.integrity_checks += 1
        kv = self.scheduler.kv
        try:
            if kv.num_pages <= FULL_CHECK_MAX_PAGES:
                self.scheduler.check_integrity()
            else:
                kv.check_idle_counts()
        except IntegrityError:
            self.integrity_failures += 1
            logger.exception("rank %d: KV cache integrity check FAILED", self.rank)

    def load(self) -> SchedulerLoad:
        s, kv = self.scheduler, self.scheduler.kv
        # held by the prefix cache alone: a running request's prompt pages count as its own
        cached = kv.prefix_cache.num_evictable_pages
        self._last_load = time.monotonic()
        return SchedulerLoad(
            num_running=len(s.running),
            num_waiting=len(s.waiting),
            request_pages=kv.used_pages - cached,
            cached_pages=cached,
            free_pages=kv.num_pages - kv.used_pages,
            num_preemptions=s.stats.num_preemptions,
            integrity_checks=self.integrity_checks,
            integrity_failures=self.integrity_failures,
        )

    def step(self, messages: list[Message]) -> StepOutputs:
        """Apply the messages, settle the grammars compiling, run one step; integrity is checked
        whenever the scheduler idles. Rank 0 first sends the messages (with the requests it
        ends) to the other ranks, which take the same step."""
        if self.rank == 0:
            if (ended := self.scheduler.take_too_slow()) is not None:
                messages = [*messages, ended]
            if self.lockstep is not None:
                self.lockstep.send(messages)
        aborted, errors = self.apply(messages)
        if self.scheduler.compiling:  # as many on every rank: the same messages added them
            flags = self.scheduler.grammar_flags(leader=self.rank == 0)
            if self.lockstep is not None:
                flags = self.lockstep.agree(flags)
            self.scheduler.settle_grammars(flags)
        out = self.scheduler.step()
        out.finished[:0] = aborted
        out.errors[:0] = errors
        idle = not self.scheduler.has_work
        if idle:
            self.check_integrity()
        if idle or time.monotonic() - self._last_load >= LOAD_INTERVAL_S:
            out.load = self.load()
        return out


# what shapes a rank's steps (its model path may differ by machine; the KV pool is the smallest
# rank's, whatever each was given)
_SAME_ON_EVERY_RANK = (
    "dtype", "page_size", "max_running_requests", "max_model_len", "attention_backend",
    "moe_backend", "cuda_graph_max_bs", "dummy_weights",
)  # fmt: skip


def start_worker(
    engine_config: EngineConfig, scheduler_config: SchedulerConfig, wait_for_grammars: bool
) -> SchedulerWorker:
    """This rank's engine and scheduler, returned once every rank has built its own.
    wait_for_grammars: as `Scheduler`'s, the same on every rank (an offline LLM's)."""
    PREFIX_CACHES.get(scheduler_config.cache)  # an unknown name fails before the weights load
    engine = Engine(engine_config)
    scheduler = Scheduler(
        scheduler_config, engine, load_eos_token_ids(engine_config.model_path), wait_for_grammars
    )
    if engine.device.type == "cuda":  # where kernels compile
        scheduler.warm_up()
    lockstep = None
    if engine_config.tp_size > 1:
        lockstep = Lockstep()
        lockstep.check_same(
            {
                **dataclasses.asdict(scheduler_config),
                **{name: getattr(engine_config, name) for name in _SAME_ON_EVERY_RANK},
            }
        )
        dist.barrier()
    return SchedulerWorker(scheduler, engine_config.tp_rank, lockstep)


def run_scheduler(
    engine_config: EngineConfig, scheduler_config: SchedulerConfig, addresses: Addresses
) -> None:
    """Rank 0's process entry point; runs until the process is terminated."""
    worker = start_worker(engine_config, scheduler_config, wait_for_grammars=False)
    for line in worker.scheduler.engine.summary():
        logger.info(line)
    _serve_primary(worker, addresses)


def run_follower(
    engine_config: EngineConfig, scheduler_config: SchedulerConfig, wait_for_grammars: bool
) -> None:
    """The process entry point of ranks 1..tp-1 (a server's or an offline LLM's, which waits for
    its grammars): they take rank 0's steps until it stops, or is gone."""
    worker = start_worker(engine_config, scheduler_config, wait_for_grammars)
    assert worker.lockstep is not None
    while (messages := worker.lockstep.recv()) is not None:
        worker.step(messages)  # exactly the messages of rank 0's step
    # with rank 0 gone, leaving the groups waits forever for it (NCCL, pytorch#141510)
    if not worker.lockstep.leader_gone:
        worker.scheduler.engine.close()
    exit_now(0)


def _serve_primary(worker: SchedulerWorker, addresses: Addresses) -> None:
    ctx = zmq.Context()
    inbox = bind_pull(ctx, addresses.scheduler)
    outbox = connect_push(ctx, addresses.detokenizer)
    layout = worker.scheduler.layout
    # through the tokenize thread, which checks prompts against it, to the API server
    to_tokenize = connect_push(ctx, addresses.tokenizer)
    send(to_tokenize, Ready(layout.max_seq_len, layout.vocab_size))
    threading.Thread(
        target=_heartbeat, args=(worker, ctx, addresses.detokenizer), daemon=True
    ).start()
    while True:
        worker.last_turn = time.monotonic()
        busy = worker.scheduler.has_work
        messages = recv_all(inbox, timeout_ms=0 if busy else IDLE_TURN_MS)
        if not messages and not busy:  # idle: the loop only shows that it turns
            if worker.lockstep is not None:
                worker.lockstep.ping()
            continue
        out = worker.step(messages)
        if out.rids or out.finished or out.errors or out.load is not None:
            send(outbox, out)


def _heartbeat(worker: SchedulerWorker, ctx: zmq.Context, address: str) -> None:
    """Tell the server this process is alive and how long ago its loop last turned, however
    long a step takes (a socket of its own: a ZMQ socket belongs to one thread)."""
    sock = connect_push(ctx, address)
    while True:
        send(sock, Heartbeat(time.monotonic() - worker.last_turn))
        time.sleep(HEARTBEAT_INTERVAL_S)
