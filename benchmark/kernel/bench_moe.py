"""The fused Triton MoE (minisgl.kernel.triton.fused_moe) next to the torch backend and the device's
copy bandwidth, at Qwen3-30B-A3B's sparse layer (128 experts of intermediate 768, hidden 2048,
top-8, bf16), by token count. The figure is GB/s of the selected experts' weights: the experts
that some token of the batch chose, each counted once, as the floor of bench.py counts them.

Each measurement runs LAYERS layers, each with its own weights and random routing, so that the
weights stream from HBM and not from L2. The Triton MoE runs inside a CUDA graph, as a decode step
runs it; the torch backend reads the host each layer and cannot, so it runs eagerly. At a few
tokens both Triton paths are timed (the GEMVs, and the grouped GEMM with its grouping alone too):
where the GEMVs stop paying is fused_moe's _GEMV_MAX_TOKENS.

    python benchmark/kernel/bench_moe.py            # H200
    python benchmark/kernel/bench_moe.py --json out.json
    python benchmark/kernel/bench_moe.py --sweep      # the GEMV path's tiles at one token
"""

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from bench_attention import copy_bandwidth
from triton.testing import do_bench, do_bench_cudagraph

from minisgl.kernel import moe_route
from minisgl.kernel.triton.fused_moe import (
    DEFAULT_GEMV_TILES,
    fused_moe,
    gemv_moe,
    grouped_moe,
    grouped_tile,
)
from minisgl.kernel.triton.gemv import GemvConfig
from minisgl.kernel.triton.moe_align import align_by_expert
from minisgl.moe.base import Routing
from minisgl.moe.torch_backend import TorchMoE

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "offline"))
from common import write_json  # with the provenance every result records

EXPERTS, HIDDEN, INTER, TOP_K = 128, 2048, 768, 8
LAYERS = 8  # 9.7 GB of experts
TOKENS = (1, 2, 4, 8, 16, 64, 256, 1024)
FEW = 16  # up to this many tokens, both Triton paths are timed
TOLERANCE = 0.02  # of the reference's largest magnitude (bf16)


