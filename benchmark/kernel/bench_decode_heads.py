"""Decode attention's default launch at the presets' head counts (32/4 Qwen3-30B-A3B, 16/8
Qwen3-0.6B, 28/4 Qwen2.5-7B, 32/8 Llama-3.1-8B and Qwen3-8B), batches of 1, 4 and 16 requests of
768 or 2,048 keys: microseconds per launch inside a CUDA graph, the median of three timings. At
these batches a launch waits on its chain of dependent reads more than on bandwidth, so the time
is the figure (bench_attention.py reports bandwidth, on the 0.6B shape).

    python benchmark/kernel/bench_decode_heads.py      # bf16 (H200)
"""

import functools

import torch
from bench_attention import HEAD_DIM, Setup
from triton.testing import do_bench_cudagraph

from minisgl.kernel.triton import (
    decode_attention,
    decode_num_splits,
    num_sms,
    split_counter_count,
)

HEADS = ((32, 4), (16, 8), (28, 4), (32, 8))  # (query heads, KV heads)


def main() -> None:
    if not torch.cuda.is_available():
        print("bench_decode_heads: no CUDA device, nothing to measure (the kernel needs a GPU)")
        return
    for qo, kv in HEADS:
        for bs in (1, 4, 16):
            for ctx in (768, 2048):
                setup = Setup([ctx] * bs, 1, torch.bfloat16, kv)
                q = torch.randn(bs, qo, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
                _, inputs = setup.batch(1)
                counters = torch.zeros(
                    split_counter_count(bs, kv), dtype=torch.int32, device="cuda"
                )
                splits = decode_num_splits(bs, kv, num_sms(q.device))
                launch = functools.partial(
                    decode_attention, q, *setup.kernel_args(inputs), splits, counters,
                    inputs.longest_first,
                )  # fmt: skip
                times = [do_bench_cudagraph(launch) * 1e3 for _ in range(3)]
                print(
                    f"{qo}/{kv} bs {bs:>2} ctx {ctx}: {sorted(times)[1]:.2f} us ({splits} splits)"
                )


if __name__ == "__main__":
    main()
