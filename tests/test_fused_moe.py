"""The fused Triton MoE (minisgl.kernel.triton.fused_moe) against the torch backend, the reference:
the grouping by expert on its own, then the GEMV path of a few tokens and the grouped GEMM at
each tile the engine launches. On CPU in Triton's interpreter (conftest sets TRITON_INTERPRET=1)
at small sizes, in fp32 and fp16; on CUDA in bf16 too."""

import pytest
import torch

from minisgl.kernel import torch_ops
from minisgl.kernel.triton.fused_moe import (
    _GEMV_MAX_TOKENS,
    _GROUPED_TILES,
    _LARGE_TILE,
    MoETile,
    gemv_moe,
    grouped_moe,
)
from minisgl.kernel.triton.gemv import GemvConfig
from minisgl.kernel.triton.moe_align import align_by_expert, max_blocks
from minisgl.kernel.triton.moe_route import moe_route
from minisgl.moe.base import Routing
from minisgl.moe.torch_backend import TorchMoE

from .conftest import DEVICE

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
# the kernels sum in fp32 and round where the reference rounds, but in another order
TOL = {torch.float32: (2e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}
HIDDEN, INTER = 32, 48
SMALLEST = _GROUPED_TILES[0][1]
GROUPED_TILES = [tile for _, tile in _GROUPED_TILES] + [_LARGE_TILE]


def make_routing(tokens: int, experts: int, top_k: int, used: int | None = None) -> Routing:
    """A softmax top-k over random logits; only the first `used` experts can be chosen."""
    logits = torch.randn(tokens, experts, device=DEVICE)
    if used is not None:
        logits[:, used:] = float("-inf")
    return Routing(*torch_ops.moe_route(logits, top_k, renormalize=True))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize(
    ("tokens", "experts", "top_k"), [(1, 4, 1), (1, 128, 8), (5, 8, 2), (3, 60, 8), (2, 128, 8)]
)
def test_fused_router_chooses_the_experts_torch_chooses(
    tokens: int, experts: int, top_k: int, renormalize: bool, dtype: torch.dtype
) -> None:
    """One token on a Hopper: also warming the chosen experts' gate/up rows into L2."""
    torch.manual_seed(experts)
    logits = (3 * torch.randn(tokens, experts, device=DEVICE)).to(dtype)
    want_weights, want_ids = torch_ops.moe_route(logits, top_k, renormalize)
    gate_up = torch.zeros(experts, 2 * INTER, HIDDEN, dtype=dtype, device=DEVICE)
    weights, ids = moe_route(logits, top_k, renormalize, warm=gate_up)
    # the same k largest logits in the same order; experts of equal logits (bf16 has few values)
    # may come in either order, as torch's CUDA top-k leaves them
    assert torch.equal(logits.gather(1, ids), logits.gather(1, want_ids))
    assert all(len(set(row)) == top_k for row in ids.tolist())
    assert weights.dtype == dtype
    torch.testing.assert_close(weights, want_weights, rtol=TOL[dtype][0], atol=TOL[dtype][1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_router_takes_the_lower_id_among_equal_probabilities(dtype: torch.dtype) -> None:
    """Row 0 all equal; row 1 ties at its top: experts 5 and 2 share the largest logit, and 7
    and 1 the next."""
    logits = torch.zeros(2, 8, device=DEVICE)
    logits[1, [5, 2]], logits[1, [7, 1]] = 3.0, 1.0
    weights, ids = moe_route(logits.to(dtype), 3, renormalize=False)
    assert ids.tolist() == [[0, 1, 2], [2, 5, 1]]
    assert torch.equal(weights[0], torch.full((3,), 1 / 8, device=DEVICE).to(dtype))


@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "used", "block_m"),
    [(1, 4, 1, None, 16), (3, 8, 2, None, 16), (40, 8, 2, 3, 16), (33, 16, 8, None, 16),
     (20, 4, 4, None, 64), (7, 128, 8, None, 32)],
)  # fmt: skip
def test_align_puts_every_pair_once_in_blocks_of_its_expert(
    tokens: int, experts: int, top_k: int, used: int | None, block_m: int
) -> None:
    torch.manual_seed(tokens)
    ids = make_routing(tokens, experts, top_k, used).ids
    pairs = ids.numel()
    blocks = align_by_expert(ids, experts, block_m)
    assert blocks.slots.numel() == max_blocks(pairs, experts, block_m) * block_m
    n = int(blocks.num_blocks.item())
    rows = blocks.slots.view(-1, block_m).long().cpu()
    expert = blocks.expert.long().cpu()
    counts = torch.bincount(ids.flatten().cpu(), minlength=experts)
    assert n == int((-(-counts // block_m)).sum())
    assert (rows[n:] == pairs).all() and (expert[n:] == experts).all()  # unused blocks
    valid = rows[:n]
    assert sorted(valid[valid < pairs].tolist()) == list(range(pairs))  # each pair once
    flat_ids = ids.flatten().cpu()
    for b in range(n):
        row = valid[b]
        real = row[row < pairs]
        assert (flat_ids[real] == expert[b]).all()
        # padding only after an expert's pairs, in its last block
        assert (row[: len(real)] == real).all()
        assert len(real) == block_m or b == n - 1 or expert[b + 1] != expert[b]
    assert (expert[:n].diff() >= 0).all()  # expert by expert


def run_both(
    tokens: int, experts: int, top_k: int, dtype: torch.dtype, tile: MoETile | None,
    used: int | None = None, inter: int = INTER,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The fused MoE's output (the GEMVs, or the grouped GEMM with `tile`), the torch backend's,
    and the routing's expert ids."""
    torch.manual_seed(tokens * 1000 + experts)
    x = torch.randn(tokens, HIDDEN, device=DEVICE).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, HIDDEN, device=DEVICE) / HIDDEN**0.5).to(dtype)
    w2 = (torch.randn(experts, HIDDEN, inter, device=DEVICE) / inter**0.5).to(dtype)
    weights, ids = make_routing(tokens, experts, top_k, used)
    routing = Routing(weights.to(dtype), ids)
    want = TorchMoE().forward(x, w13, w2, routing)
    if tile is None:
        return gemv_moe(x, w13, w2, routing.weights, ids), want, ids
    return grouped_moe(x, w13, w2, routing.weights, ids, tile), want, ids


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOL[dtype]
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("tokens", "experts", "top_k"),
    [(1, 4, 1), (1, 8, 4), (3, 8, 2), (2, 8, 8), (_GEMV_MAX_TOKENS, 16, 2)],
)
def test_gemv_path_of_a_few_tokens_equals_torch(
    tokens: int, experts: int, top_k: int, dtype: torch.dtype
) -> None:
    """inter 18: a partial last block of features and of K (a program per pair and 4 features);
    one token of top-4: the down kernel's first experts as a block (fused_moe._EARLY_EXPERTS)."""
    got, want, _ = run_both(tokens, experts, top_k, dtype, tile=None, inter=18)
    assert_close(got, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("down", [GemvConfig(2, 16, 4), GemvConfig(1, 64, 1)])
def test_gemv_down_kernel_over_k_tiles_and_an_odd_top_k(down: GemvConfig, dtype: torch.dtype):
    """inter 40: the down kernel's rows over three tiles of 16 (the last partial), or in one of
    64; top-3: an expert count that is no power of 2."""
    torch.manual_seed(3)
    x = torch.randn(2, HIDDEN, device=DEVICE).to(dtype)
    w13 = (torch.randn(8, 2 * 40, HIDDEN, device=DEVICE) / HIDDEN**0.5).to(dtype)
    w2 = (torch.randn(8, HIDDEN, 40, device=DEVICE) / 40**0.5).to(dtype)
    weights, ids = make_routing(2, 8, 3)
    routing = Routing(weights.to(dtype), ids)
    want = TorchMoE().forward(x, w13, w2, routing)
    assert_close(gemv_moe(x, w13, w2, routing.weights, ids, down=down), want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "used"),
    [(1, 4, 1, None), (5, 8, 2, None), (40, 8, 2, 3), (33, 16, 8, None)],
    ids=["one-token", "experts-without-tokens", "blocks-cross-16", "top-8"],
)
def test_grouped_gemm_equals_torch(
    tokens: int, experts: int, top_k: int, used: int | None, dtype: torch.dtype
) -> None:
    got, want, ids = run_both(tokens, experts, top_k, dtype, SMALLEST, used)
    assert_close(got, want, dtype)
    if used is not None:  # the case's point: experts without a token, and one over two blocks
        counts = torch.bincount(ids.flatten().cpu(), minlength=experts)
        assert (counts == 0).any() and counts.max() > SMALLEST.block_m


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tile", GROUPED_TILES, ids=lambda t: f"block_m-{t.block_m}")
def test_every_grouped_tile_equals_torch(tile: MoETile, dtype: torch.dtype) -> None:
    """inter 16: fewer features than one tile's columns."""
    got, want, _ = run_both(12, 8, 2, dtype, tile, inter=16)
    assert_close(got, want, dtype)
