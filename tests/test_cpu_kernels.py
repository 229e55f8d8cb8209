"""The CPU's C++ kernels (`minisgl/kernel/cpp`) against the reference: decode attention over the
paged pool within rounding of SDPA's, RoPE with the K/V store bit for bit (with QK-norm, and
RMSNorm with the residual add, within a rounding of the mean; SiLU-and-mul within float
rounding); the C++ backend's greedy tokens equal to the torch backend's; what the kernels cannot
take goes to the reference; and where no compiler builds the kernels, the PyTorch path."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from minisgl import kernel
from minisgl.kernel import cpp, torch_ops
from minisgl.kernel.torch_ops import KVStore

from .conftest import DEVICE

pytestmark = [
    pytest.mark.skipif(DEVICE != "cpu", reason="the CPU's own kernels"),
    pytest.mark.skipif(not cpp.available(), reason="no C++ compiler built the kernels"),
]


def reference_attention(q, k_cache, v_cache, locations: list[int]) -> torch.Tensor:
    """One decode row [qo_heads, D] over the keys at `locations`, as the torch backend runs it."""
    group = q.shape[0] // k_cache.shape[1]
    keys, values = (
        c[locations].float().repeat_interleave(group, dim=1) for c in (k_cache, v_cache)
    )
    out = F.scaled_dot_product_attention(
        q.float()[:, None], keys.transpose(0, 1), values.transpose(0, 1)
    )
    return out[:, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("qo_heads", "kv_heads", "head_dim"), [(8, 4, 64), (4, 4, 128), (8, 2, 8), (6, 3, 96)]
)
def test_decode_attention_is_sdpas_over_each_requests_keys(
    dtype, qo_heads, kv_heads, head_dim
) -> None:
    """A batch of decode rows around a prompt chunk (left untouched), keys scattered over the pool
    as pages of a running server leave them, lengths from 1 to 300."""
    torch.manual_seed(0)
    locations, width = 4096, 320
    k_cache, v_cache = (torch.randn(locations, kv_heads, head_dim, dtype=dtype) for _ in range(2))
    extend_lens, seq_lens = [1, 1, 3, 1, 1], [1, 300, 40, 77, 2]
    page_table = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    for slot, n in enumerate(seq_lens):
        page_table[slot, :n] = torch.randperm(locations - 1)[:n].int()
    cu = torch.tensor([0, *torch.tensor(extend_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), qo_heads, head_dim, dtype=dtype)
    out = torch.full_like(q, 7.0)
    cpp.decode_attention(
        q, k_cache, v_cache, page_table, cu, torch.arange(len(seq_lens), dtype=torch.int32),
        torch.tensor(seq_lens, dtype=torch.int32), out,
    )  # fmt: skip
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype]
    for i, (start, n) in enumerate(zip(cu.tolist(), seq_lens, strict=False)):
        if extend_lens[i] != 1:
            assert (out[start : start + extend_lens[i]] == 7.0).all()
            continue
        want = reference_attention(q[start], k_cache, v_cache, page_table[i, :n].tolist())
        torch.testing.assert_close(out[start].float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("tokens", [1, 9, 300])  # the kernel splits tokens over threads past 16
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("store", [False, True])
def test_rope_and_store_are_the_references(tokens, qk_norm, store) -> None:
    """q, k and v split from the merged qkv, as the attention layer passes them: bit for bit
    without QK-norm, which sums its mean in another order (within two float roundings)."""
    torch.manual_seed(0)
    head, kv_heads, locations = 64, 4, 1024
    positions = torch.randint(0, 512, (tokens,), dtype=torch.int32)
    cos_sin = torch.randn(512, head)
    norm = (torch.randn(head), torch.randn(head), 1e-6) if qk_norm else None
    results = []
    for ops in (cpp, torch_ops):
        torch.manual_seed(1)
        qkv = torch.randn(tokens, (8 + 2 * kv_heads) * head)
        q, k, v = qkv.split([8 * head, kv_heads * head, kv_heads * head], dim=-1)
        caches = [torch.zeros(locations, kv_heads, head) for _ in range(2)]
        out_loc = torch.randperm(locations)[:tokens].int()
        kv_store = KVStore(*caches, out_loc, v) if store else None
        assert cpp.serves_rope(positions, q, k, head, norm, kv_store)
        ops.apply_rope_inplace(positions, q, k, head, cos_sin, norm, kv_store)
        results.append([q, k, *caches])
    for got, want in zip(*results, strict=True):
        if qk_norm:
            torch.testing.assert_close(got, want, rtol=2.5e-7, atol=1e-6)
        else:
            assert torch.equal(got, want)


@pytest.mark.parametrize("rows", [1, 32, 300])  # the kernel splits rows over threads past 64
@pytest.mark.parametrize("mode", ["add", "in place", "new"])
def test_rmsnorm_is_the_references_within_a_rounding_of_its_mean(rows, mode) -> None:
    """Rows strided as the attention layer's views are; the residual sum exact, the norm within
    two float roundings; in place, into a new tensor, or with the residual add."""
    torch.manual_seed(0)
    weight = torch.randn(512)
    results = []
    for ops in (kernel, torch_ops):
        torch.manual_seed(1)
        x, residual = torch.randn(rows, 1024)[:, :512], torch.randn(rows, 512)
        assert cpp.serves_norm(x, weight, residual)
        if mode == "add":
            out = ops.fused_add_rmsnorm(x, residual, weight, 1e-6)
        else:
            out = ops.rmsnorm(x, weight, 1e-6, out=x if mode == "in place" else None)
        assert (out.data_ptr() == x.data_ptr()) == (mode != "new")
        results.append((out, residual))
    (out, residual), (want_out, want_residual) = results
    assert torch.equal(residual, want_residual)
    torch.testing.assert_close(out, want_out, rtol=2.5e-7, atol=1e-6)


@pytest.mark.parametrize("rows", [1, 32, 300])  # the kernel splits rows over threads past 16
def test_silu_and_mul_is_the_references_within_float_rounding(rows) -> None:
    torch.manual_seed(0)
    x = torch.randn(rows, 2 * 1536) * 8
    x[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -1e-30])  # e^x clamped at both ends, and zero
    assert cpp.serves_activation(x)
    torch.testing.assert_close(
        kernel.silu_and_mul(x), torch_ops.silu_and_mul(x), rtol=5e-7, atol=1e-30
    )


def test_what_the_kernels_cannot_take_goes_to_the_reference() -> None:
    """bf16, linear_split_k's partial sums, rows that overlap, a weight of another length or
    dtype, an odd SiLU width, int64 positions."""
    x, residual, weight = torch.randn(4, 8), torch.randn(4, 8), torch.randn(8)
    assert cpp.serves_norm(x, weight, residual)
    assert not cpp.serves_norm(torch.randn(2, 4, 8), weight, residual)
    assert not cpp.serves_norm(x.bfloat16(), weight, residual.bfloat16())
    assert not cpp.serves_norm(torch.randn(1, 8).expand(4, 8), weight)
    assert not cpp.serves_norm(x, torch.randn(4), residual)
    assert not cpp.serves_norm(x, weight.bfloat16(), residual)
    assert cpp.serves_activation(x)
    assert not cpp.serves_activation(x.bfloat16())
    assert not cpp.serves_activation(torch.randn(4, 7))
    q, k, positions = torch.randn(3, 128), torch.randn(3, 64), torch.zeros(3, dtype=torch.int32)
    norm = (torch.randn(64), torch.randn(64), 1e-6)
    assert cpp.serves_rope(positions, q, k, 64, norm, None)
    assert not cpp.serves_rope(positions.long(), q, k, 64, None, None)
    assert not cpp.serves_rope(positions, q.bfloat16(), k.bfloat16(), 64, None, None)
    assert not cpp.serves_rope(positions, q, k, 64, (torch.randn(32), norm[1], 1e-6), None)
    assert not cpp.serves_rope(positions, q, k, 64, (norm[0].double(), norm[1], 1e-6), None)


def resolve_auto(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    """The CPU's "auto" attention backend, asked in a fresh process with an empty kernel cache."""
    code = "from minisgl.attention import ATTENTION_BACKENDS as A; print(A.resolve('auto', 'cpu'))"
    environ = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), **env}
    return subprocess.run(
        [sys.executable, "-c", code], env=environ, capture_output=True, text=True, check=True
    )


def test_kernels_are_built_once_into_the_cache_and_auto_takes_them(tmp_path) -> None:
    assert resolve_auto(tmp_path).stdout.split() == ["cpp"]
    built = sorted((tmp_path / "minisgl" / "kernels").iterdir())
    kernels = ["decode_attention", "rmsnorm", "rope_store", "silu_and_mul"]
    assert [p.name.split("-")[0] for p in built] == kernels
    assert all(p.suffix == ".so" for p in built)  # no half-written file left behind
    stamps = [p.stat().st_mtime_ns for p in built]
    assert resolve_auto(tmp_path).stdout.split() == ["cpp"]
    assert [p.stat().st_mtime_ns for p in built] == stamps  # loaded, not built again


@pytest.mark.parametrize(
    "env",
    [{"CXX": "/nonexistent/c++"}, {"MINISGL_CPU_KERNELS": "torch"}],
    ids=["no-compiler", "off"],
)
def test_without_the_kernels_auto_takes_the_batched_backend(tmp_path, env) -> None:
    result = resolve_auto(tmp_path, **env)
    assert result.stdout.split() == ["batched"]
    if "CXX" in env:
        assert "did not build" in result.stderr
