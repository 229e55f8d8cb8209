"""Programmatic dependent launch (PDL, Hopper and newer): the GPU starts a kernel while the one
before it in the stream is still finishing, instead of after it has drained. A decode step of a
small batch is ~300 kernels of a few microseconds each, so the launch and ramp-up gaps between
them are a large share of the step.

    kernel i:    [ ... work ... | tail ]
    kernel i+1:            [ weights | wait ....... | work ... ]

The rule every kernel here keeps, which makes this safe: before `wait_for_previous` it writes
nothing and reads nothing but weights, the step's inputs, and what kernels two or more back
wrote. Those have finished: a kernel that ends in `wait_for_previous` lets this one launch only
once each of its programs has passed its own wait, and that wait returns once the kernel before
it has finished. After a kernel that uses `launch_next_then_wait` instead (below), that no longer
holds, so its successor reads only weights and inputs before its wait. After the wait, a kernel
sees every write of the kernel before.

The inputs (positions, seq_lens, the page table, the K/V of earlier steps) are written by copies
and by kernels not launched with PDL (torch's, and `read_tables`, which applies the step's table
writes): the forward's first PDL kernel waits for them to finish, and every later one launches
after it. Kernels not launched with PDL (torch's, cuBLAS's) wait for the whole previous kernel as
usual.

The next kernel may launch once every program has passed the wait (`wait_for_previous`), or, for a
kernel whose successor reads much before its own wait, as soon as every program has started
(`launch_next_then_wait`): RoPE of a small batch lets decode attention prefetch its keys while
RoPE runs.

MINISGL_PDL=0 turns it off (for ablation).
"""

import functools
import os

import torch
import triton
import triton.language as tl


@functools.cache
def runs_hopper_ptx(device: torch.device) -> bool:
    """Whether kernels on `device` may use Hopper's (sm_90) instructions: a CUDA device of compute
    capability 9 or more, outside the interpreter (which runs no PTX)."""
    return (
        device.type == "cuda"
        and os.environ.get("TRITON_INTERPRET", "0") != "1"
        and torch.cuda.get_device_capability(device)[0] >= 9
    )


@functools.cache
def use_pdl(device: torch.device) -> bool:
    return runs_hopper_ptx(device) and os.environ.get("MINISGL_PDL", "1") != "0"


def pdl_args(device: torch.device) -> dict[str, bool]:
    """Keyword arguments for a kernel launch: the USE_PDL constexpr, and Triton's launch flag."""
    return {"USE_PDL": True, "launch_pdl": True} if use_pdl(device) else {"USE_PDL": False}


@triton.jit
def wait_for_previous(USE_PDL: tl.constexpr):
    """Wait until the previous kernel's writes are visible, then let the next kernel launch."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def launch_next_then_wait(USE_PDL: tl.constexpr):
    """Let the next kernel launch now, then wait until the previous kernel's writes are visible:
    the next kernel's work before its own wait overlaps this whole kernel."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
