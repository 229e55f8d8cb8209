"""The offline API: `LLM(model, **settings).generate(prompts, sampling_params)`, in this process.

The settings are EngineConfig's and SchedulerConfig's fields (`minisgl.config`), the same the CLI
sets; chunk_size defaults to the offline one there. With tp_size=N this process is TP rank 0 and
starts ranks 1..N-1 as the server's follower processes (spawned: a script that makes an LLM needs
`if __name__ == "__main__":`); `close()` stops them. A process holds one TP group: one such LLM at
a time."""

import functools
import itertools
import operator
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from multiprocessing.process import BaseProcess
from types import TracebackType
from typing import Any

import torch
from tqdm import tqdm

from minisgl.config import (
    EngineConfig,
    SchedulerConfig,
    offline_chunk_size,
    split_overrides,
)
from minisgl.core import PromptOptions, SamplingParams, choice_params
from minisgl.engine.preflight import check_engine_config
from minisgl.messages import (
    AbortRequest,
    AddRequests,
    Finished,
    FlushPrefixCache,
    StepOutputs,
    TokenLogprobs,
)
from minisgl.scheduler.lockstep import Message
from minisgl.scheduler.worker import SchedulerWorker, start_worker
from minisgl.server.protocol import template_messages
from minisgl.tokenizer.detokenizer import IncrementalDetokenizer
from minisgl.tokenizer.loader import load_tokenizer, prompt_ids
from minisgl.utils import resolve_model_path, sampling_defaults
from minisgl.utils.interrupts import deferred_interrupts
from minisgl.utils.process import local_init_method, start_child
from minisgl.utils.torch_utils import resolve_device

# text, token ids, or vLLM's prompt dicts: {"prompt": text} and {"prompt_token_ids": ids}
Prompt = str | list[int] | dict[str, Any]
# vLLM's: a bool, or what makes the progress bar (a tqdm subclass, say), given total and desc
Progress = bool | Callable[..., tqdm]
_PLACEMENT = ("tp_rank", "nnodes", "dist_init_method")  # the LLM places its ranks itself
_STOP_TIMEOUT_S = 30.0


