"""What an EBNF grammar costs xgrammar (0.2.9) to match, read before it compiles from the grammar
as xgrammar prints it back (`str(Grammar.from_ebnf(text))`): every group a rule of its own, `?`,
`*` and `+` as alternatives and recursion, counts as `rule{m, n}`.

Counts over rules of varying length multiply as a regex's do (regex_cost), and a `Regex("...")`
inside is read as one: `root ::= "x" ([a-z]?){0,40} ([a-z]?){0,40}` took 12.1 s for its second
mask on a 2-core CPU. A cycle of rules that may go round matching nothing, the grammar's form of a
repeated part that may match nothing, costs past any bound: `r ::= [a-z]? r | ""` twice side by
side took 3.4 s a mask, `x ::= x x | [a-z] | ""` 3.8 s; so does a count over a rule of its own
cycle (`r ::= [a-z] r{0,32}`: 2.4-3.2 s by its 14th token). Recursion that matches a character
each time round counts once: its cost grows with the output (`x ::= x x | [a-z]`), which the
per-step bound (grammar.MAX_MATCH_SECONDS) ends. A rule that names itself at one end only is read
as the repetition it prints (`r ::= x r | ""` is `x*`), so that the characters around it are
known: copies of `"\"" char* "\""` split one way. Printed syntax not known here costs past any
bound: it cannot be judged."""

import re
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

from minisgl.scheduler.regex_cost import (
    CONTROL_ESCAPES,
    MAX_SPLITS,
    Part,
    any_text,
    char_class,
    either,
    in_sequence,
    literal,
    regex_part,
    repeated,
)

_NAME = r"[\w.-]+"
_STRING = r'"(?:[^"\\]|\\.)*"'
_RULE = re.compile(rf"^({_NAME})(?:\[[^\]\n]*\])? ::= ", re.MULTILINE)  # `r[max_tokens=9] ::= `
_TOKEN = re.compile(
    rf"\s*(?:(?P<string>{_STRING})|(?P<chars>\[(?:[^\]\\]|\\.)*\])(?P<star>\*)?|(?P<lookahead>\(=)"
    rf"|(?P<regex>Regex\((?P<pattern>{_STRING})\))|(?P<token>(?:Exclude)?Token\([\d, ]*\))"
    rf"|(?P<name>{_NAME})(?:\{{(?P<low>\d+), (?P<high>-?\d+)\}})?|(?P<mark>[()|]))"
)
# a TagDispatch rule's (tag, rule) pairs, a TokenTagDispatch's (token id, rule): the rest of it
# (its options) matches nothing itself
_TAG_DISPATCH = re.compile(r"(?:Token)?TagDispatch\(")
_DISPATCHED = re.compile(rf"\(\s*(?:({_STRING})|\d+)\s*,\s*({_NAME})\s*\)")
_EXCLUDES = re.compile(rf"excludes=\(((?:\s*{_STRING}\s*,?)*)\)")
_LONGEST_EXCLUDE = 256  # characters of an exclude matched against what follows, at most
_STRING_ESCAPE = re.compile(r"\\(x[0-9A-Fa-f]{2}|u[0-9A-Fa-f]{4}|U[0-9A-Fa-f]{8}|.)")
_CONTROL = {**CONTROL_ESCAPES, "0": "\0"}  # in an EBNF string `\0` is the NUL character
_ANY_TEXT = any_text(0)  # what comes between a TagDispatch's tags
_ONE_TOKEN = any_text(1)  # `Token(...)`, `ExcludeToken(...)`: some text
_UNKNOWN = any_text(1, MAX_SPLITS + 1)  # a rule named and not defined


@dataclass(frozen=True)
class _Ref:
    rule: str
    low: int = 1
    high: int | None = 1  # None: no bound


_Item = Part | _Ref  # a sequence's: a terminal, or a rule (a group is one, once printed)
_Rule = list[list[_Item]]  # alternatives, each a sequence


class _Unread(Exception):
    """Printed syntax this module does not know."""


def too_costly(grammar: Any) -> str | None:
    """Why a grammar (EBNF text, or an xgrammar.Grammar built) is too costly to match; None if it
    is not (or xgrammar cannot read it: its own error comes when it compiles)."""
    if splits(grammar) <= MAX_SPLITS:
        return None
    return (
        "too costly to match: the counts of its repetitions of rules of varying length, nested or "
        f"side by side, multiply past {MAX_SPLITS}, or a cycle of its rules may go round "
        "matching nothing or is counted, or it holds what its cost cannot be read from"
    )


