"""CPU offline throughput, minisgl against Hugging Face transformers on the same weights and prompts,
timed alternately in one run: useful output tok/s of each, and the ratio (issue 27).

Workload: 32 requests, prompt lengths uniform in 16-256 and output lengths in 8-128 (seed 0),
random prompt ids, greedy, ignore_eos. HF generates the whole batch at once, left padded, to the
longest output (the usual way to batch it); only each request's own tokens count. Each engine
runs in a process of its own, with its own thread settings, and is warmed up on the workload;
minisgl's prefix cache is emptied before each run.

    python benchmark/offline/bench_cpu.py                          # qwen3-small, fp32
    python benchmark/offline/bench_cpu.py --model embedded --dtype bfloat16
    python benchmark/offline/bench_cpu.py --model embedded --num-requests 3 --repeats 1 \
        --min-prompt-len 4 --max-prompt-len 12 --min-output-len 2 --max-output-len 6  # smoke
"""

import argparse
import multiprocessing
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from common import QWEN3_SHAPE, Workload, make_workload, print_table, result_row, write_json

from minisgl.core import SamplingParams
from minisgl.llm import LLM
from minisgl.utils import DEFAULT_MODEL_PATH
from minisgl.utils.hf import cached_load_hf_config
from minisgl.utils.torch_utils import resolve_dtype

# the CPU model: the Qwen3 architecture at a size two cores decode in milliseconds
QWEN3_SMALL = dict(
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    vocab_size=32000,
    tie_word_embeddings=True,
    max_position_embeddings=2048,
)
SYSTEMS = ("minisgl", "HF transformers")
PAD_ID = 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("qwen3-small", "embedded"), default="qwen3-small")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--min-prompt-len", type=int, default=16)
    parser.add_argument("--max-prompt-len", type=int, default=256)
    parser.add_argument("--min-output-len", type=int, default=8)
    parser.add_argument("--max-output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5, help="timed runs of each (medians)")
    parser.add_argument("--json", help="also write the results here")
    return parser.parse_args(argv)


@dataclass(frozen=True)
class Run:
    seconds: float
    tokens: list[list[int]]  # each request's own output tokens


def write_qwen3_small(path: Path) -> Path:
    """A random-weight checkpoint of the issue's CPU model (HF's own init, seed 0), with the Qwen3
    tokenizer (the ids fit its vocabulary)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**QWEN3_SMALL)
    config.architectures = [Qwen3ForCausalLM.__name__]
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(QWEN3_SHAPE / name, path / name)
    return path


def minisgl_engine(path: str, dtype: str, workload: Workload) -> Callable[[], Run]:
    llm = LLM(path, device="cpu", dtype=dtype)
    params = [
        SamplingParams(temperature=0, ignore_eos=True, max_tokens=n) for n in workload.output_lens
    ]

    def run() -> Run:
        llm.reset_prefix_cache()  # each run prefills its prompts
        start = time.perf_counter()
        results = llm.generate(workload.prompts, params, use_tqdm=False)
        return Run(time.perf_counter() - start, [r["token_ids"] for r in results])

    return run


def hf_engine(path: str, dtype: str, workload: Workload) -> Callable[[], Run]:
    """Hugging Face's `generate` on the whole batch, left padded, greedy, to the longest output."""
    from transformers import AutoModelForCausalLM

    torch_dtype = resolve_dtype(dtype, torch.device("cpu"))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype).eval()

    width = max(workload.prompt_lens)
    ids = torch.tensor([[PAD_ID] * (width - len(p)) + p for p in workload.prompts])
    mask = torch.tensor([[0] * (width - n) + [1] * n for n in workload.prompt_lens])
    output_lens = workload.output_lens

    @torch.inference_mode()
    def run() -> Run:
        start = time.perf_counter()
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=max(output_lens),
            do_sample=False,
            eos_token_id=None,  # never stop early, as ignore_eos
            pad_token_id=PAD_ID,
        )
        seconds = time.perf_counter() - start
        rows = out[:, width:].tolist()
        return Run(seconds, [row[:n] for row, n in zip(rows, output_lens, strict=True)])

    return run


