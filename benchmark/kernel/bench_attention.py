"""Triton paged attention on the Qwen3-0.6B attention shape: checked against the torch backend, then
timed inside a CUDA graph (so launch gaps stay out). Decode is bound by reading K/V, so it is
reported as GB/s of K+V read next to the device's copy bandwidth; extend (a quarter of each context
new, after a cached prefix) as TFLOP/s. The ragged rows use the offline benchmark's mix of contexts
(100-2048 tokens) and sweep the split count, since uneven requests leave SMs idle at the tail.
First, whole prompts (one of 8k tokens, 16 of 256-2048) in extend's two block orders: most keys
first (the engine's) and request order ("ext-req"); `--extend-orders` stops there.

    python benchmark/kernel/bench_attention.py                    # bf16, page size 1 (H200)
    python benchmark/kernel/bench_attention.py --dtype float16 --page-size 16
    python benchmark/kernel/bench_attention.py --extend-orders
"""

import argparse
import random
from collections.abc import Callable

import torch
from triton.testing import do_bench, do_bench_cudagraph

from minisgl.attention import ATTENTION_BACKENDS
from minisgl.attention.base import AttentionBackend
from minisgl.core import Batch, BatchInputs, EngineLayout, Req, SamplingParams
from minisgl.engine.context import ForwardBatch
from minisgl.engine.engine import upload
from minisgl.kernel.triton import decode_attention, decode_num_splits, extend_attention, num_sms
from minisgl.kvcache.pool import KVPool
from minisgl.scheduler.batch_builder import build_batch

QO_HEADS, KV_HEADS, HEAD_DIM = 16, 8, 128  # Qwen3-0.6B
BATCH_SIZES = (1, 16, 64, 256)
CONTEXTS = (512, 2048)
RAGGED_SPLITS = (1, 2, 4, 8)
TOLERANCE = {torch.float16: 5e-3, torch.bfloat16: 3e-2}


