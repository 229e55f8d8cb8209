"""The vocabulary every module shares: sampling parameters, requests, batches, the forward context.

Names used the same way everywhere:
- `req`: one request; `batch`: the requests computed in one forward step.
- `slot`: a request's row in the page table and the token table.
- `cached_len`: tokens of a request whose KV is in the pool.
- `device_len`: tokens of a request whose ids are in the device token table (prompt + sampled,
  including a token still being sampled by an in-flight step).
- `extend_len`: tokens a step computes for a request (1 for decode, a chunk for prefill).
- `out_loc`: the pool locations (page * page_size + offset) a step writes K/V to.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from minisgl.kernel import DeviceWrites, read_tables
from minisgl.utils import pack_to_device, ragged_arange, repeat_each

if TYPE_CHECKING:
    from minisgl.attention import AttentionBackend

FinishReason = Literal["stop", "length", "abort"]
TableWrites = tuple[np.ndarray, np.ndarray]  # flat entries of a device table, and their values
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next tokens and when to stop. Validated on creation; temperature 0 = greedy."""

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    max_tokens: int = 16
    ignore_eos: bool = False
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
    seed: int | None = None
    logprobs: int | None = None

    def __post_init__(self) -> None:
        def check(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        check(_is_number(self.temperature) and self.temperature >= 0, "temperature must be >= 0")
        check(
            _is_int(self.top_k) and (self.top_k in (-1, 0) or self.top_k >= 1),
            "top_k must be -1 (disabled) or >= 1",
        )
        check(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p must be in (0, 1]")
        check(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p must be in [0, 1]")
        check(_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens must be >= 1")
        check(self.seed is None or (_is_int(self.seed) and -(2**63) <= self.seed < 2**63),
              "seed must be a 64-bit integer")  # fmt: skip
        check(
            self.logprobs is None
            or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
            f"logprobs must be an integer in [0, {MAX_LOGPROBS}]",
        )
        # normalise to hashable tuples once, here, so every reader sees one form
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        check(all(isinstance(s, str) and s for s in stop), "stop must be non-empty strings")
        stop_ids = tuple(self.stop_token_ids or ())
        check(all(_is_int(t) and t >= 0 for t in stop_ids), "stop_token_ids must be ints >= 0")
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", stop_ids)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def check_prompt(prompt_ids: Sequence[int], max_seq_len: int, vocab_size: int) -> None:
    """Raise ValueError unless the prompt can be served: non-empty, known token ids, and room in
    the context for at least one generated token."""
    if len(prompt_ids) == 0:
        raise ValueError("the prompt is empty")
    if len(prompt_ids) >= max_seq_len:
        raise ValueError(
            f"this model's maximum context length is {max_seq_len} tokens; the prompt has "
            f"{len(prompt_ids)}, leaving no room for a generated token"
        )
    # the common case in C loops: a Python loop over every id held the GPU idle for ~12 ms at
    # the start of the offline benchmark (256 prompts, 143k ids)
    if (
        set(map(type, prompt_ids)) == {int}
        and min(prompt_ids) >= 0
        and max(prompt_ids) < vocab_size
    ):
        return
    bad = next((t for t in prompt_ids if not _is_int(t) or not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"token id {bad!r} is outside the vocabulary [0, {vocab_size})")


@dataclass(eq=False)
class Req:
    """One request. Owned and advanced by the scheduler only."""

    rid: int
    prompt_ids: list[int]
    params: SamplingParams
    seed: int  # the sampling seed: params.seed, or one drawn at arrival
    output_ids: list[int] = field(default_factory=list)
    slot: int = -1
    cached_len: int = 0
    device_len: int = 0
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache at first admission
    finish_reason: FinishReason | None = None
    matched_stop: str | int | None = None
    num_preemptions: int = 0

    def __post_init__(self) -> None:
        self.device_len = len(self.prompt_ids)

    @property
    def known_ids(self) -> list[int]:
        """Every token id the host has seen: prompt, then sampled."""
        return self.prompt_ids + self.output_ids

    @property
    def num_sampled(self) -> int:
        """Tokens sampled so far, including one an in-flight step is still producing."""
        return self.device_len - len(self.prompt_ids)

    @property
    def is_prefilling(self) -> bool:
        return self.cached_len < self.device_len - 1

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


# the per-token and per-request inputs of a batch, by name (the table writes travel as
# `<table>_write_entries` and `<table>_write_values`)
INPUT_FIELDS = (
    "positions", "token_entries", "page_entries", "slots", "seq_lens", "longest_first",
    "cu_seqlens_q", "last_indices", "sample_entries",
)  # fmt: skip
HostColumn = Sequence[int] | np.ndarray


@dataclass(eq=False)
class Batch:
    """The requests of one forward step and the inputs that describe it.

    Host lists are snapshots taken when the step was scheduled (the requests move on afterwards):
    request i computes tokens [prefix_lens[i], prefix_lens[i] + extend_lens[i]), which are rows
    cu_seqlens_q[i]:cu_seqlens_q[i+1] of the step's token dimension.

    The scheduler builds the inputs as int32 columns on the host (`host_inputs`); the engine puts
    them on the device in one transfer, as the tensors below: `upload` for an eager forward, or a
    copy straight into a CUDA graph's static inputs.

    A batch names its tokens by their entries in the device tables, not by value: the forward
    reads the ids and KV locations itself (`load_inputs`), so a step can be launched before the
    host has seen the tokens the step before it sampled.
    """

    reqs: list[Req]
    prefix_lens: list[int]
    extend_lens: list[int]
    sample_rows: list[int]  # rows whose sampled token is kept (a mid-prompt chunk samples nothing)
    is_decode: bool
    host_inputs: dict[str, HostColumn]  # by INPUT_FIELDS name, and the table writes
    all_logits: bool = False  # logits for every token instead of each request's last
    # on the device (int32), set by `set_device_inputs`; entries index the flattened tables
    # per token:
    positions: torch.Tensor = field(init=False)
    token_entries: torch.Tensor = field(init=False)  # where its id is in the token table
    page_entries: torch.Tensor = field(init=False)  # where its KV location is in the page table
    # per request:
    slots: torch.Tensor = field(init=False)  # page-table row
    seq_lens: torch.Tensor = field(init=False)  # KV length after this step
    longest_first: torch.Tensor = field(init=False)  # rows by seq_len, longest first
    cu_seqlens_q: torch.Tensor = field(init=False)  # [size + 1]
    last_indices: torch.Tensor = field(init=False)  # row of each request's last new token
    sample_entries: torch.Tensor = field(init=False)  # token-table entry of its sampled token
    # (flat entries, values) written into the tables before they are read
    page_writes: DeviceWrites | None = field(init=False, default=None)
    token_writes: DeviceWrites | None = field(init=False, default=None)
    attn_metadata: Any = field(init=False, default=None)  # the attention backend's, per batch
    # per token, read from the tables by load_inputs at the start of the forward
    input_ids: torch.Tensor | None = field(init=False, default=None)
    out_loc: torch.Tensor | None = field(init=False, default=None)

    @property
    def size(self) -> int:
        return len(self.reqs)

    @property
    def num_tokens(self) -> int:
        return len(self.host_inputs["positions"])

    def num_writes(self, table: str) -> int:
        """Entries the batch writes into the "page" or "token" table."""
        return len(self.host_inputs.get(f"{table}_write_entries", ()))

    def upload(self, device: torch.device) -> None:
        """Put the inputs on the device in one transfer."""
        self.set_device_inputs(pack_to_device(device, torch.int32, **self.host_inputs))

    def set_device_inputs(self, tensors: dict[str, torch.Tensor]) -> None:
        for name in INPUT_FIELDS:
            setattr(self, name, tensors[name])
        self.page_writes = _device_writes(tensors, "page")
        self.token_writes = _device_writes(tensors, "token")


def _device_writes(tensors: dict[str, torch.Tensor], table: str) -> DeviceWrites | None:
    entries = tensors.get(f"{table}_write_entries")
    return None if entries is None else (entries, tensors[f"{table}_write_values"])


def build_batch(
    reqs: list[Req],
    prefix_lens: list[int],
    extend_lens: list[int],
    page_table: torch.Tensor,
    token_table: torch.Tensor,
    sample_rows: list[int] | None = None,
    page_writes: TableWrites | None = None,
    token_writes: TableWrites | None = None,
) -> Batch:
    """The batch computing tokens [prefix, prefix + extend) of each request (in its `slot` row),
    with the writes into the page table (pool locations, from KVCacheManager.take_page_writes)
    and the token table (prompt ids, from TokenTable.take_writes) that must land before the
    batch reads either table. Its inputs are on the host: the engine uploads them.

    A sampled token goes right after its request's computed ones; a request outside
    `sample_rows` (default: all) writes its token into the token table's last row, a sink."""
    slots = [req.slot for req in reqs]
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    cu_seqlens = list(itertools.accumulate(extend_lens, initial=0))
    is_decode = cu_seqlens[-1] == len(reqs)
    if is_decode:
        token_slots, positions = np.array(slots), np.array(prefix_lens)
    else:  # thousands of tokens: built in bulk, not with a Python step per token
        token_slots = repeat_each(slots, extend_lens)
        positions = ragged_arange(prefix_lens, extend_lens)
    sample_slots = np.full(len(reqs), token_table.shape[0] - 1)
    keep = list(range(len(reqs))) if sample_rows is None else sample_rows
    sample_slots[keep] = np.array(slots)[keep]
    # each token's (slot, position) entry in the flattened tables: a 1-D int32 index, which the
    # gathers and scatters take as is (a 2-D int32 index would cost two conversion kernels each)
    assert max(token_table.numel(), page_table.numel()) < 2**31
    host_inputs: dict[str, HostColumn] = {
        "positions": positions,
        "token_entries": token_slots * token_table.shape[1] + positions,
        "page_entries": token_slots * page_table.shape[1] + positions,
        "slots": slots,
        "seq_lens": seq_lens,
        "longest_first": np.argsort(-np.array(seq_lens), kind="stable"),
        "cu_seqlens_q": cu_seqlens,
        "last_indices": [end - 1 for end in cu_seqlens[1:]],
        "sample_entries": sample_slots * token_table.shape[1] + np.array(seq_lens),
    }
    for table, writes in [("page", page_writes), ("token", token_writes)]:
        if writes is not None and len(writes[0]):
            host_inputs[f"{table}_write_entries"], host_inputs[f"{table}_write_values"] = writes
    return Batch(
        reqs=reqs,
        prefix_lens=prefix_lens,
        extend_lens=extend_lens,
        sample_rows=keep,
        is_decode=is_decode,
        host_inputs=host_inputs,
    )


def load_inputs(batch: Batch, page_table: torch.Tensor, token_table: torch.Tensor) -> None:
    """The first thing a forward does (inside the CUDA graph when one replays): apply the batch's
    table writes, then read its input ids and KV locations from the tables."""
    batch.input_ids, batch.out_loc = read_tables(
        page_table, token_table, batch.page_writes, batch.token_writes,
        batch.token_entries, batch.page_entries,
    )  # fmt: skip


@dataclass
class Context:
    """What layers read during a forward: the batch being computed and the attention backend."""

    attn_backend: AttentionBackend | None = None
    batch: Batch | None = None

    @contextmanager
    def forward_batch(self, batch: Batch, attn_backend: AttentionBackend) -> Iterator[None]:
        """Set for one forward only, so several engines can live in one process."""
        assert self.batch is None, "nested forward"
        self.batch, self.attn_backend = batch, attn_backend
        try:
            yield
        finally:
            self.batch, self.attn_backend = None, None


_GLOBAL_CTX = Context()


def get_global_ctx() -> Context:
    return _GLOBAL_CTX
