from .detokenizer import IncrementalDetokenizer

__all__ = ["IncrementalDetokenizer"]
