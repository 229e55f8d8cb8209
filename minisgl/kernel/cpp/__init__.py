"""The CPU's own kernels, in C++: decode attention over the paged pool, RoPE with QK-norm and the
K/V store, RMSNorm with the residual add, and SiLU-and-mul. Each source is compiled on first use
by the machine's C++ compiler for its own CPU (-O3 -march=native), kept in a cache under the hash
of the source, its headers, the flags and the CPU, and called through ctypes on the tensors'
memory. Their OpenMP is the runtime torch has already loaded, so they run on torch's threads.
Where no compiler builds them, `available()` is False and callers take the PyTorch path."""

import ctypes
import functools
import hashlib
import os
import platform
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from minisgl.utils import init_logger

from ..torch_ops import KVStore

logger = init_logger(__name__)

_FLAGS = ("-O3", "-march=native", "-fopenmp", "-std=c++20", "-shared", "-fPIC")
_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int


@dataclass(frozen=True)
class _Kernel:
    source: str  # a file beside this one, whose extern "C" function has the source's stem
    flags: tuple[str, ...]  # its own, after _FLAGS
    signature: tuple[type, ...]


_DECODE_ATTENTION = _Kernel(
    "decode_attention.cpp",
    # sums in any order (a dot product's lanes as a tree): 0.30 against 0.50 ms for 32 rows of the
    # CPU benchmark's shape; never -ffast-math, whose start-up code (GCC < 13) would flush
    # denormals to zero in the whole process
    ("-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math"),
    (_PTR, _I64, _PTR, _PTR, _INT, _PTR, _I64, _PTR, _PTR, _PTR)
    + (_I64, _I64, _I64, _I64, ctypes.c_float, _PTR, _I64, _INT),
)
_ROPE_STORE = _Kernel(
    "rope_store.cpp",
    ("-ffp-contract=off",),  # each product rounded, as torch's ops round them
    (
        _PTR,
        _I64,
        _PTR,
        _I64,
        _PTR,
        _I64,
        _I64,
        _PTR,
        _I64,
        _I64,
        _PTR,
        _PTR,
        ctypes.c_float,
        _PTR,
        _I64,
        _PTR,
        _PTR,
        _PTR,
        _INT,
    ),
)
_RMSNORM = _Kernel(
    "rmsnorm.cpp",
    ("-ffp-contract=off",),
    (_PTR, _I64, _PTR, _I64, _PTR, _I64, _I64, ctypes.c_float, _PTR, _I64, _INT),
)
_SILU_AND_MUL = _Kernel(
    "silu_and_mul.cpp",
    ("-fno-trapping-math",),  # lets gcc vectorise exp_float's floor: 4x faster at 32 rows
    (_PTR, _I64, _I64, _I64, _PTR, _INT),
)
_KERNELS = (_DECODE_ATTENTION, _ROPE_STORE, _RMSNORM, _SILU_AND_MUL)


def available() -> bool:
    """Whether the kernels built (on the first call) and loaded on this machine;
    MINISGL_CPU_KERNELS=torch says no (the PyTorch path, for tests and ablation)."""
    if os.environ.get("MINISGL_CPU_KERNELS") == "torch":
        return False
    return all(_function(kernel) is not None for kernel in _KERNELS)


def serves_rope(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    head_size: int,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None,
    kv_store: KVStore | None,
) -> bool:
    """Whether `apply_rope_inplace` takes these: fp32 on the CPU (QK-norm's weights one head
    long), with the engine's int32 positions and locations, where the kernels run."""
    floats, ints = [query, key], [positions]
    if kv_store is not None:
        floats += [kv_store.value, kv_store.k_cache, kv_store.v_cache]
        ints.append(kv_store.out_loc)
    weights = qk_norm[:2] if qk_norm is not None else ()
    return (
        all(t.device.type == "cpu" and t.dtype == torch.float32 for t in floats)
        and all(t.dtype == torch.int32 for t in ints)
        and all(_fp32_vector(w, head_size) for w in weights)
        and available()
    )


