"""Offline throughput on nano-vllm's standard workload, side by side with the memory-bandwidth floor
and Hugging Face transformers' continuous batching, all measured in one run.

Workload: 256 requests, prompt and output lengths uniform in 100-1024 (seed 0), random prompt ids,
ignore_eos, temperature 0.6 (nano-vllm's bench), on the Qwen3-0.6B shape with random weights.

    python benchmark/offline/bench.py                          # the standard run (H200)
    python benchmark/offline/bench.py --skip-hf --profile      # where the GPU time goes
    python benchmark/offline/bench.py --skip-hf --model benchmark/presets/qwen3-30b-a3b
                                    # MoE: the floor counts the experts each step selects
    python benchmark/offline/bench.py --skip-hf --tp 2         # two GPUs (floor: one rank's share + all-reduces)
    python benchmark/offline/bench.py --model TINY --device cpu --dtype float32 \
        --num-requests 4 --min-len 8 --max-len 16 --skip-hf    # CPU smoke run
"""

import argparse
import multiprocessing
import statistics
import traceback
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from contextlib import nullcontext
from typing import Any

import torch
from common import (
    TOP_KERNELS,
    Row,
    Workload,
    add_engine_args,
    bound_row,
    build_llm,
    chunk_setting,
    describe_weights,
    device_profiler,
    floor_row,
    free_device_memory,
    make_workload,
    measure_bandwidth,
    model_bytes,
    print_profile,
    print_table,
    record_experts_per_layer,
    result_row,
    run_device,
    step_weight_bytes,
    timed,
    tp_all_reduce_seconds,
    triton_compiles,
    write_json,
)
from roofline import ModelCost, measure_matmul_peak, roofline_seconds
from torch.autograd import DeviceType
from torch.profiler import profile

from minisgl.core import SamplingParams
from minisgl.llm import LLM
from minisgl.utils.hf import cached_load_hf_config
from minisgl.utils.torch_utils import resolve_dtype

GOAL_SHARE = 0.75  # the goal: 75 % of the floor (about 27,000 tok/s on an H200)
STEP_END = "_sample_kernel"  # the last kernel of a step (it samples the tokens)
PREFILL_KERNEL = "_extend_kernel"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_args(parser)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=100, help="shortest prompt and output")
    parser.add_argument("--max-len", type=int, default=1024, help="longest prompt and output")
    parser.add_argument("--temperature", type=float, default=0.6, help="nano-vllm's bench: 0.6")
    parser.add_argument(
        "--chunk-size", type=int, help="prefill tokens per step (default: the offline API's)"
    )
    parser.add_argument("--skip-hf", action="store_true", help="no Hugging Face comparison")
    parser.add_argument(
        "--hf-requests",
        type=int,
        help="give HF only the first N requests (if it is too slow); its tok/s then comes from a "
        "smaller batch, so it is a lower bound and ours/HF an upper bound",
    )
    parser.add_argument("--profile", action="store_true", help="profile the timed run")
    parser.add_argument(
        "--repeats", type=int, default=1, help="timed runs on one engine (the row: the median)"
    )
    return parser.parse_args(argv)


def sampling_params(workload: Workload, temperature: float) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=n)
        for n in workload.output_lens
    ]