def splits(grammar: Any) -> int:
    """The largest product over a grammar's rules (EBNF text, or an xgrammar.Grammar built) of the
    counts of repetitions of rules of varying length (regex_cost.splits), up to MAX_SPLITS + 1;
    MAX_SPLITS + 1 for a cycle of rules that may match nothing or is counted, or syntax not known
    here; 1 for a grammar xgrammar cannot read."""
    import xgrammar

    if isinstance(grammar, str):
        try:
            grammar = xgrammar.Grammar.from_ebnf(grammar)
        except (RuntimeError, UnicodeError):
            return 1
    try:
        rules = _read(str(grammar))
    except _Unread:
        return MAX_SPLITS + 1
    nullable = _nullable(rules)
    if _empty_cycle(rules, nullable):
        return MAX_SPLITS + 1
    return max(part.splits for part in _parts(rules, nullable).values())


def _read(printed: str) -> dict[str, _Rule]:
    """The rules of xgrammar's print of a grammar, by name (lookaheads left out)."""
    heads = list(_RULE.finditer(printed))
    rules: dict[str, _Rule] = {}
    # the excludes of each TagDispatch with nothing to dispatch (a structural tag's any text)
    excluding: dict[str, set[str]] = {}
    for head, after in zip(heads, [*heads[1:], None], strict=True):
        body = printed[head.end() : after.start() if after else len(printed)].rstrip()
        if _TAG_DISPATCH.match(body):
            dispatched = [
                [_ANY_TEXT, *(_string(tag) if tag else [_ONE_TOKEN]), _Ref(rule)]
                for tag, rule in _DISPATCHED.findall(body)
            ]
            rules[head.group(1)] = [[_ANY_TEXT], *dispatched]
            if not dispatched and (excludes := _EXCLUDES.search(body)):
                excluding[head.group(1)] = {
                    _unescaped(e[1:-1]) for e in re.findall(_STRING, excludes[1])
                }
            continue
        tokens = [m for m in _TOKEN.finditer(body) if m.group().strip()]
        if "".join(m.group() for m in tokens) != body:
            raise _Unread
        reader = _Reader(tokens)
        rules[head.group(1)] = reader.alternatives(rules, head.group(1))
        if reader.i != len(tokens):  # a parenthesis closed that never opened
            raise _Unread
    if excluding:
        rules = {name: [_ended(s, excluding) for s in options] for name, options in rules.items()}
    return rules


def _ended(sequence: list[_Item], excluding: dict[str, set[str]]) -> list[_Item]:
    """The sequence with text that holds none of its excludes (a structural tag's any text), then
    one of them, read as one part that ends where that exclude first comes: once it has no
    border (no proper prefix of it is also its suffix), no whole match goes on."""
    out: list[_Item] = []
    k = 0
    while k < len(sequence):
        item = sequence[k]
        k += 1
        if isinstance(item, _Ref) and item == _Ref(item.rule) and item.rule in excluding:
            following = ""
            for after in sequence[k : k + _LONGEST_EXCLUDE]:
                if (char := _char(after)) is None:
                    break
                following += char
            for end in excluding[item.rule]:
                if end and following.startswith(end) and _borderless(end):
                    out.append(replace(any_text(len(end)), continues=frozenset()))
                    k += len(end)
                    break
            else:
                out.append(item)
        else:
            out.append(item)
    return out


def _char(item: _Item) -> str | None:
    """The character of a part that is one literal character (an EBNF string's); else None."""
    if isinstance(item, Part) and item.shortest == item.longest == 1 and len(item.firsts) == 1:
        atom = next(iter(item.firsts))
        if len(atom) == 1 and not item.later:
            return atom
    return None


def _borderless(text: str) -> bool:
    return all(text[:n] != text[-n:] for n in range(1, len(text)))


