"""What a regex costs xgrammar (0.2.9) to match, read from its text before anything is compiled.

A repetition with a count (`{n,m}`, `{n}`) is expanded into that many copies, and where the part
repeated varies in length the matcher follows every way of splitting the output between the
copies: a step's time grows with the product of such counts, nested or side by side. A `*`, `+` or
`{n,}` over such a part nests the same way, and a repeated part that may match nothing costs past
any bound (`x(([a-z]?)*){0,2}`: 3.3 s for a mask, `x(([a-z]?)*){0,16}(([a-z]?)*){0,2}`: 76 s).
Measured on a 2-core CPU, the worst mask of 30-40 random tokens: `([a-z]{1,5}){1,10}` 0.13 s,
`([a-z]{1,5}){1,32}` 0.53 s, `([a-z]{1,5}){1,64}` 2.1 s, `([a-z]?){0,40}([a-z]?){0,40}` 12.4 s. A
count over a part of fixed length costs nothing of the kind (`[a-z]{0,1000}`: 3 ms), nor does one
over a part that starts or ends with a character none of its other atoms matches, which splits
its copies one way only (`(\\d+,){1,100}`: 1.5 ms)."""

import re
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache

# the largest product allowed: `([a-z]{1,5}){1,32}` passes (0.53 s a mask), `{1,33}` does not
MAX_SPLITS = 32
# a `*`, `+` or `{n,}` over a part of varying length counts as this many copies
UNBOUNDED_COPIES = 4
# characters of regex one constraint may hold (its patterns together): reading them takes ~2.4 us a
# character here, in the scheduler process
MAX_REGEX_LENGTH = 100_000
_MAX_DEPTH = 64  # groups within groups
_MAX_DELIMITED_ATOMS = 64  # distinct atoms of a part judged delimited at most (each is checked)
_QUANTIFIERS = {"*": (0, None), "+": (1, None), "?": (0, 1)}
COUNT = re.compile(r"\{\s*(\d+)\s*(,\s*(\d*)\s*)?\}")  # `{n}`, `{n,}`, `{n,m}`; EBNF allows spaces
_CLASS_ESCAPES = set("dDwWsSbBpP0123456789")  # `\p{L}`, a back reference: not one character
CONTROL_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v"}
ANY = "(?s:.)"  # a class taken to match any character (one Python may read otherwise)
_ASCII_CLASSES = {"d": "[0-9]", "w": "[A-Za-z0-9_]"}  # xgrammar's; the others: ANY
_PROPERTY = re.compile(r"\{[^}]{0,64}\}")  # `\p{L}`'s
_GROUP_NAME = re.compile(r"P?<(?![=!])[^>]{0,256}>")  # `(?<name>`, `(?P<name>`
_HEX_ESCAPE = re.compile(r"x([0-9A-Fa-f]{2})|u([0-9A-Fa-f]{4})|u\{([0-9A-Fa-f]{1,6})\}")


@dataclass(frozen=True)
class Part:
    shortest: int
    longest: int | None  # None: no bound
    splits: int  # the product of the counts above, up to MAX_SPLITS + 1
    atoms: Counter[str]  # its atoms: a character (length 1), or a class's regex
    first: str | None = None  # the character every match starts with, where there is one
    last: str | None = None  # the one every match ends with

    @property
    def varies(self) -> bool:
        return self.shortest != self.longest

    @property
    def delimited(self) -> bool:
        """Copies of the part side by side split one way only: it starts (or ends) with a
        character that no other atom of it matches."""
        if len(self.atoms) > _MAX_DELIMITED_ATOMS:
            return False
        return any(
            c is not None and sum(n for atom, n in self.atoms.items() if _matches(atom, c)) == 1
            for c in (self.first, self.last)
        )


class _TooDeep(Exception):
    pass


def too_costly(pattern: str) -> str | None:
    """Why a regex is too costly to match; None if it is not. Its counts are at most
    unenforced.MAX_COUNT (repeats_past_limit), its length at most MAX_REGEX_LENGTH."""
    if splits(pattern) <= MAX_SPLITS:
        return None
    return (
        "too costly to match: the counts of its repetitions of parts of varying length, nested or "
        f"side by side, multiply past {MAX_SPLITS} (`*` and `+` count {UNBOUNDED_COPIES}), or it "
        "repeats a part that may match nothing"
    )


def splits(pattern: str) -> int:
    """The product of the counts of repetitions of parts of varying length (but delimited ones),
    nested or in sequence (the largest over alternatives), up to MAX_SPLITS + 1; 1 for a pattern
    with none, MAX_SPLITS + 1 for groups nested past _MAX_DEPTH. A pattern xgrammar cannot read
    gets some number: its own error comes when it compiles."""
    return regex_part(pattern).splits


def regex_part(pattern: str) -> Part:
    """The pattern as a Part (its splits MAX_SPLITS + 1 for groups nested past _MAX_DEPTH)."""
    try:
        return _Reader(pattern).alternatives()
    except _TooDeep:
        return Part(1, None, MAX_SPLITS + 1, _bounded(Counter([ANY])))


@lru_cache(maxsize=4096)
def _matches(atom: str, char: str) -> bool:
    """Whether the atom may match the character (a class Python cannot read: yes)."""
    if len(atom) == 1:
        return atom == char
    try:
        return re.fullmatch(atom, char) is not None
    except re.error:
        return True


