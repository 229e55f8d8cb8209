from .detokenizer import IncrementalDetokenizer
from .worker import TokenizerWorker, prompt_ids, run_tokenizer

__all__ = ["IncrementalDetokenizer", "TokenizerWorker", "prompt_ids", "run_tokenizer"]
