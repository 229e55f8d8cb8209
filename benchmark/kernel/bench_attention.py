"""Triton paged attention on the Qwen3-0.6B attention shape: checked against the torch backend, then
timed. Decode is bound by reading K/V, so it is reported as GB/s of K+V read next to the device's
copy bandwidth; extend (a quarter of each context new, after a cached prefix) as TFLOP/s.

    python benchmark/kernel/bench_attention.py                    # bf16, page size 1 (H200)
    python benchmark/kernel/bench_attention.py --dtype float16 --page-size 16

Small cases (bs 1, context 512: 2 MB of K/V) are bound by launch latency, not bandwidth.
"""

import argparse

import torch
from triton.testing import do_bench

from minisgl.attention import AttentionBackend, create_attention_backend
from minisgl.core import Batch, Req, SamplingParams
from minisgl.kernel.triton import decode_attention, decode_num_splits, extend_attention
from minisgl.kvcache import KVPool

QO_HEADS, KV_HEADS, HEAD_DIM = 16, 8, 128  # Qwen3-0.6B
BATCH_SIZES = (1, 16, 64, 256)
CONTEXTS = (512, 2048)
TOLERANCE = {torch.float16: 5e-3, torch.bfloat16: 3e-2}


class Setup:
    """A one-layer pool holding `bs` requests of `ctx` tokens each, their pages in random order."""

    def __init__(self, bs: int, ctx: int, page_size: int, dtype: torch.dtype) -> None:
        device = torch.device("cuda")
        pages_per_req = -(-ctx // page_size)
        self.pool = KVPool(1, bs * pages_per_req, page_size, KV_HEADS, HEAD_DIM, dtype, device)
        for cache in (self.pool.k_cache(0), self.pool.v_cache(0)):
            cache.normal_()
        pages = torch.randperm(bs * pages_per_req, device=device).view(bs, pages_per_req)
        offsets = torch.arange(pages_per_req * page_size, device=device) % page_size
        locs = pages.repeat_interleave(page_size, dim=1) * page_size + offsets
        self.page_table = locs.int()
        self.bs, self.ctx = bs, ctx

    def batch(self, extend_len: int) -> Batch:
        """Every request computes its last `extend_len` tokens."""
        device = self.page_table.device
        reqs = [Req(i, [0], SamplingParams(), seed=0, slot=i) for i in range(self.bs)]
        positions = torch.arange(self.ctx - extend_len, self.ctx, device=device).repeat(self.bs)
        slots = torch.arange(self.bs, device=device).repeat_interleave(extend_len)
        return Batch(
            reqs=reqs,
            prefix_lens=[self.ctx - extend_len] * self.bs,
            extend_lens=[extend_len] * self.bs,
            sample_rows=[],
            input_ids=torch.zeros_like(positions),
            positions=positions.int(),
            out_loc=self.page_table[slots, positions],
            slots=torch.arange(self.bs, dtype=torch.int32, device=device),
            is_decode=extend_len == 1,
        )

    def backend(self, name: str) -> AttentionBackend:
        return create_attention_backend(name, self.pool, self.page_table)


def copy_bandwidth() -> float:
    """Bytes read + written per second by a 1 GiB device copy, timed like the kernels."""
    src = torch.ones(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / (do_bench(lambda: dst.copy_(src)) * 1e-3)


def check_against_torch(setup: Setup, batch: Batch, q: torch.Tensor) -> None:
    k_cache, v_cache = setup.pool.k_cache(0), setup.pool.v_cache(0)
    k, v = k_cache[batch.out_loc], v_cache[batch.out_loc]  # store_kv rewrites what is there
    outputs = []
    for name in ("torch", "triton"):
        backend = setup.backend(name)
        backend.prepare(batch)
        outputs.append(backend.forward(q, k, v, 0, batch).float())
    error = (outputs[0] - outputs[1]).abs().max().item()
    assert error < TOLERANCE[q.dtype], f"bs {setup.bs}, ctx {setup.ctx}: max error {error}"


def bench_decode(setup: Setup, dtype: torch.dtype, copy_bytes_per_s: float) -> list[str]:
    batch = setup.batch(1)
    q = torch.randn(setup.bs, QO_HEADS, HEAD_DIM, dtype=dtype, device="cuda")
    check_against_torch(setup, batch, q)
    meta = batch.attn_metadata
    splits = decode_num_splits(setup.bs, KV_HEADS, q.device)
    args = (setup.pool.k_cache(0), setup.pool.v_cache(0), setup.page_table, meta.slots)
    seconds = do_bench(lambda: decode_attention(q, *args, meta.seq_lens, splits)) * 1e-3
    bytes_per_s = 2 * setup.bs * setup.ctx * KV_HEADS * HEAD_DIM * dtype.itemsize / seconds
    return [
        str(splits),
        f"{seconds * 1e6:.1f}",
        f"{bytes_per_s / 1e9:.0f} GB/s",
        f"{bytes_per_s / copy_bytes_per_s:.0%}",
    ]


def bench_extend(setup: Setup, dtype: torch.dtype) -> list[str]:
    """A quarter of each context is new, after a cached prefix."""
    extend_len = setup.ctx // 4
    batch = setup.batch(extend_len)
    q = torch.randn(batch.num_tokens, QO_HEADS, HEAD_DIM, dtype=dtype, device="cuda")
    check_against_torch(setup, batch, q)
    meta = batch.attn_metadata
    args = (setup.pool.k_cache(0), setup.pool.v_cache(0), setup.page_table, meta.slots)
    blocks = (meta.seq_lens, meta.cu_seqlens_q, meta.block_req, meta.block_start)
    seconds = do_bench(lambda: extend_attention(q, *args, *blocks)) * 1e-3
    prefix = setup.ctx - extend_len
    keys_seen = setup.bs * (extend_len * prefix + extend_len * (extend_len + 1) // 2)
    flops = 4 * QO_HEADS * HEAD_DIM * keys_seen  # QK^T and PV: 2 flops per multiply-add each
    return ["-", f"{seconds * 1e6:.1f}", f"{flops / seconds / 1e12:.1f} TFLOP/s", "-"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--page-size", type=int, default=1)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_attention: no CUDA device, nothing to measure (the kernels need a GPU)")
        return
    dtype = getattr(torch, args.dtype)
    copy_bytes_per_s = copy_bandwidth()
    print(
        f"copy bandwidth {copy_bytes_per_s / 1e9:.0f} GB/s; {args.dtype}, page size {args.page_size}"
    )
    header = ["kernel", "bs", "ctx", "splits", "us", "achieved", "of copy"]
    widths = [6, 5, 6, 7, 10, 16, 8]
    row = lambda cells: "".join(f"{c:>{w}}" for c, w in zip(cells, widths, strict=True))
    print(row(header))
    for bs in BATCH_SIZES:
        for ctx in CONTEXTS:
            setup = Setup(bs, ctx, args.page_size, dtype)
            for kernel, cells in (
                ("decode", bench_decode(setup, dtype, copy_bytes_per_s)),
                ("extend", bench_extend(setup, dtype)),
            ):
                print(row([kernel, str(bs), str(ctx), *cells]))
            del setup
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