class _Reader:
    def __init__(self, pattern: str) -> None:
        self.text = pattern
        self.i = 0
        self.depth = 0

    def alternatives(self) -> Part:
        options = [self._sequence()]
        while self.text.startswith("|", self.i):
            self.i += 1
            options.append(self._sequence())
        return either(options)

    def _sequence(self) -> Part:
        parts = []
        while self.i < len(self.text) and self.text[self.i] not in "|)":
            parts.append(self._repeated(self._atom()))
        return in_sequence(parts)

    def _atom(self) -> Part:
        char = self.text[self.i]
        self.i += 1
        if char == "(":
            if self.text.startswith("?", self.i):  # (?:...), (?=...), (?<=...), (?<name>...)
                self.i += 1
                if match := _GROUP_NAME.match(self.text, self.i):
                    self.i = match.end()
                while self.i < len(self.text) and self.text[self.i] in ":=!<>":
                    self.i += 1
            self.depth += 1
            if self.depth > _MAX_DEPTH:
                raise _TooDeep
            inner = self.alternatives()
            self.depth -= 1
            self.i += 1  # the closing parenthesis
            return inner
        if char in "^$":
            return Part(0, 0, 1, Counter())
        if char == "\\":
            return self._escape()
        if char == "[":
            start = self.i - 1
            self.i += self.text.startswith("^", self.i)
            self.i += self.text.startswith("]", self.i)  # `[]...]`: a bracket as its first member
            while self.i < len(self.text) and self.text[self.i] != "]":
                self.i += 2 if self.text[self.i] == "\\" else 1
            self.i += 1
            return char_class(self.text[start : self.i])
        if char == ".":
            return char_class(ANY)
        return literal(char)

    def _escape(self) -> Part:
        """The atom of the escape after a backslash."""
        char = self.text[self.i : self.i + 1]
        if match := _HEX_ESCAPE.match(self.text, self.i):
            self.i = match.end()
            return literal(chr(min(int(next(g for g in match.groups() if g), 16), 0x10FFFF)))
        self.i += 1
        if char in _CLASS_ESCAPES:
            if char in "pP" and (match := _PROPERTY.match(self.text, self.i)):
                self.i = match.end()
            return char_class(_ASCII_CLASSES.get(char, ANY))
        if (
            char.isalnum() and char not in CONTROL_ESCAPES
        ):  # `\a`, `\e`, `\cA`, `\U...`: xgrammar's own
            return char_class(ANY)
        return literal(CONTROL_ESCAPES.get(char, char))

    def _repeated(self, part: Part) -> Part:
        counts = self._counts()
        if counts is None:
            return part
        if self.text.startswith(("?", "+"), self.i):  # lazy, or possessive
            self.i += 1
        return repeated(part, *counts)

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


def either(options: list[Part]) -> Part:
    """A choice between parts: the largest product of theirs."""
    if len(options) == 1:
        return options[0]
    lengths = [o.longest for o in options]
    atoms = Counter[str]()
    for option in options:
        atoms.update(option.atoms)
    return Part(
        min(o.shortest for o in options),
        None if None in lengths else max(lengths),  # type: ignore[type-var]
        max(o.splits for o in options),
        _bounded(atoms),
    )


def in_sequence(parts: list[Part]) -> Part:
    """Parts side by side: their products multiply."""
    shortest, longest, product, atoms = 0, 0, 1, Counter[str]()
    for part in parts:
        shortest += part.shortest
        longest = None if longest is None or part.longest is None else longest + part.longest
        product = min(product * part.splits, MAX_SPLITS + 1)
        atoms.update(part.atoms)
    first = parts[0].first if parts else None
    last = parts[-1].last if parts else None
    return Part(shortest, longest, product, _bounded(atoms), first, last)


def repeated(part: Part, low: int, high: int | None) -> Part:
    """The part repeated `low` to `high` times (None: no bound)."""
    if high == 0:
        return Part(0, 0, 1, Counter())
    if part.longest == 0:
        longest: int | None = 0
    elif high is None or part.longest is None:
        longest = None
    else:
        longest = high * part.longest
    if part.shortest == 0 and part.longest != 0 and (high is None or high > 1):
        copies = MAX_SPLITS + 1  # each copy may match nothing: any number of them at each place
    elif not part.varies or part.delimited:
        copies = 1
    else:
        copies = high if high is not None else max(low, UNBOUNDED_COPIES)
    edges = (part.first, part.last) if low >= 1 else (None, None)
    product = min(part.splits * copies, MAX_SPLITS + 1)
    # an atom that repeats is no delimiter of a part around it
    atoms = part.atoms if high == 1 else Counter({a: 2 * n for a, n in part.atoms.items()})
    return Part(low * part.shortest, longest, product, atoms, *edges)


def _bounded(atoms: Counter[str]) -> Counter[str]:
    """The atoms, or, past _MAX_DELIMITED_ATOMS, any character twice: no part holding them is
    delimited either way, and a chain of parts does not carry ever more of them."""
    if len(atoms) > _MAX_DELIMITED_ATOMS:
        return Counter({ANY: 2})
    return atoms


def literal(char: str) -> Part:
    return Part(1, 1, 1, Counter([char]), char, char)


def char_class(regex: str) -> Part:
    """One character of a class, written as a regex (one Python cannot read matches any)."""
    return Part(1, 1, 1, Counter([regex]))
