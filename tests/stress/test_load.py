"""Ordinary load: many concurrent clients (the `openai` client), streaming and not, completions and
chats, one or two choices each. Every client gets exactly the tokens it asked for, the counters
agree with the answers, and the server is clean afterwards."""

import asyncio
import random
from dataclasses import dataclass

import openai

from ..server_process import ServerProcess
from .checks import GENERATED, MODEL, PROMPT_TOKENS, assert_clean, delta, finished


@dataclass
class Answer:
    n: int
    max_tokens: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    texts: list[str]
    finish_reasons: list[str | None]


async def _ask(client: openai.AsyncOpenAI, i: int, max_tokens: int, n: int) -> Answer:
    """Client i: a chat or a completion, streamed or not, by the bits of i."""
    chat, stream = i % 2 == 1, i // 2 % 2 == 1
    texts, reasons = [""] * n, [None] * n
    kwargs = dict(
        model=MODEL,
        max_tokens=max_tokens,
        n=n,
        seed=i,
        extra_body={"ignore_eos": True},
    )
    if stream:
        kwargs.update(stream=True, stream_options={"include_usage": True})
    prompt = f"Once upon a time there was a {i}"
    if chat:
        messages = [{"role": "user", "content": prompt}]
        response = await client.chat.completions.create(messages=messages, **kwargs)
    else:
        response = await client.completions.create(prompt=prompt, **kwargs)
    if stream:
        usage = None
        async for chunk in response:
            usage = chunk.usage or usage
            for c in chunk.choices:
                texts[c.index] += (c.delta.content or "") if chat else c.text
                reasons[c.index] = c.finish_reason or reasons[c.index]
    else:
        usage = response.usage
        for c in response.choices:
            texts[c.index] = c.message.content if chat else c.text
            reasons[c.index] = c.finish_reason
    assert usage is not None
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return Answer(
        n, max_tokens, usage.prompt_tokens, usage.completion_tokens, cached, texts, reasons
    )


def _run(server: ServerProcess, requests: list[tuple[int, int]]) -> list[Answer]:
    """One concurrent client per (max_tokens, n)."""

    async def all_clients() -> list[Answer]:
        client = server.async_client(max_retries=0, timeout=300)
        return await asyncio.gather(*(_ask(client, i, m, n) for i, (m, n) in enumerate(requests)))

    return asyncio.run(all_clients())


def test_concurrent_mixed_streams_and_chats_get_exact_token_counts(
    ordinary_server: ServerProcess, size
) -> None:
    server = ordinary_server
    clients = size(64, 200)
    rng = random.Random(0)
    requests = [(rng.randint(8, size(40, 200)), rng.choice((1, 2))) for _ in range(clients)]
    before = server.metrics()
    answers = _run(server, requests)
    after = server.metrics()

    for a in answers:
        assert a.completion_tokens == a.n * a.max_tokens
        assert a.finish_reasons == ["length"] * a.n
        assert all(a.texts)
    # each engine request (one per choice) counts its prompt; usage counts a prompt once
    assert delta(before, after, PROMPT_TOKENS) == sum(a.prompt_tokens * a.n for a in answers)
    assert delta(before, after, GENERATED) == sum(a.completion_tokens for a in answers)
    assert delta(before, after, finished("length")) == sum(a.n for a in answers)
    assert delta(before, after, finished("abort")) == delta(before, after, finished("error")) == 0
    assert_clean(server, before)


def test_cached_prompt_tokens_counter_agrees_with_the_answers(
    ordinary_server: ServerProcess,
) -> None:
    server = ordinary_server
    before = server.metrics()
    # the same prompts twice: the second round finds them in the prefix cache
    answers = _run(server, [(8, 1)] * 8) + _run(server, [(8, 1)] * 8)
    after = server.metrics()
    assert sum(a.cached_tokens for a in answers[8:]) > 0
    assert delta(before, after, "minisgl_cached_prompt_tokens_total") == sum(
        a.cached_tokens for a in answers
    )
    assert_clean(server, before)
