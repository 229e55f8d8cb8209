"""Stop strings found in a stream of text at a cost per character, however many stop strings
a request has and however long they are: an Aho-Corasick automaton over them.

    stops "ab", "bc":   root ─a─▶ 1 ─b─▶ 2 ("ab")     2 fails to 3: after "ab", a "c" still
                             └─b─▶ 3 ─c─▶ 4 ("bc")    completes "bc"

Its state after each character is the longest tail of the text that begins some stop string:
its depth is how much text must be held back, since it may still become a stop.
"""

import functools
from collections import deque


class _Automaton:
    def __init__(self, stops: tuple[str, ...]) -> None:
        self.goto: list[dict[str, int]] = [{}]
        self.depth = [0]
        self.match: list[str | None] = [None]  # the longest stop string ending in each state
        for stop in stops:
            state = 0
            for char in stop:
                if char not in self.goto[state]:
                    self.goto[state][char] = len(self.goto)
                    self.goto.append({})
                    self.depth.append(self.depth[state] + 1)
                    self.match.append(None)
                state = self.goto[state][char]
            self.match[state] = stop
        self.fail = [0] * len(self.goto)
        queue = deque(self.goto[0].values())  # breadth first: a state's fail is shallower
        while queue:
            state = queue.popleft()
            for char, child in self.goto[state].items():
                self.fail[child] = self.next(self.fail[state], char)
                if self.match[child] is None:
                    self.match[child] = self.match[self.fail[child]]
                queue.append(child)

    def next(self, state: int, char: str) -> int:
        while state and char not in self.goto[state]:
            state = self.fail[state]
        return self.goto[state].get(char, 0)


@functools.lru_cache(maxsize=256)  # many requests send the same stop strings
def _automaton(stops: tuple[str, ...]) -> _Automaton:
    return _Automaton(stops)


class StopMatcher:
    """One request's search for its stop strings in its text, fed as the text grows."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._automaton = _automaton(stops)
        self._state = 0

    def feed(self, text: str, start: int) -> tuple[int, str] | None:
        """Feed text[start:]; returns (where in text the first completed stop string begins, that
        string), or None. Of stop strings completed by the same character, the longest wins."""
        automaton, state = self._automaton, self._state
        for i in range(start, len(text)):
            state = automaton.next(state, text[i])
            stop = automaton.match[state]
            if stop is not None:
                self._state = state
                return i + 1 - len(stop), stop
        self._state = state
        return None

    @property
    def held(self) -> int:
        """Characters at the end of the text fed so far that may begin a stop string."""
        return self._automaton.depth[self._state]
