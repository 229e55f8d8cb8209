"""Prompt logprobs (vLLM's `prompt_logprobs`; OpenAI's `echo` with `logprobs`, which
lm-evaluation-harness scores loglikelihoods with): each prompt token's logprob under the tokens
before it, and the likeliest tokens', equal to Hugging Face's in fp32 however the prompt is
chunked, with its prefix cached or not, batched with other requests; offline and through the
server."""

import httpx
import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.scheduler.scheduler import PROMPT_LOGPROBS_CHUNK
from minisgl.tokenizer.loader import load_tokenizer
from minisgl.utils import DEFAULT_MODEL_PATH

from .conftest import DEVICE, hf_model, save_random_checkpoint
from .server_process import ServerProcess
from .stress.checks import assert_openai_error

TEXT = "Once upon a time, there was a little girl named Lily. She loved to play"
TOP = 3


@pytest.fixture(scope="module")
def reference() -> tuple[list[int], torch.Tensor]:
    """The prompt's ids and Hugging Face's logprobs at each of its positions."""
    prompt = load_tokenizer(DEFAULT_MODEL_PATH).encode(TEXT)
    with torch.no_grad():
        logits = hf_model(DEFAULT_MODEL_PATH)(torch.tensor([prompt], device=DEVICE)).logits[0]
    return prompt, torch.log_softmax(logits.float(), dim=-1).cpu()


def _check(entries: list, prompt: list[int], want: torch.Tensor) -> None:
    """vLLM's shape: None for the first token, then each token's logprob and the top ones."""
    assert entries[0] is None and len(entries) == len(prompt)
    for p, entry in enumerate(entries[1:]):
        assert entry["token_id"] == prompt[p + 1]
        assert entry["logprob"] == pytest.approx(want[p, prompt[p + 1]].item(), abs=1e-4)
        top = want[p].topk(TOP)
        assert [t["token_id"] for t in entry["top_logprobs"]] == top.indices.tolist()
        assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx(
            top.values.tolist(), abs=1e-4
        )


@pytest.mark.parametrize("chunk_size", [5, 8192])
def test_prompt_logprobs_equal_hugging_faces(reference, chunk_size: int) -> None:
    """In chunks of 5 tokens or whole; the second time with the prompt's prefix in the cache
    (computed again: a cached prefix has no logits), beside a request that asks none, n 2."""
    prompt, want = reference
    llm = LLM(device=DEVICE, dtype="float32", max_kv_tokens=2048, chunk_size=chunk_size)
    asks = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=TOP, n=2)
    plain = SamplingParams(temperature=0, max_tokens=4)
    first = llm.generate([prompt], asks, use_tqdm=False)
    again = llm.generate([prompt[:20], prompt], [plain, asks], use_tqdm=False)
    assert "prompt_logprobs" not in again[0]
    for result in [*first, *again[1:]]:
        _check(result["prompt_logprobs"], prompt, want)
        assert result["token_ids"] == first[0]["token_ids"]
    llm.scheduler.check_integrity()
    assert llm.scheduler.kv.used_pages == llm.scheduler.kv.prefix_cache.num_cached_pages


@pytest.mark.parametrize("chunk_size", [1, 4])
def test_a_one_token_chunk_beside_decodes_is_a_prefill(reference, chunk_size: int) -> None:
    """A step of one token per request is a decode's shape, but the prompt's chunk asks for a
    row of logits more: 1 token a step, or 4 with three requests decoding beside it."""
    prompt, want = reference
    llm = LLM(device=DEVICE, dtype="float32", max_kv_tokens=2048, chunk_size=chunk_size)
    plain = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    asks = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=TOP)
    results = llm.generate([[5], [6], [7], prompt], [plain, plain, plain, asks], use_tqdm=False)
    _check(results[3]["prompt_logprobs"], prompt, want)
    llm.scheduler.check_integrity()


def test_a_prompts_choices_share_its_first_choices_prompt_logprobs(reference) -> None:
    """n 3 of two prompts whose prefixes are cached: only each prompt's first choice computes
    its prompt's logprobs (the prompt whole: a cached prefix has no logits); the others reuse
    the cached prefix, and get the first's logprobs, equal to Hugging Face's."""
    prompt, want = reference
    prompts = [prompt, prompt[:12]]
    llm = LLM(device=DEVICE, dtype="float32", max_kv_tokens=2048)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    asks = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=TOP, n=3)
    results = llm.generate(prompts, asks, use_tqdm=False)
    for i, ids in enumerate(prompts):
        choices = results[3 * i : 3 * i + 3]
        assert [c["cached_tokens"] for c in choices] == [0, len(ids) - 1, len(ids) - 1]
        for choice in choices:
            _check(choice["prompt_logprobs"], ids, want)
    results[1]["prompt_logprobs"].clear()  # each result's list is its own
    _check(results[2]["prompt_logprobs"], prompt, want)


