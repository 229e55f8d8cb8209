"""The tokenizer and how a request's prompt becomes token ids. Loaded with PreTrainedTokenizerFast
from tokenizer.json: `AutoTokenizer` imports torch in transformers 5, and the tokenizer process
runs without it."""

from pathlib import Path

import jinja2
from transformers import PreTrainedTokenizerFast

from minisgl.config import ConfigError

Tokenizer = PreTrainedTokenizerFast


def check_tokenizer(model_path: Path) -> None:
    """Raise ConfigError unless the directory holds a fast tokenizer."""
    if not (model_path / "tokenizer.json").is_file():
        raise ConfigError(f"{model_path} has no tokenizer.json (a fast tokenizer is required)")


def load_tokenizer(model_path: Path) -> Tokenizer:
    check_tokenizer(model_path)
    return PreTrainedTokenizerFast.from_pretrained(str(model_path))


def prompt_ids(
    tokenizer: Tokenizer,
    prompt: str | list[int] | None,
    messages: list[dict[str, str]] | None = None,
    chat_template: str | None = None,
) -> list[int]:
    """A prompt (text or ids), or a chat rendered with the chat template (chat_template: one
    given instead of the model's), as token ids; raises ValueError if it cannot be built."""
    if messages is not None:
        if chat_template is None and tokenizer.chat_template is None:
            raise ValueError("the model has no chat template; use /v1/completions")
        try:
            text = tokenizer.apply_chat_template(
                messages, chat_template=chat_template, tokenize=False, add_generation_prompt=True
            )
        except jinja2.TemplateError as e:
            raise ValueError(f"cannot apply the chat template: {e}") from e
        # the template writes any BOS itself; encoding must not add a second one
        return tokenizer.encode(text, add_special_tokens=False)
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    if prompt is None:
        raise ValueError("a request needs a prompt or messages")
    return list(prompt)
