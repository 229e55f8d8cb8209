"""Decode attention's launch at ragged large batches (contexts 100-2,048, the offline benchmark's
mix): keys per step (BLOCK_N), warps, pipeline stages and splits, each timed inside a CUDA graph
and reported as a share of the copy bandwidth, next to the default launch with and without the
longest-first order. It chose the tile for batches above PREFETCH_MAX_BATCH (RESULTS.md, ninth
session).

`--offline-run N` instead times every N-th decode step of `bench.py`'s run (its batch sizes and
contexts) with each number of programs per SM the split rule could aim at (and each `--tiles`
launch), and sums the steps: the rule's effect on the whole run, without the run's noise.
`--offline-launches N` reports the best of a small grid of launches per step.
`--one-request QO,KV ...` sweeps one request's launch (keys per step, query heads per program,
splits) at those head counts, e.g. 32,4 for Qwen3-30B-A3B's 8:1 groups.

    python benchmark/kernel/sweep_decode_attention.py            # bf16, batches 256 and 128
    python benchmark/kernel/sweep_decode_attention.py --offline-run 16
"""

import argparse
import functools
import itertools
import random
import sys
from pathlib import Path

import torch
import triton
from bench_attention import HEAD_DIM, KV_HEADS, QO_HEADS, Setup, copy_bandwidth
from triton.testing import do_bench_cudagraph

from minisgl.kernel.triton import decode_attention, decode_num_splits, num_sms
from minisgl.kernel.triton.decode_attention import PREFETCH_MAX_BATCH, DecodeLaunch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "offline"))
from common import make_workload  # the offline benchmark's workload

BLOCK_NS, WARPS, STAGES = (32, 64, 128), (4, 8), (2, 3, 4)
NUM_LAYERS = 28  # Qwen3-0.6B


def sweep(ctx_lens: list[int], copy_bw: float, top: int) -> None:
    bs, dtype = len(ctx_lens), torch.bfloat16
    setup = Setup(ctx_lens, 1, dtype)
    q = torch.randn(bs, QO_HEADS, HEAD_DIM, dtype=dtype, device="cuda")
    _, batch = setup.batch(1)
    kernel_args, order = setup.kernel_args(batch), batch.longest_first
    counters = torch.zeros(bs * KV_HEADS, dtype=torch.int32, device="cuda")
    default_splits = decode_num_splits(bs, KV_HEADS, num_sms(q.device))
    default = functools.partial(decode_attention, q, *kernel_args, default_splits, counters, order)
    unordered = functools.partial(decode_attention, q, *kernel_args, default_splits, counters)
    want = default().float()
    kv_bytes = 2 * sum(ctx_lens) * KV_HEADS * HEAD_DIM * dtype.itemsize
    results = []
    for tile in itertools.product(BLOCK_NS, WARPS, STAGES, sorted({1, 2, 4, default_splits})):
        *launch, splits = tile
        run = functools.partial(
            decode_attention, q, *kernel_args, splits, counters, order, DecodeLaunch(*launch)
        )
        try:
            error = (run().float() - want).abs().max().item()
            results.append((do_bench_cudagraph(run) * 1e-3, tile, error))
        except triton.runtime.errors.OutOfResources:
            continue
    for name, fn in (("in the batch's order", unordered), ("longest first", default)):
        seconds = do_bench_cudagraph(fn) * 1e-3
        print(
            f"bs {bs}, default launch ({default_splits} splits), {name}: {seconds * 1e6:.1f} us, "
            f"{kv_bytes / seconds / copy_bw:.1%} of copy"
        )
    for seconds, (block_n, warps, stages, splits), error in sorted(results)[:top]:
        print(
            f"bs {bs:>3} BLOCK_N {block_n:>3} warps {warps} stages {stages} splits {splits}: "
            f"{seconds * 1e6:7.1f} us {kv_bytes / seconds / copy_bw:6.1%} of copy, "
            f"max difference from the default {error:.2e}"
        )


