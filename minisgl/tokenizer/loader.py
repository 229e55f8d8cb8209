"""The tokenizer and how a request's prompt becomes token ids. Loaded with PreTrainedTokenizerFast
from tokenizer.json: `AutoTokenizer` imports torch in transformers 5, and the tokenizer process
runs without it."""

import inspect
from pathlib import Path
from typing import Any

import jinja2
from transformers import PreTrainedTokenizerFast

from minisgl.config import ConfigError
from minisgl.core import FieldError, PromptOptions

Tokenizer = PreTrainedTokenizerFast
# what apply_chat_template sets itself, and the globals of its Jinja environment (Jinja's own,
# transformers' raise_exception and strftime_now): a request's template variable may replace none
_RENDER_NAMES = (
    {*inspect.signature(Tokenizer.apply_chat_template).parameters, "messages"} - {"kwargs"}
) | {*jinja2.defaults.DEFAULT_NAMESPACE, "raise_exception", "strftime_now"}


def check_tokenizer(model_path: Path) -> None:
    """Raise ConfigError unless the directory holds a fast tokenizer."""
    if not (model_path / "tokenizer.json").is_file():
        raise ConfigError(f"{model_path} has no tokenizer.json (a fast tokenizer is required)")


def check_chat_template(tokenizer: Tokenizer, chat_template: str) -> None:
    """Raise ConfigError if a template given instead of the model's is no Jinja template, or
    writes nothing for a conversation (an empty file): every chat would otherwise get a 400 for
    the operator's mistake."""
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "Hi"}], chat_template=chat_template, tokenize=False
        )
    except jinja2.TemplateSyntaxError as e:
        raise ConfigError(f"--chat-template is no Jinja template: {e}") from None
    except jinja2.TemplateError:  # its own checks, which a real conversation may pass
        return
    if not str(text).strip():
        raise ConfigError("--chat-template writes no text for a conversation (an empty file?)")


def load_tokenizer(model_path: Path) -> Tokenizer:
    check_tokenizer(model_path)
    return PreTrainedTokenizerFast.from_pretrained(str(model_path))


DEFAULT_PROMPT_OPTIONS = PromptOptions()


def prompt_ids(
    tokenizer: Tokenizer,
    prompt: str | list[int] | None,
    messages: list[dict[str, Any]] | None = None,
    chat_template: str | None = None,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
    options: PromptOptions = DEFAULT_PROMPT_OPTIONS,
) -> list[int]:
    """A prompt (text or ids), or a chat rendered with the chat template (chat_template: one
    given instead of the model's; tools and template_kwargs, the template's own variables, passed
    to it), as token ids, built as `options` say; raises ValueError if it cannot be built."""
    if messages is not None:
        if chat_template is None and tokenizer.chat_template is None:
            raise ValueError("the model has no chat template; use /v1/completions")
        kwargs = template_kwargs or {}
        taken = sorted(set(kwargs) & _RENDER_NAMES)
        if taken:
            raise FieldError(
                "chat_template_kwargs", f"chat_template_kwargs may not set {', '.join(taken)}"
            )
        try:
            text = tokenizer.apply_chat_template(
                messages,
                tools=tools,
                chat_template=chat_template,
                tokenize=False,
                add_generation_prompt=options.add_generation_prompt,
                continue_final_message=options.continue_final_message,
                **kwargs,
            )
        except Exception as e:  # a template is code: its rendering may raise anything
            raise ValueError(f"cannot apply the chat template: {e}") from e
        # the template writes any BOS itself: by default encoding adds no second one
        return tokenizer.encode(_unicode(text), add_special_tokens=bool(options.add_special_tokens))
    if isinstance(prompt, str):
        special = options.add_special_tokens is not False
        return tokenizer.encode(_unicode(prompt), add_special_tokens=special)
    if prompt is None:
        raise ValueError("a request needs a prompt or messages")
    return list(prompt)


def _unicode(text: str) -> str:
    """The text, if it is Unicode; raises ValueError (UnicodeEncodeError) for a lone surrogate,
    which the tokenizer refuses with a TypeError."""
    if not text.isascii():
        text.encode("utf-8")
    return text