class _Reader:
    def __init__(self, tokens: list[re.Match[str]]) -> None:
        self.tokens = tokens
        self.i = 0
        self.groups: set[str] = set()  # the rules made of groups

    def alternatives(self, rules: dict[str, _Rule], name: str) -> _Rule:
        """A choice. A group inside of one alternative joins the sequence around it, one that is
        a whole alternative joins the choice, and any other becomes a rule of its own."""
        options: _Rule = []
        while True:
            sequence = self._sequence(rules, name)
            match sequence:
                case [_Ref(rule=group)] if group in self.groups:
                    options += rules.pop(group)
                case _:
                    options.append(sequence)
            if not self._at("|"):
                return options
            self.i += 1

    def _sequence(self, rules: dict[str, _Rule], name: str) -> list[_Item]:
        items: list[_Item] = []
        while self.i < len(self.tokens) and not self._at("|") and not self._at(")"):
            token = self.tokens[self.i]
            self.i += 1
            if token["lookahead"]:  # what must follow, not matched here
                self._skip_group()
            elif token["mark"] == "(":
                inner = self.alternatives(rules, name)
                if not self._at(")"):
                    raise _Unread
                self.i += 1
                if len(inner) == 1:
                    items += inner[0]
                else:
                    group = f"{name}/{self.i}"
                    rules[group] = inner
                    self.groups.add(group)
                    items.append(_Ref(group))
            elif token["string"]:
                items += _string(token["string"])
            elif token["chars"]:
                one = char_class(token["chars"])
                items.append(repeated(one, 0, None) if token["star"] else one)
            elif token["regex"]:
                items.append(regex_part(_unescaped(token["pattern"][1:-1])))
            elif token["token"]:
                items.append(_ONE_TOKEN)
            elif token["name"]:
                low, high = token["low"], token["high"]
                if low is None:
                    items.append(_Ref(token["name"]))
                else:
                    items.append(_Ref(token["name"], int(low), None if high == "-1" else int(high)))
            else:
                raise _Unread
        return items

    def _at(self, mark: str) -> bool:
        return self.i < len(self.tokens) and self.tokens[self.i]["mark"] == mark

    def _skip_group(self) -> None:
        open_groups = 1
        while open_groups and self.i < len(self.tokens):
            mark = self.tokens[self.i]["mark"] or ("(" if self.tokens[self.i]["lookahead"] else "")
            open_groups += {"(": 1, ")": -1}.get(mark, 0)
            self.i += 1


def _string(quoted: str) -> list[Part]:
    """A string's characters, each a part of the sequence around it (as a regex's are): where
    the parts before it may end is then judged at each of them."""
    return [literal(c) for c in _unescaped(quoted[1:-1])]


def _unescaped(text: str) -> str:
    def char(m: re.Match[str]) -> str:
        escape = m.group(1)
        if len(escape) > 1:
            return chr(min(int(escape[1:], 16), 0x10FFFF))
        return _CONTROL.get(escape, escape)

    return _STRING_ESCAPE.sub(char, text)


def _refs(rules: dict[str, _Rule], name: str) -> Iterator[_Ref]:
    return (
        item for s in rules[name] for item in s if isinstance(item, _Ref) and item.rule in rules
    )


def _nullable(rules: dict[str, _Rule]) -> set[str]:
    """The rules that may match nothing: a worklist over who names whom (a chain of rules is read
    once, not once a rule)."""
    # for each (rule, alternative): its items that must match something, by rule named
    missing: dict[tuple[str, int], int] = {}
    waiting: dict[str, list[tuple[str, int]]] = {}
    found: list[str] = []
    for name, options in rules.items():
        for k, sequence in enumerate(options):
            count = 0
            for item in sequence:
                if isinstance(item, Part):
                    count += item.shortest > 0
                elif item.low > 0:
                    count += 1
                    waiting.setdefault(item.rule, []).append((name, k))
            missing[name, k] = count
            if count == 0:
                found.append(name)
    nullable: set[str] = set()
    while found:
        name = found.pop()
        if name in nullable:
            continue
        nullable.add(name)
        for alternative in waiting.get(name, []):
            missing[alternative] -= 1
            if missing[alternative] == 0:
                found.append(alternative[0])
    return nullable


