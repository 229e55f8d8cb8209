"""How a request is written for an OpenAI-compatible server: `/v1/completions` with token ids or
text, or `/v1/chat/completions`; always streamed, with the usage chunk asked for, EOS ignored,
nucleus, top-k and min-p sampling and the repetition penalty off.

Text is the prompt ids decoded with the model's tokenizer, so the server tokenizes it again (to
about as many tokens: the usage chunk says how many). A chat sends a request's shared prefix as
the system message and the rest as the user message.
"""

from collections.abc import Callable
from typing import Any

from workload import BenchRequest

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
Prompt = list[int] | str | list[dict[str, str]]  # token ids, a text, or chat messages


def api_prompt(
    request: BenchRequest, endpoint: str, text: bool, decode: Callable[[list[int]], str]
) -> Prompt:
    """The prompt as the endpoint takes it; `text`: completions get text instead of ids."""
    if endpoint == "completions":
        return decode(request.prompt) if text else request.prompt
    split = request.prefix_len
    messages = [{"role": "user", "content": decode(request.prompt[split:])}]
    if split:
        messages.insert(0, {"role": "system", "content": decode(request.prompt[:split])})
    return messages


def request_body(
    endpoint: str, model: str, prompt: Prompt, output_len: int, temperature: float
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "temperature": temperature,
        # given, not left to the server's defaults (a model's generation_config.json may set
        # them): the same sampling on every server and in the offline run
        "top_p": 1.0,
        "top_k": -1,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "ignore_eos": True,  # not OpenAI's; vLLM, SGLang and minisgl take it
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if endpoint == "chat":
        return {**body, "messages": prompt, "max_completion_tokens": output_len}
    return {**body, "prompt": prompt, "max_tokens": output_len}
