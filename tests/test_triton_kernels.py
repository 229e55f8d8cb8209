"""Triton kernels and the triton attention backend against the PyTorch reference.

On CPU they run in Triton's interpreter (conftest sets TRITON_INTERPRET=1), at small sizes, in fp32
and fp16 (the interpreter's tl.dot is wrong for bf16 inputs); on CUDA in fp32, fp16 and bf16.
"""

import functools
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from minisgl import kernel
from minisgl.attention import ATTENTION_BACKENDS
from minisgl.attention.base import AttentionBackend
from minisgl.core import Batch, BatchInputs, EngineLayout, Req, SamplingParams
from minisgl.engine.context import ForwardBatch, load_inputs
from minisgl.engine.engine import upload
from minisgl.kernel import KVStore, torch_ops
from minisgl.kernel import triton as triton_ops
from minisgl.kernel.triton.decode_attention import reduce_chunk
from minisgl.kvcache.pool import KVPool
from minisgl.llm import LLM
from minisgl.scheduler.batch_builder import build_batch

from .conftest import DEVICE

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
# (atol, rtol) per dtype: attention accumulates in fp32 but rounds p to the input dtype for P @ V
ATTENTION_TOL = {
    torch.float32: (2e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}
# elementwise kernels reproduce the reference's roundings: at most one ulp apart
ELEMENTWISE_TOL = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (8e-3, 8e-3),
}
HEAD_DIM = 32


def assert_close(got: torch.Tensor, want: torch.Tensor, tol: tuple[float, float]) -> None:
    atol, rtol = tol
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)


def randn(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, device=DEVICE).to(dtype)


