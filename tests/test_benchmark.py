"""The offline benchmarks: the floor arithmetic, the standard workload, and a CPU smoke run of each
script on a tiny checkpoint (timings are printed, never asserted)."""

import random
import statistics
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmark" / "offline"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmark" / "host"))
import bench
import bench_decode_step
import latency
from common import floor_bytes, make_workload

SMOKE = ["--device", "cpu", "--dtype", "float32"]


def test_floor_bytes_match_hand_computation() -> None:
    # two steps read the weights (100 B each); KV tokens read: request 0 at t=1 reads 2+1,
    # request 1 at t=1 reads 3+1 and at t=2 reads 3+2, so 3 + 4 + 5 = 12 tokens of 10 B
    assert floor_bytes([2, 3], [1, 2], weight_bytes=100, kv_per_token=10) == 2 * 100 + 12 * 10


def test_standard_workload_has_nano_vllm_lengths() -> None:
    random.seed(0)
    prompt_lens = []
    for _ in range(256):
        prompt_lens.append(random.randint(100, 1024))
        for _ in range(prompt_lens[-1]):
            random.randint(0, 10000)
    output_lens = [random.randint(100, 1024) for _ in range(256)]

    workload = make_workload(256, 100, 1024, vocab_size=151936)
    assert workload.prompt_lens == prompt_lens
    assert workload.output_lens == output_lens
    assert workload.prompt_lens[:3] == [964, 724, 484]
    assert workload.output_lens[:3] == [845, 312, 607]
    assert workload.output_tokens == 133966  # nano-vllm's README reports 133,966 output tokens


def test_workload_ids_fit_a_small_vocabulary() -> None:
    workload = make_workload(8, 10, 20, vocab_size=512)
    assert all(0 <= t < 512 for prompt in workload.prompts for t in prompt)


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="HF's continuous batching allocates on the GPU when there is one",
)
def test_bench_reports_the_workload_tokens(checkpoint) -> None:
    args = ["--model", str(checkpoint("qwen3")), *SMOKE, "--num-requests", "4"]
    args += ["--min-len", "8", "--max-len", "16", "--hf-requests", "2", "--profile"]
    result = bench.main(args)

    workload = make_workload(4, 8, 16, vocab_size=512)
    ours, floor, hf = result["rows"]
    for row in (ours, floor):
        assert (row["requests"], row["output_tokens"]) == (4, workload.output_tokens)
    # HF gets one max_new_tokens for all: the mean output length
    assert (hf["requests"], hf["output_tokens"]) == (
        2,
        2 * round(statistics.mean(workload.output_lens)),
    )
    assert floor["%_of_floor"] == pytest.approx(100)
    assert result["profile"]["kernels"]


def test_latency_reports_the_requested_tokens(checkpoint) -> None:
    args = ["--model", str(checkpoint("llama")), *SMOKE, "--prompt-len", "16", "--output-len", "8"]
    one = latency.main(args)
    ours, floor = one["rows"]
    assert ours["output_tokens"] == floor["output_tokens"] == 8
    # over two ranks (LLM(tp_size=2)): the floor is one rank's share of the KV
    two = latency.main([*args, "--tp", "2"])
    assert two["rows"][0]["output_tokens"] == 8
    assert two["kv_bytes_per_token"] == one["kv_bytes_per_token"] // 2


@pytest.mark.parametrize("temperature", ["0", "0.6"])
def test_decode_step_benchmark_builds_each_batch_size(temperature: str) -> None:
    rows = bench_decode_step.main(["--steps", "20", "--temperature", temperature])
    assert [row["batch"] for row in rows] == [1, 16, 256]
    assert all(0 < row["median_us"] <= row["p90_us"] for row in rows)
