"""Warming L2 with the weights of a later kernel, from a kernel that reads almost nothing.

At one request a MoE layer's router GEMV (0.5 MB) and its route kernel wait on latency, not
bandwidth, for ~4 us a layer, and the experts' gate/up GEMV can load nothing until the route has
chosen. Meanwhile:

- the router's GEMV pulls the next layer's QKV weights into L2, so the QKV GEMV reads them from
  cache;
- the route kernel pulls the first rows of each chosen expert's gate and up weights, so the
  gate/up GEMV's first loads find them on their way.

Each program issues one bulk prefetch of its share from one thread, which the SM's TMA unit runs
without holding the program's warps. Qwen3-30B-A3B at one request on an H100: 2.763 -> 2.726 ms
a step from the router's, 2.665-2.675 with the route's and the down kernel's early experts too
(benchmark/RESULTS.md, fifty-first session). Warming o_proj's weights from decode attention
(from all its programs, or only from those with no keys to read), from RoPE (its own two
programs, or 8 to 64 more), or from the QKV GEMV, or the next QKV from the experts' GEMVs, made
the step slower or gained nothing (forty-eighth, fifty-first and fifty-second sessions).
"""

import functools
import os

import torch
import triton
import triton.language as tl

from .pdl import runs_hopper_ptx


@functools.cache
def can_warm(device: torch.device) -> bool:
    """The bulk prefetch is Hopper's (sm_90). MINISGL_L2_WARM=0 turns warming off (for
    ablation)."""
    return runs_hopper_ptx(device) and os.environ.get("MINISGL_L2_WARM", "1") != "0"


def warm_args(weight: torch.Tensor | None, rows: int, stand_in: torch.Tensor) -> dict[str, object]:
    """A kernel's warm_ptr, warm_bytes and WARM: `weight` warmed at one row (where the kernel
    reads little) on a device that can; stand_in: any tensor, passed but never read."""
    if weight is None or rows != 1 or not can_warm(weight.device):
        return {"warm_ptr": stand_in, "warm_bytes": 0, "WARM": False}
    assert weight.is_contiguous()
    return {"warm_ptr": weight, "warm_bytes": weight.numel() * weight.element_size(), "WARM": True}


@triton.jit
def prefetch_l2(ptr, nbytes):
    """[ptr, ptr + nbytes) into L2: one cp.async.bulk.prefetch from thread 0 (nbytes: a multiple
    of 16, the copy's unit)."""
    tl.inline_asm_elementwise(
        "{ .reg .pred first; .reg .b32 tid; mov.u32 tid, %tid.x; "
        "setp.eq.u32 first, tid, 0; @first cp.async.bulk.prefetch.L2.global [$1], $2; "
        "mov.u32 $0, 0; }",
        "=r,l,r", [ptr.to(tl.pointer_type(tl.int8)), nbytes.to(tl.int32)],
        dtype=tl.int32, is_pure=False, pack=1,
    )  # fmt: skip


@triton.jit
def warm_l2(ptr, nbytes, WARM: tl.constexpr):
    """This program's share of [ptr, ptr + nbytes) into L2 (128-byte lines, the last share
    rounded down to a multiple of 16 bytes; a hint may fall short)."""
    if WARM:
        nbytes = nbytes.to(tl.int64)
        pid = tl.program_id(0) + tl.num_programs(0) * (
            tl.program_id(1) + tl.num_programs(1) * tl.program_id(2)
        )
        programs = tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)
        share = tl.cdiv(tl.cdiv(nbytes, programs), 128) * 128
        start = pid.to(tl.int64) * share
        size = tl.minimum(share, nbytes - start) // 16 * 16
        if size > 0:
            prefetch_l2(ptr.to(tl.pointer_type(tl.int8)) + start, size)
