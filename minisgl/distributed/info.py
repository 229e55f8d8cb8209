from dataclasses import dataclass


@dataclass(frozen=True)
class TPInfo:
    """This process's place in the tensor-parallel group."""

    rank: int
    size: int


_TP_INFO: TPInfo | None = None


def set_tp_info(rank: int, size: int) -> None:
    global _TP_INFO
    if not 0 <= rank < size:
        raise ValueError(f"TP rank {rank} outside [0, {size})")
    _TP_INFO = TPInfo(rank, size)


def get_tp_info() -> TPInfo:
    if _TP_INFO is None:
        raise RuntimeError("call set_tp_info() before building a model")
    return _TP_INFO
