"""minisgl: a compact, readable and fast LLM inference engine."""

from typing import TYPE_CHECKING, Any

from .core import SamplingParams, StructuredOutput

if TYPE_CHECKING:
    from .llm import LLM

__all__ = ["LLM", "SamplingParams", "StructuredOutput"]


def __getattr__(name: str) -> Any:
    # LLM imports the engine (torch): only when asked for, so the server's front-end processes,
    # which import this package, start without it
    if name == "LLM":
        from .llm import LLM

        return LLM
    raise AttributeError(f"module 'minisgl' has no attribute {name!r}")
