"""Chapter 2: how BaseOP collects weight names, and how the reference ops compare with Hugging Face.

python examples/ch02_layers.py [MODEL_DIR]
"""

import argparse

import torch
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb

from minisgl.distributed import set_tp_info
from minisgl.kernel import torch_ops
from minisgl.layers import get_rope
from minisgl.models import ModelConfig
from minisgl.models.decoder import DecoderLayer
from minisgl.moe.torch_backend import TorchMoE
from minisgl.utils import resolve_model_path
from minisgl.utils.hf import cached_load_hf_config
from minisgl.utils.torch_utils import torch_dtype

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument(
    "model", nargs="?", default=None, help="HF model directory (default: embedded stories260K)"
)
args = parser.parse_args()

set_tp_info(0, 1)
config = ModelConfig.from_hf(cached_load_hf_config(resolve_model_path(args.model)))
with (
    torch.device("meta"),
    torch_dtype(torch.bfloat16),
):  # build the structure only, allocating no memory
    # the MoE backend runs a sparse layer's experts; the device holds the RoPE table, which is
    # real data and cannot live on the meta device
    layer = DecoderLayer(config, 0, TorchMoE(), torch.device("cpu"))
for name, t in layer.state_dict(prefix="model.layers.0").items():
    print(f"{name:<50} {tuple(t.shape)!s:<14} {t.dtype} {t.device}")

# the reference ops against HF's own modules, in fp32
torch.manual_seed(0)
hidden, d = config.hidden_size, config.head_dim
x, w = torch.randn(4, hidden), torch.randn(hidden)
ref = Qwen3RMSNorm(hidden, eps=config.rms_norm_eps)
ref.weight.data.copy_(w)
print(
    "RMSNorm max error:", (torch_ops.rmsnorm(x, w, config.rms_norm_eps) - ref(x)).abs().max().item()
)

hq, hkv, theta = config.num_qo_heads, config.num_kv_heads, config.rope_theta
rope = get_rope(d, config.max_position_embeddings, theta, None, torch.device("cpu"))
pos = torch.tensor([0, 7, config.max_position_embeddings - 1])
q, k = torch.randn(3, hq * d), torch.randn(3, hkv * d)
inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
emb = torch.cat([pos.float()[:, None] * inv] * 2, dim=-1)
q_ref, _ = apply_rotary_pos_emb(
    q.view(3, hq, d).transpose(0, 1)[None],
    k.view(3, hkv, d).transpose(0, 1)[None],
    emb.cos()[None],
    emb.sin()[None],
)
rope.forward(pos, q, k)
print("RoPE max error:", (q.view(3, hq, d).transpose(0, 1) - q_ref[0]).abs().max().item())
