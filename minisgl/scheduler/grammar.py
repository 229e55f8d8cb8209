"""Structured output: each constrained request's grammar (xgrammar, which vLLM and SGLang use),
compiled on threads of the scheduler process and cached per constraint, and the request's
matcher, advanced by its tokens. The matcher fills the request's row of a batch's token masks.
A constraint that starts `after` a token (the end of the thinking) waits for it unmatched.

xgrammar imports torch, so it is imported here, in the scheduler, and only when a constraint
arrives: its tokenizer tables took 1.3 s to build for Qwen3's vocabulary on a 2-core CPU.
"""

import json
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from minisgl.core import StructuredOutput
from minisgl.scheduler import grammar_cost, regex_cost
from minisgl.scheduler.regex_cost import MAX_REGEX_LENGTH
from minisgl.scheduler.unenforced import (
    MAX_COUNT,
    misread_in_regex,
    repeats_past_limit,
    unenforced_keyword,
)

CACHED_GRAMMARS = 256  # compiled constraints kept for reuse, least recently used dropped first
COMPILE_THREADS = 4
# a request's matcher steps (its tokens' masks and tokens accepted, all its prompts and choices
# together) may take this long in one scheduler step, in their thread's CPU time (other threads'
# work, on few cores, adds wall time); a grammar whose first mask takes longer is refused, a
# request whose steps do is ended: xgrammar matches an ambiguous regex or grammar in time that
# grows with the output (`([a-z]{1,5}){1,32}`: 0.53 s a mask on a 2-core CPU, a JSON schema's
# 0.13 ms), and every request of the step waits for them (16 choices of 80-150 ms a step each:
# another client's request waited up to 14 s)
MAX_MATCH_SECONDS = 0.25
_TOO_SLOW = (
    "structured output too costly to match: its masks (all its prompts and choices together) "
    f"took over {MAX_MATCH_SECONDS} s of CPU time in one step"
)
_OBJECT_SCHEMA = '{"type": "object"}'
# xgrammar's log prefix on its error messages: "[21:38:14] /project/cpp/x.cc:5088: "
_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


@dataclass(frozen=True)
class _Compiler:
    compiler: Any  # xgrammar's GrammarCompiler
    tokenizer: Any
    info: Any  # its TokenizerInfo


