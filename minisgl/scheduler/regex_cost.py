"""What a regex costs xgrammar (0.2.9) to match, read from its text before anything is compiled.

A repetition with a count (`{n,m}`, `{n}`) is expanded into that many copies, and where the part
repeated varies in length the matcher follows every way of splitting the output between the
copies: a step's time grows with the product of such counts, nested or side by side. A `*`, `+` or
`{n,}` over such a part nests the same way, and a repeated part that may match nothing costs past
any bound (`x(([a-z]?)*){0,2}`: 3.3 s for a mask, `x(([a-z]?)*){0,16}(([a-z]?)*){0,2}`: 76 s).
Measured on a 2-core CPU, the worst mask of 30-40 random tokens: `([a-z]{1,5}){1,10}` 0.13 s,
`([a-z]{1,5}){1,32}` 0.53 s, `([a-z]{1,5}){1,64}` 2.1 s, `([a-z]?){0,40}([a-z]?){0,40}` 12.4 s. A
count over a part of fixed length costs nothing of the kind (`[a-z]{0,1000}`: 3 ms), nor does one
over a part whose copies split one way only: where a copy may end, the next character tells
whether it goes on or the next copy begins (`(\\d+,){1,100}`: 1.5 ms; quoted items such as
`("[^"]*",){0,59}`, or `(a|ab){40}`: under 1 ms). The reading keeps, for each part, the characters
its matches may start with, hold later, and go on with past a whole match (Part)."""

import re
from collections.abc import Iterable
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
_MAX_ATOMS = 64  # distinct atoms of a part kept at most; past it, any character
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
    # atoms (a character, or a class's regex) that a match may start with, that it may hold
    # past its first character, and by which a whole match may go on into a longer one
    firsts: frozenset[str]
    later: frozenset[str]
    continues: frozenset[str]

    @property
    def varies(self) -> bool:
        return self.shortest != self.longest

    @property
    def splits_one_way(self) -> bool:
        """Copies of the part side by side split one way only: where a copy may end, the next
        character tells whether it goes on or the next copy begins."""
        return not _overlap(self.continues, self.firsts)


EMPTY = Part(0, 0, 1, frozenset(), frozenset(), frozenset())


def any_text(shortest: int, splits: int = 1, atoms: Iterable[str] = (ANY,)) -> Part:
    """Text of the atoms in any order (by default any characters), at least `shortest` of them."""
    some = _bounded(frozenset(atoms))
    return Part(shortest, None, splits, some, some, some)


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
    """The product of the counts of repetitions of parts of varying length (but those whose copies
    split one way only), nested or in sequence (the largest over alternatives), up to MAX_SPLITS
    + 1; 1 for a pattern with none, MAX_SPLITS + 1 for groups nested past _MAX_DEPTH. A pattern
    xgrammar cannot read gets some number: its own error comes when it compiles."""
    return regex_part(pattern).splits


def regex_part(pattern: str) -> Part:
    """The pattern as a Part (its splits MAX_SPLITS + 1 for groups nested past _MAX_DEPTH)."""
    try:
        return _Reader(pattern).alternatives()
    except _TooDeep:
        return any_text(1, MAX_SPLITS + 1)


@lru_cache(maxsize=4096)
def _matches(atom: str, char: str) -> bool:
    """Whether the atom may match the character (a class Python reads otherwise: yes)."""
    if len(atom) == 1:
        return atom == char
    compiled = _as_python(atom)
    return compiled is None or compiled.fullmatch(char) is not None


# escapes Python reads otherwise than xgrammar: `\N{name}` (xgrammar: the letters), `\1`, `\012`
# (xgrammar: the digits)
_READ_OTHERWISE = re.compile(r"\\(?:N|[1-9]|0[0-9])")


@lru_cache(maxsize=4096)
def _as_python(atom: str) -> re.Pattern[str] | None:
    """A class as Python reads it; None where Python cannot, or would read it otherwise."""
    if _READ_OTHERWISE.search(atom):
        return None
    try:
        return re.compile(atom)
    except re.error:
        return None


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
            lookaround = self.text.startswith(("?=", "?!", "?<=", "?<!"), self.i)
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
            return EMPTY if lookaround else inner  # xgrammar matches a lookaround as nothing
        if char in "^$":
            return EMPTY
        if char == "\\":
            return self._escape()
        if char == "[":
            start = self.i - 1
            self.i += self.text.startswith("^", self.i)  # `[^]` is any character to xgrammar
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
    firsts, later, continues = frozenset[str](), set[str](), set[str]()
    tangled = False  # a match of one option may begin one of another's
    for option in options:
        tangled = tangled or _overlap(firsts, option.firsts)
        firsts = _bounded(firsts | option.firsts)
        later |= option.later
        continues |= option.continues
    if tangled:
        continues |= later
    if any(o.shortest == 0 for o in options):  # the empty match goes on into any other
        continues |= firsts
    return Part(
        min(o.shortest for o in options),
        None if None in lengths else max(lengths),  # type: ignore[type-var]
        max(o.splits for o in options),
        firsts,
        _bounded(later),
        _bounded(continues),
    )


