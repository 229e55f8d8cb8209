"""The scheduler process: one per TP rank, each running the same `Scheduler` in lockstep.

Rank 0 reads requests from the tokenizer and, before applying them, sends each step's messages to
ranks 1..tp-1, so every rank adds and aborts the same requests in the same order and runs identical
`step()`s (their forwards meet in the TP collectives). Only rank 0 sends outputs.
"""

import time

import torch.distributed as dist
import zmq
from transformers import AutoTokenizer

from minisgl.engine import Engine, EngineConfig
from minisgl.messages import (
    AbortRequest,
    AddRequest,
    Addresses,
    ReqError,
    SchedulerLimits,
    SchedulerLoad,
    SchedulerOutputs,
    bind_pull,
    connect_push,
    recv,
    recv_all,
    send,
)
from minisgl.utils import init_logger, load_eos_token_ids

from .config import SchedulerConfig
from .scheduler import ReqOutput, Scheduler

logger = init_logger(__name__)

LOAD_INTERVAL_S = 0.5  # how often a busy scheduler reports its load (and always when it idles)

Message = AddRequest | AbortRequest


class SchedulerWorker:
    def __init__(self, scheduler: Scheduler, rank: int) -> None:
        self.scheduler = scheduler
        self.rank = rank
        self.integrity_checks = 0
        self.integrity_failures = 0
        self._last_load = 0.0

    def apply(self, messages: list[Message]) -> tuple[list[ReqOutput], list[ReqError]]:
        outputs, errors = [], []
        for msg in messages:
            if isinstance(msg, AddRequest):
                try:
                    self.scheduler.add_request(msg.rid, msg.prompt_ids, msg.params)
                except ValueError as e:
                    errors.append(ReqError(msg.rid, str(e)))
            else:
                aborted = self.scheduler.abort_request(msg.rid)
                if aborted is not None:
                    outputs.append(aborted)
        return outputs, errors

    def check_integrity(self) -> None:
        self.integrity_checks += 1
        try:
            self.scheduler.check_integrity()
        except AssertionError:
            self.integrity_failures += 1
            logger.exception("rank %d: KV cache integrity check FAILED", self.rank)

    def load(self) -> SchedulerLoad:
        s, kv = self.scheduler, self.scheduler.kv
        cached = len(kv.prefix_cache.cached_pages())
        self._last_load = time.monotonic()
        return SchedulerLoad(
            num_running=len(s.running),
            num_waiting=len(s.waiting),
            request_pages=kv.used_pages - cached,
            cached_pages=cached,
            free_pages=kv.num_pages - kv.used_pages,
            prompt_tokens=s.stats.prompt_tokens,
            cached_prompt_tokens=s.stats.cached_prompt_tokens,
            num_preemptions=s.stats.num_preemptions,
            integrity_checks=self.integrity_checks,
            integrity_failures=self.integrity_failures,
        )

    def step(self, messages: list[Message]) -> SchedulerOutputs:
        """Apply the messages, run one step; integrity is checked whenever the scheduler idles."""
        outputs, errors = self.apply(messages)
        outputs += self.scheduler.step()
        idle = not self.scheduler.has_work
        if idle:
            self.check_integrity()
        due = idle or time.monotonic() - self._last_load >= LOAD_INTERVAL_S
        return SchedulerOutputs(outputs, errors, self.load() if due else None)


def run_scheduler(
    engine_config: EngineConfig, scheduler_config: SchedulerConfig, addresses: Addresses
) -> None:
    """The process entry point; runs until the process is terminated."""
    path = engine_config.model_path
    engine = Engine(engine_config)
    tokenizer = AutoTokenizer.from_pretrained(str(path))  # for stop strings
    scheduler = Scheduler(scheduler_config, engine, load_eos_token_ids(path), tokenizer)
    worker = SchedulerWorker(scheduler, engine_config.tp_rank)
    if engine_config.tp_size > 1:
        dist.barrier()  # rank 0 reports ready only once every rank is
    if worker.rank == 0:
        _serve_primary(worker, addresses)
    else:
        _serve_follower(worker, addresses.followers[worker.rank - 1])


def _serve_primary(worker: SchedulerWorker, addresses: Addresses) -> None:
    ctx = zmq.Context()
    inbox = bind_pull(ctx, addresses.scheduler)
    followers = [connect_push(ctx, address) for address in addresses.followers]
    outbox = connect_push(ctx, addresses.tokenizer)
    send(outbox, SchedulerLimits(worker.scheduler.max_seq_len, worker.scheduler.vocab_size))
    while True:
        messages = recv_all(inbox, block=not worker.scheduler.has_work)
        for follower in followers:
            send(follower, messages)
        out = worker.step(messages)
        if out.outputs or out.errors or out.load is not None:
            send(outbox, out)


def _serve_follower(worker: SchedulerWorker, address: str) -> None:
    inbox = bind_pull(zmq.Context(), address)
    while True:
        worker.step(recv(inbox))  # exactly the messages of rank 0's step
