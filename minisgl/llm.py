"""The offline API: `LLM(model, **settings).generate(prompts, sampling_params)`, all in this process.

The settings are EngineConfig's and SchedulerConfig's fields (`minisgl.config`), the same the CLI
sets; chunk_size defaults to the offline one there."""

import itertools
import time
from collections.abc import Sequence
from typing import Any

import torch
from tqdm import tqdm

from minisgl.config import (
    EngineConfig,
    SchedulerConfig,
    offline_chunk_size,
    split_overrides,
)
from minisgl.core import SamplingParams, choice_params
from minisgl.engine.engine import Engine
from minisgl.messages import Finished, StepOutputs
from minisgl.scheduler.scheduler import Scheduler
from minisgl.tokenizer.detokenizer import IncrementalDetokenizer
from minisgl.tokenizer.loader import load_tokenizer, prompt_ids
from minisgl.utils import load_eos_token_ids, resolve_model_path

Prompt = str | list[int]


class LLM:
    def __init__(self, model: str | None = None, **settings: Any) -> None:
        path = resolve_model_path(model)
        engine_settings, scheduler_settings = split_overrides(settings)
        if engine_settings.get("tp_size", 1) != 1:
            raise ValueError("the offline LLM runs one rank; serve with --tp for more")
        self.tokenizer = load_tokenizer(path)
        self.engine = Engine(EngineConfig(model_path=path, **engine_settings))
        if "chunk_size" not in scheduler_settings:
            scheduler_settings["chunk_size"] = _offline_chunk_size(self.engine.device)
        self.scheduler = Scheduler(
            SchedulerConfig(**scheduler_settings),
            self.engine,
            load_eos_token_ids(path),
            wait_for_grammars=True,
        )
        if self.engine.device.type == "cuda":  # where kernels compile
            self.scheduler.warm_up()
        self._rids = itertools.count()

    def _tokenize(self, prompts: str | Sequence[Prompt]) -> list[list[int]]:
        if isinstance(prompts, str):
            prompts = [prompts]
        if prompts and all(isinstance(p, int) for p in prompts):
            raise ValueError("pass token ids as a list of lists: [[id, id, ...], ...]")
        out = []
        for p in prompts:
            if isinstance(p, str):
                out.append(self.tokenizer.encode(p))
            elif isinstance(p, (list, tuple)):
                out.append(list(p))
            else:
                raise ValueError(
                    f"a prompt must be a str or a list of token ids, not {type(p).__name__}"
                )
        return out

    def generate(
        self,
        prompts: str | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[dict[str, Any]]:
        """One result dict per prompt and choice, in order: prompt i's choice j (of its params'
        n) is result i * n + j. Bad input raises ValueError before anything runs."""
        prompt_ids = self._tokenize(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            prompt_params = [sampling_params or SamplingParams()] * len(prompt_ids)
        else:
            prompt_params = list(sampling_params)
            if len(prompt_params) != len(prompt_ids):
                raise ValueError(
                    f"{len(prompt_params)} sampling params for {len(prompt_ids)} prompts"
                )
        ids, params = [], []
        for prompt, p in zip(prompt_ids, prompt_params, strict=True):
            choices = choice_params(p, p.n)
            ids += [prompt] * len(choices)
            params += choices
        rids = [next(self._rids) for _ in ids]
        self.scheduler.add_requests(list(zip(rids, ids, params, strict=True)))
        arrival = time.perf_counter()
        runs = {
            rid: _Run(self.tokenizer, prompt_ids, p, arrival)
            for rid, prompt_ids, p in zip(rids, ids, params, strict=True)
        }
        with tqdm(total=len(ids), desc="generate", disable=not use_tqdm) as bar:
            while self.scheduler.has_work:
                out = self.scheduler.step()
                now = time.perf_counter()  # when this step's tokens reached the host
                stopped = self._apply(out, runs, now)
                for rid in stopped:  # a stop string matched: it ends here, as in the server
                    finish = self.scheduler.abort_request(rid)
                    assert finish is not None
                    runs[rid].finish(finish, now)
                bar.update(sum(f.rid in runs for f in out.finished) + len(stopped))
        return [runs[rid].result for rid in rids]

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (vLLM's `reset_prefix_cache`); returns the pages freed."""
        return self.scheduler.kv.flush_prefix_cache()

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[dict[str, Any]]:
        """`generate` on one conversation (or a list of them) rendered with the model's chat
        template, as the server's /v1/chat/completions renders it."""
        chats = [messages] if messages and isinstance(messages[0], dict) else messages
        ids = [prompt_ids(self.tokenizer, None, chat) for chat in chats]  # type: ignore[arg-type]
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
            if run.add(token, logprobs, ended.get(rid), now):
                stopped.append(rid)
        for finish in out.finished:
            if finish.rid in runs:
                runs[finish.rid].finish(finish, now)
        return stopped


class _Run:
    """One request's result as its tokens arrive. Its text is decoded once at the end, except
    when it has stop strings: then after every token, so that the request ends at the first."""

    def __init__(
        self, tokenizer: Any, prompt_ids: list[int], params: SamplingParams, arrival: float
    ) -> None:
        self.detok = IncrementalDetokenizer(
            tokenizer, prompt_ids, params.stop, params.min_tokens, params.include_stop_str_in_output
        )
        self.incremental = bool(params.stop)
        metrics = {"arrival_time": arrival, "first_token_time": None, "finished_time": None}
        self.result: dict[str, Any] = {
            "text": "", "token_ids": [], "finish_reason": None, "metrics": metrics,
        }  # fmt: skip
        if params.logprobs is not None:
            self.result["logprobs"] = []

    def add(self, token: int, logprobs: Any, finish: Finished | None, now: float) -> bool:
        """Add a sampled token; True when a stop string ended the text: the request must stop."""
        if self.detok.stopped:
            return False
        self.result["token_ids"].append(token)
        if self.result["metrics"]["first_token_time"] is None:
            self.result["metrics"]["first_token_time"] = now
        if logprobs is not None:
            self.result["logprobs"].append(
                {
                    "token_id": token,
                    "logprob": logprobs.logprob,
                    "top_logprobs": [
                        {"token_id": t, "logprob": lp}
                        for t, lp in zip(logprobs.top_ids, logprobs.top_logprobs, strict=True)
                    ],
                }
            )
        return self.incremental and self.detok.step([token], finish)[1]

    def finish(self, finish: Finished, now: float) -> None:
        self.detok.step([] if self.incremental else self.result["token_ids"], finish)
        end = self.detok.end(finish)
        self.result["metrics"]["finished_time"] = now
        self.result.update(
            text=self.detok.text,
            finish_reason=end.reason,
            prompt_tokens=end.prompt_tokens,
            cached_tokens=end.cached_tokens,
        )


def _offline_chunk_size(device: torch.device) -> int:
    if device.type != "cuda":
        return offline_chunk_size(device.type)
    properties = torch.cuda.get_device_properties(device)
    return offline_chunk_size(device.type, properties.total_memory, properties.name)
