"""minisgl: a compact, readable and fast LLM inference engine."""

from .core import SamplingParams
from .llm import LLM

__all__ = ["LLM", "SamplingParams"]
