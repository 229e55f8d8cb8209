from .comm import all_gather, all_reduce, broadcast
from .info import TPInfo, get_tp_info, set_tp_info

__all__ = ["TPInfo", "all_gather", "all_reduce", "broadcast", "get_tp_info", "set_tp_info"]
