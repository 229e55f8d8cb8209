import itertools
from collections.abc import Sequence

import numpy as np

from minisgl.core import Batch, BatchInputs, EngineLayout, Req, TokenMasks
from minisgl.utils.arrays import ragged_arange, repeat_each

TableWrites = tuple[np.ndarray, np.ndarray]  # flat entries of a device table, and their values
NO_WRITES: TableWrites = (np.empty(0, np.int64), np.empty(0, np.int64))
_NO_ROWS = np.empty(0, np.int64)


def build_batch(
    reqs: list[Req],
    prefix_lens: list[int],
    extend_lens: list[int],
    layout: EngineLayout,
    sample_rows: list[int] | None = None,
    page_writes: TableWrites = NO_WRITES,
    token_writes: TableWrites = NO_WRITES,
    processed_rows: list[int] | None = None,
    token_masks: TokenMasks | None = None,
    prompt_logprob_rows: Sequence[int] = (),
) -> Batch:
    """The batch computing tokens [prefix, prefix + extend) of each request (in its `slot` row),
    with the writes into the page table (pool locations, from KVCacheManager.take_page_writes)
    and the token table (prompt ids, from TokenTable.take_writes) that must land before the
    batch reads either table. Its inputs are on the host: the engine uploads them.

    A sampled token goes right after its request's computed ones; a request outside
    `sample_rows` (default: all) writes its token into the token table's last row, a sink. The
    requests of `prompt_logprob_rows` have the logits of their prompt tokens computed (each but
    the prompt's last: its logits give the first sampled token)."""
    slots = np.array([req.slot for req in reqs], dtype=np.int64)
    seq_lens = np.add(prefix_lens, extend_lens)
    cu_seqlens = np.fromiter(itertools.accumulate(extend_lens, initial=0), np.int64)
    spans = []
    for i in prompt_logprob_rows:
        start = prefix_lens[i]
        end = min(start + extend_lens[i], reqs[i].num_prompt_tokens - 1)
        if end > start:
            spans.append((i, start, end - start))
    # a one-token chunk that asks for prompt logprobs makes a prefill of a decode's shape
    is_decode = int(cu_seqlens[-1]) == len(reqs) and not spans
    if is_decode:
        token_slots, positions = slots, np.array(prefix_lens, dtype=np.int64)
    else:  # thousands of tokens: built in bulk, not with a Python step per token
        token_slots = repeat_each(slots, extend_lens)
        positions = ragged_arange(prefix_lens, extend_lens)
    prompt_rows, prompt_targets = _NO_ROWS, _NO_ROWS
    if spans:
        prompt_rows = np.concatenate([int(cu_seqlens[i]) + np.arange(n) for i, _, n in spans])
        prompt_targets = np.fromiter(
            itertools.chain(*(reqs[i].token_ids[p + 1 : p + n + 1] for i, p, n in spans)),
            np.int64,
        )
    keep = list(range(len(reqs))) if sample_rows is None else sample_rows
    sample_slots = np.full(len(reqs), layout.sink_slot)
    sample_slots[keep] = slots[keep]
    # each token's (slot, position) entry in the flattened tables: a 1-D int32 index, which the
    # gathers and scatters take as is (a 2-D int32 index would cost two conversion kernels each)
    inputs = BatchInputs(
        positions=positions,
        token_entries=token_slots * layout.token_table_width + positions,
        page_entries=token_slots * layout.page_table_width + positions,
        slots=slots,
        seq_lens=seq_lens,
        longest_first=np.argsort(-seq_lens, kind="stable"),
        cu_seqlens_q=cu_seqlens,
        last_indices=cu_seqlens[1:] - 1,
        sample_entries=sample_slots * layout.token_table_width + seq_lens,
        page_write_entries=page_writes[0],
        page_write_values=page_writes[1],
        token_write_entries=token_writes[0],
        token_write_values=token_writes[1],
        prompt_rows=prompt_rows,
        prompt_targets=prompt_targets,
    )
    return Batch(
        reqs, prefix_lens, extend_lens, keep, is_decode, inputs, processed_rows or [],
        token_masks, spans,
    )  # fmt: skip
