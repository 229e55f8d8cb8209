"""Structured output: each constrained request's grammar (xgrammar, which vLLM and SGLang use),
compiled on a thread of the scheduler process and cached per constraint, and the request's
matcher, advanced by its tokens. The matcher fills the request's row of a batch's token masks.
A constraint that starts `after` a token (the end of the thinking) waits for it unmatched.

xgrammar imports torch, so it is imported here, in the scheduler, and only when a constraint
arrives: its tokenizer tables took 1.3 s to build for Qwen3's vocabulary on a 2-core CPU.
"""

import json
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from minisgl.core import StructuredOutput

CACHED_GRAMMARS = 256  # compiled constraints kept for reuse, least recently used dropped first
_OBJECT_SCHEMA = '{"type": "object"}'


@dataclass(frozen=True)
class _Compiler:
    compiler: Any  # xgrammar's GrammarCompiler
    tokenizer: Any


class Grammars:
    """The compiled grammars and the matchers (by request id) of one scheduler: those that hold
    their request's tokens, and those waiting for their start token."""

    def __init__(self, model_path: Path, vocab_size: int, eos_ids: Sequence[int]) -> None:
        self._model_path = model_path
        self._vocab_size = vocab_size
        self._eos_ids = list(eos_ids)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._compiler: Future[_Compiler] | None = None
        self._compiled: OrderedDict[StructuredOutput, Future[Any]] = OrderedDict()
        self._matchers: dict[int, Any] = {}
        self._waiting: dict[int, tuple[int, Any]] = {}  # rid -> (start token, matcher)

    def compile(self, spec: StructuredOutput) -> Future[Any]:
        """The constraint's compiled grammar (whatever token it starts after), compiling it on the
        grammar thread if new."""
        if self._compiler is None:
            self._compiler = self._thread.submit(self._new_compiler)
        key = spec if spec.after is None else replace(spec, after=None)
        future = self._compiled.get(key)
        if future is None:
            future = self._thread.submit(_compile, self._compiler, key)
            self._compiled[key] = future
            if len(self._compiled) > CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        self._compiled.move_to_end(key)
        return future

    def _new_compiler(self) -> _Compiler:
        import xgrammar

        from minisgl.tokenizer.loader import load_tokenizer

        tokenizer = load_tokenizer(self._model_path)
        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer,
            vocab_size=self._vocab_size,
            stop_token_ids=self._eos_ids or None,  # None: the tokenizer's own
        )
        return _Compiler(xgrammar.GrammarCompiler(info, max_threads=1), tokenizer)

    def check(self, spec: StructuredOutput, compiled: Future[Any]) -> tuple[Any, int | None]:
        """The compiled grammar, once it is, and the id of the token it starts after (None: from
        the first); raises ValueError if it failed to compile, or `after` is no one token."""
        try:
            grammar = compiled.result()
        except RuntimeError as e:  # xgrammar's error for a schema, regex or grammar it refuses
            raise ValueError(f"invalid structured output: {str(e).strip().splitlines()[-1]}") from e
        if spec.after is None:
            return grammar, None
        assert self._compiler is not None, "a grammar compiled before its compiler"
        ids = self._compiler.result().tokenizer.encode(spec.after, add_special_tokens=False)
        if len(ids) != 1:
            raise ValueError(
                f"a structured output after {spec.after!r}: that is {len(ids)} tokens of this "
                "model's vocabulary, not one"
            )
        return grammar, ids[0]

    def start(self, rid: int, spec: StructuredOutput, compiled: Future[Any]) -> None:
        """Give a request a matcher at the grammar's start, holding its tokens now or once its
        start token comes; raises ValueError as `check` does."""
        import xgrammar

        grammar, start_token = self.check(spec, compiled)
        matcher = xgrammar.GrammarMatcher(grammar)
        if start_token is None:
            self._matchers[rid] = matcher
        else:
            self._waiting[rid] = (start_token, matcher)

    @property
    def active(self) -> bool:
        """Some request has a matcher."""
        return bool(self._matchers or self._waiting)

    def has(self, rid: int) -> bool:
        """The request has a matcher (holding its tokens, or waiting for its start token): its
        next step's mask depends on the token it samples now."""
        return rid in self._matchers or rid in self._waiting

    def holds(self, rid: int) -> bool:
        """The request's grammar holds its next token."""
        return rid in self._matchers

    def accept(self, rid: int, token: int) -> bool:
        """Advance a request's matcher by its sampled token (or start it, if that is its start
        token); True when the grammar has ended (or refuses the token, which the mask prevents)."""
        if rid in self._waiting:
            start, matcher = self._waiting[rid]
            if token == start:
                del self._waiting[rid]
                self._matchers[rid] = matcher
            return False
        matcher = self._matchers[rid]
        return not matcher.accept_token(token) or matcher.is_terminated()

    def fill_mask(self, rid: int, bits: np.ndarray, row: int) -> None:
        self._matchers[rid].fill_next_token_bitmask(bits, row)

    def drop(self, rid: int) -> None:
        self._matchers.pop(rid, None)
        self._waiting.pop(rid, None)


def _compile(compiler: Future[_Compiler], spec: StructuredOutput) -> Any:
    """The grammar of one constraint. JSON allows no free whitespace (vLLM's
    disable_any_whitespace): sampled whitespace otherwise runs to the token limit."""
    c = compiler.result().compiler
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
