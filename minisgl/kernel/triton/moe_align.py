"""The (token, slot) pairs of a routing, grouped by expert into blocks of BLOCK_M rows: the rows
the fused MoE's grouped GEMMs walk, one expert per block.

    ids [tokens, k] -> pair p = t * k + j chose expert ids[t, j]

    slots:   | e0 e0 e0 -- | e2 e2 e2 e2 | e2 -- -- -- | e5 -- -- -- | -- -- ... |
    expert:  |     0       |     2       |     2       |     5       |  E  ...   |
             '-- valid blocks (num_blocks) ---------------------------'-- unused --'

Each expert that got a pair owns ceil(count / BLOCK_M) blocks; its rows hold its pairs (in
token order) and then `pairs` (no pair) up to the block's end. Torch ops only, every shape fixed
by (tokens, k, experts, BLOCK_M) and none read back to the host, so a CUDA graph captures it:
the worst case, every pair of its own expert's padded block, sizes the buffers, and the kernels
read `num_blocks` on the device to skip the unused blocks.
"""

from typing import NamedTuple

import torch


class ExpertBlocks(NamedTuple):
    """slots: [max_blocks * block_m] int64, each row's pair or `pairs` for padding; expert:
    [max_blocks] int32, each block's expert (num_experts past the valid ones); num_blocks: [1]
    int64, how many blocks are valid. int64 where the sort's indices are: no casts."""

    slots: torch.Tensor
    expert: torch.Tensor
    num_blocks: torch.Tensor


def max_blocks(pairs: int, num_experts: int, block_m: int) -> int:
    """Blocks the worst case fills: every pair, plus a partial block's padding for each expert
    that can get a pair."""
    return -(-(pairs + min(pairs, num_experts) * (block_m - 1)) // block_m)


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """Group the pairs of ids [tokens, k] by expert, each expert's padded to whole blocks."""
    pairs, device = ids.numel(), ids.device
    experts, order = ids.flatten().sort(stable=True)
    # edges[e]: the first sorted row of expert e (edges[E] = pairs)
    edges = torch.searchsorted(
        experts, torch.arange(num_experts + 1, device=device, dtype=experts.dtype)
    )
    blocks = (edges.diff() + (block_m - 1)) // block_m
    block_ends = blocks.cumsum(0)
    # sorted row i of expert e goes to e's first padded row plus i's rank within e
    shift = (block_ends - blocks) * block_m - edges[:-1]
    rows = torch.arange(pairs, device=device) + shift[experts]
    n = max_blocks(pairs, num_experts, block_m)
    slots = torch.full((n * block_m,), pairs, dtype=order.dtype, device=device)
    slots.scatter_(0, rows, order)
    block_ids = torch.arange(n, device=device, dtype=block_ends.dtype)
    expert = torch.searchsorted(block_ends, block_ids, right=True, out_int32=True)
    return ExpertBlocks(slots, expert, block_ends[-1:])