class LLM:
    def __init__(
        self, model: str | None = None, *, generation_config: str = "auto", **settings: Any
    ) -> None:
        """generation_config: where `get_default_sampling_params` comes from, as vLLM's:
        "auto", the model's generation_config.json; "vllm", SamplingParams(); or a folder."""
        path = resolve_model_path(model)
        self._sampling_defaults = sampling_defaults(generation_config, path)
        engine_settings, scheduler_settings = split_overrides(settings)
        if given := [name for name in _PLACEMENT if name in engine_settings]:
            raise ValueError(f"{', '.join(given)}: the offline LLM places its TP ranks itself")
        engine_config = EngineConfig(model_path=path, **engine_settings)
        check_engine_config(engine_config)  # before any rank starts, each of which would fail alike
        if engine_config.tp_size > 1:
            engine_config = replace(engine_config, dist_init_method=local_init_method())
        if "chunk_size" not in scheduler_settings:  # rank 0's, which every rank must share
            device = resolve_device(engine_config.device)
            scheduler_settings["chunk_size"] = _offline_chunk_size(device)
        scheduler_config = SchedulerConfig(**scheduler_settings)
        self.tokenizer = load_tokenizer(path)
        followers = [
            start_child(
                f"minisgl-rank{rank}",
                "minisgl.scheduler.worker:run_follower",
                replace(engine_config, tp_rank=rank),
                scheduler_config,
                True,  # wait_for_grammars, as this rank's
            )
            for rank in range(1, engine_config.tp_size)
        ]
        try:
            self._worker = start_worker(engine_config, scheduler_config, wait_for_grammars=True)
        except BaseException:
            _stop_followers(None, followers)
            raise
        self.scheduler = self._worker.scheduler
        self.engine = self.scheduler.engine
        self._close = weakref.finalize(self, _stop_followers, self._worker, followers)
        self._rids = itertools.count()

    def _step(self, messages: list[Message]) -> StepOutputs:
        """One turn of every rank. A Ctrl-C takes effect at its end (on one rank, inside the
        model's forward too): cut short, the scheduler's bookkeeping would be left half done,
        and under TP rank 0 would leave the others in a collective it never joins."""
        with deferred_interrupts():
            return self._worker.step(messages)

    def _check_open(self) -> None:
        if not self._close.alive:  # its TP group is gone: a collective would fail obscurely
            raise ValueError("this LLM is closed: it generates no more")

    def close(self) -> None:
        """Stop the other TP ranks' processes and leave the TP group (at TP 1: nothing to do).
        Done on garbage collection and at exit too; the LLM generates no more after it."""
        self._close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def _tokenize(self, prompts: str | Sequence[Prompt]) -> list[list[int]]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        elif isinstance(prompts, Iterable):  # a generator's items are read once
            prompts = list(prompts)
        else:
            raise ValueError(
                f"prompts are a prompt or a list of them, not {type(prompts).__name__}"
            )
        if prompts and all(isinstance(p, int) for p in prompts):
            raise ValueError("pass token ids as a list of lists: [[id, id, ...], ...]")
        out = []
        for p in prompts:
            if isinstance(p, dict):
                p = _prompt_of(p)
            if isinstance(p, str):
                out.append(prompt_ids(self.tokenizer, p))
            elif isinstance(p, (list, tuple)):
                out.append(_token_ids(p))
            else:
                raise ValueError(
                    "a prompt must be a str, a list of token ids or vLLM's prompt dict, not "
                    f"{type(p).__name__}"
                )
        return out

    def get_default_sampling_params(self) -> SamplingParams:
        """The params of a `generate` given none, as vLLM's: the sampling fields of the model's
        generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty) over
        SamplingParams' defaults. Frozen, as every SamplingParams (validated once): where vLLM's
        code sets a field (`params.max_tokens = 64`), `dataclasses.replace` makes the copy."""
        return SamplingParams(**self._sampling_defaults)

    def generate(
        self,
        prompts: str | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: Progress = True,
    ) -> list[dict[str, Any]]:
        """One result dict per prompt and choice: prompt by prompt, each prompt's choices (its
        params' n) in order. Bad input raises ValueError, before anything runs or as a
        request's grammar fails to go on; an exception while it runs (that one, Ctrl-C) aborts
        the requests it added and empties the prefix cache (the step it cut off may have
        published pages before writing them)."""
        self._check_open()
        if not isinstance(use_tqdm, bool) and not callable(use_tqdm):
            raise ValueError(f"use_tqdm must be a bool or make a progress bar, not {use_tqdm!r}")
        tokenized = self._tokenize(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = sampling_params or self.get_default_sampling_params()
            prompt_params = [params] * len(tokenized)
        else:
            if not isinstance(sampling_params, (list, tuple)):
                raise ValueError("sampling_params must be a SamplingParams or a list of them")
            prompt_params = list(sampling_params)
            if len(prompt_params) != len(tokenized):
                raise ValueError(
                    f"{len(prompt_params)} sampling params for {len(tokenized)} prompts"
                )
        if not all(isinstance(p, SamplingParams) for p in prompt_params):
            raise ValueError("sampling_params must be a SamplingParams or a list of them")
        add = AddRequests([], [], [], prompts_apart=True)
        for prompt, p in zip(tokenized, prompt_params, strict=True):
            choices = choice_params(p, p.n)
            add.prompts.append(prompt)
            add.rids.append([next(self._rids) for _ in choices])
            add.params.append(choices)
        arrival = time.perf_counter()
        runs: dict[int, _Run] = {}
        try:
            # the server's way in: every rank applies the same messages in the same step
            out = self._step([add])
            if out.errors:  # none was added, or one ended in its first step
                raise ValueError(out.errors[0].message)
            runs = {
                rid: _Run(self.tokenizer, prompt, p, arrival)
                for prompt, rids, choices in zip(add.prompts, add.rids, add.params, strict=True)
                for rid, p in zip(rids, choices, strict=True)
            }
            self._run_to_end(out, runs, use_tqdm)
        except BaseException:
            # the next call must not run these requests to their end first, nor read the pages
            # of a step that was cut off before it wrote them
            ended = {rid for rid, run in runs.items() if run.result["finish_reason"] is not None}
            unfinished = [rid for rid in itertools.chain(*add.rids) if rid not in ended]
            self._step([AbortRequest(unfinished), FlushPrefixCache()])
            raise
        return _results(add, runs)

    def _run_to_end(self, out: StepOutputs, runs: dict[int, "_Run"], use_tqdm: Progress) -> None:
        progress = (
            functools.partial(tqdm, disable=not use_tqdm)
            if isinstance(use_tqdm, bool)
            else use_tqdm
        )
        with progress(total=len(runs), desc="generate") as bar:
            while True:
                if out.errors:  # a request ended in error as it ran (its grammar too costly)
                    raise ValueError(out.errors[0].message)
                now = time.perf_counter()  # when this step's tokens reached the host
                # a stop string matched: the request ends in the next step, as in the server
                stopped = self._apply(out, runs, now)
                bar.update(sum(f.rid in runs for f in out.finished))
                messages: list[Message] = [AbortRequest(stopped)] if stopped else []
                if not messages and not self.scheduler.has_work:
                    return
                out = self._step(messages)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (vLLM's `reset_prefix_cache`), on every TP rank."""
        self._check_open()
        self._step([FlushPrefixCache()])

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: Progress = True,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[dict[str, Any]]:
        """`generate` on one conversation (or a list of them) in OpenAI's message format (text
        parts, tool calls, ...), rendered with the model's chat template, its tools and its own
        variables, as the server's /v1/chat/completions renders it (vLLM's LLM.chat: the
        assistant's turn opened, or the final message continued); raises ValueError for a
        message the server would refuse."""
        chats = [messages] if messages and isinstance(messages[0], dict) else messages
        options = PromptOptions(
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
        )
        ids = [
            prompt_ids(
                self.tokenizer,
                None,
                template_messages(chat),
                None,
                tools,
                chat_template_kwargs,
                options,
            )
            for chat in chats
        ]
        return self.generate(ids, sampling_params, use_tqdm)

    @staticmethod
    def _apply(out: StepOutputs, runs: dict[int, "_Run"], now: float) -> list[int]:
        """Apply one step's outputs; returns the requests a stop string ended."""
        ended = {f.rid: f for f in out.finished}
        stopped = []
        for i, (rid, token) in enumerate(zip(out.rids, out.token_ids, strict=True)):
            run = runs.get(rid)
            if run is None:
                continue
            logprobs = None if out.logprobs is None else out.logprobs[i]
            if out.prompt_logprobs is not None and out.prompt_logprobs[i] is not None:
                run.add_prompt_logprobs(out.prompt_logprobs[i])
            if run.add(token, logprobs, ended.get(rid), now):
                stopped.append(rid)
        for finish in out.finished:
            if finish.rid in runs:
                runs[finish.rid].finish(finish, now)
        return stopped


def _results(add: AddRequests, runs: dict[int, "_Run"]) -> list[dict[str, Any]]:
    """The runs' results, prompt by prompt. Only a prompt's first choice computed its prompt
    logprobs (choice_params): each of its other choices gets a copy of that list."""
    for rids, choices in zip(add.rids, add.params, strict=True):
        if choices[0].prompt_logprobs is not None:
            shared = runs[rids[0]].result["prompt_logprobs"]
            for rid in rids[1:]:
                runs[rid].result["prompt_logprobs"] = None if shared is None else list(shared)
    return [runs[rid].result for rid in itertools.chain(*add.rids)]


class _Run:
    """One request's result as its tokens arrive. Its text is decoded once at the end, except
    when it has stop strings: then after every token, so that the request ends at the first."""

    def __init__(
        self, tokenizer: Any, prompt_ids: list[int], params: SamplingParams, arrival: float
    ) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids, params)
        self.prompt_ids = prompt_ids
        self.incremental = bool(params.stop)
        metrics = {"arrival_time": arrival, "first_token_time": None, "finished_time": None}
        self.result: dict[str, Any] = {
            "text": "", "token_ids": [], "finish_reason": None, "metrics": metrics,
        }  # fmt: skip
        if params.logprobs is not None:
            self.result["logprobs"] = []
        if params.prompt_logprobs is not None:
            self.result["prompt_logprobs"] = None

    def add_prompt_logprobs(self, logprobs: list[TokenLogprobs]) -> None:
        """vLLM's prompt_logprobs: None for the first prompt token, then each one's."""
        tokens = self.prompt_ids[1:]
        self.result["prompt_logprobs"] = [
            None,
            *(_logprob_entry(t, lp) for t, lp in zip(tokens, logprobs, strict=True)),
        ]

    def add(self, token: int, logprobs: Any, finish: Finished | None, now: float) -> bool:
        """Add a sampled token; True when a stop string ended the text: the request must stop."""
        if self.detok.stopped:
            return False
        self.result["token_ids"].append(token)
        if self.result["metrics"]["first_token_time"] is None:
            self.result["metrics"]["first_token_time"] = now
        if logprobs is not None:
            self.result["logprobs"].append(_logprob_entry(token, logprobs))
        return self.incremental and self.detok.step([token], finish)[1]

    def finish(self, finish: Finished, now: float) -> None:
        self.detok.step([] if self.incremental else self.result["token_ids"], finish)
        end = self.detok.end(finish)
        self.result["metrics"]["finished_time"] = now
        self.result.update(
            text=self.detok.text,
            finish_reason=end.reason,
            stop_reason=end.matched_stop,
            prompt_tokens=end.prompt_tokens,
            cached_tokens=end.cached_tokens,
        )


def _logprob_entry(token: int, logprobs: TokenLogprobs) -> dict[str, Any]:
    return {
        "token_id": token,
        "logprob": logprobs.logprob,
        "top_logprobs": [
            {"token_id": t, "logprob": lp}
            for t, lp in zip(logprobs.top_ids, logprobs.top_logprobs, strict=True)
        ],
    }


def _stop_followers(worker: SchedulerWorker | None, followers: list[BaseProcess]) -> None:
    """Tell the other ranks to stop (when they follow `worker`), leave the group with them, then
    wait for them: NCCL's teardown synchronises the ranks of a node (a rank's destroy waits for
    the others'), so rank 0 must not wait for theirs to end before it starts its own."""
    if worker is not None and worker.lockstep is not None:
        worker.lockstep.send(None)
    if worker is not None:
        worker.scheduler.engine.close()
    for proc in followers:
        proc.join(_STOP_TIMEOUT_S if worker is not None else 0)
        if proc.is_alive():
            proc.kill()
            proc.join()


def _offline_chunk_size(device: torch.device) -> int:
    if device.type != "cuda":
        return offline_chunk_size(device.type)
    properties = torch.cuda.get_device_properties(device)
    return offline_chunk_size(device.type, properties.total_memory, properties.name)


def _token_ids(ids: Sequence[Any]) -> list[int]:
    """The ids as ints: of any integer type (numpy's too), but not a float or a bool."""
    bad = [t for t in ids if isinstance(t, bool) or not hasattr(t, "__index__")]
    if bad:
        raise ValueError(f"a token id must be an integer, not {type(bad[0]).__name__}")
    return [operator.index(t) for t in ids]


def _prompt_of(prompt: dict[str, Any]) -> str | list[int]:
    """vLLM's TextPrompt or TokensPrompt: its text or its token ids."""
    if set(prompt) == {"prompt"}:
        if not isinstance(prompt["prompt"], str):
            raise ValueError(
                'a prompt dict\'s "prompt" is a str; token ids go in "prompt_token_ids"'
            )
        return prompt["prompt"]
    if set(prompt) == {"prompt_token_ids"}:
        if not isinstance(prompt["prompt_token_ids"], (list, tuple)):
            raise ValueError('a prompt dict\'s "prompt_token_ids" is a list of token ids')
        return prompt["prompt_token_ids"]
    raise ValueError(
        f'a prompt dict holds "prompt" or "prompt_token_ids" alone, not {", ".join(sorted(prompt))}'
    )
