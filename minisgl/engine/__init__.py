from .config import EngineConfig
from .engine import Engine, ForwardOutput
from .sampler import SampleOutput, Sampler, SamplingArgs

__all__ = ["Engine", "EngineConfig", "ForwardOutput", "SampleOutput", "Sampler", "SamplingArgs"]
