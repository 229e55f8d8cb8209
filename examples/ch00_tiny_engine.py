"""Step 0: a minimal inference engine that runs.

Imports nothing from minisgl. Reads config.json and the safetensors, writes the decoder's forward
pass by hand (Llama, Mistral, Qwen2 and Qwen3 differ only in q/k norms and qkv biases), keeps the KV
cache the most naive way, greedy-decodes one prompt, checks it against Hugging Face token by token
and measures tokens per second.

    python examples/ch00_tiny_engine.py [MODEL_DIR] [--prompt TEXT] [--tokens N]
"""

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

EMBEDDED = Path(__file__).resolve().parent.parent / "minisgl" / "assets" / "stories260K"
parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument(
    "model",
    nargs="?",
    default=str(EMBEDDED),
    help="HF model directory (default: embedded stories260K)",
)
parser.add_argument("--prompt", default="Once upon a time")
parser.add_argument("--tokens", type=int, default=16)
args = parser.parse_args()
MODEL = Path(args.model)
torch.manual_seed(0)

# ------------------------------------------------------------------ 1. config and weights
cfg = json.loads((MODEL / "config.json").read_text())
H, HQ = cfg["hidden_size"], cfg["num_attention_heads"]
HKV = cfg.get("num_key_value_heads", HQ)
D = cfg.get("head_dim") or H // HQ
L, EPS = cfg["num_hidden_layers"], cfg["rms_norm_eps"]
THETA = cfg.get("rope_theta") or cfg.get("rope_parameters", {}).get("rope_theta", 10000.0)

W = {}
for file in sorted(MODEL.glob("*.safetensors")):
    with safe_open(file, "pt") as f:
        W.update({k: f.get_tensor(k).float() for k in f.keys()})  # noqa: SIM118  fp32: matches HF's fp32 bit for bit
if cfg.get("tie_word_embeddings"):  # the output layer shares the embedding's weights
    W["lm_head.weight"] = W["model.embed_tokens.weight"]
n_params = sum(
    v.numel() for k, v in W.items() if k != "lm_head.weight" or not cfg.get("tie_word_embeddings")
)
print(f"{cfg['architectures'][0]}: {L} layers, hidden {H}, {HQ} query heads / {HKV} KV heads, "
      f"head_dim {D}, {n_params / 1e6:.2f}M parameters")  # fmt: skip


# ------------------------------------------------------------------ 2. four operators
def rmsnorm(x, w):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS))


def rope(x, pos):
    """Rotary position embedding (the two halves paired). x: [T, heads, D], pos: [T]"""
    inv_freq = 1.0 / (THETA ** (torch.arange(0, D, 2).float() / D))  # [D/2]
    ang = pos[:, None].float() * inv_freq[None, :]  # [T, D/2]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]  # broadcast over the head dimension
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def attention(q, k, v):
    """q: [T, HQ, D]; k, v: [S, HKV, D], S the total cached length (this step included). -> [T, HQ*D]"""
    T, S = q.shape[0], k.shape[0]
    k = k.repeat_interleave(HQ // HKV, dim=1)  # GQA: each KV head serves HQ/HKV query heads
    v = v.repeat_interleave(HQ // HKV, dim=1)
    scores = torch.einsum("thd,shd->hts", q, k) / D**0.5
    causal = torch.arange(S)[None, :] <= torch.arange(S - T, S)[:, None]  # query t sits at S-T+t
    scores = scores.masked_fill(~causal, float("-inf"))
    return torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(T, HQ * D)


def linear(x, name):
    return F.linear(x, W[name + ".weight"], W.get(name + ".bias"))  # Qwen2 has q/k/v biases


def mlp(x, p):
    return linear(F.silu(linear(x, p + "gate_proj")) * linear(x, p + "up_proj"), p + "down_proj")


# ------------------------------------------------------------------ 3. one layer, the whole model
def layer(x, i, pos, cache):
    """x: [T, H]. cache[i] holds this layer's (k, v) so far, [S_old, HKV, D]; this step's are appended."""
    p = f"model.layers.{i}."
    T = x.shape[0]
    h = rmsnorm(x, W[p + "input_layernorm.weight"])
    q = linear(h, p + "self_attn.q_proj").view(T, HQ, D)
    k = linear(h, p + "self_attn.k_proj").view(T, HKV, D)
    v = linear(h, p + "self_attn.v_proj").view(T, HKV, D)
    if p + "self_attn.q_norm.weight" in W:  # Qwen3: q and k each go through an RMSNorm before RoPE
        q, k = (
            rmsnorm(q, W[p + "self_attn.q_norm.weight"]),
            rmsnorm(k, W[p + "self_attn.k_norm.weight"]),
        )
    q, k = rope(q, pos), rope(k, pos)
    if cache[i] is not None:  # prepend the cached KV
        k, v = torch.cat([cache[i][0], k]), torch.cat([cache[i][1], v])
    cache[i] = (k, v)
    x = x + linear(attention(q, k, v), p + "self_attn.o_proj")
    return x + mlp(rmsnorm(x, W[p + "post_attention_layernorm.weight"]), p + "mlp.")


def forward(ids, pos, cache):
    """ids, pos: [T]. Returns the logits of the last position only: [vocab]"""
    x = W["model.embed_tokens.weight"][ids]
    for i in range(L):
        x = layer(x, i, pos, cache)
    return F.linear(rmsnorm(x[-1:], W["model.norm.weight"]), W["lm_head.weight"])[0]


# ------------------------------------------------------------------ 4. one prefill, then one token per decode step
def generate(ids, n):
    cache = [None] * L
    out = []
    t0 = time.perf_counter()
    logits = forward(torch.tensor(ids), torch.arange(len(ids)), cache)  # prefill: the whole prompt
    t1 = time.perf_counter()
    for step in range(n):  # decode: one new token per step
        nxt = int(logits.argmax())  # greedy
        out.append(nxt)
        logits = forward(torch.tensor([nxt]), torch.tensor([len(ids) + step]), cache)
    return out, t1 - t0, time.perf_counter() - t1


from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402  only to tokenize and check

tok = AutoTokenizer.from_pretrained(MODEL)
ids = tok(args.prompt).input_ids
n = args.tokens
print(f"prompt {args.prompt!r} ({len(ids)} tokens)")
out, t_prefill, t_decode = generate(ids, n)
print(f"generated: {tok.decode(out)!r}")
print(f"default {torch.get_num_threads()} threads: prefill {t_prefill * 1000:.0f} ms, "
      f"{n} decode steps {t_decode:.2f} s ({n / t_decode:.1f} tokens/s)")  # fmt: skip
# half the logical cores ~ the physical cores: decode's one-row matmuls are too small to split widely
torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
out2, t_prefill, t_decode = generate(ids, n)
assert out2 == out
print(f"with {torch.get_num_threads()} threads: prefill {t_prefill * 1000:.0f} ms, "
      f"{n} decode steps {t_decode:.2f} s ({n / t_decode:.1f} tokens/s)")  # fmt: skip

hf = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
with torch.no_grad():
    ref = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None)
print(f"matches Hugging Face token by token: {out == ref[0, len(ids) :].tolist()}")
