"""Compile every Triton kernel for an H100/H200 (sm_90) without a GPU: run as a script, in a process
without TRITON_INTERPRET, it calls each host wrapper with small CPU tensors, in each of the
variants the engine launches, and where a GPU would launch the kernel it compiles it instead.

The interpreter runs kernels as Python and accepts code that the compiler rejects (a variable
retyped in a branch), so the CPU tests alone would not catch that; the compiler's front end and
ptxas run here as they would on the GPU. Prints one line per compiled variant, then the count.
"""

import inspect
import os

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction, mangle_type

HOPPER = GPUTarget("cuda", 90, 32)
compiled: set[str] = set()


def compile_instead_of_launching(
    kernel: JITFunction, *args: object, grid: object, warmup: bool, **kwargs: object
) -> None:
    options = {name: kwargs.pop(name) for name in ("num_warps", "num_stages") if name in kwargs}
    kwargs.pop("launch_pdl", None)
    bound = inspect.signature(kernel.fn).bind(*args, **kwargs)
    bound.apply_defaults()
    signature, constexprs = {}, {}
    for param in kernel.params:
        value = bound.arguments[param.name]
        if param.is_constexpr:
            # the GPU path: CPU tensors turn PDL off, but an H200 launches every kernel with it
            constexprs[param.name] = True if param.name == "USE_PDL" else value
            signature[param.name] = "constexpr"
        else:
            signature[param.name] = mangle_type(value)
    # a weight warmed into L2 (l2_warm.py) needs a Hopper, so the CPU passes WARM off: both ways
    variants = [constexprs]
    if constexprs.get("WARM") is False:
        variants.append({**constexprs, "WARM": True})
    for variant in variants:
        key = f"{kernel.fn.__name__} {sorted(variant.items())} {sorted(options.items())}"
        if key not in compiled:
            triton.compile(ASTSource(kernel, signature, variant), target=HOPPER, options=options)
            compiled.add(key)
            print(key)


