"""--offline: the same requests through `LLM.generate`, with the launched server's engine settings,
in a child process that has exited when this returns, so that it never holds the device while a
server does. Its output tok/s is total output tokens over the wall time of `generate`."""

import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from api import Prompt
from transformers import PreTrainedTokenizerBase

from minisgl.core import SamplingParams
from minisgl.llm import LLM
from minisgl.server.args import ServerArgs
from minisgl.tokenizer.loader import prompt_ids

# engine settings the offline LLM sets itself: where its ranks run and the model it is given
_NOT_SETTINGS = ("model_path", "tp_rank", "nnodes", "dist_init_method")


def engine_overrides(server: ServerArgs) -> dict[str, Any]:
    """The LLM settings that give an offline engine the server's, defaults included: the
    offline API's own defaults differ (its chunk size on a large GPU)."""
    if server.engine.nnodes != 1:
        raise ValueError("--offline runs on one machine: launch the server without --nnodes")
    engine = {k: v for k, v in vars(server.engine).items() if k not in _NOT_SETTINGS}
    return {**engine, **vars(server.scheduler)}


def server_ids(tokenizer: PreTrainedTokenizerBase, prompt: Prompt) -> list[int]:
    """The prompt's ids as the server's tokenizer process makes them (chat template included)."""
    if prompt and isinstance(prompt[0], dict):
        return prompt_ids(tokenizer, None, prompt, None)  # type: ignore[arg-type]
    return prompt_ids(tokenizer, prompt)  # type: ignore[arg-type]


@dataclass(frozen=True)
class OfflineJob:
    model: Path
    overrides: dict[str, Any]  # LLM keywords (engine_overrides)
    prompts: list[Prompt]
    output_lens: list[int]
    temperature: float
    warmup: list[tuple[Prompt, int]]  # (prompt, output length), generated before the timed run


def _generate(job: OfflineJob) -> dict[str, Any]:
    def sampling(max_tokens: int) -> SamplingParams:
        return SamplingParams(temperature=job.temperature, ignore_eos=True, max_tokens=max_tokens)

    llm = LLM(str(job.model), **job.overrides)
    if job.warmup:  # as the server got it before its runs
        warmup_ids = [server_ids(llm.tokenizer, p) for p, _ in job.warmup]
        llm.generate(warmup_ids, [sampling(n) for _, n in job.warmup], use_tqdm=False)
    ids = [server_ids(llm.tokenizer, p) for p in job.prompts]
    start = time.perf_counter()
    results = llm.generate(ids, [sampling(n) for n in job.output_lens], use_tqdm=False)
    seconds = time.perf_counter() - start
    output = sum(len(r["token_ids"]) for r in results)
    return {
        "requests": len(results),
        "duration_s": seconds,
        "total_input_tokens": sum(r["prompt_tokens"] for r in results),
        "cached_tokens": sum(r["cached_tokens"] for r in results),
        "total_output_tokens": output,
        "output_throughput": output / seconds,
        "engine": {"model": str(job.model), **job.overrides},
    }


def run_offline(job: OfflineJob) -> dict[str, Any]:
    """The offline run's results, from a process that has exited when this returns."""
    spawn = multiprocessing.get_context("spawn")  # a forked child cannot use CUDA
    with ProcessPoolExecutor(max_workers=1, mp_context=spawn) as pool:
        return pool.submit(_generate, job).result()
