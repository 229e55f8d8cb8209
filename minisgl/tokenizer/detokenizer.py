"""Incremental detokenization: turn a stream of token ids into a stream of text pieces.

A piece is released only when it is final: never half of a multi-byte character (the decoder shows
those as U+FFFD until the rest arrives), and never a tail that could still grow into a stop string.
The stop strings are found here, in the text as it is decoded (with the prompt's last tokens as
context, as the whole output is decoded): the text ends before the first one, and the pieces always
concatenate to the final text.
"""

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from minisgl.messages import Finished

from .stop_matcher import StopMatcher

# prompt tokens decoded with the first output tokens, so a leading space is rendered as in context
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_ids: Sequence[int],
        stop: tuple[str, ...] = (),
    ) -> None:
        self.tokenizer = tokenizer
        self._stops = StopMatcher(stop) if stop else None
        self._ids = list(prompt_ids[-_CONTEXT_TOKENS:])  # only the ids still to be decoded again
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""  # decoded output so far
        self._released = 0  # characters of self.text already handed out
        self.num_tokens = 0  # output tokens given, up to the one that completed a stop string
        self.matched_stop: str | None = None  # the stop string that ended the text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _read(self, final: bool) -> None:
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) > len(prefix_text) and (final or not new_text.endswith("\ufffd")):
            self.text += new_text[len(prefix_text) :]
            # the ids before the new prefix are never decoded again
            del self._ids[: self._read_offset]
            self._prefix_offset, self._read_offset = 0, len(self._ids)

    def step(
        self, token_ids: Sequence[int], finished: bool = False, stop_token: bool = False
    ) -> str:
        """Add sampled tokens (one per step when streaming or matching stop strings; all at once
        otherwise); returns the text that became final. With stop_token, the last token is the
        eos or stop id that finished the request: it contributes no text. Once a stop string has
        ended the text, later tokens add nothing."""
        if self.matched_stop is not None:
            return ""
        self.num_tokens += len(token_ids)
        new = token_ids[:-1] if stop_token else token_ids
        scanned = len(self.text)
        if new:
            self._ids.extend(new)
            self._read(final=finished)
        elif finished:
            self._read(final=True)
        if self._stops is not None:
            found = self._stops.feed(self.text, scanned)
            if found is not None:
                cut, self.matched_stop = found
                self.text, finished = self.text[:cut], True
        end = len(self.text)
        if not finished and self._stops is not None:
            end -= self._stops.held
        piece = self.text[self._released : end]
        self._released = max(self._released, end)
        return piece

    @property
    def stopped(self) -> bool:
        """A stop string ended the text: the request must be stopped."""
        return self.matched_stop is not None

    def end(self, finish: Finished) -> Finished:
        """The request's end as the client sees it: a stop string ends it where it matched, with
        the tokens up to the one that completed it."""
        if self.matched_stop is None:
            return finish
        return Finished(
            rid=finish.rid,
            reason="stop",
            matched_stop=self.matched_stop,
            prompt_tokens=finish.prompt_tokens,
            completion_tokens=self.num_tokens,
            cached_tokens=finish.cached_tokens,
        )
