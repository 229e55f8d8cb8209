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
import bench_cpu
import bench_decode_step
import latency
import prefill
from collectives import all_reduce_seconds
from common import floor_bytes, make_workload
from roofline import ModelCost, roofline_seconds

from minisgl.models.config import ModelConfig
from minisgl.utils.hf import cached_load_hf_config

PRESETS = Path(__file__).resolve().parents[1] / "benchmark" / "presets"

SMOKE = ["--device", "cpu", "--dtype", "float32"]


def test_floor_bytes_match_hand_computation() -> None:
    # two steps read the weights (100 B each); KV tokens read: request 0 at t=1 reads 2+1,
    # request 1 at t=1 reads 3+1 and at t=2 reads 3+2, so 3 + 4 + 5 = 12 tokens of 10 B
    assert floor_bytes([2, 3], [1, 2], weight_bytes=100, kv_per_token=10) == 2 * 100 + 12 * 10


@pytest.mark.parametrize(
    ("bandwidth", "peak", "seconds"),
    # prefill: 2 tokens x 10 + 3 causal pairs x 1 + the head's 2 = 25 FLOPs; the one decode step
    # reads 100 B of weights and 3 tokens x 10 B of KV and does 12 matmul + 3 attention FLOPs
    [(1.0, 1.0, (25 + 130, 25 + 100 + 30)), (10.0, 1.0, (25 + 15, 25 + 12 + 3))],
)
def test_roofline_matches_hand_computation(
    bandwidth: float, peak: float, seconds: tuple[float, float]
) -> None:
    cost = ModelCost(layer_flops=10, head_flops=2, attention_flops=1)
    got = roofline_seconds([2], [1], cost, 100, 10, bandwidth, peak)
    assert got == pytest.approx(seconds)


def test_model_cost_counts_llama_8b_parameters() -> None:
    mc = ModelConfig.from_hf(cached_load_hf_config(str(PRESETS / "llama-3.1-8b")))
    cost = ModelCost.of(mc)
    embedding = mc.vocab_size * mc.hidden_size
    params = (cost.layer_flops + cost.head_flops) / 2 + embedding
    assert params == pytest.approx(8_030_261_248, rel=1e-4)  # less the norms' 266,240


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


