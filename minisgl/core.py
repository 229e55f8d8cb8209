"""The vocabulary every module shares: sampling parameters, requests and batches.

Names used the same way everywhere:
- `req`: one request; `batch`: the requests computed in one forward step.
- `slot`: a request's row in the page table and the token table.
- `cached_len`: tokens of a request whose KV is in the pool.
- `device_len`: tokens of a request whose ids are in the device token table (prompt + sampled,
  including a token still being sampled by an in-flight step).
- `extend_len`: tokens a step computes for a request (1 for decode, a chunk for prefill).
- `out_loc`: the pool locations (page * page_size + offset) a step writes K/V to.

This module imports nothing heavy at run time: the API server and the tokenizer process use it
without torch or numpy.
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar

if TYPE_CHECKING:
    import numpy as np

FinishReason = Literal["stop", "length", "abort"]
MAX_LOGPROBS = 20
MAX_TEMPERATURE = 2.0  # OpenAI's and vLLM's bound (1e39, a finite float, is inf as a float32)
MAX_N = 16384  # vLLM's default bound (VLLM_MAX_N_SEQUENCES) on one prompt's outputs
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# a temperature below this (and above 0) samples greedily: far enough below it, dividing the
# logits by it overflows to inf and the probabilities to NaN (vLLM, instead, samples any
# temperature below 0.01 at 0.01)
MIN_TEMPERATURE = 1e-5
# the nesting a JSON schema may have: xgrammar compiled 128 levels of arrays in 0.1 s and 256 in
# 0.7 s (growing ~7x a doubling), on one of the scheduler's grammar threads
MAX_SCHEMA_DEPTH = 128


def schema_depth(schema: object) -> int:
    """How deep a schema's objects and arrays nest (JSON text is parsed first), level by level
    rather than by recursion: a hostile schema may nest a hundred thousand deep. Text that is
    not JSON counts as flat (the grammar compiler names its error)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except RecursionError:
            return MAX_SCHEMA_DEPTH + 1
        except ValueError:
            return 0
    depth, level = 0, [schema]
    while containers := [v for v in level if isinstance(v, (Mapping, list, tuple))]:
        depth += 1
        level = [c for v in containers for c in (v.values() if isinstance(v, Mapping) else v)]
    return depth


