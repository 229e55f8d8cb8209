from .comm import DistributedCommunicator
from .info import TPInfo, get_tp_info, set_tp_info

__all__ = ["DistributedCommunicator", "TPInfo", "get_tp_info", "set_tp_info"]
