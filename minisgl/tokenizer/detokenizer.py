"""Incremental detokenization: turn a stream of token ids into a stream of text pieces.

A piece is released only when it is final: never half of a multi-byte character (the decoder shows
those as U+FFFD until the rest arrives), and never a tail that could still grow into a stop string.
The stop strings are found here, in the text as it is decoded (with the prompt's last tokens as
context, as the whole output is decoded): the text ends before the one that ends first (or after
it, with include_stop), whatever tokens the text came in; one that ends within the text of the
first min_tokens tokens does not count (one that only begins there does, as in vLLM); and the
pieces always concatenate to the final text.
"""

import codecs
import functools
import re
from collections.abc import Sequence
from dataclasses import replace

from transformers import PreTrainedTokenizerBase

from minisgl.core import SamplingParams
from minisgl.messages import Finished

# prompt tokens decoded with the first output tokens, so a leading space is rendered as in context
_CONTEXT_TOKENS = 5
# the tokens after a character's first byte that may still complete it: UTF-8 has 4 bytes at most,
# and every token kept (`_silent_ids`) has a byte at least
_HELD_TOKENS = 3
_NO_STOP = SamplingParams()
_BYTE_TOKEN = re.compile(r"<0x([0-9A-F]{2})>")


def _bytes_settle(tokenizer: PreTrainedTokenizerBase) -> bool:
    """A character's bytes decode alike whatever tokens follow them once it is complete or
    broken: not with sentencepiece's ByteFallback, which makes every byte of an invalid run
    U+FFFD, so that a run's text depends on bytes any number of tokens later."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = None if backend is None else backend.decoder
    return decoder is not None and b'"ByteFallback"' not in decoder.__getstate__()


@functools.cache
def _silent_ids(tokenizer: PreTrainedTokenizerBase) -> tuple[frozenset[int], int]:
    """The special tokens, which decode with skip_special_tokens drops, and the tokenizer's
    length, past which ids (the model's vocabulary may be larger) decode to nothing too. Such
    ids are not kept: a run of them, never released, would be decoded again at every step."""
    special = (i for i, token in tokenizer.added_tokens_decoder.items() if token.special)
    return frozenset(special), len(tokenizer)


@functools.cache
def _fallback_bytes(tokenizer: PreTrainedTokenizerBase) -> dict[int, int]:
    """ByteFallback's byte tokens (`<0xE4>`), id -> byte."""
    vocab = tokenizer.get_vocab().items()
    return {i: int(m[1], 16) for token, i in vocab if (m := _BYTE_TOKEN.fullmatch(token))}


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_ids: Sequence[int],
        params: SamplingParams = _NO_STOP,  # read: stop, min_tokens, include_stop_str_in_output
    ) -> None:
        self._tokenizer = tokenizer
        self._stops: tuple[str, ...] = params.stop  # type: ignore[assignment]
        self._min_tokens = params.min_tokens
        self._include_stop = params.include_stop_str_in_output
        # vLLM's stop_reason is None for the tokenizer's eos (even one in stop_token_ids) and the
        # id of any other stop token, the model's other eos ids among them
        self._unnamed_eos = None if params.ignore_eos else tokenizer.eos_token_id
        self._searched = 0  # stop strings ending in self.text[:_searched] were looked for
        # the longest tail that may still become a stop string: held back until it cannot
        self._hold = max(map(len, self._stops), default=1) - 1
        self._ids = list(prompt_ids[-_CONTEXT_TOKENS:])  # only the ids still to be decoded again
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""  # decoded output so far
        self._released = 0  # characters of self.text already handed out
        self.num_tokens = 0  # output tokens given, up to the one that completed a stop string
        self.matched_stop: str | None = None  # the stop string that ended the text
        self._bytes_settle = _bytes_settle(tokenizer)
        self._special_ids, self._known = _silent_ids(tokenizer)
        # under ByteFallback, the run of byte tokens the kept ids end in (its bytes as UTF-8 so
        # far), and whether it is broken: then each of its later bytes is U+FFFD, whatever follows
        self._byte_of = {} if self._bytes_settle else _fallback_bytes(tokenizer)
        self._run = codecs.getincrementaldecoder("utf-8")()
        self._broken = False
        for token in self._kept(self._ids):  # a prompt may end inside a run
            self._track_run(token)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    def _read(self, final: bool) -> None:
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        start = len(prefix_text)
        if not new_text.startswith(prefix_text):
            # a prompt that ends inside a character: the output's first bytes complete it, and
            # the whole character is output text
            start = len(prefix_text.rstrip("\ufffd"))
        if len(new_text) > start and (final or not new_text.endswith("\ufffd")):
            self._release(new_text[start:], len(self._ids))
        elif self._bytes_settle and len(self._ids) - self._read_offset > _HELD_TOKENS:
            # a U+FFFD that the last tokens leave in place is no half character: its text goes
            # out, so that a run of such tokens is not decoded again at every step
            cut = len(self._ids) - _HELD_TOKENS
            settled = self._decode(self._ids[self._prefix_offset : cut])
            if len(settled) > start and new_text.startswith(settled):
                self._release(settled[start:], cut)

    def _release(self, text: str, end: int) -> None:
        """Adds the text of the ids up to `end`; the ids before the new prefix are never
        decoded again."""
        self.text += text
        del self._ids[: self._read_offset]
        self._prefix_offset, self._read_offset = 0, end - self._read_offset

    def step(self, token_ids: Sequence[int], finish: Finished | None = None) -> tuple[str, bool]:
        """Add sampled tokens (one per step when streaming or matching stop strings; all at once
        otherwise), `finish` saying how the request ended if it did with the last of them (a stop
        id or eos that ended it contributes no text). Returns the text that became final, and
        whether a stop string ended the text while the request runs on: it must be stopped. Once
        a stop string has ended the text, later tokens add nothing. A stop id or eos that ended
        the request adds its text only with include_stop_str_in_output, as in vLLM."""
        if self.matched_stop is not None:
            return "", False
        self.num_tokens += len(token_ids)
        finished = finish is not None
        stop_token = finished and isinstance(finish.matched_stop, int) and not self._include_stop
        new = token_ids[:-1] if stop_token else token_ids
        if new or finished:
            for token in self._kept(new):
                self._add(token)
            if finished and (held := len(self._run.getstate()[0])):  # it ends inside a character
                self._cut_run(held, "")
            self._read(final=finished)
        found = self._find_stop() if self.num_tokens > self._min_tokens else None
        self._searched = len(self.text)
        if found is not None:
            cut, self.matched_stop = found
            self.text = self.text[: cut + len(self.matched_stop) if self._include_stop else cut]
        end = (
            len(self.text)
            if finished or found
            else max(self._released, len(self.text) - self._hold)
        )
        piece, self._released = self.text[self._released : end], end
        return piece, found is not None and not finished

    def _kept(self, ids: Sequence[int]) -> list[int]:
        return [t for t in ids if t < self._known and t not in self._special_ids]

    def _track_run(self, token: int) -> None:
        byte = self._byte_of.get(token)
        if byte is None:  # no byte token: the run ends
            self._run.reset()
            self._broken = False
        elif not self._broken:
            try:
                self._run.decode(bytes((byte,)))
            except UnicodeDecodeError:
                self._broken = True

    def _add(self, token: int) -> None:
        """Keep a token to decode. Under ByteFallback, the byte that breaks a run and every later
        byte of it add their U+FFFD at once, unkept: a run held to its end would be decoded again
        at every step, and decoded with the bytes before the break it would make the characters
        already given U+FFFD too."""
        was_broken = self._broken
        held = len(self._run.getstate()[0])  # the bytes of a character begun in the run
        self._track_run(token)
        if was_broken and self._broken:
            self.text += "\ufffd"
            return
        if self._broken:
            self._cut_run(held, "\ufffd")
            return
        if held and token not in self._byte_of:  # the run ends inside a character
            self._cut_run(held, "")
        self._ids.append(token)

    def _cut_run(self, held: int, breaking: str) -> None:
        """The run ends inside a character: the text before that character goes out, then a
        U+FFFD for each of its bytes (the prompt's not counted) and the breaking byte's, as
        ByteFallback decodes an invalid run. The characters the run completed before stay
        (tokenizer.decode would make them U+FFFD too, but they are final once given)."""
        held = min(held, len(self._ids) - self._read_offset)
        if held:
            del self._ids[-held:]
        self._read(final=True)
        self.text += "\ufffd" * held + breaking

    def _find_stop(self) -> tuple[int, str] | None:
        """Where the stop string that ends first after self._searched begins, and which it is
        (of two ending together, the longer): a search of the new text per stop string, however
        long the text has grown."""
        hits = [
            (i, s)
            for s in self._stops
            if (i := self.text.find(s, max(0, self._searched - len(s) + 1))) >= 0
        ]
        return min(hits, key=lambda hit: (hit[0] + len(hit[1]), hit[0]), default=None)

    @property
    def stopped(self) -> bool:
        """A stop string ended the text."""
        return self.matched_stop is not None

    def end(self, finish: Finished) -> Finished:
        """The request's end as the client sees it: a stop string ends it where it matched, with
        the tokens up to the one that completed it; what matched is vLLM's stop_reason, a stop
        string or a stop token (None for the tokenizer's eos)."""
        if self.matched_stop is not None:
            return replace(
                finish,
                reason="stop",
                matched_stop=self.matched_stop,
                completion_tokens=self.num_tokens,
            )
        if finish.matched_stop is not None and finish.matched_stop == self._unnamed_eos:
            return replace(finish, matched_stop=None)
        return finish
