"""A step's table writes and reads in one kernel of one program: the writes, a barrier, then the
reads, which therefore see them. Four torch kernels otherwise (two scatters, two gathers); a decode
step touches a few hundred entries, far too few for more than one program to pay."""

import torch
import triton
import triton.language as tl

from ..torch_ops import DeviceWrites

_BLOCK = 1024


@triton.jit
def _write(table_ptr, entries_ptr, values_ptr, num_writes, BLOCK: tl.constexpr):
    for start in range(0, num_writes, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < num_writes
        entries = tl.load(entries_ptr + offs, mask=mask)
        tl.store(table_ptr + entries, tl.load(values_ptr + offs, mask=mask), mask=mask)


# the counts vary step to step: a variant compiled per count being 1 or a multiple of 16 would
# show up as compiles inside a run (the offline benchmark's with 16,384-token prefill chunks did)
@triton.jit(do_not_specialize=["num_page_writes", "num_token_writes", "num_tokens"])
def _read_tables_kernel(
    page_table_ptr, token_table_ptr,
    page_entries_w_ptr, page_values_ptr, num_page_writes,
    token_entries_w_ptr, token_values_ptr, num_token_writes,
    token_entries_ptr, page_entries_ptr, input_ids_ptr, out_loc_ptr, num_tokens,
    BLOCK: tl.constexpr,
):  # fmt: skip
    _write(page_table_ptr, page_entries_w_ptr, page_values_ptr, num_page_writes, BLOCK)
    _write(token_table_ptr, token_entries_w_ptr, token_values_ptr, num_token_writes, BLOCK)
    tl.debug_barrier()  # every thread's writes are visible to the whole program after it
    for start in range(0, num_tokens, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < num_tokens
        token_entries = tl.load(token_entries_ptr + offs, mask=mask)
        tl.store(input_ids_ptr + offs, tl.load(token_table_ptr + token_entries, mask=mask), mask)
        page_entries = tl.load(page_entries_ptr + offs, mask=mask)
        tl.store(out_loc_ptr + offs, tl.load(page_table_ptr + page_entries, mask=mask), mask)


def read_tables(
    page_table: torch.Tensor,
    token_table: torch.Tensor,
    page_writes: DeviceWrites,
    token_writes: DeviceWrites,
    token_entries: torch.Tensor,
    page_entries: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same as torch_ops.read_tables. Not launched with PDL: the kernels after it may read the
    tables before their wait (pdl.py), so it must have finished before they start."""
    num_tokens = token_entries.shape[0]
    input_ids, out_loc = (torch.empty_like(token_entries) for _ in range(2))
    # an empty view may point just past its buffer, a pointer Triton refuses: any int32 tensor
    # does then, as nothing is read from it
    no_writes = (token_entries, token_entries)
    page_entries_w, page_values = page_writes if len(page_writes[1]) else no_writes
    token_entries_w, token_values = token_writes if len(token_writes[1]) else no_writes
    _read_tables_kernel[(1,)](
        page_table, token_table,
        page_entries_w, page_values, len(page_writes[1]),
        token_entries_w, token_values, len(token_writes[1]),
        token_entries, page_entries, input_ids, out_loc, num_tokens,
        BLOCK=_BLOCK, num_warps=4,
    )  # fmt: skip
    return input_ids, out_loc