def serves_norm(x: torch.Tensor, weight: torch.Tensor, *others: torch.Tensor | None) -> bool:
    """Whether `rmsnorm` and `fused_add_rmsnorm` take x, its weight and the others given with it
    (residual, out): fp32 [rows, n] on the CPU, each row's elements contiguous and apart from the
    next row's, all of one shape (so not linear_split_k's partial sums), where the kernels run."""
    rows = [x, *(t for t in others if t is not None)]
    return (
        all(_fp32_rows(t) and t.shape == x.shape for t in rows)
        and _fp32_vector(weight, x.shape[-1])
        and available()
    )


def serves_decode_attention(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether `decode_attention` takes these caches: fp32 or bf16, both of one dtype."""
    return k_cache.dtype in (torch.float32, torch.bfloat16) and v_cache.dtype == k_cache.dtype


def serves_activation(x: torch.Tensor) -> bool:
    """Whether `silu_and_mul` takes x: fp32 [rows, 2n] on the CPU, each row contiguous."""
    return _fp32_rows(x) and x.shape[-1] % 2 == 0 and available()


def _fp32_rows(t: torch.Tensor) -> bool:
    """fp32 rows on the CPU, each contiguous; rows that overlap (stride 0, say) would race where
    the kernels write in place."""
    return (
        t.device.type == "cpu"
        and t.dtype == torch.float32
        and t.dim() <= 2
        and t.stride(-1) == 1
        and (t.dim() == 1 or t.shape[0] <= 1 or t.stride(0) >= t.shape[1])
    )


def _fp32_vector(t: torch.Tensor, n: int) -> bool:
    return t.shape == (n,) and _fp32_rows(t)


def rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """torch_ops.rmsnorm's result, its mean summed in another order (see rms.h)."""
    out = torch.empty_like(x) if out is None else out
    _norm(x, None, weight, eps, out)
    return out


def fused_add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """torch_ops.fused_add_rmsnorm's results (residual += x; x <- rmsnorm(residual)), the mean
    summed in another order."""
    _norm(x, residual, weight, eps, x)
    return x


def _norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
) -> None:
    n = x.shape[-1]
    x2, out2 = x.view(-1, n), out.view(-1, n)
    residual2 = x2 if residual is None else residual.view(-1, n)
    _function(_RMSNORM)(
        x2.data_ptr(), x2.stride(0), None if residual is None else residual2.data_ptr(),
        residual2.stride(0), weight.data_ptr(), x2.shape[0], n, eps, out2.data_ptr(),
        out2.stride(0), torch.get_num_threads(),
    )  # fmt: skip


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """torch_ops.silu_and_mul's result within float rounding (e^x by exp.h's series)."""
    rows = x.view(-1, x.shape[-1])
    n = rows.shape[1] // 2
    out = x.new_empty(*x.shape[:-1], n)
    _function(_SILU_AND_MUL)(
        rows.data_ptr(), rows.stride(0), rows.shape[0], n, out.data_ptr(), torch.get_num_threads()
    )
    return out


