"""BaseOP: the one thing an inference engine needs from nn.Module, collecting and loading weights by name.

Three rules: a public Tensor attribute is a weight named by its attribute path; a public BaseOP
attribute is a sub-op; attributes starting with `_` take no part. Loading *replaces* each tensor
(no copy), so a model built on the meta device costs nothing until its weights arrive.
"""

from abc import abstractmethod
from collections.abc import Iterator
from typing import Any, Generic, TypeVar

import torch

StateDict = dict[str, torch.Tensor]


def _concat_prefix(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


class BaseOP:
    @abstractmethod
    def forward(self, *args: Any, **kwargs: Any) -> Any: ...

    def _parts(self) -> Iterator[tuple[str, Any]]:
        """(name, value) of each attribute that may be a weight or a sub-op."""
        return ((name, v) for name, v in self.__dict__.items() if not name.startswith("_"))

    def state_dict(self, *, prefix: str = "", result: StateDict | None = None) -> StateDict:
        result = result if result is not None else {}
        for name, param in self._parts():
            if isinstance(param, torch.Tensor):
                result[_concat_prefix(prefix, name)] = param
            elif isinstance(param, BaseOP):
                param.state_dict(prefix=_concat_prefix(prefix, name), result=result)
        return result

    def load_state_dict(
        self, state_dict: StateDict, *, prefix: str = "", _internal: bool = False
    ) -> None:
        """Take this op's tensors out of `state_dict` (it is consumed); leftovers are an error."""
        for name, param in self._parts():
            key = _concat_prefix(prefix, name)
            if isinstance(param, torch.Tensor):
                if key not in state_dict:
                    raise KeyError(f"missing tensor {key!r}")
                item = state_dict.pop(key)
                if param.shape != item.shape or param.dtype != item.dtype:
                    raise ValueError(
                        f"tensor {key!r}: expected {tuple(param.shape)} {param.dtype}, "
                        f"got {tuple(item.shape)} {item.dtype}"
                    )
                setattr(self, name, item)
            elif isinstance(param, BaseOP):
                param.load_state_dict(state_dict, prefix=key, _internal=True)
        if not _internal and state_dict:
            raise RuntimeError(f"Unexpected keys in state_dict: {list(state_dict.keys())}")

    def pack_weights(self) -> None:
        """After loading: give each sub-op's weights the layout its kernel wants (oneDNN's
        packed one on the CPU), kept beside the loaded weights, which the state dict holds."""
        for _, part in self._parts():
            if isinstance(part, BaseOP):
                part.pack_weights()


class StateLessOP(BaseOP):
    """An op with no weights (RoPE, the attention layer): its state_dict is always empty."""

    def _parts(self) -> Iterator[tuple[str, Any]]:
        return iter(())


T = TypeVar("T", bound=BaseOP)


class OPList(BaseOP, Generic[T]):
    """A list of ops named 0, 1, 2 and so on, matching layers.0 and layers.1 in the checkpoint."""

    def __init__(self, ops: list[T]) -> None:
        self.op_list = ops

    def __iter__(self) -> Iterator[T]:
        return iter(self.op_list)

    def _parts(self) -> Iterator[tuple[str, Any]]:
        return ((str(i), op) for i, op in enumerate(self.op_list))
