"""Programmatic dependent launch (PDL, Hopper and newer): the GPU starts a kernel while the one
before it in the stream is still finishing, instead of after it has drained. A decode step of a
small batch is ~300 kernels of a few microseconds each, so the launch and ramp-up gaps between
them are a large share of the step.

    kernel i:    [ ... work ... | tail ]
    kernel i+1:            [ weights | wait ....... | work ... ]

The rule every kernel here keeps, which makes this safe: before `wait_for_previous` it reads
nothing but weights (never written during a forward) and writes nothing; after it, it sees every
write of the kernel before. The next kernel may launch once every program has passed the wait.
Kernels not launched with PDL (torch's, cuBLAS's) wait for the whole previous kernel as usual.

MINISGL_PDL=0 turns it off (for ablation).
"""

import functools
import os

import torch
import triton
import triton.language as tl


@functools.cache
def use_pdl(device: torch.device) -> bool:
    return (
        device.type == "cuda"
        and os.environ.get("MINISGL_PDL", "1") != "0"
        and os.environ.get("TRITON_INTERPRET", "0") != "1"
        and torch.cuda.get_device_capability(device)[0] >= 9
    )


def pdl_args(device: torch.device) -> dict[str, bool]:
    """Keyword arguments for a kernel launch: the USE_PDL constexpr, and Triton's launch flag."""
    return {"USE_PDL": True, "launch_pdl": True} if use_pdl(device) else {"USE_PDL": False}


@triton.jit
def wait_for_previous(USE_PDL: tl.constexpr):
    """Wait until the previous kernel's writes are visible, then let the next kernel launch."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
