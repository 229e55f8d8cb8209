"""Prefill speed: prompt tokens per second and model FLOPs utilisation (MFU) against the matmul
peak measured in the same run, causal attention counted as half the square.

    python benchmark/offline/prefill.py                        # one 8k-token prompt, Qwen3-0.6B shape
    python benchmark/offline/prefill.py --model benchmark/presets/llama-3.1-8b
    python benchmark/offline/prefill.py --model benchmark/presets/llama-3.1-8b \
        --num-requests 16 --min-len 16384 --max-len 32768      # the long-context row
    python benchmark/offline/prefill.py --profile              # the last timed run, kernel by kernel
    python benchmark/offline/prefill.py --model TINY --device cpu --dtype float32 \
        --min-len 64 --max-len 64 --repeats 1                  # CPU smoke run
"""

import argparse
import statistics
from contextlib import nullcontext
from typing import Any

from common import (
    add_engine_args,
    build_llm,
    chunk_setting,
    device_profiler,
    make_workload,
    print_profile,
    print_table,
    run_device,
    timed,
    write_json,
)
from roofline import ModelCost, measure_matmul_peak

from minisgl.core import SamplingParams
from minisgl.utils.hf import cached_load_hf_config
from minisgl.utils.torch_utils import resolve_dtype

GOAL_MFU = 0.5  # the aim at 8k tokens in one request


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_args(parser)
    parser.add_argument("--num-requests", type=int, default=1)
    parser.add_argument("--min-len", type=int, default=8192, help="shortest prompt")
    parser.add_argument("--max-len", type=int, default=8192, help="longest prompt")
    parser.add_argument("--chunk-size", type=int, help="prefill tokens per step")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs (the median counts)")
    parser.add_argument("--profile", action="store_true", help="profile the last timed run")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = run_device(args.device)
    vocab_size = cached_load_hf_config(args.model).vocab_size
    workload = make_workload(args.num_requests, args.min_len, args.max_len, vocab_size)
    peak = measure_matmul_peak(device, resolve_dtype(args.dtype, device))
    llm = build_llm(args, **chunk_setting(args))
    one_token = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    def prefill() -> None:
        llm.reset_prefix_cache()  # each run computes every prompt token
        llm.generate(workload.prompts, one_token, use_tqdm=False)

    prefill()  # warm-up: kernels for these lengths compiled and tuned
    runs, prof = [], None
    for run in range(args.repeats):
        if args.profile and run == args.repeats - 1:
            prof = device_profiler(device)
        steps_before = llm.scheduler.stats.steps
        with prof or nullcontext():
            runs.append(timed(prefill, device)[1])
    seconds = statistics.median(runs)
    cost = ModelCost.of(llm.engine.model_config)
    flops = sum(cost.prefill_flops(p) for p in workload.prompt_lens)
    rows = [
        {
            "system": "minisgl",
            "prompt_tokens": workload.prompt_tokens,
            "seconds": seconds,
            "prompt_tok_s": workload.prompt_tokens / seconds,
            "TFLOP_s": flops / seconds / 1e12,
            "MFU_%": 100 * flops / seconds / peak,
        },
        {
            "system": "matmul peak",
            "prompt_tokens": workload.prompt_tokens,
            "seconds": flops / peak,
            "prompt_tok_s": workload.prompt_tokens * peak / flops,
            "TFLOP_s": peak / 1e12,
            "MFU_%": 100.0,
        },
    ]
    print(
        f"\n{args.num_requests} request(s), prompts of {args.min_len:,}-{args.max_len:,} tokens "
        f"({workload.prompt_tokens:,} in all), {flops / 1e12:,.1f} TFLOP; median of "
        f"{args.repeats} runs"
    )
    print_table(rows)
    print(f"aim: {100 * GOAL_MFU:.0f} % MFU")
    payload = {"benchmark": "prefill", "args": vars(args), "flops": flops, "rows": rows}
    if prof is not None:
        steps = llm.scheduler.stats.steps - steps_before
        payload["profile"] = print_profile(prof, device, runs[-1], steps)
    write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