def test_prompt_logprobs_beyond_the_limit_are_refused() -> None:
    with pytest.raises(ValueError, match="prompt_logprobs must be an integer in"):
        SamplingParams(prompt_logprobs=21)


def test_requests_behind_prompt_logprobs_that_wait_for_rows_are_admitted() -> None:
    """A step computes PROMPT_LOGPROBS_CHUNK prompt logprobs at most; a request at the head of
    the queue that asks for more waits for the next step's, and those behind it that ask for
    none are admitted meanwhile (the step's token budget is left to them)."""
    llm = LLM(DEFAULT_MODEL_PATH, device=DEVICE, dtype="float32", max_kv_tokens=8192)
    scheduler = llm.scheduler
    asking = SamplingParams(max_tokens=1, prompt_logprobs=1)
    long_prompt = [(7 * i) % 500 + 1 for i in range(PROMPT_LOGPROBS_CHUNK + 100)]
    scheduler.add_requests(
        [(0, long_prompt, asking), (1, long_prompt[::-1], asking), (2, [5, 6, 7], SamplingParams())]
    )
    scheduler.step()
    assert [req.rid for req in scheduler.waiting] == [1]
    while scheduler.has_work:
        scheduler.step()
    scheduler.check_integrity()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    s = ServerProcess(tmp_path_factory.mktemp("echo"), "--served-model-name", "m")
    yield s
    s.stop()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("max_tokens", [1, 0])