def apply_rope_inplace(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    kv_store: KVStore | None = None,
) -> None:
    """torch_ops.apply_rope_inplace's results, with QK-norm, the rotation and the K/V store in
    one pass over the tokens: bit for bit without QK-norm, whose mean is summed in another order
    (see rms.h)."""
    q, k = (t.view(t.shape[0], -1, head_size) for t in (query, key))
    norms: tuple[int | None, int | None, float] = (None, None, 0.0)
    if qk_norm is not None:
        q_weight, k_weight, eps = qk_norm
        norms = (q_weight.data_ptr(), k_weight.data_ptr(), eps)
    for t in (q, k):
        assert t.stride()[1:] == (head_size, 1), "each row's heads must lie contiguously"
    assert cos_sin_cache.dtype == torch.float32 and cos_sin_cache.is_contiguous()
    pointers, value_stride = (None, None, None, None), 0
    if kv_store is not None:
        k_cache, v_cache, out_loc, value = kv_store
        value = value.view(len(positions), -1)
        assert k_cache.shape[1:] == k.shape[1:] and value.shape[1] == k.shape[1] * head_size
        assert k_cache.is_contiguous() and v_cache.is_contiguous() and value.stride(1) == 1
        pointers = (value.data_ptr(), out_loc.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr())
        value_stride = value.stride(0)
    value_ptr, out_loc_ptr, k_cache_ptr, v_cache_ptr = pointers
    _function(_ROPE_STORE)(
        positions.data_ptr(), len(positions), cos_sin_cache.data_ptr(), head_size,
        q.data_ptr(), q.stride(0), q.shape[1], k.data_ptr(), k.stride(0), k.shape[1], *norms,
        value_ptr, value_stride, out_loc_ptr, k_cache_ptr, v_cache_ptr, torch.get_num_threads(),
    )  # fmt: skip


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    slots: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """For each request i that computes one token (cu_seqlens_q[i + 1] - cu_seqlens_q[i] == 1):
    out[row] = attention of q[row] (row = cu_seqlens_q[i]) over the K/V of the first seq_lens[i]
    positions of page-table row slots[i], scaled by 1/sqrt(D). Other rows of out are left as they
    are. q, out: [rows, qo_heads, D] (any row stride); caches: [locations, kv_heads, D], fp32 or
    bf16; the int columns int32."""
    assert serves_decode_attention(k_cache, v_cache)
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and page_table.is_contiguous()
    columns = (page_table, cu_seqlens_q, slots, seq_lens)
    assert all(c.dtype == torch.int32 and c.is_contiguous() for c in columns)
    _, qo_heads, head_dim = q.shape
    q32 = q.float()
    out32 = out.float()  # out itself in fp32; other rows go back unchanged (exactly)
    for t in (q32, out32):
        assert t.stride()[1:] == (head_dim, 1), "each row's heads must lie contiguously"
    _function(_DECODE_ATTENTION)(
        q32.data_ptr(), q32.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
        int(k_cache.dtype == torch.bfloat16), page_table.data_ptr(), page_table.shape[1],
        cu_seqlens_q.data_ptr(), slots.data_ptr(), seq_lens.data_ptr(), len(slots), qo_heads,
        k_cache.shape[1], head_dim, head_dim**-0.5, out32.data_ptr(), out32.stride(0),
        torch.get_num_threads(),
    )  # fmt: skip
    if out32 is not out:
        out.copy_(out32)


@functools.cache
def _function(kernel: _Kernel) -> ctypes._CFuncPtr | None:
    path = _build(kernel)
    if path is None:
        return None
    function = getattr(ctypes.CDLL(str(path)), Path(kernel.source).stem)
    function.argtypes = kernel.signature
    function.restype = None
    return function


def _build(kernel: _Kernel) -> Path | None:
    """The compiled library's path, built now unless the cache holds it; None if it can't be."""
    compiler = os.environ.get("CXX", "c++")
    source = Path(__file__).with_name(kernel.source)
    command = [compiler, *_FLAGS, *kernel.flags, str(source)]
    headers = [h.read_bytes() for h in sorted(source.parent.glob("*.h"))]
    key = hashlib.sha256(
        b"\0".join([source.read_bytes(), *headers, " ".join(command).encode(), _cpu()])
    )
    path = _cache_dir() / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    # a file of its own, then renamed: processes that build at once never load half a file
    fd, partial = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        subprocess.run([*command, "-o", partial], check=True, capture_output=True, text=True)
        os.replace(partial, path)
    except (OSError, subprocess.CalledProcessError) as e:
        Path(partial).unlink(missing_ok=True)
        reason = (
            e.stderr.strip().splitlines()[:1] if isinstance(e, subprocess.CalledProcessError) else e
        )
        logger.warning("the C++ CPU kernels did not build (%s): the PyTorch path runs", reason)
        return None
    return path


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "minisgl" / "kernels"


def _cpu() -> bytes:
    """What -march=native compiled for: the CPU's feature flags (Linux), else its name."""
    try:
        with open("/proc/cpuinfo", "rb") as cpuinfo:
            return next((line for line in cpuinfo if line.startswith(b"flags")), b"")
    except OSError:
        return platform.processor().encode()