def in_sequence(parts: list[Part]) -> Part:
    """Parts side by side: their products multiply."""
    shortest, longest, product = 0, 0, 1
    firsts, later, continues = frozenset[str](), frozenset[str](), frozenset[str]()
    for part in parts:
        if _overlap(continues, part.firsts):  # where the parts before end is not known
            continues = continues | later | part.firsts | part.later
        elif part.shortest == 0:
            continues = continues | part.continues | part.firsts
        else:
            continues = part.continues
        if shortest == 0:
            firsts |= part.firsts
        if longest != 0:
            later |= part.firsts
        later |= part.later
        shortest += part.shortest
        longest = None if longest is None or part.longest is None else longest + part.longest
        product = min(product * part.splits, MAX_SPLITS + 1)
        firsts, later, continues = _bounded(firsts), _bounded(later), _bounded(continues)
    return Part(shortest, longest, product, firsts, later, continues)


def repeated(part: Part, low: int, high: int | None) -> Part:
    """The part repeated `low` to `high` times (None: no bound)."""
    if high == 0:
        return EMPTY
    if part.longest == 0:
        longest: int | None = 0
    elif high is None or part.longest is None:
        longest = None
    else:
        longest = high * part.longest
    if part.shortest == 0 and part.longest != 0 and (high is None or high > 1):
        copies = MAX_SPLITS + 1  # each copy may match nothing: any number of them at each place
    elif not part.varies or part.splits_one_way:
        copies = 1
    else:
        copies = high if high is not None else max(low, UNBOUNDED_COPIES)
    later = part.later if high == 1 else _bounded(part.later | part.firsts)
    if high == 1:
        continues = part.continues | part.firsts if low == 0 else part.continues
    elif not part.splits_one_way:
        continues = later | part.firsts
    elif low == high and part.shortest > 0:
        continues = part.continues
    else:  # a whole match goes on into one more copy
        continues = part.continues | part.firsts
    product = min(part.splits * copies, MAX_SPLITS + 1)
    return Part(low * part.shortest, longest, product, part.firsts, later, _bounded(continues))


def _bounded(atoms: frozenset[str] | set[str]) -> frozenset[str]:
    """The atoms, or past _MAX_ATOMS any character: a chain of parts does not carry ever more."""
    if len(atoms) > _MAX_ATOMS:
        return frozenset([ANY])
    return frozenset(atoms)


def _overlap(atoms: frozenset[str] | set[str], others: frozenset[str] | set[str]) -> bool:
    """Whether an atom of each may match one character."""
    if not atoms or not others:
        return False
    if _ascii(atoms) & _ascii(others):
        return True
    wide = [a for a in atoms if _wide(a)]
    return any(_both_wide(a, b) for a in wide for b in others if _wide(b))


def _ascii(atoms: frozenset[str] | set[str]) -> int:
    """The ASCII characters the atoms may match, one bit each."""
    bits = 0
    for atom in atoms:
        bits |= _ascii_bits(atom)
    return bits


_ASCII = "".join(map(chr, range(128)))


@lru_cache(maxsize=4096)
def _ascii_bits(atom: str) -> int:
    if len(atom) == 1:
        return 1 << ord(atom) if atom < "\x80" else 0
    compiled = _as_python(atom)
    if compiled is None:
        return (1 << 128) - 1
    return sum(1 << ord(c) for c in set(compiled.findall(_ASCII)) if len(c) == 1)


# a class that may only match ASCII: no `[^`, no character past it, no escape that may name one
# (xgrammar's `\s` holds spaces past ASCII)
_NARROW_CLASS = re.compile(r"\[(?!\^)(?:[\x00-\x5b\x5d-\x7f]|\\[^uUxNpPsWSD0-9])*\]")


@lru_cache(maxsize=4096)
def _wide(atom: str) -> bool:
    """Whether the atom may match a character past ASCII."""
    if len(atom) == 1:
        return atom >= "\x80"
    return _NARROW_CLASS.fullmatch(atom) is None


def _both_wide(atom: str, other: str) -> bool:
    """Whether two atoms that may match characters past ASCII may match the same one."""
    if len(atom) == 1:
        return _matches(other, atom)
    return len(other) != 1 or _matches(atom, other)


def literal(char: str) -> Part:
    return Part(1, 1, 1, frozenset([char]), frozenset(), frozenset())


def char_class(regex: str) -> Part:
    """One character of a class, written as a regex (one Python cannot read matches any)."""
    return Part(1, 1, 1, frozenset([regex]), frozenset(), frozenset())