def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_asks(
    server: ServerProcess, reference, stream: bool, max_tokens: int
) -> None:
    """lm-evaluation-harness's loglikelihood request: token ids, echo, logprobs 1, max_tokens 1;
    the logprobs cover the prompt's tokens (the first with none), then the one generated. With
    max_tokens 0 (its older form, and vLLM's and OpenAI's) the prompt alone (it was a 400)."""
    prompt, want = reference
    body = {"model": "m", "prompt": prompt, "echo": True, "logprobs": 1,
            "max_tokens": max_tokens, "temperature": 0, "stream": stream,
            "stream_options": {"include_usage": True} if stream else None}  # fmt: skip
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    if stream:
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: {")]
        replies = [httpx.Response(200, content=e).json() for e in events]
        pieces = [r["choices"][0] for r in replies if r["choices"]]
        text = "".join(p["text"] for p in pieces)
        token_logprobs = [lp for p in pieces for lp in p["logprobs"]["token_logprobs"]]
        top_logprobs = [t for p in pieces for t in p["logprobs"]["top_logprobs"]]
        finish_reason, usage = pieces[-1]["finish_reason"], replies[-1]["usage"]
    else:
        choice = response.json()["choices"][0]
        text = choice["text"]
        token_logprobs = choice["logprobs"]["token_logprobs"]
        top_logprobs = choice["logprobs"]["top_logprobs"]
        finish_reason, usage = choice["finish_reason"], response.json()["usage"]
    assert TEXT in text  # after "<s> ": an echoed id prompt shows its special tokens, as vLLM
    assert len(token_logprobs) == len(prompt) + max_tokens
    assert usage["completion_tokens"] == max_tokens and finish_reason == "length"
    if max_tokens == 0:
        detokenized = httpx.post(server.url + "/detokenize", json={"tokens": prompt}).json()
        assert text == detokenized["prompt"]
    assert token_logprobs[0] is None and top_logprobs[0] is None
    for p in range(len(prompt) - 1):
        assert token_logprobs[p + 1] == pytest.approx(want[p, prompt[p + 1]].item(), abs=1e-4)
        assert len(top_logprobs[p + 1]) in (1, 2)  # the likeliest token, and the prompt's


@pytest.mark.parametrize(
    "asks", [{"prompt_logprobs": 20}, {"echo": True, "logprobs": 20}], ids=["vllm", "echo"]
)
def test_more_prompt_logprobs_than_a_request_may_ask_for_is_a_400(
    server: ServerProcess, asks: dict
) -> None:
    """25 prompts of 2,047 tokens x 21 logprobs each: 1,074,150, over the default 2^20 (256 such
    prompts of 2,000 tokens made a 731 MB answer): computed nothing; one such prompt is served."""
    prompts = [[(i * 7 + j) % 500 + 1 for j in range(2047)] for i in range(25)]
    body = {"model": "m", "prompt": prompts, "max_tokens": 1, **asks}
    before = server.metrics()["minisgl_prompt_tokens_total"]
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    error = assert_openai_error(response, 400)
    assert "1074150 prompt logprobs" in error["message"], error
    assert server.metrics()["minisgl_prompt_tokens_total"] == before
    body = {"model": "m", "prompt": prompts[:1], "max_tokens": 1, **asks}
    assert httpx.post(server.url + "/v1/completions", json=body, timeout=120).status_code == 200


def test_each_choice_of_a_completion_counts_its_copy_of_the_prompt_logprobs(
    server: ServerProcess,
) -> None:
    """A completion's choices each carry their prompt's logprobs: one prompt of 2,047 tokens x
    21 x 25 choices is the same 1,074,150 (it was served: n=128 of a 2,000-token prompt made a
    365 MB answer); a chat answer holds them once, whatever n."""
    prompt = [(j * 7) % 500 + 1 for j in range(2047)]
    body = {"model": "m", "prompt": prompt, "max_tokens": 1, "prompt_logprobs": 20, "n": 25}
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    error = assert_openai_error(response, 400)
    assert "1074150 prompt logprobs" in error["message"] and "x 25 choices" in error["message"]
    assert (
        httpx.post(server.url + "/v1/completions", json={**body, "n": 24}, timeout=120).status_code
        == 200
    )


def _vllm_check(entries: list, prompt: list[int], want: torch.Tensor, top: int) -> None:
    """vLLM's prompt_logprobs: None, then {token id: {logprob, rank, decoded_token}} of the
    prompt's token and the `top` likeliest."""
    assert entries[0] is None and len(entries) == len(prompt)
    for p, by_id in enumerate(entries[1:]):
        token = prompt[p + 1]
        mine = by_id[str(token)]
        assert mine["logprob"] == pytest.approx(want[p, token].item(), abs=1e-4)
        assert mine["rank"] == int((want[p] >= want[p, token]).sum())
        likeliest = want[p].topk(top).indices.tolist()
        assert set(by_id) == {str(token), *map(str, likeliest)}
        assert [by_id[str(t)]["rank"] for t in likeliest] == list(range(1, top + 1))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_vllms_prompt_logprobs_field_on_completions(
    server: ServerProcess, reference, stream: bool
) -> None:
    prompt, want = reference
    body = {"model": "m", "prompt": prompt, "max_tokens": 2, "prompt_logprobs": 2,
            "stream": stream}  # fmt: skip
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    if stream:
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: {")]
        choices = [c for e in events for c in httpx.Response(200, content=e).json()["choices"]]
        with_them = [c for c in choices if "prompt_logprobs" in c]
        assert len(with_them) == 1  # the choice's first chunk
        entries = with_them[0]["prompt_logprobs"]
    else:
        entries = response.json()["choices"][0]["prompt_logprobs"]
    _vllm_check(entries, prompt, want, top=2)


def test_vllms_prompt_logprobs_field_on_chat(server: ServerProcess) -> None:
    """Beside the choices, as vLLM's chat response has them: one prompt for every choice."""
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
            "prompt_logprobs": 0, "n": 2}  # fmt: skip
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    entries = response.json()["prompt_logprobs"]
    assert entries[0] is None and len(entries) == response.json()["usage"]["prompt_tokens"]
    assert all(len(by_id) == 1 for by_id in entries[1:])  # the prompt's token alone
    for bad in ({"prompt_logprobs": 21}, {"stream": True}):  # not streamed, as in vLLM
        refused = httpx.post(server.url + "/v1/chat/completions", json={**body, **bad})
        assert refused.status_code == 400 and "prompt_logprobs" in refused.text


def test_echo_gives_logprobs_many_likeliest_tokens_whatever_prompt_logprobs_asks(
    server: ServerProcess, reference
) -> None:
    """As vLLM's: the echoed prompt's top_logprobs hold logprobs + 1 entries at most; the
    prompt_logprobs field holds its own count."""
    prompt, _ = reference
    body = {"model": "m", "prompt": prompt, "echo": True, "logprobs": 1, "prompt_logprobs": 5,
            "max_tokens": 1}  # fmt: skip
    choice = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    assert all(len(top) <= 2 for top in choice["logprobs"]["top_logprobs"][1:])
    assert all(len(by_id) >= 5 for by_id in choice["prompt_logprobs"][1:])


def test_a_default_max_tokens_without_room_for_min_tokens_says_so(server: ServerProcess) -> None:
    body = {"model": "m", "prompt": [5] * 2040, "min_tokens": 12}
    refused = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "min_tokens"
    assert "at most the 8 tokens that the prompt leaves" in refused.text


# longer than a step's prompt logprobs (PROMPT_LOGPROBS_CHUNK): a prompt's first choice gets its
# first token steps after its siblings, which find the prompt cached
LONG = [3 + (7 * i) % 509 for i in range(1100)]


def _same_entries(got: list, want: list) -> None:
    """vLLM-shaped prompt_logprobs alike: the same tokens, ranks and texts; logprobs to 1e-5."""
    assert len(got) == len(want) and got[0] is None and want[0] is None
    for g, w in zip(got[1:], want[1:], strict=True):
        assert g.keys() == w.keys()
        for token, entry in g.items():
            assert entry["logprob"] == pytest.approx(w[token]["logprob"], abs=1e-5)
            assert (entry["rank"], entry["decoded_token"]) == (
                w[token]["rank"], w[token]["decoded_token"],
            )  # fmt: skip


def _choices(response: httpx.Response, stream: bool) -> list[dict]:
    """A completion's choices; streamed, each merged from its chunks, the first of which alone
    carries its prompt_logprobs."""
    assert response.status_code == 200, response.text
    if not stream:
        return response.json()["choices"]
    merged: dict[int, dict] = {}
    for line in response.text.splitlines():
        if not line.startswith("data: {"):
            continue
        for chunk in httpx.Response(200, content=line[6:]).json()["choices"]:
            choice = merged.get(chunk["index"])
            if choice is None:
                assert "prompt_logprobs" in chunk, "a choice's first chunk has them"
                merged[chunk["index"]] = chunk
                continue
            assert "prompt_logprobs" not in chunk
            choice["text"] += chunk["text"]
            for key in ("tokens", "token_logprobs", "top_logprobs") if chunk["logprobs"] else ():
                choice["logprobs"][key] += chunk["logprobs"][key]
    return [merged[i] for i in sorted(merged)]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize(
    "fields", [{"prompt_logprobs": 2}, {"echo": True, "logprobs": 1}], ids=["field", "echo"]
)
def test_a_prompts_choices_share_its_prompt_logprobs_on_the_server(
    server: ServerProcess, reference, stream: bool, fields: dict
) -> None:
    """Two prompts, n 3, their prefixes cached: each prompt's first choice alone computes its
    prompt's logprobs (its siblings find the prompt cached), and every choice has what n 1
    gives, before its own text and logprobs; the long prompt's siblings get their tokens before
    their prompt's logprobs come."""
    prompts = [LONG, reference[0]]
    body = {"model": "m", "max_tokens": 3, "temperature": 0, **fields}
    url = server.url + "/v1/completions"
    alone = [
        _choices(httpx.post(url, json={**body, "prompt": p}, timeout=60), False)[0] for p in prompts
    ]
    cached = server.metrics()["minisgl_cached_prompt_tokens_total"]
    both = {**body, "prompt": prompts, "n": 3, "stream": stream}
    choices = _choices(httpx.post(url, json=both, timeout=60), stream)
    cached = server.metrics()["minisgl_cached_prompt_tokens_total"] - cached
    assert cached == sum(2 * (len(p) - 1) for p in prompts)
    assert len(choices) == 6
    for i, choice in enumerate(choices):
        want, prompt = alone[i // 3], prompts[i // 3]
        _same_entries(choice["prompt_logprobs"], want["prompt_logprobs"])
        if "echo" in fields:
            echoed = httpx.post(server.url + "/detokenize", json={"tokens": prompt}).json()
            assert choice["text"].startswith(echoed["prompt"])
            got, expected = choice["logprobs"], want["logprobs"]
            assert got["tokens"][: len(prompt)] == expected["tokens"][: len(prompt)]
            assert got["token_logprobs"][: len(prompt)] == pytest.approx(
                expected["token_logprobs"][: len(prompt)], abs=1e-5
            )


def test_more_likeliest_tokens_than_the_vocabulary_has_are_all_of_them(tmp_path) -> None:
    """logprobs and prompt_logprobs 20 (the most allowed) of a 16-token vocabulary: each
    position lists all 16. The step had raised a RuntimeError (torch.topk past the vocabulary)."""
    path = save_random_checkpoint(tmp_path / "v16", vocab_size=16)
    llm = LLM(str(path), device=DEVICE, dtype="float32", max_kv_tokens=512, max_model_len=512)
    params = SamplingParams(max_tokens=3, logprobs=20, prompt_logprobs=20, ignore_eos=True)
    [result] = llm.generate([[3, 5, 7, 11]], params, use_tqdm=False)
    assert len(result["token_ids"]) == 3
    assert [len(t["top_logprobs"]) for t in result["logprobs"]] == [16] * 3
    assert [len(t["top_logprobs"]) for t in result["prompt_logprobs"][1:]] == [16] * 3
    llm.scheduler.check_integrity()