def sweep_one_request(qo_heads: int, kv_heads: int, ctx: int, top: int) -> None:
    """One request of ctx keys: every launch of keys per step x query heads per program x
    splits, against the default launch, each in a CUDA graph."""
    dtype, group = torch.bfloat16, qo_heads // kv_heads
    setup = Setup([ctx], 1, dtype, kv_heads)
    q = torch.randn(1, qo_heads, HEAD_DIM, dtype=dtype, device="cuda")
    _, inputs = setup.batch(1)
    args = (q, *setup.kernel_args(inputs))
    counters = torch.zeros(qo_heads, dtype=torch.int32, device="cuda")
    default_splits = decode_num_splits(1, kv_heads, num_sms(q.device))
    default = functools.partial(decode_attention, *args, default_splits, counters)
    want = default().float()
    default_seconds = do_bench_cudagraph(default) * 1e-3
    print(
        f"one request, {qo_heads}/{kv_heads} heads, {ctx} keys: default launch "
        f"({default_splits} splits) {default_seconds * 1e6:.2f} us"
    )
    heads = [h for h in (1, 2, 4, 8, 16) if group % h == 0]
    results = []
    for block_n, head_count, splits in itertools.product((16, 32, 64), heads, (8, 16, 32, 64)):
        launch = DecodeLaunch(block_n, heads=head_count)
        run = functools.partial(decode_attention, *args, splits, counters, None, launch)
        error = (run().float() - want).abs().max().item()
        results.append((do_bench_cudagraph(run) * 1e-3, block_n, head_count, splits, error))
    for seconds, block_n, head_count, splits, error in sorted(results)[:top]:
        print(
            f"  BLOCK_N {block_n:>2} heads/program {head_count} splits {splits:>2}: "
            f"{seconds * 1e6:6.2f} us ({default_seconds / seconds:.2f}x the default), "
            f"max difference {error:.1e}"
        )


def offline_run_steps(every: int) -> list[list[int]]:
    """Contexts of every `every`-th decode step of bench.py's run that has more than
    PREFETCH_MAX_BATCH requests. Taken as if every prompt were prefilled before the first decode
    (in the run, the first requests decode while later prompts prefill: ~16 steps)."""
    workload = make_workload(256, 100, 1024, vocab_size=1)
    lens = list(zip(workload.prompt_lens, workload.output_lens, strict=True))
    steps = [
        [prompt + step + 1 for prompt, output in lens if output > step]
        for step in range(0, max(workload.output_lens), every)
    ]
    return [contexts for contexts in steps if len(contexts) > PREFETCH_MAX_BATCH]


