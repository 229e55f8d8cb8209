"""Single-request latency: time to first token and decode speed of one greedy request, side by side
with the memory-bandwidth floor of one request (every step reads the weights, of a mixture of
experts those its token selects, and its own KV).

    python benchmark/offline/latency.py                        # the standard run (H200)
    python benchmark/offline/latency.py --model benchmark/presets/qwen3-30b-a3b   # MoE (H200)
    python benchmark/offline/latency.py --tp 2                 # two GPUs (floor: one rank's share + all-reduces)
    python benchmark/offline/latency.py --model TINY --device cpu --dtype float32 \
        --prompt-len 16 --output-len 8                         # CPU smoke run
"""

import argparse
import statistics
from typing import Any

from common import (
    add_engine_args,
    build_llm,
    describe_weights,
    floor_bytes,
    make_workload,
    measure_bandwidth,
    model_bytes,
    print_table,
    record_experts_per_layer,
    run_device,
    step_weight_bytes,
    timed,
    tp_all_reduce_seconds,
    triton_compiles,
    write_json,
)

from minisgl.core import SamplingParams
from minisgl.llm import LLM
from minisgl.utils.hf import cached_load_hf_config

GOAL_TOK_S = 1500  # the goal for one request on an H200


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_args(parser)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs (medians)")
    return parser.parse_args(argv)


def generate_timed(llm: LLM, prompt: list[int], max_tokens: int) -> tuple[int, float, float]:
    """(tokens generated, seconds to the first token, seconds per later token) of one greedy
    request that ignores EOS, from the times its tokens reached the host in that run."""
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=max_tokens)
    result = timed(lambda: llm.generate([prompt], params, use_tqdm=False), llm.engine.device)[0][0]
    metrics, tokens = result["metrics"], len(result["token_ids"])
    ttft = metrics["first_token_time"] - metrics["arrival_time"]
    return tokens, ttft, (metrics["finished_time"] - metrics["first_token_time"]) / (tokens - 1)


def gpu_step_seconds(llm: LLM, replays: int = 200) -> float | None:
    """The GPU's part of one decode step: the one-row CUDA graph replayed back to back on the last
    step's inputs, with no host work in between. None without CUDA graphs, and under TP: rank 0
    replaying alone would wait in its all-reduces for ranks that do not."""
    runner = llm.engine.graph_runner
    if runner is None or llm.engine.device.type != "cuda" or llm.engine.config.tp_size > 1:
        return None
    runner.replay(1)
    _, seconds = timed(lambda: [runner.replay(1) for _ in range(replays)], llm.engine.device)
    return seconds / replays


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.output_len < 2:
        raise SystemExit(
            "--output-len must be >= 2: decode speed is measured after the first token"
        )
    device = run_device(args.device)
    vocab_size = cached_load_hf_config(args.model).vocab_size
    # a fresh prompt for each run, so that no run finds an earlier one in the prefix cache
    prompts = make_workload(1 + args.repeats, args.prompt_len, args.prompt_len, vocab_size).prompts
    bandwidth = measure_bandwidth(device)
    all_reduce_s = tp_all_reduce_seconds(args, device, [args.output_len])  # before the ranks
    experts_per_layer = record_experts_per_layer(
        args, lambda llm: generate_timed(llm, prompts[0], args.output_len), max_running_requests=1
    )
    llm = build_llm(args, max_running_requests=1)

    generate_timed(llm, prompts[0], 16)  # warm-up
    with triton_compiles() as compiles:
        runs = [generate_timed(llm, p, args.output_len) for p in prompts[1:]]
    if compiles:
        print(f"Triton kernel builds inside the timed runs: {dict(compiles)}")
    output_tokens = runs[0][0]
    # medians over the runs; decode is timed between the first token and the last, in each run
    ttft = statistics.median(run[1] for run in runs)
    decode_s = statistics.median(run[2] for run in runs)
    ours = {
        "system": "minisgl",
        "output_tokens": output_tokens,
        "ttft_ms": 1e3 * ttft,
        "ms_per_token": 1e3 * decode_s,
        "decode_tok_s": 1 / decode_s,
    }
    rows = [ours]
    gpu_s = gpu_step_seconds(llm)
    if gpu_s is not None:  # how far the host keeps the step from the GPU's own time
        rows.append(
            {
                "system": "minisgl, GPU alone (graph replays)",
                "output_tokens": None,
                "ttft_ms": None,
                "ms_per_token": 1e3 * gpu_s,
                "decode_tok_s": 1 / gpu_s,
            }
        )
    weight_bytes, kv_per_token = model_bytes(llm)
    step_bytes = step_weight_bytes(llm, experts_per_layer)
    floor_s = floor_bytes([args.prompt_len], [args.output_len], step_bytes, kv_per_token)
    floor_s = floor_s / bandwidth + all_reduce_s
    with_all_reduces = (
        f" + all-reduces {1e6 * all_reduce_s / args.output_len:,.0f} us" if all_reduce_s else ""
    )
    floor = {
        "system": f"floor @ {bandwidth / 1e9:,.0f} GB/s{with_all_reduces}",
        "output_tokens": args.output_len,
        "ttft_ms": None,
        "ms_per_token": 1e3 * floor_s / args.output_len,
        "decode_tok_s": args.output_len / floor_s,
    }
    rows.append(floor)
    for row in rows:
        row["%_of_floor"] = 100 * row["decode_tok_s"] / floor["decode_tok_s"]

    print(
        f"\none request: {args.prompt_len} prompt + {args.output_len} output tokens, greedy; "
        f"{describe_weights(llm, step_bytes, experts_per_layer)}, "
        f"KV {kv_per_token / 1024:,.1f} KiB/token"
    )
    print_table(rows)
    print(f"goal: {GOAL_TOK_S:,} decode tok/s")
    payload = {
        "benchmark": "single-request latency",
        "args": vars(args),
        "bandwidth_bytes_per_s": bandwidth,
        "weight_bytes": weight_bytes,
        "step_weight_bytes": step_bytes,
        "experts_per_layer": experts_per_layer,
        "kv_bytes_per_token": kv_per_token,
        "all_reduce_seconds": all_reduce_s,
        "rows": rows,
        "goal_decode_tok_s": GOAL_TOK_S,
    }
    write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
