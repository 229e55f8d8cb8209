"""Streaming safetensors loader: reads one tensor at a time, slices it for this TP rank, merges
q/k/v -> qkv_proj and gate/up -> gate_up_proj (and stacks experts, expert_weights.py) on the
way, and checks every name and shape."""

import json
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

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
    per_expert_names,
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
# merged name -> its parts, in their order inside it
_PARTS = {
    merged: [module for module, (target, _) in _MERGED.items() if target == merged]
    for merged, _ in _MERGED.values()
}
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
    if ".experts." in name:  # no expert's weight (a bias, `05`): not the dense MLP's either
        return name, None
    if module in _MERGED:
        name = name.replace(f".{module}.", f".{_MERGED[module][0]}.")
    return name, _checkpoint_shape(module, kind, config)


# a checkpoint's tensors in a float type: any other (int8, fp8, packed ints) is a quantized one's
_FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")


@dataclass(frozen=True)
class _Source:
    """A checkpoint tensor and the model's tensor it goes into."""

    name: str
    target: str
    full_shape: tuple[int, ...]
    expert: tuple[str, int, str] | None  # per_expert(name)


@dataclass(frozen=True)
class Checkpoint:
    """What the model takes from each of a checkpoint's files, as their headers describe it."""

    sources: dict[Path, list[_Source]]
    tied_head: Path | None  # a file holding an lm_head.weight that tied embeddings must equal


def _checkpoint_files(model_path: Path) -> list[Path]:
    """The files of the checkpoint, in Hugging Face's order: model.safetensors (an adapter or a
    consolidated copy beside it is no part of it), else those its index names, else every
    *.safetensors file."""
    if (single := model_path / "model.safetensors").is_file():
        return [single]
    index = model_path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = list(dict.fromkeys(weight_map.values()))
            if not all(isinstance(name, str) for name in names):
                raise TypeError("weight_map's values must be file names")
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ConfigError(f"{index} cannot be read: {e!r}") from None
        files = [model_path / name for name in names]
        if absent := [f.name for f in files if not f.is_file()]:
            raise ConfigError(
                f"{index.name} names {', '.join(absent)}, which {model_path} lacks (a download "
                "that did not finish?)"
            )
        return files
    files = sorted(model_path.glob("*.safetensors"))
    if not files:
        raise ConfigError(
            f"{model_path} holds no *.safetensors weights (--dummy-weights for random ones)"
        )
    return files


def scan_checkpoint(
    model_path: Path, config: ModelConfig, names: Collection[str] | None = None
) -> Checkpoint:
    """The checkpoint's tensors, checked from its files' headers alone (no tensor is read): every
    file is there and whole, and every tensor is one the model has, of its shape and of a float
    type; with `names` (every tensor the model wants), none of them is missing. Raises
    ConfigError naming the file or the tensor."""
    sources: dict[Path, list[_Source]] = {}
    covered: dict[str, set[str]] = {}  # model tensor -> the checkpoint tensors found for it
    found_in: dict[str, Path] = {}  # checkpoint tensor -> its file
    tied_head = None
    for file in _checkpoint_files(model_path):
        try:
            with safe_open(str(file), framework="pt") as f:
                headers = {name: f.get_slice(name) for name in f.keys()}  # noqa: SIM118
        except (OSError, SafetensorError) as e:
            raise ConfigError(f"{file} cannot be read: {e}") from None
        sources[file] = []
        for name, header in headers.items():
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            if (first := found_in.setdefault(name, file)) != file:
                raise ConfigError(
                    f"tensor {name!r} is stored in both {first.name} and {file.name}: which one "
                    "the model should take is not known"
                )
            if name == "lm_head.weight" and config.tie_word_embeddings:
                tied_head = file  # the LM head shares embed_tokens' weight
                continue
            expert = per_expert(name) if config.moe is not None else None
            target, full_shape = _target(name, expert, config)
            if full_shape is None or (names is not None and target not in names):
                raise ConfigError(f"unexpected tensor {name!r} in {file.name}")
            shape = tuple(header.get_shape())
            if shape != full_shape:
                raise ConfigError(
                    f"tensor {name!r} in {file.name} has shape {shape}, expected {full_shape}"
                )
            if (dtype := header.get_dtype()) not in _FLOAT_DTYPES:
                raise ConfigError(
                    f"tensor {name!r} in {file.name} is {dtype}, not a float type: quantized "
                    "checkpoints are not supported"
                )
            sources[file].append(_Source(name, target, full_shape, expert))
            covered.setdefault(target, set()).add(name)
    for target, found in covered.items():
        if target in found and len(found) > 1:  # read both, the last would have been taken
            parts = sorted(found - {target})
            more = f" and {len(parts) - 1} more" if len(parts) > 1 else ""
            raise ConfigError(
                f"tensor {target!r} is stored both whole and in parts ({parts[0]!r}{more}): "
                "which the model should take is not known"
            )
    if names is not None:
        per_expert_files = any(s.expert is not None for file in sources.values() for s in file)
        missing = [
            source
            for target in names
            for source in _sources_of(target, covered.get(target, set()), per_expert_files, config)
            if source not in covered.get(target, ())
        ]
        if missing:
            raise ConfigError(
                f"checkpoint {model_path} is missing tensor(s) {', '.join(map(repr, missing))}"
            )
    return Checkpoint(sources, tied_head)


def _sources_of(
    target: str, found: set[str], per_expert_files: bool, config: ModelConfig
) -> list[str]:
    """The checkpoint tensors that make up the model's `target`, of which `found` came; experts
    are read from their fused tensor where it came, else one tensor per expert where the
    checkpoint stores them so."""
    module = target.split(".")[-2]
    if module in _PARTS:
        return [target.replace(f".{module}.", f".{part}.") for part in _PARTS[module]]
    if module == "experts" and target not in found and (found or per_expert_files):
        assert config.moe is not None
        return per_expert_names(target, config.moe.num_experts)
    return [target]


def load_weights(
    model_path: Path,
    config: ModelConfig,
    expected: dict[str, tuple[int, ...]],
    tp: TPInfo,
    device: torch.device,
    dtype: torch.dtype,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name in the model, tensor on `device`) for this rank. `expected` maps every name the
    model wants to its local shape; a checkpoint that disagrees raises a ConfigError naming the
    tensor, before any tensor is read."""
    checkpoint = scan_checkpoint(model_path, config, expected)
    if checkpoint.tied_head is not None:
        _require_tied_head(list(checkpoint.sources), checkpoint.tied_head)
    pending: dict[str, dict[int, torch.Tensor]] = {}
    stacker = ExpertStacker(expected, config.moe.num_experts if config.moe is not None else 0)
    for file, sources in checkpoint.sources.items():
        with safe_open(str(file), framework="pt", device=str(device)) as f:
            for source in sources:
                target, expert = source.target, source.expert
                module, kind = source.name.split(".")[-2:]
                tensor_slice = f.get_slice(source.name)
                if module == "experts":
                    tensor = shard_fused(kind, tensor_slice, config, tp)
                else:
                    tensor = _shard(module, tensor_slice, source.full_shape, config, tp)
                tensor = tensor.to(device, dtype)
                if expert is not None:
                    stacked = stacker.add(target, expert[1], expert[2], tensor)
                    if stacked is not None:
                        yield target, stacked
                    continue
                if module not in _MERGED:
                    yield target, tensor
                    continue
                merged, part = _MERGED[module]
                parts = pending.setdefault(target, {})
                parts[part] = tensor
                if len(parts) == len(_PARTS[merged]):
                    del pending[target]
                    yield target, torch.cat([parts[i] for i in range(len(parts))])


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
