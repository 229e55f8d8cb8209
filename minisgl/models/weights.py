"""Streaming safetensors loader: reads one tensor at a time, slices it for this TP rank, merges
q/k/v -> qkv_proj and gate/up -> gate_up_proj (and stacks experts, expert_weights.py) on the
way, and checks every name and shape."""

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from minisgl.config import ConfigError
from minisgl.distributed import TPInfo
from minisgl.layers import local_kv_heads
from minisgl.utils import div_ceil

from .config import ModelConfig
from .expert_weights import (
    ExpertStacker,
    TensorSlice,
    expert_shape,
    fused_shape,
    per_expert,
    shard_fused,
)

# checkpoint projection -> (merged name, position inside it)
_MERGED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_PARTS = {"qkv_proj": 3, "gate_up_proj": 2}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_EMBEDDING = "model.embed_tokens.weight"


def _checkpoint_shape(module: str, kind: str, c: ModelConfig) -> tuple[int, ...] | None:
    """The full (unsharded) shape Hugging Face stores for `<module>.<kind>`; None if unknown."""
    hidden, d, inter = c.hidden_size, c.head_dim, c.intermediate_size
    weights = {
        "q_proj": (c.num_qo_heads * d, hidden),
        "k_proj": (c.num_kv_heads * d, hidden),
        "v_proj": (c.num_kv_heads * d, hidden),
        "o_proj": (hidden, c.num_qo_heads * d),
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
        "embed_tokens": (c.vocab_size, hidden),
        "lm_head": (c.vocab_size, hidden),
        "q_norm": (d,),
        "k_norm": (d,),
        "input_layernorm": (hidden,),
        "post_attention_layernorm": (hidden,),
        "norm": (hidden,),
    }
    if c.moe is not None:
        weights["gate"] = (c.moe.num_experts, hidden)  # the router
    shape = weights.get(module)
    if shape is None or kind not in ("weight", "bias"):
        return None
    return shape if kind == "weight" else shape[:1]


def _shard(
    module: str,
    tensor_slice: TensorSlice,
    full_shape: tuple[int, ...],
    c: ModelConfig,
    tp: TPInfo,
) -> torch.Tensor:
    """This rank's part of a checkpoint tensor, read without loading the rest."""
    if tp.size == 1:
        return tensor_slice[:]
    if module in ("q_proj", "gate_proj", "up_proj"):
        rows = full_shape[0] // tp.size
        return tensor_slice[tp.rank * rows : (tp.rank + 1) * rows]
    if module in ("k_proj", "v_proj"):
        local = local_kv_heads(c.num_kv_heads, tp.size)
        head = tp.rank * local if c.num_kv_heads >= tp.size else tp.rank * c.num_kv_heads // tp.size
        return tensor_slice[head * c.head_dim : (head + local) * c.head_dim]
    if module in ("o_proj", "down_proj"):
        cols = full_shape[1] // tp.size
        return tensor_slice[:, tp.rank * cols : (tp.rank + 1) * cols]
    if module in ("embed_tokens", "lm_head"):
        rows = div_ceil(full_shape[0], tp.size)
        part = tensor_slice[tp.rank * rows : min((tp.rank + 1) * rows, full_shape[0])]
        return torch.nn.functional.pad(part, (0, 0, 0, rows - part.shape[0]))
    return tensor_slice[:]


def _target(
    name: str, expert: tuple[str, int, str] | None, config: ModelConfig
) -> tuple[str, tuple[int, ...] | None]:
    """(the model's tensor a checkpoint tensor goes into, the checkpoint tensor's full shape;
    None if unknown). expert: `per_expert(name)`."""
    module, kind = name.split(".")[-2:]
    if expert is not None:
        return expert[0], expert_shape(expert[1], expert[2], config)
    if module == "experts":
        return name, fused_shape(kind, config)
    if module in _MERGED:
        name = name.replace(f".{module}.", f".{_MERGED[module][0]}.")
    return name, _checkpoint_shape(module, kind, config)