def compare_split_rules(
    every: int, programs_per_sm: list[int], tiles: list[DecodeLaunch | None]
) -> None:
    """Decode attention's time over bench.py's run (all layers, the steps in between counted as
    the one timed) for each tile (None: the default launch) and each number of programs per SM
    the split rule could aim at (None: the default rule), every step run the same way."""
    sms = num_sms(torch.device("cuda"))
    rules = list(itertools.product(tiles, [None, *programs_per_sm]))
    totals = dict.fromkeys(rules, 0.0)
    for contexts in offline_run_steps(every):
        bs = len(contexts)
        setup = Setup(contexts, 1, torch.bfloat16)
        q = torch.randn(bs, QO_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        _, batch = setup.batch(1)
        counters = torch.zeros(bs * KV_HEADS, dtype=torch.int32, device="cuda")
        timed: dict[tuple[DecodeLaunch | None, int], float] = {}
        for tile, per_sm in rules:
            splits = decode_num_splits(bs, KV_HEADS, sms)
            if per_sm is not None:
                splits = max(1, min(32, triton.cdiv(per_sm * sms, bs * KV_HEADS)))
            if (tile, splits) not in timed:
                run = functools.partial(
                    decode_attention, q, *setup.kernel_args(batch), splits, counters,
                    batch.longest_first, tile,
                )  # fmt: skip
                timed[tile, splits] = do_bench_cudagraph(run) * 1e-3
            totals[tile, per_sm] += timed[tile, splits] * every * NUM_LAYERS
        del setup
    default = totals[None, None]
    for (tile, per_sm), seconds in sorted(totals.items(), key=lambda item: item[1]):
        name = f"{tuple(tile) if tile else 'default tile'}, " + (
            "the default split rule" if per_sm is None else f"{per_sm} programs per SM"
        )
        print(
            f"{name:>44}: {seconds:.3f} s of decode attention over the run, "
            f"{default / seconds:.3f}x the default's speed"
        )


def compare_launches(every: int) -> None:
    """Every launch of a small grid (keys per step, stages, splits) on each `every`-th decode
    step of bench.py's run: the best per step next to the default, and what taking the best at
    every step would save over the run (all layers)."""
    sms = num_sms(torch.device("cuda"))
    tiles = [(64, 4, 3), (64, 4, 4), (128, 4, 2), (128, 4, 3)]
    default_total = best_total = 0.0
    for contexts in offline_run_steps(every):
        bs = len(contexts)
        setup = Setup(contexts, 1, torch.bfloat16)
        q = torch.randn(bs, QO_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        _, batch = setup.batch(1)
        args = (q, *setup.kernel_args(batch))
        counters = torch.zeros(bs * KV_HEADS, dtype=torch.int32, device="cuda")
        default_splits = decode_num_splits(bs, KV_HEADS, sms)
        run = functools.partial(
            decode_attention, *args, default_splits, counters, batch.longest_first
        )
        default = do_bench_cudagraph(run) * 1e-3
        timed = []
        for tile, splits in itertools.product(tiles, sorted({1, 2, 3, 4, 6, default_splits})):
            run = functools.partial(
                decode_attention, *args, splits, counters, batch.longest_first, DecodeLaunch(*tile)
            )
            try:
                timed.append((do_bench_cudagraph(run) * 1e-3, tile, splits))
            except triton.runtime.errors.OutOfResources:
                continue
        best, tile, splits = min(timed)
        default_total += default * every * NUM_LAYERS
        best_total += min(best, default) * every * NUM_LAYERS
        print(
            f"bs {bs:>3} default ({default_splits} splits) {default * 1e6:7.1f} us, best "
            f"{tile} x {splits} splits {best * 1e6:7.1f} us: {default / best:.3f}x"
        )
        del setup
    print(
        f"over the run: default {default_total:.3f} s, best per step {best_total:.3f} s "
        f"({default_total / best_total:.3f}x)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[256, 128])
    parser.add_argument("--top", type=int, default=8, help="launches printed per batch size")
    parser.add_argument(
        "--offline-run", type=int, metavar="N", help="compare split rules on every N-th step"
    )
    parser.add_argument("--programs-per-sm", type=int, nargs="+", default=[2, 3, 4, 6, 8, 12, 16])
    parser.add_argument(
        "--tiles", nargs="+", default=[], metavar="BLOCK_N,WARPS,STAGES",
        help="--offline-run: launches to try besides the default",
    )  # fmt: skip
    parser.add_argument(
        "--offline-launches", type=int, metavar="N", help="sweep launches on every N-th step"
    )
    parser.add_argument("--one-request", nargs="+", default=[], metavar="QO,KV")
    parser.add_argument("--contexts", type=int, nargs="+", default=[768, 4096])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("sweep_decode_attention: no CUDA device, nothing to measure")
        return
    if args.one_request:
        for heads, ctx in itertools.product(args.one_request, args.contexts):
            sweep_one_request(*map(int, heads.split(",")), ctx, args.top)
        return
    if args.offline_launches:
        compare_launches(args.offline_launches)
        return
    if args.offline_run:
        tiles = [DecodeLaunch(*map(int, tile.split(","))) for tile in args.tiles]
        compare_split_rules(args.offline_run, args.programs_per_sm, [None, *tiles])
        return
    copy_bw = copy_bandwidth()
    print(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s")
    rng = random.Random(0)
    for bs in args.batch_sizes:
        sweep([rng.randint(100, 2048) for _ in range(bs)], copy_bw, args.top)


if __name__ == "__main__":
    main()
