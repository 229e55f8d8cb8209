"""Mixture-of-experts checkpoint tensors -> the model's stacked experts.

A checkpoint holds either one tensor per expert and projection (`mlp.experts.<e>.gate_proj.weight`,
as the released Qwen3-MoE checkpoints and transformers' save_pretrained have them) or
transformers' fused 3-D `mlp.experts.gate_up_proj` and `mlp.experts.down_proj`, which is what
the model holds (this rank's slice of each expert's intermediate dimension):

    gate_up_proj [experts, 2 * inter, hidden]   expert e: rows [gate_e ; up_e]
    down_proj    [experts, hidden, inter]
"""

import re
from typing import Any, Protocol

import torch

from minisgl.distributed import TPInfo

from .config import ModelConfig

# an expert's number written one way only (`05` beside `5` was read as expert 5 twice)
_PER_EXPERT = re.compile(r"(.*\.experts)\.(0|[1-9]\d*)\.(gate_proj|up_proj|down_proj)\.weight")
# per-expert projection -> (stacked tensor, position inside an expert's slice of it)
_STACKED = {
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}
_PARTS = {"gate_up_proj": 2, "down_proj": 1}


def per_expert(name: str) -> tuple[str, int, str] | None:
    """(the stacked tensor's name, expert, projection) of a per-expert checkpoint tensor."""
    match = _PER_EXPERT.fullmatch(name)
    if match is None:
        return None
    prefix, expert, projection = match.groups()
    return f"{prefix}.{_STACKED[projection][0]}", int(expert), projection


def expert_shape(expert: int, projection: str, c: ModelConfig) -> tuple[int, ...] | None:
    """The full shape of one expert's gate_proj, up_proj or down_proj; None past the last."""
    assert c.moe is not None
    if expert >= c.moe.num_experts:
        return None
    inter = c.moe.intermediate_size
    return (c.hidden_size, inter) if projection == "down_proj" else (inter, c.hidden_size)


def fused_shape(kind: str, c: ModelConfig) -> tuple[int, ...] | None:
    """The full shape of a fused `experts.<kind>`; None for a model without experts."""
    if c.moe is None or kind not in _PARTS:
        return None
    e, inter, hidden = c.moe.num_experts, c.moe.intermediate_size, c.hidden_size
    return (e, 2 * inter, hidden) if kind == "gate_up_proj" else (e, hidden, inter)


def per_expert_names(target: str, num_experts: int) -> list[str]:
    """The per-expert checkpoint tensors that make up the stacked `target`."""
    prefix, kind = target.rsplit(".", 1)
    return [
        f"{prefix}.{e}.{projection}.weight"
        for e in range(num_experts)
        for projection, (stacked, _) in _STACKED.items()
        if stacked == kind
    ]


class TensorSlice(Protocol):
    """A checkpoint tensor not read yet (safetensors' get_slice): indexing reads that part only."""

    def __getitem__(self, index: Any) -> torch.Tensor: ...


def shard_fused(kind: str, tensor_slice: TensorSlice, c: ModelConfig, tp: TPInfo) -> torch.Tensor:
    """This rank's slice of every expert in a fused tensor, read without loading the rest."""
    assert c.moe is not None
    local = c.moe.intermediate_size // tp.size
    start = tp.rank * local
    if kind == "down_proj":
        return tensor_slice[:, :, start : start + local]
    inter = c.moe.intermediate_size
    gate = tensor_slice[:, start : start + local]
    up = tensor_slice[:, inter + start : inter + start + local]
    return torch.cat([gate, up], dim=1)


class ExpertStacker:
    """Collects per-expert tensors into the stacked ones, each filled in place as its parts
    arrive (no second copy of a layer's experts)."""

    def __init__(self, expected: dict[str, tuple[int, ...]], num_experts: int) -> None:
        self._expected = expected
        self._num_experts = num_experts
        self._stacks: dict[str, torch.Tensor] = {}
        self._received: dict[str, set[tuple[int, str]]] = {}

    def add(
        self, target: str, expert: int, projection: str, tensor: torch.Tensor
    ) -> torch.Tensor | None:
        """Place one expert's (sharded) projection; returns the stacked tensor once complete."""
        if target not in self._stacks:
            shape = self._expected[target]
            self._stacks[target] = torch.empty(shape, dtype=tensor.dtype, device=tensor.device)
            self._received[target] = set()
        stack = self._stacks[target]
        _, part = _STACKED[projection]
        rows = tensor.shape[0]
        stack[expert, part * rows : (part + 1) * rows] = tensor
        received = self._received[target]
        received.add((expert, projection))
        if len(received) < self._num_experts * _PARTS[target.rsplit(".", 1)[1]]:
            return None
        del self._stacks[target], self._received[target]
        return stack