def call_every_wrapper() -> None:
    from minisgl.kernel import KVStore
    from minisgl.kernel import triton as ops

    bf16, i32 = torch.bfloat16, torch.int32
    hidden, head_dim, q_heads, kv_heads = 1024, 128, 4, 2  # the Qwen3-0.6B tiles

    def ints(n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=i32)

    def x(*shape: int) -> torch.Tensor:
        return torch.zeros(*shape, dtype=bf16)

    pages, width = 64, 32
    k_cache, v_cache = x(pages, kv_heads, head_dim), x(pages, kv_heads, head_dim)
    page_table = torch.zeros(8, width, dtype=i32)
    cos_sin = torch.zeros(pages, head_dim)
    for bs in (1, 20):  # decode attention prefetches, and RoPE launches it early, up to 16
        qkv = x(bs, (q_heads + 2 * kv_heads) * head_dim)
        q, k, v = qkv.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
        store = KVStore(k_cache, v_cache, ints(bs), v)
        ops.apply_rope_inplace(
            ints(bs), q, k, head_dim, cos_sin, (x(head_dim), x(head_dim), 1e-6), store
        )
        q3 = q.reshape(bs, q_heads, head_dim)
        ops.decode_attention(
            q3, k_cache, v_cache, page_table, ints(bs), ints(bs), 4, ints(64), ints(bs)
        )
    one_head = ops.DecodeLaunch(64, heads=1)  # a program per query head (one request's rule)
    ops.decode_attention(
        x(1, q_heads, head_dim), k_cache, v_cache, page_table, ints(1), ints(1), 4, ints(64),
        None, one_head,
    )  # fmt: skip
    ops.apply_rope_inplace(
        ints(3), x(3, q_heads * head_dim), x(3, kv_heads * head_dim), head_dim, cos_sin
    )
    block_req, block_start = (
        torch.tensor(t, dtype=i32) for t in ops.extend_blocks([0, 0], [5, 70])
    )
    cu_seqlens = torch.tensor([0, 5, 75], dtype=i32)
    ops.extend_attention(
        x(75, q_heads, head_dim), k_cache, v_cache, page_table, ints(2), ints(2), cu_seqlens,
        block_req, block_start,
    )  # fmt: skip

    norm = ops.Prologue(x(hidden), 1e-6)
    with_residual = ops.Prologue(x(hidden), 1e-6, x(1, hidden), x(1, hidden))
    keeping_normed = with_residual._replace(normed_out=x(1, hidden))  # a MoE layer's router
    ops.linear(x(1, hidden), x(1, hidden).expand(128, hidden), prologue=keeping_normed)
    for n, k in ((4096, hidden), (hidden, 2048), (hidden, 3072), (70000, hidden)):
        weight = x(1, k).expand(n, k)  # stride 0 along n: the shape without the bytes
        ops.linear(x(1, k), weight)
        if k == hidden:
            ops.linear(x(1, k), weight, prologue=norm)
            ops.linear(x(1, k), weight, prologue=with_residual)
    ops.linear(x(2, 2048), x(1, 2048).expand(hidden, 2048))
    # Qwen3-30B-A3B's QKV projection after the norm and its o_proj: tiles of their own
    ops.linear(x(1, 2048), x(1, 2048).expand(5120, 2048), prologue=ops.Prologue(x(2048), 1e-6))
    ops.linear(x(1, 4096), x(1, 4096).expand(2048, 4096))
    ops.linear(x(1, hidden), x(1, hidden).expand(1024, hidden), x(1024))
    ops.linear(x(1, hidden), x(1, hidden).expand(1024, hidden), prologue=with_residual, gated=True)

    ops.rmsnorm(x(3, hidden), x(hidden), 1e-6)
    ops.fused_add_rmsnorm(x(3, hidden), x(3, hidden), x(hidden), 1e-6)
    ops.fused_add_rmsnorm(x(4, 3, hidden), x(3, hidden), x(hidden), 1e-6)
    ops.silu_and_mul(x(3, 2 * hidden))
    logits = x(2, 151936)
    ops.sample_tokens(logits, ints(64), ints(2), ints(2), host_table=ints(64))
    sampling = (torch.ones(2), torch.full((2,), 0.5))
    ops.sample_tokens(logits, ints(64), ints(2), ints(2), *sampling, host_table=ints(64))
    for writes in ((ints(3), ints(3)), (ints(0), ints(0))):
        ops.read_tables(page_table, ints(64), writes, writes, ints(3), ints(3))

    from minisgl.kernel.triton.fused_moe import _GROUPED_TILES, _LARGE_TILE, grouped_moe

    experts, inter, top_k = 128, 768, 8  # Qwen3-30B-A3B's experts
    w13 = x(1, 1, hidden).expand(experts, 2 * inter, hidden)
    w2 = x(1, 1, inter).expand(experts, hidden, inter)
    ids = torch.zeros(64, top_k, dtype=torch.int64)
    ops.moe_route(x(64, experts), top_k, True)
    ops.fused_moe(x(1, hidden), w13, w2, x(1, top_k), ids[:1])  # the GEMVs
    for tile in [tile for _, tile in _GROUPED_TILES] + [_LARGE_TILE]:
        grouped_moe(x(64, hidden), w13, w2, x(64, top_k), ids, tile)
    # fp32 (the GPU tests' dtype) runs the FMA dot: its stages must fit shared memory too
    w13, w2 = (torch.zeros(1, 1, w.shape[2]).expand(w.shape) for w in (w13, w2))
    grouped_moe(torch.zeros(64, hidden), w13, w2, torch.zeros(64, top_k), ids, _LARGE_TILE)


if __name__ == "__main__":
    assert "TRITON_INTERPRET" not in os.environ, "the interpreter compiles nothing"
    JITFunction.run = compile_instead_of_launching  # type: ignore[method-assign]
    call_every_wrapper()
    print(f"compiled {len(compiled)} kernel variants for sm_90")