class Grammars:
    """The compiled grammars and the matchers (by request id) of one scheduler: those that hold
    their request's tokens, and those waiting for their start token."""

    def __init__(
        self,
        model_path: Path,
        vocab_size: int,
        eos_ids: Sequence[int],
        timed: bool = True,
        alone: bool = True,
    ) -> None:
        """timed: hold requests' matcher steps to MAX_MATCH_SECONDS (TP rank 0 only: the others
        follow its word, as their own times would decide apart). alone: no other rank keeps
        matchers, so a request past its time is ended as one whose matcher cannot go on (at once,
        before its step's tokens are taken) and fills no more masks meanwhile."""
        self._model_path = model_path
        self._vocab_size = vocab_size
        self._eos_ids = list(eos_ids)
        # a few at once: one slow schema (a 12,000-value enum: 0.67 s) must not hold the others
        self._threads = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar")
        self._compiler: Future[_Compiler] | None = None
        # when (time.monotonic()) the compiler was built: Qwen3's tokenizer tables took 1.3 s on
        # a 2-core CPU, which the first grammars' deadlines must not count
        self.compiler_built_at: float | None = None
        self._compiled: OrderedDict[StructuredOutput, Future[Any]] = OrderedDict()
        self._matchers: dict[int, Any] = {}
        self._waiting: dict[int, tuple[int, Any]] = {}  # rid -> (start token, matcher)
        self._request_of: dict[int, int] = {}  # rid -> the client request it is a row of
        self._rows_of: dict[int, set[int]] = {}  # request -> its rows with a matcher
        self._spent: dict[int, float] = {}  # request -> its matcher steps' seconds this step
        self._ending: set[int] = set()  # requests past MAX_MATCH_SECONDS, to be ended
        self._timed = timed
        self._alone = alone
        self._failed: list[tuple[int, str]] = []  # (request, why) whose matcher cannot go on
        self._too_slow: list[tuple[int, str]] = []  # (request, why) whose matcher took too long

    def compile(self, spec: StructuredOutput) -> Future[Any]:
        """The constraint's compiled grammar (whatever token it starts after), compiling it on a
        grammar thread if new."""
        if self._compiler is None:
            self._compiler = self._threads.submit(self._new_compiler)
        key = spec if spec.after is None else replace(spec, after=None)
        future = self._compiled.get(key)
        if future is None:
            future = self._threads.submit(_compile, self._compiler, key, self._timed)
            self._compiled[key] = future
            if len(self._compiled) > CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        self._compiled.move_to_end(key)
        return future

    def abandon(self, spec: StructuredOutput, compiled: Future[Any]) -> None:
        """No request waits for this compile any more: drop it if no thread has taken it yet (a
        flood of costly schemas whose requests are gone must not hold the threads). One begun
        runs on (nothing can stop it) and stays cached: a retry finds it, not a second compile."""
        key = spec if spec.after is None else replace(spec, after=None)
        if compiled.cancel() and self._compiled.get(key) is compiled:
            del self._compiled[key]

    def _new_compiler(self) -> _Compiler:
        import xgrammar

        from minisgl.tokenizer.loader import load_tokenizer

        tokenizer = load_tokenizer(self._model_path)
        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer,
            vocab_size=self._vocab_size,
            stop_token_ids=self._eos_ids or None,  # None: the tokenizer's own
        )
        # the grammars are cached here (CACHED_GRAMMARS), not again without bound in xgrammar
        compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.compiler_built_at = time.monotonic()
        return _Compiler(compiler, tokenizer, info)

    def check(self, spec: StructuredOutput, compiled: Future[Any]) -> tuple[Any, int | None]:
        """The compiled grammar, once it is, and the id of the token it starts after (None: from
        the first); raises ValueError if it failed to compile, or `after` is no one token."""
        try:
            grammar = compiled.result()
        except ValueError:  # refused here, before xgrammar: it says why
            raise
        except Exception as e:  # what xgrammar raises on a schema, regex or grammar it refuses
            # (a RuntimeError whose last line says why, a TypeError on a value of another type);
            # whatever it is, a request's constraint must not end the scheduler
            lines = str(e).strip().splitlines()
            # a number past a double's range (1e400) raises one of no text
            why = (
                _XGRAMMAR_PREFIX.sub("", lines[-1]) if lines else "the grammar compiler refused it"
            )
            raise ValueError(f"invalid structured output: {why}") from e
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

    def start(self, rid: int, spec: StructuredOutput, compiled: Future[Any], request: int) -> None:
        """Give a row (`rid`) of a client request a matcher at the grammar's start, holding its
        tokens now or once its start token comes; raises ValueError as `check` does."""
        import xgrammar

        grammar, start_token = self.check(spec, compiled)
        matcher = xgrammar.GrammarMatcher(grammar)
        self._request_of[rid] = request
        self._rows_of.setdefault(request, set()).add(rid)
        if request in self._ending:  # its other rows are ending
            self._past_time.append((rid, _TOO_SLOW))
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
        if self._alone and self._request_of[rid] in self._ending:
            return False  # it ends before its next step (take_failed), its matcher unused
        matcher = self._matchers[rid]
        return not self._timed_call(rid, matcher.accept_token, token) or matcher.is_terminated()

    def new_step(self) -> None:
        """A scheduler step begins: each request's matcher time is counted afresh."""
        self._spent.clear()

    def fill_mask(self, rid: int, bits: np.ndarray, row: int) -> None:
        """Fill the row's mask (one alone skips a request that is ending: the token its row
        samples is never taken)."""
        if self._alone and self._request_of[rid] in self._ending:
            return
        self._timed_call(rid, self._matchers[rid].fill_next_token_bitmask, bits, row)
        if not bits[row].any():  # a grammar that dead-ends (`a[^\s\S]`) after some tokens
            self._failed.append((rid, "structured output allows no next token"))

    def _timed_call(self, rid: int, call: Callable[..., Any], *args: Any) -> Any:
        start = time.thread_time()
        result = call(*args)
        request = self._request_of[rid]
        if not self._timed or request in self._ending:
            return result
        self._spent[request] = self._spent.get(request, 0.0) + time.thread_time() - start
        if self._spent[request] > MAX_MATCH_SECONDS:
            self._ending.add(request)
            self._past_time.extend((r, _TOO_SLOW) for r in self._rows_of[request])
        return result

    @property
    def _past_time(self) -> list[tuple[int, str]]:
        """Where the rows of a request past MAX_MATCH_SECONDS go: alone, with those whose matcher
        cannot go on; else to rank 0's word for every rank (take_too_slow)."""
        return self._failed if self._alone else self._too_slow

    def take_failed(self) -> list[tuple[int, str]]:
        """The requests whose matcher cannot go on since the last call (no token allowed next,
        the same on every rank; alone, a request past MAX_MATCH_SECONDS too), and why: they are
        to be ended now."""
        found, self._failed = self._failed, []
        return found

    def take_too_slow(self) -> list[tuple[int, str]]:
        """The rows of each request whose matcher steps took more than MAX_MATCH_SECONDS in a
        step since the last call, and why (timed, not alone): rank 0 ends them on every rank in its
        next turn (EndRequests), before the step's tokens are taken."""
        found, self._too_slow = self._too_slow, []
        return found

    def drop(self, rid: int) -> None:
        self._matchers.pop(rid, None)
        self._waiting.pop(rid, None)
        request = self._request_of.pop(rid, None)
        if request is not None:
            rows = self._rows_of[request]
            rows.discard(rid)
            if not rows:  # its last row: _spent is cleared each step
                del self._rows_of[request]
                self._ending.discard(request)