def _empty_cycle(rules: dict[str, _Rule], nullable: set[str]) -> bool:
    """Some rule may derive itself with nothing else matched (`r ::= [a-z]? r | ""`, `x ::= x x
    | ""`): the matcher follows every number of times round."""

    def empty(item: _Item) -> bool:
        if isinstance(item, Part):
            return item.shortest == 0
        return item.low == 0 or item.rule in nullable

    # rule -> the rules it may derive alone, everything beside them matching nothing
    alone: dict[str, set[str]] = {name: set() for name in rules}
    for name, options in rules.items():
        for sequence in options:
            solid = [item for item in sequence if not empty(item)]
            if len(solid) > 1:
                continue
            for item in solid or sequence:
                if (
                    isinstance(item, _Ref)
                    and item.rule in rules
                    and item.high != 0
                    and (item.low <= 1 or item.rule in nullable)
                ):
                    alone[name].add(item.rule)
    return any(len(c) > 1 or c[0] in alone[c[0]] for c in _cycles(alone))


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components (Tarjan's, without recursion: grammars may be deep),
    each after every one it reaches."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in edges:
        if start in index:
            continue
        path = [(start, iter(edges[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while path:
            name, successors = path[-1]
            successor = next(successors, None)
            if successor is not None:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    path.append((successor, iter(edges[successor])))
                elif successor in on_stack:
                    low[name] = min(low[name], index[successor])
                continue
            path.pop()
            if path:
                low[path[-1][0]] = min(low[path[-1][0]], low[name])
            if low[name] == index[name]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == name:
                        break
                found.append(component)
    return found


def _parts(rules: dict[str, _Rule], nullable: set[str]) -> dict[str, Part]:
    """Each rule's Part, the rules it names first. A rule that names itself only at one end of its
    alternatives is the repetition it prints (`r ::= x r | ""` is `x*`, counted once); otherwise
    within a cycle a rule of the cycle is taken as repeating any of the cycle's atoms (a count
    over one: past any bound), and as matching nothing where one of them may."""
    named = {name: {ref.rule for ref in _refs(rules, name)} for name in rules}
    parts: dict[str, Part] = {}
    for cycle in _cycles(named):
        if len(cycle) == 1 and (linear := _linear(rules[cycle[0]], cycle[0], parts)) is not None:
            parts[cycle[0]] = linear
            continue
        members = set(cycle)
        atoms = set[str]()
        for name in cycle:
            for sequence in rules[name]:
                for item in sequence:
                    known = item if isinstance(item, Part) else parts.get(item.rule)
                    if known is not None:
                        atoms |= known.firsts | known.later
        # a rule of the cycle costs what the costliest rule of it does, found in a second pass
        recursion = any_text(0 if members & nullable else 1, atoms=atoms)
        for _ in range(2 if len(cycle) > 1 or cycle[0] in named[cycle[0]] else 1):
            found = {name: _part(rules[name], parts, members, recursion) for name in cycle}
            recursion = replace(recursion, splits=max(p.splits for p in found.values()))
        # read with the stand-in, a rule that may match nothing may seem not to
        parts.update({n: replace(p, shortest=0) if n in nullable else p for n, p in found.items()})
    return parts


def _linear(rule: _Rule, name: str, parts: dict[str, Part]) -> Part | None:
    """A rule that names itself once in some of its alternatives, always as their last item
    (`r ::= x r | y`: x* y) or always as their first (`r ::= r x | y`: y x*); None for any other."""
    for end in (-1, 0):
        repeats: _Rule = []
        ends: _Rule = []
        for sequence in rule:
            own = [
                k for k, item in enumerate(sequence) if isinstance(item, _Ref) and item.rule == name
            ]
            if not own:
                ends.append(sequence)
            elif own == [end % len(sequence)] and sequence[end] == _Ref(name):
                repeats.append(sequence[:-1] if end == -1 else sequence[1:])
            else:
                break
        else:
            if repeats and ends:
                each = _part(repeats, parts, set(), _UNKNOWN)
                body = _counted_once(each, 0)
                rest = _part(ends, parts, set(), _UNKNOWN)
                return in_sequence([body, rest] if end == -1 else [rest, body])
    return None


def _part(rule: _Rule, parts: dict[str, Part], cycle: set[str], recursion: Part) -> Part:
    """A rule's Part, given those of the rules outside its cycle and `recursion` for those in it."""
    alternatives = []
    for sequence in rule:
        pieces = []
        for item in sequence:
            if isinstance(item, Part):
                pieces.append(item)
                continue
            part = recursion if item.rule in cycle else parts.get(item.rule, _UNKNOWN)
            if item.high is None and item.low <= 1:  # a `*` or `+` as a count (Lark's print)
                pieces.append(_counted_once(part, item.low))
            elif item.rule in cycle and item.high != 1:  # a count over a rule of its own cycle
                pieces.append(replace(recursion, splits=MAX_SPLITS + 1))
            else:
                pieces.append(repeated(part, item.low, item.high))
        alternatives.append(in_sequence(pieces))
    return either(alternatives)


def _counted_once(part: Part, low: int) -> Part:
    """The part `low` (0 or 1) or more times, as xgrammar prints EBNF's `*` and `+`: recursion,
    counted once (its cost grows with the output), however it is printed; a part that may match
    nothing stays past any bound."""
    each = repeated(part, low, None)
    return each if part.shortest == 0 and part.longest != 0 else replace(each, splits=part.splits)
