"""What changes a row's logits before it samples, in vLLM's order: its token mask (a grammar's,
or min_tokens holding back the stop tokens), then logit_bias, then the repetition, frequency and
presence penalties.

Each part is built for the rows that use it only, and a batch where no row uses any has none.
The penalties count tokens in the device token table, which already holds every earlier token of
a row (an in-flight step's included): the host sends lengths, never token ids.
"""

from dataclasses import dataclass

import torch

from minisgl.core import Batch
from minisgl.utils.torch_utils import pack_to_device


@dataclass
class TokenMaskArgs:
    rows: torch.Tensor  # int64 [m]
    bits: torch.Tensor  # int32 [m, ceil(vocab / 32)]: bit t % 32 of word t // 32 allows token t


@dataclass
class BiasArgs:
    rows: torch.Tensor  # int64 [b]: one entry per (row, token) pair
    tokens: torch.Tensor  # int64 [b]
    values: torch.Tensor  # float32 [b]


@dataclass
class PenaltyArgs:
    rows: torch.Tensor  # int64 [p]
    slots: torch.Tensor  # int64 [p]: its token-table row
    prompt_lens: torch.Tensor  # int64 [p]
    seq_lens: torch.Tensor  # int64 [p]: tokens before the one sampled now
    width: int  # the longest seq_len
    presence: torch.Tensor  # float32 [p]
    frequency: torch.Tensor  # float32 [p]
    repetition: torch.Tensor  # float32 [p]


@dataclass
class LogitsProcessors:
    mask: TokenMaskArgs | None = None
    bias: BiasArgs | None = None
    penalties: PenaltyArgs | None = None

    @classmethod
    def prepare(cls, batch: Batch, device: torch.device) -> "LogitsProcessors | None":
        """The batch's processors on the device; None when no row that samples has any."""
        if not batch.processed_rows:
            return None
        out = cls()
        if batch.token_masks is not None:
            masks = batch.token_masks
            out.mask = TokenMaskArgs(
                torch.tensor(masks.rows, dtype=torch.int64).to(device),
                torch.from_numpy(masks.bits).to(device),
            )
        rows = [i for i in batch.processed_rows if batch.reqs[i].params.logit_bias]
        if rows:
            pairs = [(i, t, b) for i in rows for t, b in batch.reqs[i].params.logit_bias]  # type: ignore[union-attr]
            ints = pack_to_device(
                device, torch.int64, rows=[p[0] for p in pairs], tokens=[p[1] for p in pairs]
            )
            values = pack_to_device(device, torch.float32, values=[p[2] for p in pairs])
            out.bias = BiasArgs(**ints, **values)
        rows = [i for i in batch.processed_rows if batch.reqs[i].params.has_penalties]
        if rows:
            reqs = [batch.reqs[i] for i in rows]
            seq_lens = [batch.prefix_lens[i] + batch.extend_lens[i] for i in rows]
            ints = pack_to_device(
                device, torch.int64,
                rows=rows,
                slots=[r.slot for r in reqs],
                prompt_lens=[r.num_prompt_tokens for r in reqs],
                seq_lens=seq_lens,
            )  # fmt: skip
            floats = pack_to_device(
                device, torch.float32,
                presence=[r.params.presence_penalty for r in reqs],
                frequency=[r.params.frequency_penalty for r in reqs],
                repetition=[r.params.repetition_penalty for r in reqs],
            )  # fmt: skip
            out.penalties = PenaltyArgs(**ints, width=max(seq_lens), **floats)
        if out.mask is None and out.bias is None and out.penalties is None:
            return None
        return out

    def apply(self, logits: torch.Tensor, token_table: torch.Tensor) -> None:
        """Change float32 logits [bs, vocab] in place."""
        if self.mask is not None:
            rows = self.mask.rows
            allowed = unpack_bitmask(self.mask.bits, logits.shape[1])
            logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
        if self.bias is not None:
            b = self.bias
            logits.index_put_((b.rows, b.tokens), b.values, accumulate=True)
        if self.penalties is not None:
            p = self.penalties
            logits[p.rows] = _penalised(logits[p.rows], p, token_table)


def unpack_bitmask(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bool [m, vocab_size] from int32 bitmask words [m, ceil(vocab_size / 32)]."""
    shifts = torch.arange(32, dtype=torch.int32, device=bits.device)
    return ((bits[:, :, None] >> shifts) & 1).bool().flatten(1)[:, :vocab_size]


def _penalised(logits: torch.Tensor, p: PenaltyArgs, token_table: torch.Tensor) -> torch.Tensor:
    """vLLM's penalties: repetition over prompt and output (a positive logit divided by it, a
    negative one multiplied), then frequency per occurrence and presence once, over the output."""
    ids = token_table[p.slots, : p.width].long()
    position = torch.arange(p.width, device=ids.device)[None, :]
    seen = position < p.seq_lens[:, None]
    output = seen & (position >= p.prompt_lens[:, None])
    counts = torch.zeros_like(logits).scatter_add_(1, ids, output.float())
    present = torch.zeros_like(logits).scatter_add_(1, ids, seen.float()) > 0
    repetition = p.repetition[:, None]
    logits = torch.where(
        present, torch.where(logits > 0, logits / repetition, logits * repetition), logits
    )
    return logits - p.frequency[:, None] * counts - p.presence[:, None] * (counts > 0)