def _compile(compiler: Future[_Compiler], spec: StructuredOutput, timed: bool) -> Any:
    """The grammar of one constraint, its first mask tried. Raises ValueError for a schema
    keyword xgrammar would compile without holding the output to it, a grammar that allows no
    token at all (`root ::= root`), or, with `timed`, a first mask past MAX_MATCH_SECONDS."""
    import xgrammar

    grammar = _grammar(compiler.result(), spec)
    start = time.thread_time()
    mask = xgrammar.allocate_token_bitmask(1, grammar.tokenizer_info.vocab_size)
    xgrammar.GrammarMatcher(grammar).fill_next_token_bitmask(mask)
    if timed and (seconds := time.thread_time() - start) > MAX_MATCH_SECONDS:
        raise ValueError(
            f"invalid structured output: too costly to match (its first token's mask took "
            f"{seconds:.2f} s, over {MAX_MATCH_SECONDS} s)"
        )
    if not mask.any():
        raise ValueError("invalid structured output: it allows no token at all")
    return grammar


def _grammar(compiler: _Compiler, spec: StructuredOutput) -> Any:
    """The grammar of one constraint, compiled by xgrammar. JSON allows no free whitespace (vLLM's
    disable_any_whitespace): sampled whitespace otherwise runs to the token limit."""
    c = compiler.compiler
    if spec.json_schema is not None:
        try:  # as vLLM: xgrammar would compile the first value of '{...} x' and skip the checks
            schema = json.loads(spec.json_schema)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"invalid structured output: the JSON schema is not JSON: {e}"
            ) from None
        _refuse_unenforced(schemas=[schema])
        return c.compile_json_schema(spec.json_schema, any_whitespace=False)
    if spec.json_object:  # not strict: an object may have any properties
        return c.compile_json_schema(_OBJECT_SCHEMA, any_whitespace=False, strict_mode=False)
    if spec.regex is not None:
        _refuse_unenforced(regexes=[spec.regex])
        return c.compile_regex(spec.regex)
    if spec.choice is not None:
        alternatives = " | ".join(json.dumps(choice, ensure_ascii=False) for choice in spec.choice)
        return c.compile_grammar(f"root ::= {alternatives}")
    if spec.structural_tag is not None:
        tag = json.loads(spec.structural_tag)
        if not isinstance(tag, dict):  # xgrammar's TypeError otherwise
            raise ValueError("invalid structured output: a structural tag is a JSON object")
        _refuse_unenforced(
            schemas=[
                *_tag_parts(tag, "json_schema", "json_schema"),
                *_tag_parts(tag, "qwen_xml_parameter", "json_schema"),
            ],
            regexes=_tag_parts(tag, "regex", "pattern"),
            grammars=_tag_parts(tag, "grammar", "grammar"),
        )
        built = _tag_grammar(tag, compiler.info)
        if built is not None and (why := grammar_cost.too_costly(built)) is not None:
            raise ValueError(f"invalid structured output: a structural tag {why}")
        return c.compile_structural_tag(tag)
    _refuse_unenforced(grammars=[spec.grammar])
    return c.compile_grammar(spec.grammar)