@dataclass(frozen=True)
class PromptOptions:
    """How a prompt becomes ids, as vLLM's request fields say: whether the tokenizer adds its
    special tokens (BOS; None: for a text, not for a chat, whose template writes its own), and how
    a chat ends: the assistant's turn opened (add_generation_prompt), or the final message left
    open for the model to go on with (continue_final_message)."""

    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the output text, compiled to a grammar in the scheduler process (xgrammar).
    Exactly one kind is set. With `after` (one token of the model's vocabulary: a reasoning
    parser's end tag, `</think>`), the output is free up to that token and held after it."""

    json_schema: str | Mapping[str, Any] | None = None  # a JSON schema: JSON text, or an object
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: Sequence[str] | None = None  # one of these strings
    grammar: str | None = None  # EBNF, in xgrammar's dialect
    # xgrammar's structural tag (JSON text): free text, and what follows a trigger held to its
    # tag's content (a tool parser's calls: `ToolParser.structural_tag`)
    structural_tag: str | None = None
    after: str | None = None

    def __post_init__(self) -> None:
        if self.json_schema is not None and schema_depth(self.json_schema) > MAX_SCHEMA_DEPTH:
            raise ValueError(
                f"a structured output's json_schema nests deeper than {MAX_SCHEMA_DEPTH} levels"
            )
        if isinstance(self.json_schema, Mapping):  # a schema given as an object, as vLLM takes it
            try:
                text = json.dumps(self.json_schema)
            except (TypeError, ValueError) as e:
                raise ValueError(f"a structured output's json_schema is not JSON: {e}") from None
            object.__setattr__(self, "json_schema", text)
        for name in ("json_schema", "regex", "grammar", "structural_tag", "after"):
            if not isinstance(getattr(self, name), (str, type(None))):
                raise ValueError(f"a structured output's {name} must be a string")
        if not isinstance(self.json_object, bool):
            raise ValueError("a structured output's json_object must be a bool")
        if self.choice is not None:
            choice = self.choice
            if (
                not isinstance(choice, (list, tuple))
                or not choice
                or not all(isinstance(c, str) for c in choice)
            ):
                raise ValueError("a structured output's choice must be a non-empty list of strings")
            object.__setattr__(self, "choice", tuple(choice))
        given = [
            self.json_schema, self.json_object or None, self.regex, self.choice, self.grammar,
            self.structural_tag,
        ]  # fmt: skip
        if sum(g is not None for g in given) != 1:
            raise ValueError(
                "a structured output sets exactly one of json, regex, choice, grammar, "
                "structural_tag"
            )


class FieldError(ValueError):
    """A request refused for the value of one of its fields, `name` (the error's `param`)."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(message)
        self.name = name


class InvalidSamplingParam(FieldError):
    """A SamplingParams field's value breaks its rule: the message is the field's name and the
    requirement, or `message` where other words say it better."""

    def __init__(self, name: str, requirement: str, message: str | None = None) -> None:
        super().__init__(name, message or f"{name} {requirement}")
        self.requirement = requirement


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next tokens and when to stop. Validated on creation; temperature 0 = greedy.

    Penalties are vLLM's: presence and frequency over the output tokens (subtracted from the
    logits, once per distinct token and once per occurrence), repetition over prompt and output
    (positive logits divided by it, negative ones multiplied). min_tokens holds back eos, stop
    tokens and stop strings until that many tokens are out, unless a structured output's grammar
    allows nothing else: then it ends."""

    temperature: float = 1.0
    top_k: int = -1  # -1 or 0: off; above the vocabulary: off
    top_p: float = 1.0
    min_p: float = 0.0
    max_tokens: int | None = 16  # None: the rest of the context
    ignore_eos: bool = False
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
    seed: int | None = None
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] | Sequence[tuple[int, float]] | None = None
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    structured: StructuredOutput | None = None
    n: int = 1  # offline: outputs per prompt (the server's n is the request's)
    # vLLM's: the logprob of each prompt token after the first, and this many likeliest
    # tokens' (the prompt is computed whole, its cached prefix not reused)
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        def check(ok: bool, name: str, requirement: str) -> None:
            if not ok:
                raise InvalidSamplingParam(name, requirement)

        for name in _NUMBERS:  # numpy's scalars as Python's, so every reader sees one form
            object.__setattr__(self, name, _plain_number(getattr(self, name)))

        check(
            _is_finite(self.temperature) and 0 <= self.temperature <= MAX_TEMPERATURE,
            "temperature",
            f"must be in [0, {MAX_TEMPERATURE:g}]",
        )
        check(
            _is_int64(self.top_k) and (self.top_k in (-1, 0) or self.top_k >= 1),
            "top_k",
            "must be -1 (disabled) or >= 1",
        )
        check(_is_finite(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        check(_is_finite(self.min_p) and 0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        check(
            self.max_tokens is None or (_is_int64(self.max_tokens) and self.max_tokens >= 1),
            "max_tokens",
            "must be >= 1",
        )
        check(self.seed is None or _is_int64(self.seed), "seed", "must be a 64-bit integer")
        if self.seed == -1:  # vLLM's: no seed
            object.__setattr__(self, "seed", None)
        check(
            self.logprobs is None
            or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
            "logprobs",
            f"must be an integer in [0, {MAX_LOGPROBS}]",
        )
        check(isinstance(self.ignore_eos, bool), "ignore_eos", "must be a bool")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            check(_is_finite(value) and -2 <= value <= 2, name, "must be in [-2, 2]")
        check(
            _is_finite(self.repetition_penalty) and self.repetition_penalty > 0,
            "repetition_penalty",
            "must be > 0",
        )
        check(_is_int64(self.min_tokens) and self.min_tokens >= 0, "min_tokens", "must be >= 0")
        check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"must be at most max_tokens ({self.max_tokens})",
        )
        check(
            isinstance(self.include_stop_str_in_output, bool),
            "include_stop_str_in_output",
            "must be a bool",
        )
        check(
            self.structured is None or isinstance(self.structured, StructuredOutput),
            "structured",
            "must be a StructuredOutput",
        )
        check(_is_int(self.n) and 1 <= self.n <= MAX_N, "n", f"must be in [1, {MAX_N}]")
        check(
            self.prompt_logprobs is None
            or (_is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
            "prompt_logprobs",
            f"must be an integer in [0, {MAX_LOGPROBS}]",
        )
        bias = self.logit_bias or ()
        check(
            isinstance(bias, (Mapping, list, tuple)), "logit_bias", "must map token ids to biases"
        )
        items = list(bias.items()) if isinstance(bias, Mapping) else list(bias)
        items = [tuple(map(_plain_number, p)) if isinstance(p, (list, tuple)) else p for p in items]
        check(
            all(
                isinstance(p, (list, tuple)) and len(p) == 2 and _is_int64(p[0]) and p[0] >= 0
                for p in items
            ),
            "logit_bias",
            "keys must be token ids",
        )
        check(
            all(_is_finite(b) and -100 <= b <= 100 for _, b in items),
            "logit_bias",
            "values must be in [-100, 100]",
        )
        pairs = tuple(sorted(items))
        check(
            len({token for token, _ in pairs}) == len(pairs),
            "logit_bias",
            "names a token id twice",
        )
        object.__setattr__(self, "logit_bias", pairs)
        # normalise to hashable tuples once, here, so every reader sees one form
        lists = (list, tuple, type(None))
        check(isinstance(self.stop, (str, *lists)), "stop", "must be a string or a list of strings")
        check(isinstance(self.stop_token_ids, lists), "stop_token_ids", "must be a list of ints")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        check(all(isinstance(s, str) and s for s in stop), "stop", "must be non-empty strings")
        check(all(_is_unicode(s) for s in stop), "stop", "strings must be valid Unicode")
        stop_ids = tuple(map(_plain_number, self.stop_token_ids or ()))
        check(all(_is_int64(t) and t >= 0 for t in stop_ids), "stop_token_ids", "must be ints >= 0")
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", stop_ids)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE or self.top_k == 1

    @property
    def processes_logits(self) -> bool:
        """Its logits are changed before it samples: a token mask (structured output, or
        min_tokens), logit_bias or penalties."""
        return bool(self.logit_bias or self.min_tokens or self.structured) or self.has_penalties

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty) or (
            self.repetition_penalty != 1.0
        )


def choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """The params of n independent choices of one prompt (each with n=1): distinct seeds derived
    from a given seed (choice 0 keeps it, so n=1 and the first of n agree); without one, the
    scheduler draws a seed each. Only choice 0 asks for the prompt's logprobs: the others share
    its (a prompt's are computed, detokenized and formatted once, whatever n, as vLLM's)."""
    first = replace(params, n=1)
    rest = first if params.prompt_logprobs is None else replace(first, prompt_logprobs=None)
    if params.seed is None:
        return [first] + [rest] * (n - 1)
    # the others' wrapped to 63 bits: never -1, which asks for no seed
    return [first] + [replace(rest, seed=(params.seed + i) % 2**63) for i in range(1, n)]


_NUMBERS = (
    "temperature", "top_k", "top_p", "min_p", "max_tokens", "seed", "logprobs", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "min_tokens", "n", "prompt_logprobs",
)  # fmt: skip


def _plain_number(x: Any) -> Any:
    """A numpy integer as an int and a numpy float as a float; anything else as it is."""
    if type(x) in (int, float, bool):
        return x
    if isinstance(x, numbers.Integral):
        return int(x)
    if isinstance(x, numbers.Real):
        return float(x)
    return x


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_int64(x: Any) -> bool:
    return _is_int(x) and INT64_MIN <= x <= INT64_MAX


def _is_finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _is_unicode(s: str) -> bool:
    """False for a string no UTF-8 encoder accepts (a lone surrogate)."""
    try:
        s.encode()
    except UnicodeEncodeError:
        return False
    return True


def check_prompt(
    prompt_ids: Sequence[int], max_seq_len: int, vocab_size: int, params: SamplingParams
) -> None:
    """Raise ValueError unless the request can be served: a non-empty prompt of known token ids,
    room in the context for at least one generated token, for min_tokens of them, and for
    max_tokens when it is given, and a logit_bias on known tokens. A field at fault is named
    (InvalidSamplingParam)."""
    max_tokens = params.max_tokens
    bad_bias = next((t for t, _ in params.logit_bias if t >= vocab_size), None)  # type: ignore[union-attr]
    if bad_bias is not None:
        raise InvalidSamplingParam(
            "logit_bias", f"token id {bad_bias} is outside the vocabulary [0, {vocab_size})"
        )
    if len(prompt_ids) == 0:
        raise ValueError("the prompt is empty")
    if len(prompt_ids) >= max_seq_len:
        raise ValueError(
            f"this model's maximum context length is {max_seq_len} tokens; the prompt has "
            f"{len(prompt_ids)}, leaving no room for a generated token"
        )
    if max_tokens is not None and len(prompt_ids) + max_tokens > max_seq_len:
        raise InvalidSamplingParam(
            "max_tokens",
            f"must be at most {max_seq_len - len(prompt_ids)} for this prompt",
            # vLLM's words
            f"This model's maximum context length is {max_seq_len} tokens. However, you requested "
            f"{len(prompt_ids) + max_tokens} tokens ({len(prompt_ids)} in the messages, "
            f"{max_tokens} in the completion). Please reduce the length of the messages or "
            "completion.",
        )
    check_min_tokens_room(len(prompt_ids), max_seq_len, params)
    check_token_ids(prompt_ids, vocab_size)


def check_min_tokens_room(prompt_len: int, max_seq_len: int, params: SamplingParams) -> None:
    """Raise InvalidSamplingParam where min_tokens do not fit in the context after the prompt
    (a prompt that leaves no room is check_prompt's refusal)."""
    room = max_seq_len - prompt_len
    if 0 < room < params.min_tokens:
        raise InvalidSamplingParam(
            "min_tokens",
            f"must be at most the {room} tokens that the prompt leaves in this model's context "
            f"of {max_seq_len}",
        )


def check_token_ids(ids: Sequence[int], vocab_size: int) -> None:
    """Raise ValueError unless every id is an int in [0, vocab_size)."""
    # the common case in C loops: a Python loop over every id held the GPU idle for ~12 ms at
    # the start of the offline benchmark (256 prompts, 143k ids)
    if not ids or (set(map(type, ids)) == {int} and min(ids) >= 0 and max(ids) < vocab_size):
        return
    bad = next((t for t in ids if not _is_int(t) or not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"token id {bad!r} is outside the vocabulary [0, {vocab_size})")


@dataclass(eq=False)
class Req:
    """One request. Owned and advanced by the scheduler only."""

    rid: int
    token_ids: list[int]  # the prompt when created, then every sampled token the host has seen
    params: SamplingParams
    seed: int  # the sampling seed: params.seed, or one drawn at arrival
    slot: int = -1
    cached_len: int = 0
    device_len: int = 0
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache at first admission
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    num_prompt_tokens: int = field(init=False)
    stop_ids: frozenset[int] = field(init=False)  # params.stop_token_ids, looked up every token

    def __post_init__(self) -> None:
        self.num_prompt_tokens = self.device_len = len(self.token_ids)
        self.stop_ids = frozenset(self.params.stop_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Sampled tokens the host has seen."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_sampled(self) -> int:
        """Tokens sampled so far, including one an in-flight step is still producing."""
        return self.device_len - self.num_prompt_tokens

    @property
    def is_prefilling(self) -> bool:
        return self.cached_len < self.device_len - 1

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class EngineLayout:
    """What the scheduler knows of the engine: the KV pool's size and the device tables' shapes.
    Both tables have a row per slot and one more: in the page table the padding request's (the
    dummy page), in the token table a sink for the tokens of requests that sample nothing."""

    num_pages: int
    page_size: int
    num_slots: int
    page_table_width: int
    token_table_width: int
    max_seq_len: int  # prompt + output tokens of one request, at most
    vocab_size: int

    @property
    def sink_slot(self) -> int:
        return self.num_slots


Column = TypeVar("Column")


@dataclass(frozen=True)
class BatchInputs(Generic[Column]):
    """A batch's inputs by name: integer columns on the host (numpy) or int32 views on the device
    (torch), one form or the other. Entries index the flattened [slot, position] tables."""

    # per token
    positions: Column
    token_entries: Column  # where its id is in the token table
    page_entries: Column  # where its KV location is in the page table
    # per request
    slots: Column  # page-table row
    seq_lens: Column  # KV length after this step
    longest_first: Column  # rows by seq_len, longest first
    cu_seqlens_q: Column  # [size + 1]: request i computes rows cu[i]:cu[i + 1]
    last_indices: Column  # row of each request's last new token
    sample_entries: Column  # token-table entry of its sampled token
    # (flat entries, values) written into the tables before the step reads them; empty: none
    page_write_entries: Column
    page_write_values: Column
    token_write_entries: Column
    token_write_values: Column
    # prompt logprobs (a prefill's only): the rows whose logits give one, and the prompt token
    # each row's logits are asked about (the next one)
    prompt_rows: Column
    prompt_targets: Column


@dataclass(frozen=True)
class TokenMasks:
    """The tokens some rows of a batch may sample next (from a grammar, or min_tokens holding back
    the stop tokens): row rows[i] may sample token t iff bit t % 32 of bits[i, t // 32] is set."""

    rows: list[int]
    bits: np.ndarray  # int32 [len(rows), ceil(vocab_size / 32)]


@dataclass(frozen=True, eq=False)
class Batch:
    """The requests of one forward step, as the scheduler planned it on the host.

    The lists are snapshots taken when the step was scheduled (the requests move on afterwards):
    request i computes tokens [prefix_lens[i], prefix_lens[i] + extend_lens[i]).

    A batch names its tokens by their entries in the device tables, not by value: the forward
    reads the ids and KV locations itself, so a step can be launched before the host has seen
    the tokens the step before it sampled.
    """

    reqs: list[Req]
    prefix_lens: list[int]
    extend_lens: list[int]
    sample_rows: list[int]  # rows whose sampled token is kept (a mid-prompt chunk samples nothing)
    is_decode: bool
    inputs: BatchInputs[np.ndarray]
    processed_rows: list[int] = field(default_factory=list)  # rows that sample, processes_logits
    token_masks: TokenMasks | None = None
    # (request row, first prompt position, count): its part of inputs.prompt_rows, in order
    prompt_spans: list[tuple[int, int, int]] = field(default_factory=list)
    num_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "num_tokens", len(self.inputs.positions))

    @property
    def size(self) -> int:
        return len(self.reqs)