class PagedKV:
    """A one-layer pool filled with random K/V and a page table whose pages are scattered at random;
    request i lives in page-table row slots[i] (not i) so the slot indirection is exercised."""

    def __init__(
        self,
        seq_lens: list[int],
        page_size: int,
        kv_heads: int,
        dtype: torch.dtype,
        head_dim: int = HEAD_DIM,
    ) -> None:
        pages_per_req = [-(-n // page_size) for n in seq_lens]
        num_pages = sum(pages_per_req) + 3  # a few unused pages
        self.pool = KVPool(1, num_pages, page_size, kv_heads, head_dim, dtype, torch.device(DEVICE))
        self.pool.k_cache(0).copy_(randn(*self.pool.k_cache(0).shape, dtype=dtype))
        self.pool.v_cache(0).copy_(randn(*self.pool.v_cache(0).shape, dtype=dtype))
        width = max(pages_per_req) * page_size
        # a row per request of a padded batch (4 padding rows at most), as in the engine; the
        # last row is the padding request's
        rows = len(seq_lens) + 4 + 1
        self.page_table = torch.zeros((rows, width), dtype=torch.int32, device=DEVICE)
        self.page_table[-1] = self.pool.dummy_loc
        self.dummy_slot = rows - 1
        self.slots = torch.randperm(len(seq_lens)).tolist()
        pages = torch.randperm(num_pages).tolist()
        offsets = torch.arange(width) % page_size
        for slot, n in zip(self.slots, pages_per_req, strict=True):
            req_pages = torch.tensor([pages.pop() for _ in range(n)])
            locs = req_pages.repeat_interleave(page_size) * page_size + offsets[: n * page_size]
            self.page_table[slot, : n * page_size] = locs.int().to(DEVICE)

    def batch(
        self, prefix_lens: list[int], extend_lens: list[int], padding: int = 0
    ) -> "DeviceBatch":
        """The batch computing tokens [prefix, prefix + extend) of each request, plus `padding`
        rows shaped like the CUDA-graph runner's (dummy slot, one token at position 0)."""
        slots = self.slots + [self.dummy_slot] * padding
        reqs = [Req(i, [0], SamplingParams(), seed=0, slot=s) for i, s in enumerate(slots)]
        prefix_lens, extend_lens = prefix_lens + [0] * padding, extend_lens + [1] * padding
        tokens = torch.zeros_like(self.page_table)
        rows, width = self.page_table.shape
        layout = EngineLayout(1, 1, rows - 1, width, width, width, 1)
        plan = build_batch(reqs, prefix_lens, extend_lens, layout)
        inputs = upload(plan.inputs, self.page_table.device)
        _, out_loc = load_inputs(inputs, self.page_table, tokens)
        return DeviceBatch(plan, inputs, out_loc)

    def backend(self, name: str) -> AttentionBackend:
        return ATTENTION_BACKENDS.get(name)(self.pool, self.page_table)

    def decode_args(self, batch: "DeviceBatch") -> tuple[torch.Tensor, ...]:
        """What decode_attention takes after q: the pool, the page table, the batch's rows."""
        inputs = batch.inputs
        return (
            self.pool.k_cache(0),
            self.pool.v_cache(0),
            self.page_table,
            inputs.slots,
            inputs.seq_lens,
        )


@dataclass
class DeviceBatch:
    """A batch as the engine holds it during a forward: its plan, its inputs on the device and
    the pool locations its tokens' K/V go to."""

    plan: Batch
    inputs: BatchInputs
    out_loc: torch.Tensor

    def forward_batch(self, backend: AttentionBackend, prepare: bool = True) -> ForwardBatch:
        """prepare: the backend's metadata, as for an eager forward (a graph replay has none)."""
        metadata = backend.prepare(self.plan) if prepare else None
        return ForwardBatch(self.plan.is_decode, self.inputs, self.out_loc, backend, metadata)


def attend(
    backend: AttentionBackend, batch: DeviceBatch, qkv: tuple[torch.Tensor, ...]
) -> torch.Tensor:
    q, k, v = qkv
    # the attention layer's part: the step's K/V go into the pool first
    torch_ops.store_kv(backend.pool.k_cache(0), backend.pool.v_cache(0), batch.out_loc, k, v)
    return backend.forward(q, 0, batch.forward_batch(backend))


def new_qkv(
    batch: DeviceBatch, qo_heads: int, kv_heads: int, dtype: torch.dtype, head_dim: int = HEAD_DIM
):
    tokens = batch.plan.num_tokens
    return (
        randn(tokens, qo_heads, head_dim, dtype=dtype),
        randn(tokens, kv_heads, head_dim, dtype=dtype),
        randn(tokens, kv_heads, head_dim, dtype=dtype),
    )


@pytest.mark.parametrize("qo_heads", [4, 6, 2])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("dtype", DTYPES)
def test_extend_attention_matches_reference_over_prefix_and_new_tokens(qo_heads, page_size, dtype):
    """Two KV heads, each serving 2, 3 (its second program of two heads half padding) or 1 query heads.
    The first request's second q block and the last request see keys before their first row
    (unmasked) and on the diagonal (masked)."""
    torch.manual_seed(0)
    # ragged: a prompt longer than one q block, a 1-token chunk after a prefix, mid-page prefixes
    prefix_lens, extend_lens = [0, 37, 5, 100], [70, 1, 20, 3]
    kv = PagedKV(
        [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)], page_size, 2, dtype
    )
    batch = kv.batch(prefix_lens, extend_lens)
    qkv = new_qkv(batch, qo_heads, 2, dtype)
    want = attend(kv.backend("torch"), batch, qkv)
    got = attend(kv.backend("triton"), kv.batch(prefix_lens, extend_lens), qkv)
    assert_close(got, want, ATTENTION_TOL[dtype])


def test_extend_blocks_come_most_keys_first():
    """A 130-token prompt cuts into blocks reading 64, 128 and 130 keys; 10 new tokens after a
    100-token prefix read 110."""
    block_req, block_start = triton_ops.extend_blocks([0, 100], [130, 10])
    assert list(zip(block_req, block_start, strict=True)) == [(0, 128), (0, 64), (1, 0), (0, 0)]


@pytest.mark.parametrize("num_splits", [1, 3, 8])
# the page size only moves where keys are read, which each program does alike in both head modes
@pytest.mark.parametrize(("page_size", "heads"), [(1, 0), (16, 0), (16, 1)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_attention_matches_reference_for_any_split_count(
    num_splits, page_size, heads, dtype
):
    torch.manual_seed(0)
    # 8 splits: 300 uses 5 splits of 64 keys and leaves 3 unused, 17 and 1 write their output
    # directly from their one split; 1 split: every request does
    seq_lens = [1, 70, 300, 17, 129]
    kv = PagedKV(seq_lens, page_size, 2, dtype)  # group of 3: the head block is padded to 16
    batch = kv.batch([n - 1 for n in seq_lens], [1] * len(seq_lens))
    q, k, v = new_qkv(batch, 6, 2, dtype)
    want = attend(kv.backend("torch"), batch, (q, k, v))
    # heads 0: a program per KV head's group of 3; 1: a program per query head, a counter each
    counters = torch.zeros(len(seq_lens) * 6, dtype=torch.int32, device=DEVICE)
    args = kv.decode_args(batch)
    launch = triton_ops.DecodeLaunch(64, heads=heads)
    # twice: the last split of each request resets its counter, so a second launch reduces too
    for _ in range(2):
        got = triton_ops.decode_attention(q, *args, num_splits, counters, None, launch)
        assert_close(got, want, ATTENTION_TOL[dtype])
        assert counters.count_nonzero() == 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_reduce_loads_its_splits_in_more_than_one_chunk(dtype):
    """2,100 keys over 32 splits use 17 of them (128 keys each); at head_dim 128 the reduce of a
    group of 3 query heads (padded to 4) loads 16 splits' partials at a time, so it takes two."""
    assert reduce_chunk(3, 128, 32) == 16
    torch.manual_seed(0)
    kv = PagedKV([2100], 16, 2, dtype, head_dim=128)
    batch = kv.batch([2099], [1])
    q, k, v = new_qkv(batch, 6, 2, dtype, head_dim=128)
    want = attend(kv.backend("torch"), batch, (q, k, v))
    counters = torch.zeros(6, dtype=torch.int32, device=DEVICE)
    launch = triton_ops.DecodeLaunch(64)
    got = triton_ops.decode_attention(q, *kv.decode_args(batch), 32, counters, None, launch)
    assert_close(got, want, ATTENTION_TOL[dtype])
    assert counters.count_nonzero() == 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_request_with_a_large_group_matches_reference_through_the_backend(dtype):
    """One request at 8:1 GQA: the backend's default launch splits the group in two programs per
    split, each with its own counter; twice, so the counters were left at zero."""
    torch.manual_seed(0)
    kv = PagedKV([300], 1, 1, dtype)
    batch = kv.batch([299], [1])
    qkv = new_qkv(batch, 8, 1, dtype)
    want = attend(kv.backend("torch"), batch, qkv)
    triton = kv.backend("triton")
    for _ in range(2):
        assert_close(attend(triton, batch, qkv), want, ATTENTION_TOL[dtype])
        assert triton.split_counters.count_nonzero() == 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_attention_matches_reference_with_and_without_prefetch(dtype):
    """Up to 16 requests each program reads its first key block before the PDL wait and the new
    token's row after it; a larger batch reads everything after the wait, its requests in the
    order it is given. From 2 requests up, in 2-byte dtypes, a block holds 128 keys (here one or
    two splits, with partial blocks). Both match, and a larger batch's result does not depend on
    that order."""
    torch.manual_seed(0)
    for seq_lens in ([1, 64, 65, 130], [1 + (37 * i) % 300 for i in range(17)]):
        kv = PagedKV(seq_lens, 1, 2, dtype)
        batch = kv.batch([n - 1 for n in seq_lens], [1] * len(seq_lens))
        longest_first = batch.inputs.longest_first
        assert sorted(longest_first.tolist()) == list(range(len(seq_lens)))
        assert batch.inputs.seq_lens[longest_first.long()].diff().le(0).all()
        q, k, v = new_qkv(batch, 4, 2, dtype)
        want = attend(kv.backend("torch"), batch, (q, k, v))
        counters = torch.zeros(len(seq_lens) * 2, dtype=torch.int32, device=DEVICE)
        args = kv.decode_args(batch)
        shuffled = torch.randperm(len(seq_lens)).to(DEVICE, torch.int32)
        outputs = [
            triton_ops.decode_attention(q, *args, 2, counters, order)
            for order in (None, longest_first, shuffled)
        ]
        for got in outputs:
            assert_close(got, want, ATTENTION_TOL[dtype])
            assert torch.equal(got, outputs[0])
        assert counters.count_nonzero() == 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_runs_on_graph_static_metadata_with_padding_rows(dtype):
    """The CUDA-graph runner replays without prepare(), with padding rows that point at the dummy
    slot: decode must need nothing beyond the batch's own inputs."""
    torch.manual_seed(0)
    seq_lens = [40, 1, 90]
    kv = PagedKV(seq_lens, 16, 2, dtype)
    batch = kv.batch([n - 1 for n in seq_lens], [1] * len(seq_lens))
    q, k, v = new_qkv(batch, 4, 2, dtype)
    want = attend(kv.backend("torch"), batch, (q, k, v))

    padding = 2
    padded = kv.batch([n - 1 for n in seq_lens], [1] * len(seq_lens), padding)
    pad = lambda x: torch.cat([x, torch.zeros_like(x[:padding])])
    torch_ops.store_kv(kv.pool.k_cache(0), kv.pool.v_cache(0), padded.out_loc, pad(k), pad(v))
    triton = kv.backend("triton")
    got = triton.forward(pad(q), 0, padded.forward_batch(triton, prepare=False))
    assert_close(got[: len(seq_lens)], want, ATTENTION_TOL[dtype])


def test_decode_launch_takes_three_stages_only_where_they_fit():
    """A few requests read 128 keys per step in 3 stages where 3 bf16 K and V tiles (192 KiB)
    fit in a program's shared memory (an H200's), else in 2 (an A100's, or none reported)."""
    hopper, a100, bf16, d = 232_448, 166_912, torch.bfloat16, 128
    launch = triton_ops.decode_launch
    three, two = triton_ops.DecodeLaunch(128, 4, 3), triton_ops.DecodeLaunch(128, 4, 2)
    assert launch(8, bf16, d, hopper, 2) == launch(8, bf16, d, hopper, 8) == three
    assert launch(8, bf16, d, a100, 2) == launch(8, bf16, d, 0, 2) == two
    assert launch(17, bf16, d, hopper, 2) == two
    # one request, and fp32, whose 128-key tiles would not fit even in 2 stages: 64 keys
    assert launch(1, bf16, d, hopper, 2) == launch(8, torch.float32, d, hopper, 2)
    assert launch(1, bf16, d, hopper, 2).block_n == 64


def test_one_request_splits_a_large_even_group_in_two_programs():
    """One request: a GQA group above 4 query heads, if even, in two programs of half of them
    (Qwen3-30B-A3B's 8:1), others whole; the backend's counters cover both programs."""
    launch = functools.partial(triton_ops.decode_launch, 1, torch.bfloat16, 128, 232_448)
    assert [launch(group).heads for group in (1, 2, 4, 7, 8, 16)] == [0, 0, 0, 0, 4, 8]
    assert (
        launch(
            8,
        ).block_n
        == launch(2).block_n
        == 64
    )
    # 2 rows (one request and the sink row) hold one request's two head blocks per KV head
    assert triton_ops.split_counter_count(2, 4) == 8 and triton_ops.split_counter_count(1, 4) == 8
    assert triton_ops.split_counter_count(9, 4) == 36


def test_decode_splits_shrink_as_the_batch_grows():
    sms, kv_heads, few = 132, 8, (2, 4, 8, 16)

    def splits(sizes: tuple[int, ...]) -> list[int]:
        return [triton_ops.decode_num_splits(bs, kv_heads, sms) for bs in sizes]

    # one rule per launch of decode_launch: one request, a few, more
    (one,), few_splits, many_splits = splits((1,)), splits(few), splits((17, 64, 256, 1024))
    for rule in (few_splits, many_splits):
        assert rule == sorted(rule, reverse=True) and rule[0] > rule[-1]
    assert one >= few_splits[0] and many_splits[-1] == 1
    # a few requests' programs each fill an SM's shared memory: at most two per SM
    assert all(bs * kv_heads * s <= 2 * sms for bs, s in zip(few, few_splits, strict=True))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_writes_the_rotated_keys_and_the_values_into_the_pool(dtype):
    torch.manual_seed(0)
    tokens, q_heads, kv_heads, d = 7, 4, 2, HEAD_DIM
    qkv = randn(tokens, (q_heads + 2 * kv_heads) * d, dtype=dtype)
    norm = (randn(d, dtype=dtype), randn(d, dtype=dtype), 1e-6)
    cos_sin = torch.randn(64, d, device=DEVICE)
    positions = torch.randint(0, 64, (tokens,), dtype=torch.int32, device=DEVICE)
    out_loc = torch.randperm(50, device=DEVICE)[:tokens].int()
    pool = randn(2, 50, kv_heads, d, dtype=dtype)
    untouched = torch.ones(50, dtype=torch.bool, device=DEVICE)
    untouched[out_loc.long()] = False
    results = []
    for ops in (torch_ops, triton_ops):
        got, (k_cache, v_cache) = qkv.clone(), pool.clone()
        q, k, v = got.split([q_heads * d, kv_heads * d, kv_heads * d], dim=-1)
        kv_store = KVStore(k_cache, v_cache, out_loc, v)
        ops.apply_rope_inplace(positions, q, k, d, cos_sin, norm, kv_store)
        assert torch.equal(k_cache[out_loc.long()], k.view(tokens, kv_heads, d))  # rotated keys
        assert torch.equal(
            v_cache[out_loc.long()], qkv[:, -kv_heads * d :].view(tokens, kv_heads, d)
        )
        assert torch.equal(k_cache[untouched], pool[0][untouched])
        assert torch.equal(v_cache[untouched], pool[1][untouched])
        results.append((got, k_cache))
    assert_close(results[1][0], results[0][0], ELEMENTWISE_TOL[dtype])
    assert_close(results[1][1], results[0][1], ELEMENTWISE_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rmsnorm_matches_reference_out_of_place_and_in_place(dtype):
    torch.manual_seed(0)
    x, weight = randn(5, 3, 48, dtype=dtype), randn(48, dtype=dtype)  # 48: a masked block of 64
    want = torch_ops.rmsnorm(x, weight, 1e-5)
    assert_close(triton_ops.rmsnorm(x, weight, 1e-5), want, ELEMENTWISE_TOL[dtype])
    assert triton_ops.rmsnorm(x, weight, 1e-5, out=x) is x
    assert_close(x, want, ELEMENTWISE_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_qk_norm_and_rope_work_in_place_on_strided_views_of_qkv(dtype):
    """The attention layer normalises and rotates q and k where they sit in the merged qkv, in
    one kernel; the reference is the two separate steps."""
    torch.manual_seed(0)
    tokens, q_heads, kv_heads, d = 5, 4, 2, 32
    qkv = randn(tokens, (q_heads + 2 * kv_heads) * d, dtype=dtype)
    q_weight, k_weight = randn(d, dtype=dtype), randn(d, dtype=dtype)
    cos_sin = torch.randn(64, d, device=DEVICE)
    positions = torch.tensor([0, 3, 9, 63, 1], dtype=torch.int32, device=DEVICE)
    split = [q_heads * d, kv_heads * d, kv_heads * d]
    want = qkv.clone()
    q, k, _ = want.split(split, dim=-1)
    torch_ops.rmsnorm(q.view(tokens, q_heads, d), q_weight, 1e-6, out=q.view(tokens, q_heads, d))
    torch_ops.rmsnorm(k.view(tokens, kv_heads, d), k_weight, 1e-6, out=k.view(tokens, kv_heads, d))
    torch_ops.apply_rope_inplace(positions, q, k, d, cos_sin)
    for ops in (torch_ops, triton_ops):
        got = qkv.clone()
        q, k, _ = got.split(split, dim=-1)
        ops.apply_rope_inplace(positions, q, k, d, cos_sin, (q_weight, k_weight, 1e-6))
        assert_close(got, want, ELEMENTWISE_TOL[dtype])
        assert torch.equal(got[:, -kv_heads * d :], qkv[:, -kv_heads * d :])  # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rmsnorm_updates_residual_and_x_in_place(dtype):
    torch.manual_seed(0)
    x, residual, weight = (
        randn(6, 48, dtype=dtype),
        randn(6, 48, dtype=dtype),
        randn(48, dtype=dtype),
    )
    want_x, want_residual = x.clone(), residual.clone()
    torch_ops.fused_add_rmsnorm(want_x, want_residual, weight, 1e-5)
    triton_ops.fused_add_rmsnorm(x, residual, weight, 1e-5)
    assert torch.equal(residual, want_residual)  # the add rounds exactly like add_
    assert_close(x, want_x, ELEMENTWISE_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rmsnorm_sums_partial_sums_of_x(dtype):
    """x as three partial sums (a split-K matmul's output): the sum is rounded once, added to the
    residual, and the norm written into the first partial, as the reference does."""
    torch.manual_seed(0)
    parts, residual, weight = (
        randn(3, 6, 48, dtype=dtype),
        randn(6, 48, dtype=dtype),
        randn(48, dtype=dtype),
    )
    want_parts, want_residual = parts.clone(), residual.clone()
    want = torch_ops.fused_add_rmsnorm(want_parts, want_residual, weight, 1e-5)
    got = triton_ops.fused_add_rmsnorm(parts, residual, weight, 1e-5)
    assert got.data_ptr() == parts.data_ptr() and got.shape == (6, 48)
    assert_close(residual, want_residual, ELEMENTWISE_TOL[dtype])
    assert_close(got, want, ELEMENTWISE_TOL[dtype])


@pytest.mark.parametrize("flat", [True, False], ids=["T,H*D", "T,H,D"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_rotates_query_and_key_in_place_like_reference(dtype, flat):
    torch.manual_seed(0)
    tokens, qo_heads, kv_heads = 5, 6, 2
    freqs = torch.outer(torch.arange(64.0), torch.rand(HEAD_DIM // 2)).to(DEVICE)
    cos_sin_cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    positions = torch.tensor([0, 63, 7, 7, 30], device=DEVICE)
    shape = lambda heads: (tokens, heads * HEAD_DIM) if flat else (tokens, heads, HEAD_DIM)
    q, k = randn(*shape(qo_heads), dtype=dtype), randn(*shape(kv_heads), dtype=dtype)
    want_q, want_k = q.clone(), k.clone()
    torch_ops.apply_rope_inplace(positions, want_q, want_k, HEAD_DIM, cos_sin_cache)
    triton_ops.apply_rope_inplace(positions.int(), q, k, HEAD_DIM, cos_sin_cache)
    assert_close(q, want_q, ELEMENTWISE_TOL[dtype])
    assert_close(k, want_k, ELEMENTWISE_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_reference(dtype):
    torch.manual_seed(0)
    x = randn(2, 3, 2 * 1100, dtype=dtype)  # 1100: more than one column block per row
    assert_close(triton_ops.silu_and_mul(x), torch_ops.silu_and_mul(x), ELEMENTWISE_TOL[dtype])


def sample_both(logits: torch.Tensor, entries: torch.Tensor, *sampling: torch.Tensor):
    """torch_ops' tokens, checked against the kernel's tokens and table writes (into the device
    table and its pinned host copy), twice: the counters the first launch leaves zero serve the
    second."""
    tables = [torch.full((6, 8), -1, dtype=torch.int32, device=DEVICE) for _ in range(2)]
    pinned = DEVICE == "cuda"
    host_tables = [torch.full((6, 8), -1, dtype=torch.int32, pin_memory=pinned) for _ in range(2)]
    counters = torch.zeros(logits.shape[0], dtype=torch.int32, device=DEVICE)
    want = torch_ops.sample_tokens(
        logits, tables[0], entries, counters, *sampling, host_table=host_tables[0]
    )
    assert torch.equal(host_tables[0], tables[0].cpu())
    for _ in range(2):
        got = triton_ops.sample_tokens(
            logits, tables[1], entries, counters, *sampling, host_table=host_tables[1]
        )
        assert torch.equal(got, want) and torch.equal(tables[1], tables[0])
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        assert torch.equal(host_tables[1], host_tables[0])
        assert not counters.any()
    return want


@pytest.mark.parametrize("dtype", DTYPES)
def test_sampling_kernel_picks_the_reference_tokens(dtype):
    """Same uniform numbers, same tokens as softmax + cumsum + searchsorted, over a vocabulary
    that spans several blocks (not a multiple of the block); rows of temperature 0 take the
    argmax, in the same launch."""
    torch.manual_seed(0)
    rows, vocab = 48, 5000
    logits = (3 * randn(rows, vocab, dtype=torch.float32)).to(dtype)
    temperatures = torch.rand(rows, device=DEVICE) + 0.3
    temperatures[::3] = 0.0
    uniforms = torch.rand(rows, device=DEVICE).clamp(1e-3, 1 - 1e-3)
    entries = torch.randperm(rows, device=DEVICE).int()  # the 6 x 8 table, shuffled
    tokens = sample_both(logits, entries, temperatures, uniforms)
    argmax = logits.argmax(dim=-1).int()
    assert torch.equal(tokens[::3], argmax[::3])
    assert not torch.equal(tokens[1::3], argmax[1::3])  # the others were drawn


@pytest.mark.parametrize("dtype", DTYPES)
def test_greedy_sample_takes_the_first_maximum_and_writes_the_table(dtype):
    torch.manual_seed(0)
    rows, vocab = 5, 9000  # three chunks, the last one partial
    logits = randn(rows, vocab, dtype=dtype)
    # ties across chunks and inside one: the first index wins, as in torch.argmax
    logits[0, [10, 5000]] = logits[1, [4100, 4200]] = 50.0
    logits[2, vocab - 1] = 60.0
    entries = torch.tensor([3, 17, 8, 40, 0], dtype=torch.int32, device=DEVICE)
    for sampling in ((), (torch.zeros(rows, device=DEVICE), torch.rand(rows, device=DEVICE))):
        tokens = sample_both(logits, entries, *sampling)  # no temperatures, or all 0
        assert tokens[:3].tolist() == [10, 4100, vocab - 1]


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_with_nan_or_inf_takes_the_references_token(dtype):
    """NaN is above any number (the first NaN wins, in a later chunk too, over an earlier +inf);
    +inf above the rest; sampled rows of such logits take that token as well."""
    torch.manual_seed(0)
    rows, vocab = 6, 9000  # three chunks
    logits = randn(rows, vocab, dtype=dtype)
    logits[0, [7000, 8000]] = float("nan")
    logits[0, 100] = float("inf")
    logits[1, [4100, 20]] = float("nan")
    logits[2, [5000, 300]] = float("inf")
    logits[3, :] = float("-inf")
    logits[3, 8999] = 1.0
    logits[4, 4096] = float("nan")  # alone in its chunk's first position
    entries = torch.arange(rows, dtype=torch.int32, device=DEVICE)
    temperatures = torch.tensor([0.0, 0.7, 0.0, 0.7, 0.7, 0.0], device=DEVICE)
    uniforms = torch.rand(rows, device=DEVICE).clamp(1e-3, 1 - 1e-3)
    for sampling in ((), (temperatures, uniforms)):
        tokens = sample_both(logits, entries, *sampling)
        assert tokens[:5].tolist() == [7000, 20, 300, 8999, 4096]


@pytest.mark.parametrize("with_writes", [False, True])
def test_read_tables_applies_the_writes_before_reading(with_writes):
    torch.manual_seed(0)
    page_table, token_table = (
        torch.randint(0, 1000, (9, 40), dtype=torch.int32, device=DEVICE) for _ in range(2)
    )
    ints = lambda *values: torch.tensor(values, dtype=torch.int32, device=DEVICE)
    token_entries, page_entries = ints(5, 41, 300, 359), ints(7, 41, 80, 359)
    no_writes = (ints(), ints())
    writes = (no_writes, no_writes)
    if with_writes:  # entries the reads then take (41, 359), and some they do not
        writes = ((ints(41, 2, 359), ints(-1, -2, -3)), (ints(300, 41, 6), ints(-4, -5, -6)))
    want = torch_ops.read_tables(
        page_table.clone(), token_table.clone(), *writes, token_entries, page_entries
    )
    got = triton_ops.read_tables(page_table, token_table, *writes, token_entries, page_entries)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    if with_writes:
        assert got[0].tolist()[1:3] == [-5, -4] and got[1].tolist()[1::2] == [-1, -3]
        assert page_table.view(-1)[2] == -2 and token_table.view(-1)[6] == -6


@pytest.mark.parametrize(
    ("n", "k", "norm"),
    [(2056, 1032, True), (1032, 2056, False)],
    ids=["with-norm-many-features-long-rows", "few-features-long-rows"],
)
def test_gemv_default_tiles_of_larger_layers_match_linear(n, k, norm):
    """The default tile at shapes of Qwen3-30B-A3B's kind (its QKV projection after the norm, its
    o_proj), shrunk to just past each rule's bounds: partial tiles of features and of K."""
    torch.manual_seed(n)
    dtype = torch.float16 if DEVICE == "cpu" else torch.bfloat16
    x, weight, norm_weight = (
        randn(1, k, dtype=dtype),
        randn(n, k, dtype=dtype),
        randn(k, dtype=dtype),
    )
    prologue = triton_ops.Prologue(norm_weight, 1e-6) if norm else triton_ops.Prologue()
    want = torch_ops.rmsnorm(x, norm_weight, 1e-6) if norm else x
    want = torch.nn.functional.linear(want.float(), weight.float())
    got = triton_ops.linear(x, weight, prologue=prologue)
    assert_close(got, want, (5e-2, ATTENTION_TOL[dtype][1]))


@pytest.mark.parametrize("rows", [1, 3, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gemv_matches_linear_for_small_batches(rows, dtype):
    torch.manual_seed(0)
    x, weight, bias = (
        randn(rows, 700, dtype=dtype),
        randn(300, 700, dtype=dtype),
        randn(300, dtype=dtype),
    )
    for b in (None, bias):
        want = torch.nn.functional.linear(
            x.float(), weight.float(), None if b is None else b.float()
        )
        # fp32 sums of 700 products: the order differs from the reference, hence a looser atol
        assert_close(triton_ops.linear(x, weight, b), want, (5e-3, ATTENTION_TOL[dtype][1]))


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_gemv_equals_silu_and_mul_of_the_plain_gemv(rows, dtype):
    torch.manual_seed(0)
    # 150 features: the last program's tile is partial; three tiles of K and a partial one
    x, weight = randn(rows, 700, dtype=dtype), randn(2 * 150, 700, dtype=dtype)
    bias = randn(2 * 150, dtype=dtype)
    config = triton_ops.gemv.GemvConfig(8, 256, 4)
    got = triton_ops.linear(x, weight, bias, config=config, gated=True)
    assert got.shape == (rows, 150)
    # the same sums in the same order, rounded where the separate kernels round: the same bits
    plain = triton_ops.linear(x, weight, bias, config=config)
    assert torch.equal(got, triton_ops.silu_and_mul(plain))
    want = torch_ops.silu_and_mul(
        torch.nn.functional.linear(x.float(), weight.float(), bias.float())
    )
    assert_close(got, want, (5e-3, ATTENTION_TOL[dtype][1]))


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gemv_computes_rmsnorm_of_x_plus_residual_and_keeps_the_sum(with_residual, rows, dtype):
    torch.manual_seed(0)
    x, residual = randn(rows, 700, dtype=dtype), randn(rows, 700, dtype=dtype)
    norm_weight, weight = randn(700, dtype=dtype), randn(300, 700, dtype=dtype)
    x_before, residual_before = x.clone(), residual.clone()
    new_residual = torch.full_like(x, float("nan")) if with_residual else None
    normed = torch.full_like(x, float("nan"))  # the first program stores the normed rows
    prologue = triton_ops.Prologue(
        norm_weight, 1e-6, residual if with_residual else None, new_residual, normed
    )
    got = triton_ops.linear(
        x, weight, config=triton_ops.gemv.GemvConfig(4, 256, 4), prologue=prologue
    )
    summed = (x.float() + residual.float()).to(dtype) if with_residual else x
    if with_residual:
        assert torch.equal(new_residual, summed)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)
    assert_close(normed, torch_ops.rmsnorm(summed, norm_weight, 1e-6), ELEMENTWISE_TOL[dtype])
    want = torch.nn.functional.linear(
        torch_ops.rmsnorm(summed, norm_weight, 1e-6).float(), weight.float()
    )
    assert_close(got, want, (5e-3, ATTENTION_TOL[dtype][1]))


@pytest.mark.parametrize("rows", [1, 5])
def test_dispatched_norm_and_gated_matmuls_equal_the_unfused_ops(rows):
    """On CPU (and for 5 rows) the ops run one after another, updating x and residual in place as
    fused_add_rmsnorm does; on a GPU in bf16 one row takes the fused GEMV."""
    torch.manual_seed(0)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    x, residual = randn(rows, 256, dtype=dtype), randn(rows, 256, dtype=dtype)
    norm_weight, weight = randn(256, dtype=dtype), randn(96, 256, dtype=dtype)
    summed = (x.float() + residual.float()).to(dtype)
    want = torch_ops.linear(torch_ops.rmsnorm(summed, norm_weight, 1e-6), weight)
    y, new_residual = kernel.rmsnorm_linear(x.clone(), residual.clone(), norm_weight, 1e-6, weight)
    assert torch.equal(new_residual, summed)
    assert_close(y, want, (5e-2, ATTENTION_TOL[dtype][1]))
    # a MoE layer's router: the normed rows as well, which its experts read; on a Hopper, at one
    # row, warming the next layer's weight into L2 meanwhile
    next_weight = randn(640, 256, dtype=dtype)
    h, y, new_residual = kernel.add_rmsnorm_linear(
        x.clone(), residual.clone(), norm_weight, 1e-6, weight, warm=next_weight
    )
    assert torch.equal(new_residual, summed)
    assert_close(h, torch_ops.rmsnorm(summed, norm_weight, 1e-6), ELEMENTWISE_TOL[dtype])
    assert_close(y, want, (5e-2, ATTENTION_TOL[dtype][1]))
    y, same = kernel.rmsnorm_linear(x, None, norm_weight, 1e-6, weight)
    assert same is x
    assert_close(
        y,
        torch_ops.linear(torch_ops.rmsnorm(x, norm_weight, 1e-6), weight),
        (5e-2, ATTENTION_TOL[dtype][1]),
    )
    gate_up = randn(2 * 96, 256, dtype=dtype)
    want = torch_ops.silu_and_mul(
        torch_ops.linear(torch_ops.rmsnorm(x, norm_weight, 1e-6), gate_up)
    )
    y, _ = kernel.rmsnorm_linear(x, None, norm_weight, 1e-6, gate_up, gated=True)
    assert_close(y, want, (5e-2, ATTENTION_TOL[dtype][1]))


def test_dispatch_takes_triton_only_for_cuda_half_tensors():
    assert kernel._ops_for(torch.zeros(1, dtype=torch.float16)) is torch_ops
    if DEVICE == "cuda":
        assert kernel._ops_for(torch.zeros(1, device="cuda")) is torch_ops
        assert kernel._ops_for(torch.zeros(1, dtype=torch.bfloat16, device="cuda")) is triton_ops


def test_llm_with_triton_backend_generates_the_torch_backend_tokens(checkpoint):
    """fp32 end to end: chunked prefill (prefix + extend), prefix-cache hits, paged decode with
    the graph runner's static batches (its CPU twin on CPU)."""
    path = checkpoint("qwen3")
    prompts = [[(7 * i + 3) % 500 for i in range(n)] for n in (70, 9, 1)]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    tokens = {}
    for backend in ("torch", "triton"):
        llm = LLM(
            str(path),
            device=DEVICE,
            dtype="float32",
            attention_backend=backend,
            page_size=4,
            max_kv_tokens=512,
            max_model_len=512,
            max_running_requests=4,
            chunk_size=32,
            cuda_graph_max_bs=4,
        )
        first = llm.generate(prompts, params, use_tqdm=False)
        again = llm.generate([prompts[0] + [11, 12]], params, use_tqdm=False)  # reuses the prefix
        tokens[backend] = [r["token_ids"] for r in first + again]
        assert again[0]["cached_tokens"] > 0
    assert tokens["triton"] == tokens["torch"]


def test_triton_backend_orders_a_large_padded_decode_batch_as_the_torch_backend_does(checkpoint):
    """Above 16 requests, decode attention starts the longest requests first (the batch's
    longest_first order); through the graph runner's static batches, 20 requests padded to 32,
    the tokens equal the torch backend's."""
    path = checkpoint("qwen3")
    prompts = [[(5 * i + n) % 500 for i in range(n)] for n in range(3, 43, 2)]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    tokens = {}
    for backend in ("torch", "triton"):
        llm = LLM(
            str(path), device=DEVICE, dtype="float32", attention_backend=backend,
            max_kv_tokens=2048, max_running_requests=32, cuda_graph_max_bs=32,
        )  # fmt: skip
        tokens[backend] = [r["token_ids"] for r in llm.generate(prompts, params, use_tqdm=False)]
    assert tokens["triton"] == tokens["torch"]


def test_every_kernel_compiles_for_hopper():
    """The interpreter runs kernels as Python and lets through code the compiler rejects (a
    variable retyped in a branch broke the greedy kernel on the GPU once, with every CPU test
    green). hopper_compile.py compiles each kernel's variants for sm_90, through ptxas, on CPU."""
    kernel_dir = Path(triton_ops.__file__).parent
    source = "".join(f.read_text() for f in kernel_dir.glob("*.py"))
    kernels = set(re.findall(r"^def (_\w+_kernel)\(", source, re.MULTILINE))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("hopper_compile.py")
    run = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    compiled = {line.split()[0] for line in run.stdout.splitlines()}
    assert len(kernels) >= 8 and kernels <= compiled, kernels - compiled
