"""The CPU's fast paths give the reference's tokens in fp32: batched attention and the C++ kernels'
(the CPU default) against the torch backend, and oneDNN's packed matmuls against F.linear; freed host memory is
reused."""

import os
import resource
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from minisgl import LLM, SamplingParams
from minisgl.attention.batched_backend import length_groups
from minisgl.kernel import cpp, linear, onednn, torch_ops
from minisgl.server.placement import placements
from minisgl.utils.cpus import cgroup_cpu_limit, usable_cpus
from minisgl.utils.host_memory import keep_freed_memory

from .conftest import DEVICE, assert_same_or_near_tie, hf_model

pytestmark = pytest.mark.skipif(DEVICE != "cpu", reason="the CPU's own paths")

# lengths that mix one-token rows with prompt chunks in a step (chunk_size 48), around page edges,
# and long enough apart that decode rows attend in two or more length groups
PROMPT_LENS = [1, 15, 16, 17, 40, 90, 33, 5, 200, 180]
MAX_TOKENS = [9, 4, 12, 7, 10, 3, 8, 11, 6, 9]


@pytest.fixture(scope="module")
def model_path(checkpoint):
    return checkpoint("qwen3", max_position_embeddings=256)


def prompts() -> list[list[int]]:
    first = [[(7 * i + n) % 500 for i in range(n)] for n in PROMPT_LENS]
    # then the first prompt again, and prompts that extend cached ones by one and three tokens
    return first + [first[0], first[4] + [3], first[5] + [3, 1, 4]]


def generate(path, dtype: str = "float32", **settings) -> list[list[int]]:
    ids = prompts()
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]
    llm = LLM(str(path), device="cpu", dtype=dtype, max_kv_tokens=2048, **settings)
    first = llm.generate(ids[: len(PROMPT_LENS)], params, use_tqdm=False)
    again = llm.generate(ids[len(PROMPT_LENS) :], params[:3], use_tqdm=False)
    return [r["token_ids"] for r in first + again]


@pytest.mark.parametrize("backend", ["batched", "cpp"])
@pytest.mark.parametrize(
    "options",
    [{}, {"page_size": 16}, {"chunk_size": 48}, {"cuda_graph_max_bs": 8}, {"overlap": False}],
    ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default",
)
def test_fast_attention_gives_the_torch_backends_tokens(model_path, backend, options) -> None:
    """Decode rows attend in one call per layer, prompt chunks one request at a time; with
    cuda_graph_max_bs the graph runner's padded static batches run (uncaptured on the CPU)."""
    if backend == "cpp" and not cpp.available():
        pytest.skip("no C++ compiler built the kernels")
    want = generate(model_path, attention_backend="torch", **options)
    assert generate(model_path, attention_backend=backend, **options) == want


def test_fp16_caches_attend_as_the_reference_where_the_cpp_kernel_takes_none(model_path) -> None:
    """The default backend's C++ decode kernel takes fp32 and bf16 caches only."""
    if not cpp.available():
        pytest.skip("no C++ compiler built the kernels")
    want = generate(model_path, "float16", attention_backend="torch")
    assert generate(model_path, "float16") == want


def test_one_token_rows_split_by_length_only_where_padding_outweighs_a_call() -> None:
    lens = np.array([300, 290, 280, 40, 35, 30, 30])
    # one split after the long rows saves 4 * (300 - 40) = 1,040 padded keys
    assert length_groups(lens, 1000) == [(0, 3), (3, 7)]
    assert length_groups(lens, 1100) == [(0, 7)]
    assert length_groups(lens, 1) == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (5, 7)]
    assert length_groups(lens[:1], 1) == [(0, 1)]


def test_onednn_matmuls_give_the_reference_tokens(model_path, monkeypatch) -> None:
    """Packed oneDNN matmuls against F.linear everywhere (MINISGL_CPU_MATMUL=torch): the sums
    are ordered differently, so a difference may only be a near-tie in Hugging Face's logits."""
    got = generate(model_path)
    monkeypatch.setenv("MINISGL_CPU_MATMUL", "torch")
    want = generate(model_path)
    if got != want:
        hf = hf_model(model_path)
        for prompt, g, w in zip(prompts(), got, want, strict=True):
            assert_same_or_near_tie(hf, prompt, g, w)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_takes_packed_onednn_above_its_size_and_f_linear_below(dtype) -> None:
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("no native bf16")
    torch.manual_seed(0)
    weight, bias = torch.randn(1024, 512, dtype=dtype), torch.randn(1024, dtype=dtype)
    packed = onednn.pack(weight)
    assert packed is not None
    small, large = torch.randn(1, 512, dtype=dtype), torch.randn(33, 512, dtype=dtype)
    assert small.shape[0] * weight.numel() < onednn.MIN_MACS <= large.shape[0] * weight.numel()
    assert torch.equal(linear(small, weight, bias, packed), F.linear(small, weight, bias))
    tol = {torch.float32: 1e-4, torch.bfloat16: 0.5}[dtype]  # sums of 512 products near 20
    got = linear(large, weight, bias, packed)
    torch.testing.assert_close(got, F.linear(large, weight, bias), atol=tol, rtol=tol)
    assert torch.equal(got, onednn.linear(large, packed, bias))