def test_workload_output_lengths_follow_their_own_range() -> None:
    workload = make_workload(64, 16, 256, vocab_size=512, output_range=(8, 128))
    assert min(workload.prompt_lens) >= 16 and max(workload.prompt_lens) <= 256
    assert min(workload.output_lens) >= 8 and max(workload.output_lens) <= 128
    assert workload.prompts == make_workload(64, 16, 256, vocab_size=512).prompts


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
    result = bench.main(args + ["--repeats", "2"])

    workload = make_workload(4, 8, 16, vocab_size=512)
    ours, floor, roofline, serial, hf = result["rows"]
    assert floor["seconds"] <= roofline["seconds"] <= serial["seconds"]
    for row in (ours, floor, roofline):
        assert (row["requests"], row["output_tokens"]) == (4, workload.output_tokens)
    # HF gets one max_new_tokens for all: the mean output length
    assert (hf["requests"], hf["output_tokens"]) == (
        2,
        2 * round(statistics.mean(workload.output_lens)),
    )
    # nothing outruns the floor: it reads only the bytes a step must read, at the copy bandwidth
    assert 0 < ours["output_tok_s"] < floor["output_tok_s"]
    assert ours["%_of_floor"] == pytest.approx(100 * ours["output_tok_s"] / floor["output_tok_s"])
    assert result["profile"]["kernels"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
@pytest.mark.parametrize("script", [bench, latency, prefill])
def test_a_run_on_a_machine_without_its_device_ends_in_one_line(script) -> None:
    """CUDA is the default: a CPU machine got a traceback ("Torch not compiled with CUDA")."""
    with pytest.raises(SystemExit, match=r"device 'cuda': no CUDA device is available"):
        script.main(["--model", "embedded"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_the_host_benchmark_on_cuda_without_a_gpu_ends_in_one_line() -> None:
    with pytest.raises(SystemExit, match=r"device 'cuda': no CUDA device is available"):
        bench_decode_step.main(["--device", "cuda"])


def test_cpu_bench_counts_only_each_requests_own_tokens() -> None:
    """Both engines on the embedded model; HF pads every row to the longest output."""
    args = ["--model", "embedded", "--num-requests", "3", "--repeats", "1"]
    args += ["--min-prompt-len", "4", "--max-prompt-len", "12"]
    args += ["--min-output-len", "2", "--max-output-len", "6"]
    result = bench_cpu.main(args)

    workload = make_workload(3, 4, 12, vocab_size=512, output_range=(2, 6))
    ours, hf = result["rows"]
    assert ours["output_tokens"] == hf["output_tokens"] == workload.output_tokens
    assert ours["computed_tokens"] == workload.output_tokens
    assert hf["computed_tokens"] == 3 * max(workload.output_lens)
    assert result["same_tokens"] == 3  # fp32 greedy on real weights: the same tokens


def test_latency_reports_the_requested_tokens(checkpoint) -> None:
    args = ["--model", str(checkpoint("llama")), *SMOKE, "--prompt-len", "16", "--output-len", "8"]
    one = latency.main(args)
    ours, floor = one["rows"]
    assert ours["output_tokens"] == floor["output_tokens"] == 8
    # over two ranks (LLM(tp_size=2)): the floor is one rank's share of the KV, plus its
    # decode steps' all-reduces, timed over two gloo ranks of their own
    two = latency.main([*args, "--tp", "2"])
    assert two["rows"][0]["output_tokens"] == 8
    assert two["kv_bytes_per_token"] == one["kv_bytes_per_token"] // 2
    assert one["all_reduce_seconds"] == 0 < two["all_reduce_seconds"]
    floor_s = two["rows"][-1]["ms_per_token"] * 8 / 1e3
    assert floor_s > two["all_reduce_seconds"]


def test_all_reduces_are_timed_per_message_size() -> None:
    seconds = all_reduce_seconds(2, "cpu", torch.float32, [1, 4096])
    assert sorted(seconds) == [1, 4096] and all(s > 0 for s in seconds.values())


def test_prefill_counts_every_prompt_token(checkpoint) -> None:
    args = ["--model", str(checkpoint("qwen3")), *SMOKE, "--num-requests", "3", "--profile"]
    result = prefill.main(args + ["--min-len", "20", "--max-len", "40", "--repeats", "2"])
    ours, peak = result["rows"]
    workload = make_workload(3, 20, 40, vocab_size=512)
    assert ours["prompt_tokens"] == peak["prompt_tokens"] == workload.prompt_tokens
    # MFU is the same FLOPs over our seconds against the peak's
    assert 0 < ours["MFU_%"] == pytest.approx(100 * peak["seconds"] / ours["seconds"])
    # the last run profiled: its ops, and its steps (the three prompts, one token each)
    assert result["profile"]["kernels"] and result["profile"]["per_step"]["steps"] >= 1


def test_moe_floor_reads_the_experts_one_request_selects(checkpoint) -> None:
    """One request's token selects top_k experts of each sparse layer in every decode step."""
    path = checkpoint("qwen3_moe", num_experts=8, num_hidden_layers=3, mlp_only_layers=[1])
    args = ["--model", str(path), *SMOKE, "--prompt-len", "16", "--output-len", "8"]
    result = latency.main(args)
    assert result["experts_per_layer"] == 2  # conftest's Qwen3-MoE: top-2
    # each of the two sparse layers reads 2 of its 8 experts (gate_up and down, 64 x 32 each),
    # and of the untied embedding table only the step's rows
    per_expert = 3 * 64 * 32 * 4
    table = 512 * 64 * 4
    assert result["weight_bytes"] - result["step_weight_bytes"] == 2 * 6 * per_expert + table


@pytest.mark.parametrize(("arch", "tied"), [("llama", False), ("qwen3", True)])
def test_the_floor_reads_an_embedding_table_whole_only_as_the_lm_head(
    checkpoint, arch: str, tied: bool
) -> None:
    """A step gathers its tokens' rows of the embedding table: the whole table is read only
    where the LM head shares it (counted whole, it added 10 % to Qwen3-30B-A3B's floor)."""
    args = ["--model", str(checkpoint(arch)), *SMOKE, "--prompt-len", "16", "--output-len", "4"]
    result = latency.main(args)
    table = 0 if tied else 512 * 64 * 4
    assert result["weight_bytes"] - result["step_weight_bytes"] == table


def test_moe_floor_of_a_batch_counts_each_selected_expert_once(checkpoint) -> None:
    path = checkpoint("qwen3_moe", num_experts=8, num_hidden_layers=3, mlp_only_layers=[1])
    args = ["--model", str(path), *SMOKE, "--num-requests", "4", "--min-len", "4"]
    result = bench.main([*args, "--max-len", "8", "--skip-hf"])
    # four requests decoding together choose more than two of the eight experts per layer
    assert 2 < result["experts_per_layer"] <= 8
    assert result["step_weight_bytes"] < result["weight_bytes"]


@pytest.mark.parametrize("temperature", ["0", "0.6"])
def test_decode_step_benchmark_builds_each_batch_size(temperature: str) -> None:
    rows = bench_decode_step.main(["--steps", "20", "--temperature", temperature])
    assert [row["batch"] for row in rows] == [1, 16, 256]
    assert all(0 < row["median_us"] <= row["p90_us"] for row in rows)