def layer_weights(dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [
        (
            torch.randn(EXPERTS, 2 * INTER, HIDDEN, dtype=dtype, device="cuda") / HIDDEN**0.5,
            torch.randn(EXPERTS, HIDDEN, INTER, dtype=dtype, device="cuda") / INTER**0.5,
        )
        for _ in range(LAYERS)
    ]


def torch_moe(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    return TorchMoE().forward(x, w13, w2, Routing(weights, ids))


def selected_bytes(routings: list[Routing], dtype: torch.dtype) -> int:
    """Bytes of the experts the routings select, each expert of each layer once."""
    distinct = sum(len(torch.unique(r.ids)) for r in routings)
    return distinct * 3 * INTER * HIDDEN * dtype.itemsize


def measure(
    tokens: int, weights: list[tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype
) -> list[tuple[str, float, int | None]]:
    """(kernel, microseconds for all layers, bytes of the selected experts or None for a part
    that reads none) at this token count, after checking the Triton MoE against torch's."""
    x = torch.randn(tokens, HIDDEN, dtype=dtype, device="cuda")
    routings = []
    for _ in range(LAYERS):
        probs, ids = moe_route(torch.randn(tokens, EXPERTS, device="cuda"), TOP_K, True)
        routings.append(Routing(probs.to(dtype), ids))
    nbytes = selected_bytes(routings, dtype)
    want = torch_moe(x, *weights[0], *routings[0]).float()
    error = (fused_moe(x, *weights[0], *routings[0]).float() - want).abs().max().item()
    assert error <= TOLERANCE * want.abs().max().item(), f"{tokens} tokens: error {error}"

    def us(moe: Callable[..., torch.Tensor], bench: Callable = do_bench_cudagraph) -> float:
        layers = list(zip(weights, routings, strict=True))
        return bench(lambda: [moe(x, *w, *r) for w, r in layers]) * 1e3

    rows = [
        ("torch (eager)", us(torch_moe, do_bench), nbytes),
        ("triton (graph)", us(fused_moe), nbytes),
    ]
    if tokens <= FEW:
        tile = grouped_tile(tokens * TOP_K, EXPERTS)
        align = lambda: [align_by_expert(r.ids, EXPERTS, tile.block_m) for r in routings]
        rows += [
            ("triton gemv (graph)", us(gemv_moe), nbytes),
            (f"triton grouped, block_m {tile.block_m} (graph)",
             us(lambda *a: grouped_moe(*a, tile)), nbytes),
            ("  of which the grouping", do_bench_cudagraph(align) * 1e3, None),
        ]  # fmt: skip
    return rows


def sweep(weights: list[tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype) -> list[dict]:
    """The GEMV path at one token, each kernel's tile varied with the other's at its default:
    microseconds a layer of the pair, and GB/s of the experts' bytes (the k chosen, 3 matrices)."""
    x = torch.randn(1, HIDDEN, dtype=dtype, device="cuda")
    routings = []
    for _ in range(LAYERS):
        probs, ids = moe_route(torch.randn(1, EXPERTS, device="cuda"), TOP_K, True)
        routings.append(Routing(probs.to(dtype), ids))
    nbytes = selected_bytes(routings, dtype)
    default_gate_up, default_down = DEFAULT_GEMV_TILES
    gate_ups = [
        GemvConfig(n, k, w)
        for n in (2, 4, 8, 16)
        for k in (256, 512, 1024, 2048)
        for w in (2, 4, 8)
    ]
    downs = [
        GemvConfig(n, k, w) for n in (2, 4, 8, 16) for k in (128, 256, 512, 1024) for w in (2, 4, 8)
    ]
    trials = [("gate_up", t, t, default_down) for t in gate_ups]
    trials += [("down", t, default_gate_up, t) for t in downs]
    layers = list(zip(weights, routings, strict=True))

    def run(gate_up: GemvConfig, down: GemvConfig) -> list[torch.Tensor]:
        return [gemv_moe(x, *w, *r, gate_up=gate_up, down=down) for w, r in layers]

    results = []
    for kernel, tile, gate_up, down in trials:
        us = do_bench_cudagraph(lambda: run(gate_up, down)) * 1e3 / LAYERS  # noqa: B023 (called now)
        results.append({"kernel": kernel, "tile": list(tile), "us_per_layer": us,
                        "GB/s": nbytes / LAYERS / us / 1e3})  # fmt: skip
        print(
            f"sweep {kernel:>8} {tile!s:>44} {us:>7.1f} us/layer {results[-1]['GB/s']:>6.0f} GB/s"
        )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    parser.add_argument("--json", help="also write every measurement here")
    parser.add_argument("--sweep", action="store_true", help="the GEMV tiles at one token first")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_moe: no CUDA device, nothing to measure (the kernels need a GPU)")
        return
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    copy_bw = copy_bandwidth()
    weights = layer_weights(dtype)
    print(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s; {args.dtype}; {LAYERS} layers")
    results: list[dict] = sweep(weights, dtype) if args.sweep else []
    for tokens in args.tokens:
        for kernel, us, nbytes in measure(tokens, weights, dtype):
            gbs = None if nbytes is None else nbytes / us / 1e3
            results.append({"tokens": tokens, "kernel": kernel, "us_per_layer": us / LAYERS,
                            "GB/s": gbs})  # fmt: skip
            share = "" if gbs is None else f"{gbs:>7.0f} GB/s {gbs * 1e9 / copy_bw:>5.0%}"
            print(f"{tokens:>5} {kernel:>34} {us / LAYERS:>9.1f} us/layer {share}")
    if args.json:
        write_json(args.json, {"measurements": results})


if __name__ == "__main__":
    main()