def checkpoint_files(model_path: Path) -> list[Path]:
    index = model_path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_path / name for name in dict.fromkeys(weight_map.values())]
    files = sorted(model_path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors checkpoint in {model_path}")
    return files


def load_weights(
    model_path: Path,
    config: ModelConfig,
    expected: dict[str, tuple[int, ...]],
    tp: TPInfo,
    device: torch.device,
    dtype: torch.dtype,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name in the model, tensor on `device`) for this rank. `expected` maps every name the
    model wants to its local shape; a checkpoint that disagrees raises a ValueError naming the tensor."""
    pending: dict[str, dict[int, torch.Tensor]] = {}
    stacker = ExpertStacker(expected, config.moe.num_experts if config.moe is not None else 0)
    seen: set[str] = set()
    files = checkpoint_files(model_path)
    for file in files:
        with safe_open(str(file), framework="pt", device=str(device)) as f:
            for name in f.keys():  # noqa: SIM118  (safe_open has no __iter__)
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                if name == "lm_head.weight" and config.tie_word_embeddings:
                    _require_tied_head(files, file)  # the LM head shares embed_tokens' weight
                    continue
                module, kind = name.split(".")[-2:]
                expert = per_expert(name) if config.moe is not None else None
                target, full_shape = _target(name, expert, config)
                if full_shape is None or target not in expected:
                    raise ConfigError(f"unexpected tensor {name!r} in {file.name}")
                tensor_slice = f.get_slice(name)
                shape = tuple(tensor_slice.get_shape())
                if shape != full_shape:
                    raise ConfigError(
                        f"tensor {name!r} in {file.name} has shape {shape}, expected {full_shape}"
                    )
                if module == "experts":
                    tensor = shard_fused(kind, tensor_slice, config, tp)
                else:
                    tensor = _shard(module, tensor_slice, full_shape, config, tp)
                tensor = tensor.to(device, dtype)
                if expert is not None:
                    stacked = stacker.add(target, expert[1], expert[2], tensor)
                    if stacked is not None:
                        seen.add(target)
                        yield target, stacked
                    continue
                if module not in _MERGED:
                    seen.add(target)
                    yield target, tensor
                    continue
                merged, part = _MERGED[module]
                parts = pending.setdefault(target, {})
                parts[part] = tensor
                if len(parts) == _PARTS[merged]:
                    del pending[target]
                    seen.add(target)
                    yield target, torch.cat([parts[i] for i in range(len(parts))])
    missing = [name for name in expected if name not in seen]
    if missing:
        raise ConfigError(
            f"checkpoint {model_path} is missing tensor(s) "
            f"{_describe_missing(missing, pending, stacker)}"
        )


def _require_tied_head(files: list[Path], head_file: Path) -> None:
    """A config that ties the LM head to the embedding, over a checkpoint that stores a head of
    its own: transformers 5 loads a head that differs untied, so such a head is refused, not
    dropped."""
    with safe_open(str(head_file), framework="pt", device="cpu") as f:
        head = f.get_tensor("lm_head.weight")
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            if _EMBEDDING in f.keys():  # noqa: SIM118  (safe_open has no __contains__)
                if not torch.equal(head, f.get_tensor(_EMBEDDING)):
                    raise ConfigError(
                        f"config.json ties the word embeddings, but {head_file.name} stores an "
                        f"lm_head.weight that differs from {_EMBEDDING}; set "
                        "tie_word_embeddings to false to use it"
                    )
                return


def _describe_missing(
    missing: list[str], pending: dict[str, dict[int, torch.Tensor]], stacker: ExpertStacker
) -> str:
    names = []
    for name in missing:
        merged = name.split(".")[-2]
        if stacker.missing(name):
            names += stacker.missing(name)
        elif merged in _PARTS:
            got = pending.get(name, {})
            for module, (target, part) in _MERGED.items():
                if target == merged and part not in got:
                    names.append(name.replace(f".{merged}.", f".{module}."))
        else:
            names.append(name)
    return ", ".join(repr(n) for n in names)
