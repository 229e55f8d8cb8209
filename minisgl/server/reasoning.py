"""Reasoning parsers (--reasoning-parser): a chat reply split into its thinking, returned as
`reasoning_content`, and its answer, returned as `content`.

A parser is fed the reply piece by piece, as it streams, and holds back only what may still turn
out to be a tag; fed the whole reply at once it gives the same texts, however the reply was split.
"""


def partial_tag_len(text: str, tag: str) -> int:
    """The length of the longest end of `text` that starts `tag` (and may yet become it)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class Qwen3ReasoningParser:
    """Qwen3's `<think>…</think>`, as vLLM's qwen3 parser reads it. With thinking on (the
    template's default), the reply is thinking up to `</think>` and the answer after it; a
    leading `<think>` is dropped, and a template that opened the block in the prompt leaves only
    `</think>` in the reply. A reply that never closes the block was cut short while thinking: it
    is all reasoning. With thinking off (`chat_template_kwargs: {"enable_thinking": false}`) the
    whole reply is the answer. So is a `constrained` reply (a structured output held it from its
    first token: JSON, a regex, a choice) that does not open the block itself, and a reply that
    `continues` the prompt's last message (continue_final_message): the template closes that
    message's thinking."""

    start, end = "<think>", "</think>"

    def __init__(
        self, template_kwargs: dict[str, object], constrained: bool = False, continues: bool = False
    ) -> None:
        thinks = self.thinks(template_kwargs) and not continues
        self._state = "start" if thinks else "answer"  # -> thinking -> answer
        self._constrained = constrained
        self._held = ""

    @staticmethod
    def thinks(template_kwargs: dict[str, object]) -> bool:
        """The template lets the model think (a reply may open the block)."""
        return template_kwargs.get("enable_thinking", True) is not False

    def feed(self, text: str) -> tuple[str, str]:
        """The reasoning and the answer that `text`, the reply's next piece, makes final."""
        text, self._held = self._held + text, ""
        if self._state == "start":
            if self.start.startswith(text) and len(text) < len(self.start):
                self._held = text
                return "", ""
            opened = text.startswith(self.start)
            text = text.removeprefix(self.start)
            self._state = "thinking" if opened or not self._constrained else "answer"
        if self._state == "answer":
            return "", text
        reasoning, tag, answer = text.partition(self.end)
        if tag:
            self._state = "answer"
            return reasoning, answer
        keep = partial_tag_len(text, self.end)
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep], ""

    def finish(self) -> tuple[str, str]:
        """What was held back, once the reply has ended."""
        held, self._held = self._held, ""
        # held while thinking: a part of `</think>`; at the start: a part of `<think>`, which
        # a constrained reply has not opened
        opened = self._state == "thinking" or not self._constrained
        return (held, "") if opened else ("", held)


# name -> the parser of one reply, made from the request's chat_template_kwargs and whether a
# structured output holds it from its first token
REASONING_PARSERS: dict[str, type[Qwen3ReasoningParser]] = {"qwen3": Qwen3ReasoningParser}