def test_no_packing_where_the_reference_is_asked_for_or_the_dtype_is_not_served(
    monkeypatch,
) -> None:
    assert onednn.pack(torch.randn(8, 8, dtype=torch.float16)) is None
    monkeypatch.setenv("MINISGL_CPU_MATMUL", "torch")
    assert onednn.pack(torch.randn(8, 8)) is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_freed_host_memory_is_reused_without_new_page_faults() -> None:
    """40 MB blocks, above the largest size glibc would ever serve from its heap by default: it
    maps each afresh (10,240 pages to fault in). Here the heap settles after a few rounds."""
    keep_freed_memory()
    faults = []
    for _ in range(10):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        torch.empty(10 << 20).fill_(1)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    assert sum(faults[-4:]) < 256, faults


def test_greedy_tokens_are_torchs_argmax_with_its_ties_and_nans() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 1000)
    logits[1, [3, 700]] = 9.0  # a tie: the first
    logits[2, [5, 9]] = torch.nan  # NaN above any number: the first NaN
    logits[3] = -torch.inf
    logits[4, 10] = torch.inf
    want = logits.argmax(dim=-1).to(torch.int32)
    for x in (logits, logits.bfloat16()):
        got = torch_ops.greedy_tokens(x)
        assert got.dtype == torch.int32
        assert torch.equal(got, x.float().argmax(dim=-1).to(torch.int32))
    assert torch.equal(torch_ops.greedy_tokens(logits), want)


@pytest.mark.parametrize("rows", [1, 5, 300])
def test_rope_of_q_and_k_in_one_view_has_the_bits_of_each_apart(rows) -> None:
    """q and k split from the merged qkv run as one view; copies of them, apart, one by one."""
    torch.manual_seed(0)
    head, qkv = 64, torch.randn(rows, 16 * 64)
    positions, cos_sin = torch.randint(0, 512, (rows,)), torch.randn(512, head)
    norm = (torch.randn(head), torch.randn(head), 1e-6)
    q, k, _ = qkv.split([8 * head, 4 * head, 4 * head], dim=-1)
    assert torch_ops._heads_together(q.view(rows, 8, head), k.view(rows, 4, head)) is not None
    apart_q, apart_k = q.clone(), k.clone()
    torch_ops.apply_rope_inplace(positions, q, k, head, cos_sin, norm)
    torch_ops.apply_rope_inplace(positions, apart_q, apart_k, head, cos_sin, norm)
    assert torch.equal(q, apart_q) and torch.equal(k, apart_k)


def test_rope_of_q_and_k_that_only_lie_side_by_side_runs_them_apart() -> None:
    """Two tensors adjacent in memory but not one storage (the allocator may place a copy of k
    right after a copy of q) are no merged qkv: one view of both would run past q's storage."""
    torch.manual_seed(0)
    head, rows = 64, 1
    memory = torch.randn(rows * 12 * head).numpy()
    q = torch.from_numpy(memory[: rows * 8 * head]).view(rows, 8, head)
    k = torch.from_numpy(memory[rows * 8 * head :]).view(rows, 4, head)
    assert k.data_ptr() == q.data_ptr() + q.nbytes
    assert torch_ops._heads_together(q, k) is None
    want_q, want_k = q.clone(), k.clone()
    positions, cos_sin = torch.tensor([3]), torch.randn(8, head)
    norm = (torch.randn(head), torch.randn(head), 1e-6)
    torch_ops.apply_rope_inplace(positions, q, k, head, cos_sin, norm)
    torch_ops.apply_rope_inplace(positions, want_q, want_k, head, cos_sin, norm)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)


@pytest.mark.parametrize(
    ("files", "limit"),
    [
        ({"cpu.max": "150000 100000\n"}, 2),  # cgroup v2, 1.5 cores: rounded up
        ({"cpu.max": "max 100000\n"}, None),
        ({"cpu/cpu.cfs_quota_us": "100000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 1),  # v1
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
        ({}, None),  # no cgroup files: the mask alone
    ],
)
def test_a_cgroup_quota_caps_the_threads(tmp_path: Path, files: dict[str, str], limit) -> None:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cgroup_cpu_limit(tmp_path) == limit
    cores = len(os.sched_getaffinity(0))
    assert usable_cpus(tmp_path) == (cores if limit is None else min(cores, limit))


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_dp_replicas_share_the_cores_the_cgroup_quota_allows(tmp_path: Path) -> None:
    """A container limited to one core's time (--cpus 1) in a mask of more: one replica takes
    one core of the mask, not all of them; two replicas without a quota split the mask."""
    (tmp_path / "cpu.max").write_text("100000 100000\n")
    cores = sorted(os.sched_getaffinity(0))
    assert placements(1, 1, tmp_path)[0].cpus == {cores[0]}
    split = [p.cpus for p in placements(2, 1, tmp_path / "none")]
    assert split[0].isdisjoint(split[1]) and len(split[0]) == len(split[1]) == len(cores) // 2
