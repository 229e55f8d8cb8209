"""The offline API: `LLM(model).generate(prompts, sampling_params)`, everything in this process."""

import itertools
import time
from collections.abc import Sequence
from typing import Any

import torch
from tqdm import tqdm
from transformers import AutoTokenizer

from minisgl.core import SamplingParams
from minisgl.engine import Engine, EngineConfig
from minisgl.scheduler import ReqOutput, Scheduler, SchedulerConfig
from minisgl.tokenizer import IncrementalDetokenizer
from minisgl.utils import load_eos_token_ids, resolve_model_path

Prompt = str | list[int]


def default_chunk_size(device: torch.device) -> int:
    """Tokens per step when none is given: 16,384 on a GPU of 70 GiB or more but an A100,
    else 8,192 (vLLM's offline defaults; vLLM measured the larger one slower on an A100). A
    prefill step runs eagerly, and on an H200 launching its kernels takes the host about as long
    as the GPU takes for 8,192 tokens: twice the tokens per step halves the launches, and the
    offline benchmark ran 1.6-3.4 % faster (RESULTS.md, eleventh session). The server keeps
    8,192, since a longer step delays its running streams more."""
    if device.type != "cuda":
        return 8192
    properties = torch.cuda.get_device_properties(device)
    return 16384 if properties.total_memory >= 70 << 30 and "A100" not in properties.name else 8192


class LLM:
    def __init__(
        self,
        model: str | None = None,
        *,
        device: str = "auto",
        dtype: str = "auto",
        page_size: int = 1,
        max_running_requests: int = 256,
        max_kv_tokens: int | None = None,
        chunk_size: int | None = None,
        cache: str = "radix",
        attention_backend: str = "auto",
        cuda_graph_max_bs: int | None = None,
        overlap: bool = True,
        dummy_weights: bool = False,
    ) -> None:
        path = resolve_model_path(model)
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        self.engine = Engine(
            EngineConfig(
                model_path=path,
                device=device,
                dtype=dtype,
                page_size=page_size,
                max_running_requests=max_running_requests,
                max_kv_tokens=max_kv_tokens,
                attention_backend=attention_backend,
                cuda_graph_max_bs=cuda_graph_max_bs,
                dummy_weights=dummy_weights,
            )
        )
        if chunk_size is None:
            chunk_size = default_chunk_size(self.engine.device)
        self.scheduler = Scheduler(
            SchedulerConfig(
                chunk_size=chunk_size,
                cache=cache,
                overlap=overlap,
            ),
            self.engine,
            load_eos_token_ids(path),
            self.tokenizer,
        )
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
        """One result dict per prompt, in order. Bad input raises ValueError before anything runs."""
        ids = self._tokenize(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(ids)
        else:
            params = list(sampling_params)
            if len(params) != len(ids):
                raise ValueError(f"{len(params)} sampling params for {len(ids)} prompts")
        rids = [next(self._rids) for _ in ids]
        self.scheduler.add_requests(list(zip(rids, ids, params, strict=True)))
        detoks = {}
        results: dict[int, dict[str, Any]] = {}
        arrival = time.perf_counter()
        for rid, prompt_ids, p in zip(rids, ids, params, strict=True):
            detoks[rid] = IncrementalDetokenizer(self.tokenizer, prompt_ids, p.stop)
            metrics = {"arrival_time": arrival, "first_token_time": None, "finished_time": None}
            results[rid] = {"text": "", "token_ids": [], "finish_reason": None, "metrics": metrics}
            if p.logprobs is not None:
                results[rid]["logprobs"] = []
        with tqdm(total=len(ids), desc="generate", disable=not use_tqdm) as bar:
            while self.scheduler.has_work:
                outputs = self.scheduler.step()
                now = time.perf_counter()  # when this step's tokens reached the host
                for out in outputs:
                    if out.rid in results:
                        self._apply(results[out.rid], detoks[out.rid], out, now)
                        bar.update(out.finish_reason is not None)
        return [results[rid] for rid in rids]

    @staticmethod
    def _apply(
        result: dict[str, Any], detok: IncrementalDetokenizer, out: ReqOutput, now: float
    ) -> None:
        if out.token_id is not None:
            result["token_ids"].append(out.token_id)
            if result["metrics"]["first_token_time"] is None:
                result["metrics"]["first_token_time"] = now
        if out.logprob is not None:
            logprob, top = out.logprob
            result["logprobs"].append(
                {
                    "token_id": out.token_id,
                    "logprob": logprob,
                    "top_logprobs": [{"token_id": t, "logprob": lp} for t, lp in top],
                }
            )
        if out.finish_reason is not None:
            result["metrics"]["finished_time"] = now
            # offline, the text is decoded once at the end (the same detokenizer as streaming)
            stop_token = isinstance(out.matched_stop, int)
            result["text"] = detok.step(result["token_ids"], finished=True, stop_token=stop_token)
            result.update(
                finish_reason=out.finish_reason,
                prompt_tokens=out.prompt_tokens,
                cached_tokens=out.cached_tokens,
            )
