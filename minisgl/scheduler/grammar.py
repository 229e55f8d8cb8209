"""Structured output: each constrained request's grammar (xgrammar, which vLLM and SGLang use),
compiled on a thread of the scheduler process and cached per constraint, and the request's
matcher, advanced by its tokens. The matcher fills the request's row of a batch's token masks.

xgrammar imports torch, so it is imported here, in the scheduler, and only when a constraint
arrives: its tokenizer tables took 1.3 s to build for Qwen3's vocabulary on a 2-core CPU.
"""

import json
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from minisgl.core import StructuredOutput

CACHED_GRAMMARS = 256  # compiled constraints kept for reuse, least recently used dropped first
_OBJECT_SCHEMA = '{"type": "object"}'


class Grammars:
    """The compiled grammars and the live matchers (by request id) of one scheduler."""

    def __init__(self, model_path: Path, vocab_size: int, eos_ids: Sequence[int]) -> None:
        self._model_path = model_path
        self._vocab_size = vocab_size
        self._eos_ids = list(eos_ids)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._compiler: Future[Any] | None = None
        self._compiled: OrderedDict[StructuredOutput, Future[Any]] = OrderedDict()
        self._matchers: dict[int, Any] = {}

    def compile(self, spec: StructuredOutput) -> Future[Any]:
        """The constraint's compiled grammar, compiling it on the grammar thread if new."""
        if self._compiler is None:
            self._compiler = self._thread.submit(self._new_compiler)
        future = self._compiled.get(spec)
        if future is None:
            future = self._thread.submit(_compile, self._compiler, spec)
            self._compiled[spec] = future
            if len(self._compiled) > CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        self._compiled.move_to_end(spec)
        return future

    def _new_compiler(self) -> Any:
        import xgrammar

        from minisgl.tokenizer.loader import load_tokenizer

        info = xgrammar.TokenizerInfo.from_huggingface(
            load_tokenizer(self._model_path),
            vocab_size=self._vocab_size,
            stop_token_ids=self._eos_ids or None,  # None: the tokenizer's own
        )
        return xgrammar.GrammarCompiler(info, max_threads=1)

    @staticmethod
    def check(compiled: Future[Any]) -> Any:
        """The compiled grammar, once it is; raises ValueError if it failed to compile."""
        try:
            return compiled.result()
        except RuntimeError as e:  # xgrammar's error for a schema, regex or grammar it refuses
            raise ValueError(f"invalid structured output: {str(e).strip().splitlines()[-1]}") from e

    def start(self, rid: int, compiled: Future[Any]) -> None:
        """Give a request a matcher at the grammar's start; raises ValueError if it failed to
        compile."""
        import xgrammar

        self._matchers[rid] = xgrammar.GrammarMatcher(self.check(compiled))

    @property
    def active(self) -> bool:
        """Some request has a matcher."""
        return bool(self._matchers)

    def has(self, rid: int) -> bool:
        return rid in self._matchers

    def accept(self, rid: int, token: int) -> bool:
        """Advance a request's matcher by its sampled token; True when the grammar has ended (or
        refuses the token, which the mask prevents)."""
        matcher = self._matchers[rid]
        return not matcher.accept_token(token) or matcher.is_terminated()

    def fill_mask(self, rid: int, bits: np.ndarray, row: int) -> None:
        self._matchers[rid].fill_next_token_bitmask(bits, row)

    def drop(self, rid: int) -> None:
        self._matchers.pop(rid, None)


def _compile(compiler: Future[Any], spec: StructuredOutput) -> Any:
    """The grammar of one constraint. JSON allows no free whitespace (vLLM's
    disable_any_whitespace): sampled whitespace otherwise runs to the token limit."""
    c = compiler.result()
    if spec.json_schema is not None:
        return c.compile_json_schema(spec.json_schema, any_whitespace=False)
    if spec.json_object:  # not strict: an object may have any properties
        return c.compile_json_schema(_OBJECT_SCHEMA, any_whitespace=False, strict_mode=False)
    if spec.regex is not None:
        return c.compile_regex(spec.regex)
    if spec.choice is not None:
        alternatives = " | ".join(json.dumps(choice, ensure_ascii=False) for choice in spec.choice)
        return c.compile_grammar(f"root ::= {alternatives}")
    return c.compile_grammar(spec.grammar)
