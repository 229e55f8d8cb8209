"""StopMatcher (Aho-Corasick) against a brute-force search: the first stop string to complete, and
the held-back tail, on random texts fed in random pieces."""

import random

from minisgl.tokenizer.stop_matcher import StopMatcher


def _brute_force(text: str, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """The earliest end of any stop string in text; of those ending there, the longest."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            stop = max(done, key=len)
            return end - len(stop), stop
    return None


def _held(text: str, stops: tuple[str, ...]) -> int:
    """The longest tail of text that begins some stop string."""
    return max((n for s in stops for n in range(1, len(s) + 1) if text.endswith(s[:n])), default=0)


def test_matches_and_held_tails_equal_a_brute_force_search() -> None:
    rng = random.Random(0)
    for _ in range(300):
        stops = tuple(
            "".join(rng.choice("abc") for _ in range(rng.randint(1, 5)))
            for _ in range(rng.randint(1, 6))
        )
        text = "".join(rng.choice("abcd") for _ in range(rng.randint(0, 40)))
        matcher, fed, found = StopMatcher(stops), 0, None
        while fed < len(text) and found is None:
            end = min(len(text), fed + rng.randint(1, 4))
            found = matcher.feed(text[:end], fed)
            if found is None:
                assert matcher.held == _held(text[:end], stops), (stops, text[:end])
            fed = end
        assert found == _brute_force(text, stops), (stops, text)


def test_one_of_64_stop_strings_of_1024_characters_is_found() -> None:
    stops = tuple(f"{i:04d}" * 256 for i in range(64))  # 64 stop strings of 1,024 characters
    matcher = StopMatcher(stops)
    text = "0001" * 300
    assert matcher.feed(text, 0) == (0, stops[1])
