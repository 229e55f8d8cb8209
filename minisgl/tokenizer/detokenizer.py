"""Incremental detokenization: turn a stream of token ids into a stream of text pieces.

A piece is released only when it is final: never half of a multi-byte character (the decoder shows
those as U+FFFD until the rest arrives), and never a tail that could still grow into a stop string.
The finished text excludes the stop string, and the pieces always concatenate to the final text.
"""

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

# prompt tokens decoded with the first output tokens, so a leading space is rendered as in context
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_ids: Sequence[int],
        stop: Sequence[str] = (),
    ) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self._ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""  # decoded output so far
        self._released = 0  # characters of self.text already handed out

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _read(self, final: bool) -> None:
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) > len(prefix_text) and (final or not new_text.endswith("\ufffd")):
            self.text += new_text[len(prefix_text) :]
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)

    def step(
        self, token_ids: Sequence[int], finished: bool = False, stop_token: bool = False
    ) -> str:
        """Add sampled tokens (one per step when streaming, all at once otherwise); returns the
        text that became final. With stop_token, the last token is the eos or stop id that
        finished the request: it contributes no text."""
        new = token_ids[:-1] if stop_token else token_ids
        if new:
            self._ids.extend(new)
            self._read(final=finished)
        elif finished:
            self._read(final=True)
        end = self._final_length() if finished else self._safe_length()
        piece = self.text[self._released : end]
        self._released = max(self._released, end)
        if finished:
            self.text = self.text[:end]
        return piece

    def _final_length(self) -> int:
        """The text ends before the first stop string, if any."""
        cuts = [i for i in (self.text.find(s) for s in self.stop) if i >= 0]
        return min(cuts, default=len(self.text))

    def _safe_length(self) -> int:
        """Hold back the longest tail that could be the start of a stop string."""
        end = self._final_length()
        if end == len(self.text):
            for stop in self.stop:
                longest = min(len(stop) - 1, end)
                n = next((n for n in range(longest, 0, -1) if self.text.endswith(stop[:n])), 0)
                end = min(end, len(self.text) - n)
        return max(end, self._released)