def run_hf(args: argparse.Namespace, workload: Workload, device: torch.device) -> Row:
    """HF transformers' continuous batching (`generate_batch`) on the same prompts, random weights,
    one max_new_tokens for all: the workload's mean output length."""
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        ContinuousBatchingConfig,
        GenerationConfig,
    )

    prompts = workload.prompts[: args.hf_requests]
    config = AutoConfig.from_pretrained(args.model)
    dtype = resolve_dtype(args.dtype, device)
    with torch.device(device):  # random init straight on the device; .to() in case it is ignored
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).to(device)
    sampling: dict[str, Any] = {"do_sample": False}
    if args.temperature > 0:  # top_k=0: no top-k filter, as in our SamplingParams default
        sampling = {"do_sample": True, "temperature": args.temperature, "top_k": 0, "top_p": 1.0}
    max_new_tokens = round(statistics.mean(workload.output_lens))
    generation = GenerationConfig(
        max_new_tokens=max_new_tokens,
        eos_token_id=None,  # None: generate_batch disables EOS, as ignore_eos does for us
        **sampling,
    )
    # room for every request at once, twice over: sized by free memory it takes ~8 GB of a CPU's RAM
    page_size = 256
    pages = sum(-(-(len(prompt) + max_new_tokens) // page_size) for prompt in prompts)
    batching = ContinuousBatchingConfig(page_size=page_size, num_blocks=2 * pages)
    batch = model.eval().generate_batch(
        prompts, generation_config=generation, continuous_batching_config=batching
    )
    outputs = list(batch.values())
    errors = [o.error for o in outputs if o.error is not None]
    if len(outputs) != len(prompts) or errors:
        raise RuntimeError(
            f"generate_batch: {len(outputs)}/{len(prompts)} results, errors {errors[:3]}"
        )
    # requests are created after the manager's set-up and CUDA-graph warm-up; time from the first
    # request's creation to the last one's end so that set-up is not counted against HF
    seconds = max(o.lifespan[1] for o in outputs) - min(o.created_time for o in outputs)
    return result_row(
        "HF transformers CB",
        len(prompts),
        sum(len(p) for p in prompts),
        sum(len(o.generated_tokens) for o in outputs),
        seconds,
    )


def run_hf_apart(args: argparse.Namespace, workload: Workload, device: torch.device) -> Row:
    """run_hf in a process of its own, which has exited when this returns: nothing of HF's
    (memory, graph pools, threads) stays behind in ours."""
    spawn = multiprocessing.get_context("spawn")  # a forked child cannot use CUDA
    with ProcessPoolExecutor(max_workers=1, mp_context=spawn) as pool:
        return pool.submit(run_hf, args, workload, device).result()


def run_minisgl(
    args: argparse.Namespace, workload: Workload, device: torch.device
) -> tuple[LLM, Row, profile | None]:
    """(engine, result row of the median timed run, the profiler of the last run if --profile)."""
    llm = build_llm(args, **chunk_setting(args))
    # a slice of the workload itself, so every kernel variant and allocation is made before timing
    warm_up = SamplingParams(temperature=args.temperature, max_tokens=16, ignore_eos=True)
    llm.generate(workload.prompts[:32], warm_up, use_tqdm=False)
    params = sampling_params(workload, args.temperature)
    name = "minisgl (profiled)" if args.profile else "minisgl"
    rows, prof = [], None
    for run in range(args.repeats):
        llm.reset_prefix_cache()  # each run prefills its prompts, as the first did
        if args.profile and run == args.repeats - 1:
            prof = device_profiler(device)
        steps_before = llm.scheduler.stats.steps
        with prof or nullcontext(), triton_compiles() as compiles:
            results, seconds = timed(
                lambda: llm.generate(workload.prompts, params, use_tqdm=False), device
            )
        if compiles:
            print(f"Triton kernel builds inside timed run {run}: {dict(compiles)}")
        output_tokens = sum(len(r["token_ids"]) for r in results)
        steps = llm.scheduler.stats.steps - steps_before
        rows.append(
            result_row(name, len(results), workload.prompt_tokens, output_tokens, seconds, steps)
        )
    if args.repeats > 1:
        print("timed runs, output tok/s:", ", ".join(f"{r['output_tok_s']:,.0f}" for r in rows))
    median = result_row(
        name, len(results), workload.prompt_tokens, output_tokens,
        statistics.median(r["seconds"] for r in rows), steps,
    )  # fmt: skip
    return llm, median, prof


def step_timeline(
    prof: profile,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """GPU time per step, split into prefill steps (with an extend-attention launch) and decode
    steps: a step's kernels end with the sampling kernel. `gap` is the idle time before a step's
    first kernel, `span - busy` the idle time inside steps: both are time the GPU waited for the
    host. Second result: the inside-step idle time summed by the kernel that ended it. Third: the
    decode steps' span split among their kernels, each charged for how far it moved the step's
    end (with PDL, kernels overlap and their durations overstate them), by the kernel and the one
    before it (that tells apart one kernel's uses in a layer), in us a decode step."""
    kernels = sorted(
        (e.start_ns(), e.duration_ns(), e.name())
        for e in prof.profiler.kineto_results.events()
        if e.device_type() == DeviceType.CUDA and e.duration_ns() > 0
    )
    steps: list[list[tuple[int, int, str]]] = [[]]
    for kernel in kernels:
        steps[-1].append(kernel)
        if STEP_END in kernel[2]:
            steps.append([])
    steps = [s for s in steps if s]
    totals: dict[str, dict[str, float]] = {}
    idle_before: Counter[tuple[str, str]] = Counter()
    advance_ns: Counter[str] = Counter()
    previous_end = None
    for step in steps:
        kind = "prefill" if any(PREFILL_KERNEL in name for _, _, name in step) else "decode"
        t = totals.setdefault(kind, {"steps": 0, "busy_ms": 0.0, "span_ms": 0.0, "gap_ms": 0.0})
        end = step[0][0]
        before = "the step's start"
        for start, duration, name in step:
            idle_before[kind, name] += max(0, start - end) / 1e6
            if kind == "decode":
                advance_ns[f"{name[:40]} after {before[:40]}"] += max(0, start + duration - end)
            end = max(end, start + duration)
            before = name
        t["steps"] += 1
        t["busy_ms"] += sum(duration for _, duration, _ in step) / 1e6
        t["span_ms"] += (end - step[0][0]) / 1e6
        if previous_end is not None:
            t["gap_ms"] += max(0, step[0][0] - previous_end) / 1e6
        previous_end = end
    by_kind = [
        {"kind": kind, **t, **{f"{k}_per_step": t[k] / t["steps"] for k in ("busy_ms", "gap_ms")}}
        for kind, t in totals.items()
    ]
    idle = [
        {"kind": kind, "idle before kernel": name[:60], "idle_ms": ms}
        for (kind, name), ms in idle_before.most_common(TOP_KERNELS // 3)
    ]
    decode_steps = totals.get("decode", {}).get("steps", 0)
    critical = [
        {"kernel, after": key, "us_per_decode_step": ns / 1e3 / decode_steps}
        for key, ns in advance_ns.most_common(TOP_KERNELS)
    ]
    return by_kind, idle, critical


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = run_device(args.device)
    vocab_size = cached_load_hf_config(args.model).vocab_size
    workload = make_workload(args.num_requests, args.min_len, args.max_len, vocab_size)
    bandwidth = measure_bandwidth(device)
    peak = measure_matmul_peak(device, resolve_dtype(args.dtype, device))
    all_reduce_s = tp_all_reduce_seconds(args, device, workload.output_lens)  # before the ranks
    params = sampling_params(workload, args.temperature)
    experts_per_layer = record_experts_per_layer(
        args, lambda llm: llm.generate(workload.prompts, params, use_tqdm=False),
        **chunk_setting(args),
    )  # fmt: skip

    llm, ours, prof = run_minisgl(args, workload, device)
    steps, preemptions = ours["steps"], llm.scheduler.stats.num_preemptions
    weight_bytes, kv_per_token = model_bytes(llm)
    step_bytes = step_weight_bytes(llm, experts_per_layer)
    weights = describe_weights(llm, step_bytes, experts_per_layer)
    pool_tokens = llm.engine.layout.num_pages * llm.engine.layout.page_size
    cost = ModelCost.of(llm.engine.model_config)
    hf_row: Row | None = None
    hf_error = None
    # ours first: in both runs where ours followed HF's three minutes, it was the slowest of its
    # session (cause not found: benchmark/RESULTS.md, 2026-11-30, thirteenth session)
    if not args.skip_hf:
        del llm  # the KV pool and graphs go back before HF sizes its cache by free memory
        free_device_memory(device)
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            print(f"device memory free for HF: {free / 2**30:,.1f} of {total / 2**30:,.1f} GiB")
        try:
            hf_row = run_hf_apart(args, workload, device)
        except Exception as e:  # a failed comparison must not cost the minisgl numbers of this run
            traceback.print_exc()
            hf_error = repr(e)
    with_all_reduces = f" + all-reduces {all_reduce_s:,.2f} s" if all_reduce_s else ""
    floor = floor_row(
        f"floor @ {bandwidth / 1e9:,.0f} GB/s{with_all_reduces}",
        workload, step_bytes, kv_per_token, bandwidth, all_reduce_s,
    )  # fmt: skip
    overlapped_s, serial_s = roofline_seconds(
        workload.prompt_lens,
        workload.output_lens,
        cost,
        step_bytes,
        kv_per_token,
        bandwidth,
        peak,
    )
    roofline = bound_row(
        f"roofline @ {peak / 1e12:,.1f} TFLOP/s{with_all_reduces}", workload,
        overlapped_s + all_reduce_s,
    )  # fmt: skip
    serial = bound_row("roofline, one kernel at a time", workload, serial_s + all_reduce_s)
    rows = [ours, floor, roofline, serial]
    for row in rows:
        row["%_of_floor"] = 100 * row["output_tok_s"] / floor["output_tok_s"]
        row["%_of_roofline"] = 100 * row["output_tok_s"] / roofline["output_tok_s"]
    if hf_row:  # on its own workload (fewer requests, one output length): no share of ours
        rows.append(hf_row)

    print(
        f"\n{len(workload.prompts)} requests, {workload.prompt_tokens:,} prompt + "
        f"{workload.output_tokens:,} output tokens; {weights}, "
        f"KV {kv_per_token / 1024:,.1f} KiB/token; device copy {bandwidth / 1e9:,.0f} GB/s; "
        f"KV pool {pool_tokens:,} tokens, {preemptions} preemptions"
    )
    print_table(rows)
    goal = GOAL_SHARE * floor["output_tok_s"]
    print(f"goal: {100 * GOAL_SHARE:.0f} % of the floor = {goal:,.0f} output tok/s")
    if hf_row:
        print(f"minisgl / HF transformers CB: {ours['output_tok_s'] / hf_row['output_tok_s']:.2f}x")
    if hf_error:
        print(f"HF transformers CB failed: {hf_error}")

    payload = {
        "benchmark": "offline throughput",
        "args": vars(args),
        "bandwidth_bytes_per_s": bandwidth,
        "matmul_peak_flop_s": peak,
        "weight_bytes": weight_bytes,
        "step_weight_bytes": step_bytes,
        "experts_per_layer": experts_per_layer,
        "kv_bytes_per_token": kv_per_token,
        "all_reduce_seconds": all_reduce_s,
        "prompt_tokens": workload.prompt_tokens,
        "workload_output_tokens": workload.output_tokens,
        "preemptions": preemptions,
        "rows": rows,
        "goal_output_tok_s": goal,
        "hf_error": hf_error,
        "profile": None,
    }
    write_json(args.json, payload)  # before the profile summary, which may take a while
    if prof is not None:
        payload["profile"] = print_profile(prof, device, ours["seconds"], steps)
        if device.type == "cuda":
            parts = ("steps_by_kind", "idle", "decode_critical_path")
            timeline = dict(zip(parts, step_timeline(prof), strict=True))
            payload["profile"] |= timeline
            for part in parts:
                print_table(timeline[part])
        write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