class Setup:
    """A one-layer pool holding one request per context length, their pages in random order."""

    def __init__(
        self, ctx_lens: list[int], page_size: int, dtype: torch.dtype, kv_heads: int = KV_HEADS
    ) -> None:
        device = torch.device("cuda")
        pages_per_req = [-(-n // page_size) for n in ctx_lens]
        num_pages = sum(pages_per_req)
        self.pool = KVPool(1, num_pages, page_size, kv_heads, HEAD_DIM, dtype, device)
        for cache in (self.pool.k_cache(0), self.pool.v_cache(0)):
            cache.normal_()
        width = max(pages_per_req) * page_size
        self.page_table = torch.zeros((len(ctx_lens), width), dtype=torch.int32, device=device)
        pages = torch.randperm(num_pages, device=device).split(pages_per_req)
        offsets = torch.arange(width, device=device) % page_size
        for row, req_pages in enumerate(pages):
            locs = (
                req_pages.repeat_interleave(page_size) * page_size
                + offsets[: len(req_pages) * page_size]
            )
            self.page_table[row, : locs.numel()] = locs.int()
        self.ctx_lens = ctx_lens

    @property
    def bs(self) -> int:
        return len(self.ctx_lens)

    def batch(self, extend_lens: list[int]) -> tuple[Batch, BatchInputs]:
        """Request i computes its last extend_lens[i] tokens: the plan and its device inputs."""
        reqs = [Req(i, [0], SamplingParams(), seed=0, slot=i) for i in range(self.bs)]
        prefix_lens = [n - e for n, e in zip(self.ctx_lens, extend_lens, strict=True)]
        width = self.page_table.shape[1]
        layout = EngineLayout(1, 1, self.bs, width, width, width, 1)  # the sink row: unused
        plan = build_batch(reqs, prefix_lens, extend_lens, layout)
        return plan, upload(plan.inputs, self.page_table.device)

    def kernel_args(self, inputs: BatchInputs) -> tuple[torch.Tensor, ...]:
        """The pool and per-request arguments both attention kernels take after q."""
        return (
            self.pool.k_cache(0),
            self.pool.v_cache(0),
            self.page_table,
            inputs.slots,
            inputs.seq_lens,
        )

    def backend(self, name: str) -> AttentionBackend:
        return ATTENTION_BACKENDS.get(name)(self.pool, self.page_table)


def copy_bandwidth() -> float:
    """Bytes read + written per second by a 1 GiB device copy (median of event-timed runs)."""
    src = torch.ones(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / (do_bench(lambda: dst.copy_(src), return_mode="median") * 1e-3)


def check_against_torch(setup: Setup, plan: Batch, inputs: BatchInputs, q: torch.Tensor) -> None:
    outputs = []
    for name in ("torch", "triton"):
        backend = setup.backend(name)
        # the pool already holds every key: no token's KV is written here
        batch = ForwardBatch(
            plan.is_decode, inputs, inputs.positions, backend, backend.prepare(plan)
        )
        outputs.append(backend.forward(q, 0, batch).float())
    error = (outputs[0] - outputs[1]).abs().max().item()
    assert error < TOLERANCE[q.dtype], f"bs {setup.bs}: max error {error}"


def bench_decode(
    setup: Setup, dtype: torch.dtype, copy_bw: float, splits: int | None = None
) -> list[str]:
    plan, inputs = setup.batch([1] * setup.bs)
    q = torch.randn(setup.bs, QO_HEADS, HEAD_DIM, dtype=dtype, device="cuda")
    check_against_torch(setup, plan, inputs, q)
    splits = splits or decode_num_splits(setup.bs, KV_HEADS, num_sms(q.device))
    args = setup.kernel_args(inputs)
    counters = torch.zeros(setup.bs * KV_HEADS, dtype=torch.int32, device="cuda")
    order = inputs.longest_first
    seconds = do_bench_cudagraph(lambda: decode_attention(q, *args, splits, counters, order)) * 1e-3
    bytes_per_s = 2 * sum(setup.ctx_lens) * KV_HEADS * HEAD_DIM * dtype.itemsize / seconds
    return [
        str(splits),
        f"{seconds * 1e6:.1f}",
        f"{bytes_per_s / 1e9:.0f} GB/s",
        f"{bytes_per_s / copy_bw:.0%}",
    ]


def bench_extend(
    setup: Setup, dtype: torch.dtype, whole: bool = False, request_order: bool = False
) -> list[str]:
    """A quarter of the shortest context is new in each, after a cached prefix (whole: every
    token new). request_order: the q blocks in request order, not most keys first."""
    extend_lens = list(setup.ctx_lens) if whole else [min(setup.ctx_lens) // 4] * setup.bs
    plan, inputs = setup.batch(extend_lens)
    q = torch.randn(plan.num_tokens, QO_HEADS, HEAD_DIM, dtype=dtype, device="cuda")
    check_against_torch(setup, plan, inputs, q)
    meta = setup.backend("triton").prepare(plan)
    block_req, block_start = meta.block_req, meta.block_start
    if request_order:
        order = torch.argsort(block_req.long() * (1 << 32) + block_start.long())
        block_req, block_start = block_req[order], block_start[order]
    args = setup.kernel_args(inputs)
    blocks = (inputs.cu_seqlens_q, block_req, block_start)
    seconds = do_bench_cudagraph(lambda: extend_attention(q, *args, *blocks)) * 1e-3
    keys_seen = sum(
        e * (n - e) + e * (e + 1) // 2 for n, e in zip(setup.ctx_lens, extend_lens, strict=True)
    )
    flops = 4 * QO_HEADS * HEAD_DIM * keys_seen  # QK^T and PV: 2 flops per multiply-add each
    return ["-", f"{seconds * 1e6:.1f}", f"{flops / seconds / 1e12:.1f} TFLOP/s", "-"]


def compare_extend_orders(
    dtype: torch.dtype, page_size: int, row: Callable[[list[str]], None]
) -> None:
    """Whole prompts new, each launch in both block orders: one 8k prompt (the prefill row of
    issue 27) and 16 ragged ones."""
    rng = random.Random(0)
    for name, ctx_lens in (
        ("8192", [8192]),
        ("256-2048", [rng.randint(256, 2048) for _ in range(16)]),
    ):
        setup = Setup(ctx_lens, page_size, dtype)
        for request_order, kernel in ((False, "extend"), (True, "ext-req")):
            cells = bench_extend(setup, dtype, whole=True, request_order=request_order)
            row([kernel, str(setup.bs), name, *cells])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument(
        "--extend-orders", action="store_true", help="only extend attention's two block orders"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_attention: no CUDA device, nothing to measure (the kernels need a GPU)")
        return
    dtype = getattr(torch, args.dtype)
    widths = [7, 5, 10, 7, 10, 16, 8]
    row = lambda cells: print("".join(f"{c:>{w}}" for c, w in zip(cells, widths, strict=True)))
    print(f"{args.dtype}, page size {args.page_size}")
    row(["kernel", "bs", "ctx", "splits", "us", "achieved", "of copy"])
    compare_extend_orders(dtype, args.page_size, row)
    if args.extend_orders:
        return
    copy_bw = copy_bandwidth()
    print(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s")
    for bs in BATCH_SIZES:
        for ctx in CONTEXTS:
            setup = Setup([ctx] * bs, args.page_size, dtype)
            row(["decode", str(bs), str(ctx), *bench_decode(setup, dtype, copy_bw)])
            row(["extend", str(bs), str(ctx), *bench_extend(setup, dtype)])
    rng = random.Random(0)
    for bs in (64, 256):
        setup = Setup([rng.randint(100, 2048) for _ in range(bs)], args.page_size, dtype)
        row(["decode", str(bs), "100-2048", *bench_decode(setup, dtype, copy_bw)])  # default
        for splits in RAGGED_SPLITS:
            row(["decode", str(bs), "100-2048", *bench_decode(setup, dtype, copy_bw, splits)])


if __name__ == "__main__":
    main()
