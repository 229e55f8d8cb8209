"""Triton kernels. The elementwise ops share names and semantics with `minisgl.kernel.torch_ops`
(so `minisgl.kernel` can dispatch between the two modules); the attention and MoE kernels serve the
`triton` attention and MoE backends."""

from .activation import silu_and_mul
from .decode_attention import (
    DecodeLaunch,
    decode_attention,
    decode_launch,
    decode_num_splits,
    num_sms,
    split_counter_count,
)
from .extend_attention import extend_attention, extend_blocks
from .fused_moe import fused_moe
from .gemv import Prologue, linear, use_gemv
from .moe_route import moe_route
from .norm import fused_add_rmsnorm, rmsnorm
from .rope import apply_rope_inplace
from .sampling import sample_tokens
from .tables import read_tables

__all__ = [
    "DecodeLaunch",
    "Prologue",
    "apply_rope_inplace",
    "decode_attention",
    "decode_launch",
    "decode_num_splits",
    "extend_attention",
    "extend_blocks",
    "fused_add_rmsnorm",
    "fused_moe",
    "linear",
    "moe_route",
    "num_sms",
    "read_tables",
    "rmsnorm",
    "sample_tokens",
    "silu_and_mul",
    "split_counter_count",
    "use_gemv",
]