_ENGINE: Callable[[], Run] | None = None  # in a worker process: its engine's timed run


def start_engine(system: str, path: str, dtype: str, workload: Workload) -> None:
    """Build the worker process's engine and run the workload through it once (the warm-up)."""
    global _ENGINE
    build = minisgl_engine if system == SYSTEMS[0] else hf_engine
    _ENGINE = build(path, dtype, workload)
    _ENGINE()


def run_engine() -> Run:
    assert _ENGINE is not None, "start_engine first"
    return _ENGINE()


def system_row(system: str, workload: Workload, runs: list[Run]) -> dict[str, Any]:
    """The median run's figures; HF computes every row to the longest output (`computed`)."""
    seconds = [r.seconds for r in runs]
    row = result_row(
        system,
        len(workload.prompts),
        workload.prompt_tokens,
        workload.output_tokens,
        statistics.median(seconds),
    )
    computed = workload.output_tokens
    if system != SYSTEMS[0]:
        computed = len(workload.prompts) * max(workload.output_lens)
    return {
        **row,
        "computed_tokens": computed,
        "fastest_s": min(seconds),
        "slowest_s": max(seconds),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    with ExitStack() as stack:
        path = str(DEFAULT_MODEL_PATH)
        if args.model == "qwen3-small":
            path = str(write_qwen3_small(Path(stack.enter_context(tempfile.TemporaryDirectory()))))
        vocab_size = cached_load_hf_config(path).vocab_size
        workload = make_workload(
            args.num_requests, args.min_prompt_len, args.max_prompt_len, vocab_size,
            output_range=(args.min_output_len, args.max_output_len),
        )  # fmt: skip
        spawn = multiprocessing.get_context("spawn")
        workers = {s: stack.enter_context(ProcessPoolExecutor(1, spawn)) for s in SYSTEMS}
        starts = [w.submit(start_engine, s, path, args.dtype, workload) for s, w in workers.items()]
        for started in starts:
            started.result()
        runs: dict[str, list[Run]] = {s: [] for s in SYSTEMS}
        for i in range(args.repeats):
            for system in SYSTEMS if i % 2 == 0 else SYSTEMS[::-1]:  # neither always first
                runs[system].append(workers[system].submit(run_engine).result())

    rows = [system_row(s, workload, runs[s]) for s in SYSTEMS]
    ratios = [
        hf.seconds / ours.seconds
        for ours, hf in zip(runs[SYSTEMS[0]], runs[SYSTEMS[1]], strict=True)
    ]
    ours, hf = (runs[s][-1].tokens for s in SYSTEMS)
    same = sum(a == b for a, b in zip(ours, hf, strict=True))
    native_bf16 = (
        torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )
    print(
        f"\n{args.model} ({args.dtype}) on {len(os.sched_getaffinity(0))} CPU cores "
        f"({'with' if native_bf16 else 'without'} native bf16): "
        f"{len(workload.prompts)} requests, {workload.prompt_tokens:,} prompt + "
        f"{workload.output_tokens:,} output tokens, {args.repeats} timed runs each"
    )
    print_table(rows)
    ratio = rows[0]["output_tok_s"] / rows[1]["output_tok_s"]
    print(
        f"minisgl / HF transformers: {ratio:.2f}x (medians; per run "
        f"{', '.join(f'{r:.2f}' for r in ratios)}); same tokens as HF in {same} of "
        f"{len(workload.prompts)} requests"
    )
    payload = {
        "benchmark": "CPU offline throughput against HF",
        "args": vars(args),
        "rows": rows,
        "ratio": ratio,
        "ratios_per_run": ratios,
        "same_tokens": same,
    }
    write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