def _refuse_unenforced(
    schemas: Sequence[Any] = (), regexes: Sequence[Any] = (), grammars: Sequence[Any] = ()
) -> None:
    """Raise ValueError for a constraint xgrammar would not hold the output to, or too costly."""
    patterns = [r for r in regexes if isinstance(r, str)]
    patterns += [p for schema in schemas for p in _patterns(schema)]
    if sum(map(len, patterns)) > MAX_REGEX_LENGTH:
        raise ValueError(
            f"invalid structured output: over {MAX_REGEX_LENGTH} characters of regex in all"
        )
    for schema in schemas:
        if (found := unenforced_keyword(schema, "#")) is not None:
            raise ValueError(f"invalid structured output: {found} is not supported")
    texts = [(r, False) for r in regexes] + [(g, True) for g in grammars]
    if any(isinstance(t, str) and repeats_past_limit(t, ebnf) for t, ebnf in texts):
        raise ValueError(f"invalid structured output: a repetition count past {MAX_COUNT}")
    for regex in regexes:
        if isinstance(regex, str) and (why := misread_in_regex(regex)) is not None:
            raise ValueError(f"invalid structured output: a regex with {why}")
        if isinstance(regex, str) and (why := regex_cost.too_costly(regex)) is not None:
            raise ValueError(f"invalid structured output: a regex {why}")
    for grammar in grammars:
        if isinstance(grammar, str) and (why := grammar_cost.too_costly(grammar)) is not None:
            raise ValueError(f"invalid structured output: a grammar {why}")


def _patterns(node: Any) -> list[str]:
    """Every string under a "pattern" key in a JSON schema (a property named so too)."""
    if isinstance(node, list):
        return [p for item in node for p in _patterns(item)]
    if not isinstance(node, dict):
        return []
    own = [node["pattern"]] if isinstance(node.get("pattern"), str) else []
    return own + [p for value in node.values() for p in _patterns(value)]


def _tag_parts(node: Any, kind: str, field: str) -> list[Any]:
    """The `field` of each part of a structural tag of type `kind` (json_schema's json_schema, a
    regex's pattern, a grammar's grammar)."""
    if isinstance(node, list):
        return [s for item in node for s in _tag_parts(item, kind, field)]
    if not isinstance(node, dict):
        return []
    if node.get("type") == kind:
        return [node.get(field)]
    return [s for value in node.values() for s in _tag_parts(value, kind, field)]


# a JSON schema's part of a structural tag, for its reading: a schema is not read (its compile and
# first mask are timed), here as there; but an XML style's may match nothing (no property required)
_SCHEMA_STAND_IN = {"type": "const_string", "value": "{}"}
_XML_SCHEMA_STAND_IN = {"type": "optional", "content": _SCHEMA_STAND_IN}


def _tag_grammar(tag: dict[str, Any], info: Any) -> Any:
    """The grammar xgrammar builds of a structural tag, for grammar_cost to read its repeats and
    Lark parts too; None where xgrammar refuses it (its own error comes when it compiles)."""
    import xgrammar

    try:
        return xgrammar.Grammar.from_structural_tag(_Readable(info).tag(tag))
    except Exception:  # xgrammar's errors have no common class
        return None


class _Readable:
    """A structural tag that xgrammar builds without the tokenizer: each token named by a string
    gets a number of its own past the vocabulary (any one costs the reading alike), its Lark
    parts become EBNF, its JSON schemas a stand-in."""

    def __init__(self, info: Any) -> None:
        self.info = info
        self.ids: dict[str, int] = {}

    def tag(self, node: Any) -> Any:
        if isinstance(node, list):
            return [self.tag(item) for item in node]
        if not isinstance(node, dict):
            return node
        kind = node.get("type")
        if kind == "json_schema":
            return (
                _SCHEMA_STAND_IN
                if node.get("style", "json") in ("json", "gemma")
                else _XML_SCHEMA_STAND_IN
            )
        if kind == "qwen_xml_parameter":
            return _XML_SCHEMA_STAND_IN
        if (
            kind == "grammar"
            and node.get("syntax") == "lark"
            and isinstance(node.get("grammar"), str)
        ):
            import xgrammar

            lark = xgrammar.Grammar.from_lark(node["grammar"], tokenizer_info=self.info)
            return {"type": "grammar", "grammar": str(lark)}
        out = {key: self.tag(value) for key, value in node.items()}
        if kind == "token":
            out["token"] = self._id(out.get("token"))
        for key in ("exclude_tokens", "trigger_tokens"):
            if isinstance(out.get(key), list):
                out[key] = [self._id(token) for token in out[key]]
        if kind == "token_dispatch" and isinstance(out.get("rules"), list):
            out["rules"] = [
                [self._id(rule[0]), *rule[1:]] if isinstance(rule, list) and rule else rule
                for rule in out["rules"]
            ]
        return out

    def _id(self, token: Any) -> Any:
        if not isinstance(token, str):
            return token
        return self.ids.setdefault(token, self.info.vocab_size + len(self.ids))
