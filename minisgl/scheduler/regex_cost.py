"""What a regex costs xgrammar (0.2.9) to match, read from its text before anything is compiled.

A repetition with a count (`{n,m}`, `{n}`, `{n,}`) is expanded into that many copies, and where the
part repeated varies in length the matcher follows every way of splitting the output between the
copies: a step's time grows with the product of such counts, nested or side by side. Measured on a
2-core CPU, the worst mask of 30-40 random tokens: `([a-z]?){0,20}` 0.11 s, `(([a-z]?){0,8}){0,8}`
0.95 s, `([a-z]{1,5}){1,64}` 2.1 s, `([a-z]?){0,40}([a-z]?){0,40}` 12.4 s; a count over a part of
fixed length costs nothing of the kind (`[a-z]{0,1000}`: 3 ms), nor does `*` or `+`."""

import re
from dataclasses import dataclass

# the largest product allowed: `([A-Za-z]+ ){0,31}` passes, `([a-z]?){0,5}([a-z]?){0,7}` does not
MAX_SPLITS = 32
_QUANTIFIERS = {"*": (0, None), "+": (1, None), "?": (0, 1)}
COUNT = re.compile(
    r"\{\s*(\d+)\s*(,\s*(\d*)\s*)?\}"
)  # `{n}`, `{n,}`, `{n,m}`; EBNF allows the spaces


@dataclass(frozen=True)
class _Part:
    shortest: int
    longest: int | None  # None: no bound
    splits: int  # the product of the counts above

    @property
    def varies(self) -> bool:
        return self.shortest != self.longest


def too_costly(pattern: str) -> str | None:
    """Why a regex is too costly to match; None if it is not. Its counts are at most
    unenforced.MAX_COUNT (repeats_past_limit)."""
    if splits(pattern) <= MAX_SPLITS:
        return None
    return (
        "too costly to match: the counts of its repetitions of parts of varying length, nested or "
        f"side by side, multiply past {MAX_SPLITS}"
    )


def splits(pattern: str) -> int:
    """The product of the counts of repetitions of parts of varying length, nested or in sequence
    (the largest over alternatives), up to MAX_SPLITS + 1; 1 for a pattern with none. A pattern
    xgrammar cannot read gets some number: its own error comes when it compiles."""
    return _Reader(pattern).alternatives().splits


class _Reader:
    def __init__(self, pattern: str) -> None:
        self.text = pattern
        self.i = 0

    def alternatives(self) -> _Part:
        options = [self._sequence()]
        while self.text.startswith("|", self.i):
            self.i += 1
            options.append(self._sequence())
        lengths = [o.longest for o in options]
        return _Part(
            min(o.shortest for o in options),
            None if None in lengths else max(lengths),  # type: ignore[type-var]
            max(o.splits for o in options),
        )

    def _sequence(self) -> _Part:
        shortest, longest, product = 0, 0, 1
        while self.i < len(self.text) and self.text[self.i] not in "|)":
            part = self._repeated(self._atom())
            shortest += part.shortest
            longest = None if longest is None or part.longest is None else longest + part.longest
            product = min(product * part.splits, MAX_SPLITS + 1)  # a bound, not a bignum
        return _Part(shortest, longest, product)

    def _atom(self) -> _Part:
        char = self.text[self.i]
        self.i += 1
        if char == "(":
            if self.text.startswith("?", self.i):  # (?:...), (?=...), (?<name>...)
                self.i += 1
                while self.i < len(self.text) and self.text[self.i] in ":=!<>":
                    self.i += 1
            inner = self.alternatives()
            self.i += 1  # the closing parenthesis
            return inner
        if char in "^$":
            return _Part(0, 0, 1)
        if char == "\\":
            self.i += 1
        elif char == "[":
            self.i += self.text.startswith("^", self.i)
            self.i += self.text.startswith("]", self.i)  # `[]...]`: a bracket as its first member
            while self.i < len(self.text) and self.text[self.i] != "]":
                self.i += 2 if self.text[self.i] == "\\" else 1
            self.i += 1
        return _Part(1, 1, 1)

    def _repeated(self, part: _Part) -> _Part:
        counts = self._counts()
        if counts is None:
            return part
        low, high = counts
        if self.text.startswith(("?", "+"), self.i):  # lazy, or possessive
            self.i += 1
        if part.longest == 0:
            longest: int | None = 0
        elif high is None or part.longest is None:
            longest = None
        else:
            longest = high * part.longest
        copies = high if high is not None else max(low, 1)
        product = part.splits * copies if part.varies else part.splits
        return _Part(low * part.shortest, longest, min(product, MAX_SPLITS + 1))

    def _counts(self) -> tuple[int, int | None] | None:
        """The quantifier at the reader's place (passed over), as (at least, at most)."""
        if self.i < len(self.text) and self.text[self.i] in _QUANTIFIERS:
            self.i += 1
            return _QUANTIFIERS[self.text[self.i - 1]]
        match = COUNT.match(self.text, self.i)
        if match is None:  # a brace that is no count: xgrammar reads it as itself or refuses it
            return None
        self.i = match.end()
        low, comma, high = match.groups()
        return int(low), int(high) if high else None if comma else int(low)
