"""Continuous batching, paging, chunking, prefix reuse, preemption, overlap and the CUDA-graph path
all compute the same function as running one request at a time (and as Hugging Face)."""

import io
import json
import random
import subprocess
import sys

import numpy as np
import pytest
import torch
from tqdm import tqdm

from minisgl import LLM, SamplingParams
from minisgl.config import offline_chunk_size
from minisgl.core import Req
from minisgl.scheduler.batch_builder import build_batch

from .conftest import DEVICE, assert_same_or_near_tie, hf_greedy, hf_model, step_tokens

NUM_PROMPTS = 40
PLAIN = {"attention_backend": "torch", "cuda_graph_max_bs": 0, "overlap": False}


@pytest.fixture(scope="module")
def model_path(checkpoint):
    return checkpoint("llama", max_position_embeddings=512)


@pytest.fixture(scope="module")
def workload() -> tuple[list[list[int]], list[SamplingParams]]:
    """40 prompts of lengths 1-300 with different max_tokens; some end right at a page edge."""
    rng = random.Random(0)
    lengths = [1, 2, 15, 16, 17, 64, 300] + [rng.randint(1, 300) for _ in range(NUM_PROMPTS - 7)]
    prompts = [[rng.randrange(512) for _ in range(n)] for n in lengths]
    params = [
        SamplingParams(temperature=0, max_tokens=rng.randint(1, 24), ignore_eos=True)
        for _ in range(NUM_PROMPTS)
    ]
    return prompts, params


@pytest.fixture(scope="module")
def reference(model_path, workload) -> list[list[int]]:
    """Each request alone, through the reference path: torch attention, no graphs, no overlap."""
    prompts, params = workload
    llm = LLM(str(model_path), device=DEVICE, dtype="float32", max_kv_tokens=4096, **PLAIN)
    return [
        llm.generate([p], sp, use_tqdm=False)[0]["token_ids"]
        for p, sp in zip(prompts, params, strict=True)
    ]


def test_one_at_a_time_equals_hf(model_path, workload, reference) -> None:
    prompts, params = workload
    hf = hf_model(model_path)
    for prompt, sp, got in zip(prompts, params, reference, strict=True):
        assert_same_or_near_tie(hf, prompt, got, hf_greedy(hf, prompt, sp.max_tokens))


def assert_matches_reference(model_path, workload, reference, outputs) -> None:
    prompts, _ = workload
    hf = None
    for prompt, want, out in zip(prompts, reference, outputs, strict=True):
        assert out["finish_reason"] == "length" and len(out["token_ids"]) == len(want)
        if out["token_ids"] != want:
            hf = hf or hf_model(model_path)
            assert_same_or_near_tie(hf, prompt, out["token_ids"], want)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"page_size": 4},
        {"page_size": 16},
        {"chunk_size": 8},
        {"chunk_size": 8, "page_size": 16},
        {"cache": "naive"},
        {"overlap": False},
        {"cuda_graph_max_bs": 16},
        {"cuda_graph_max_bs": 16, "overlap": False},
        {"cuda_graph_max_bs": 16, "page_size": 16},
    ],
    ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default",
)
def test_batched_generate_equals_one_at_a_time(model_path, workload, reference, options) -> None:
    prompts, params = workload
    llm = LLM(str(model_path), device=DEVICE, dtype="float32", max_kv_tokens=16384, **options)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert_matches_reference(model_path, workload, reference, outputs)
    llm.scheduler.check_integrity()
    assert llm.scheduler.kv.used_pages == len(llm.scheduler.kv.prefix_cache.cached_pages())


@pytest.mark.parametrize("splits", [2, 4])
def test_split_k_partial_sums_give_the_reference_tokens(
    model_path, workload, reference, monkeypatch, splits
) -> None:
    """o_proj and down_proj as partial sums over slices of their input, summed by the residual
    add + RMSNorm after them (forced here for every batch; on a GPU mid-size batches take it).
    Chunked prefill makes the LM head pick its rows out of partial sums."""
    monkeypatch.setenv("MINISGL_SPLIT_K", str(splits))
    prompts, params = workload
    llm = LLM(str(model_path), device=DEVICE, dtype="float32", max_kv_tokens=16384, chunk_size=64)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert_matches_reference(model_path, workload, reference, outputs)
    llm.scheduler.check_integrity()


def test_offline_default_chunk_size_follows_the_device(model_path) -> None:
    gib = 1 << 30
    assert offline_chunk_size("cuda", 141 * gib, "NVIDIA H200") == 16384
    assert offline_chunk_size("cuda", 80 * gib, "NVIDIA A100-SXM4-80GB") == 8192
    assert offline_chunk_size("cuda", 24 * gib, "NVIDIA GeForce RTX 4090") == 8192
    assert offline_chunk_size("cpu") == 8192
    llm = LLM(str(model_path), device=DEVICE, dtype="float32", max_kv_tokens=1024)
    device = llm.engine.device
    props = torch.cuda.get_device_properties(device) if device.type == "cuda" else None
    want = offline_chunk_size(device.type, *((props.total_memory, props.name) if props else ()))
    assert llm.scheduler.config.chunk_size == want
    with pytest.raises(ValueError, match="chunk_size"):
        LLM(str(model_path), device=DEVICE, dtype="float32", max_kv_tokens=1024, chunk_size=0)


def test_chunked_prefill_splits_prompts_into_steps(model_path, workload, reference) -> None:
    prompts, params = workload
    llm = LLM(str(model_path), device=DEVICE, dtype="float32", max_kv_tokens=16384, chunk_size=8)
    llm.generate(prompts, params, use_tqdm=False)
    # every step prefills at most 8 tokens, so the 300-token prompt alone needs 38 steps
    assert llm.scheduler.stats.steps >= sum(len(p) for p in prompts) // 8


def test_decode_tokens_count_in_the_step_budget(model_path, workload) -> None:
    """A step holds chunk_size tokens at most (more only when the decodes alone exceed it), and a
    step that mixes decodes with prompt chunks fills the budget exactly."""
    prompts, params = workload
    chunk = 64
    llm = LLM(
        str(model_path), device=DEVICE, dtype="float32", max_kv_tokens=16384, chunk_size=chunk
    )
    scheduler = llm.scheduler
    scheduler.add_requests(
        [(rid, p, sp) for rid, (p, sp) in enumerate(zip(prompts, params, strict=True))]
    )
    full_mixed_steps = 0
    while scheduler.has_work:
        scheduler.step()
        batch = scheduler._in_flight.batch if scheduler._in_flight else None
        if batch is None:
            continue
        decodes = sum(1 for n in batch.extend_lens if n == 1)
        assert batch.num_tokens <= max(chunk, decodes), (batch.num_tokens, decodes)
        full_mixed_steps += 0 < decodes < batch.size and batch.num_tokens == chunk
    assert full_mixed_steps > 0


def test_shared_prefix_is_reused_and_outputs_unchanged(model_path) -> None:
    rng = random.Random(1)
    prefix = [rng.randrange(512) for _ in range(200)]
    prompts = [prefix + [rng.randrange(512) for _ in range(rng.randint(1, 30))] for _ in range(6)]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone = [
        LLM(
            str(model_path), device=DEVICE, dtype="float32", max_kv_tokens=2048, cache="naive"
        ).generate([p], sp, use_tqdm=False)[0]["token_ids"]
        for p in prompts[:2]
    ]
    llm = LLM(str(model_path), device=DEVICE, dtype="float32", max_kv_tokens=4096, page_size=4)
    first = llm.generate(prompts[:1], sp, use_tqdm=False)[0]
    rest = llm.generate(prompts[1:], sp, use_tqdm=False)
    assert first["cached_tokens"] == 0
    assert all(out["cached_tokens"] >= 196 for out in rest), [o["cached_tokens"] for o in rest]
    assert [first["token_ids"], rest[0]["token_ids"]] == alone
    llm.scheduler.check_integrity()


def test_reset_prefix_cache_frees_every_cached_page_and_the_next_run_recomputes(
    model_path,
) -> None:
    prompt = list(range(1, 70))
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm = LLM(str(model_path), device=DEVICE, dtype="float32", max_kv_tokens=2048, page_size=4)
    first = llm.generate([prompt], sp, use_tqdm=False)[0]
    kv = llm.scheduler.kv
    assert kv.prefix_cache.cached_pages()
    llm.reset_prefix_cache()
    assert kv.allocator.num_free == kv.num_pages and not kv.prefix_cache.cached_pages()
    again = llm.generate([prompt], sp, use_tqdm=False)[0]
    assert again["cached_tokens"] == 0 and again["token_ids"] == first["token_ids"]
    llm.scheduler.check_integrity()


def test_requests_in_one_batch_share_a_prefix_computed_earlier_in_the_same_call(model_path) -> None:
    rng = random.Random(2)
    prefix = [rng.randrange(512) for _ in range(64)]
    prompts = [prefix + [i] for i in range(4)]
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    # chunk_size 65: the first prompt fills the first step, the others arrive after it is cached
    llm = LLM(str(model_path), device=DEVICE, dtype="float32", max_kv_tokens=2048, chunk_size=65)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert outs[0]["cached_tokens"] == 0 and all(o["cached_tokens"] == 64 for o in outs[1:])


def test_a_prompt_whose_last_chunk_is_one_token_is_shared_once_computed(model_path) -> None:
    """A request arriving while the first decodes finds its whole prompt cached, though the
    first prompt's last step computed one token."""
    llm = LLM(str(model_path), device=DEVICE, dtype="float32", max_kv_tokens=2048, chunk_size=64)
    scheduler = llm.scheduler
    prompt = [(5 * i) % 500 + 1 for i in range(65)]  # a chunk of 64, then one token
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    scheduler.add_requests([(0, prompt, sp)])
    for _ in range(3):
        scheduler.step()
    assert 0 in {r.rid for r in scheduler.running}  # still decoding
    scheduler.add_requests([(1, prompt, sp)])
    finished = {}
    while scheduler.has_work:
        finished.update((f.rid, f) for f in scheduler.step().finished)
    assert finished[1].cached_tokens == 64  # all but the token it must compute
    scheduler.check_integrity()


def test_preemption_when_the_pool_is_too_small_keeps_outputs(
    model_path, workload, reference
) -> None:
    prompts, params = workload
    # about 1/4 of what all 40 requests need at once
    llm = LLM(str(model_path), device=DEVICE, dtype="float32", max_kv_tokens=1600, page_size=4)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.scheduler.stats.num_preemptions > 0
    assert_matches_reference(model_path, workload, reference, outputs)
    kv = llm.scheduler.kv
    llm.scheduler.check_integrity()
    # nothing leaked: every page is free or held by the prefix cache, none by a request
    assert kv.allocator.num_free + len(kv.prefix_cache.cached_pages()) == kv.num_pages
    assert not llm.scheduler.running and not llm.scheduler.waiting


def test_preemption_with_naive_cache_recomputes_from_scratch(
    model_path, workload, reference
) -> None:
    prompts, params = workload
    llm = LLM(str(model_path), device=DEVICE, dtype="float32", max_kv_tokens=1200, cache="naive")
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.scheduler.stats.num_preemptions > 0
    assert_matches_reference(model_path, workload, reference, outputs)
    assert llm.scheduler.kv.allocator.num_free == llm.scheduler.kv.num_pages


def test_max_running_requests_bounds_the_batch(model_path, workload, reference) -> None:
    """No step admits or runs more than 3 requests, some run 3, and the outputs are unchanged."""
    prompts, params = workload
    llm = LLM(
        str(model_path), device=DEVICE, dtype="float32", max_kv_tokens=16384, max_running_requests=3
    )
    scheduler = llm.scheduler
    scheduler.add_requests(
        [(rid, p, sp) for rid, (p, sp) in enumerate(zip(prompts, params, strict=True))]
    )
    sizes = []
    while scheduler.has_work:
        scheduler.step()
        assert len(scheduler.running) <= 3
        if scheduler._in_flight:
            sizes.append(scheduler._in_flight.batch.size)
    assert max(sizes) == 3, sizes
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert_matches_reference(model_path, workload, reference, outputs)


def test_generation_stops_at_the_context_length(model_path) -> None:
    llm = LLM(str(model_path), device=DEVICE, dtype="float32", max_kv_tokens=64, max_model_len=64)
    assert llm.engine.layout.max_seq_len == 64
    rest = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)  # the whole context
    out = llm.generate([[5] * 60], rest, use_tqdm=False)
    assert out[0]["finish_reason"] == "length" and len(out[0]["token_ids"]) == 4
    with pytest.raises(ValueError, match=r"you requested 160 tokens \(60 in the messages, 100 in"):
        llm.generate([[5] * 60], SamplingParams(max_tokens=100), use_tqdm=False)


def test_abort_frees_the_request(model_path) -> None:
    llm = LLM(str(model_path), device=DEVICE, dtype="float32", max_kv_tokens=2048)
    scheduler = llm.scheduler
    scheduler.add_requests(
        [
            (100, list(range(50)), SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)),
            (101, list(range(40)), SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)),
        ]
    )
    for _ in range(3):
        scheduler.step()
    aborted = scheduler.abort_request(100)
    assert aborted is not None and aborted.reason == "abort"
    assert scheduler.abort_request(100) is None
    while scheduler.has_work:
        assert set(scheduler.step().rids) <= {101}
    scheduler.check_integrity()
    assert scheduler.kv.used_pages == len(scheduler.kv.prefix_cache.cached_pages())


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("page_size", [1, 8])
def test_random_arrivals_aborts_and_preemption_keep_the_pool_consistent(
    model_path, overlap: bool, page_size: int
) -> None:
    rng = random.Random(page_size * 2 + overlap)
    llm = LLM(
        str(model_path), device=DEVICE, dtype="float32", max_kv_tokens=640, page_size=page_size,
        chunk_size=48, overlap=overlap,
    )  # fmt: skip
    scheduler, shared = llm.scheduler, [rng.randrange(512) for _ in range(40)]
    expected, finished, aborted = {}, {}, set()
    alone = LLM(str(model_path), device=DEVICE, dtype="float32", max_kv_tokens=1024, **PLAIN)
    for rid in range(30):
        prompt = (shared if rng.random() < 0.5 else []) + [
            rng.randrange(512) for _ in range(rng.randint(1, 90))
        ]
        sp = SamplingParams(temperature=0, max_tokens=rng.randint(1, 30), ignore_eos=True)
        expected[rid] = alone.generate([prompt], sp, use_tqdm=False)[0]["token_ids"]
        scheduler.add_requests([(rid, prompt, sp)])
        finished[rid] = []
    while scheduler.has_work:
        for rid, token in step_tokens(scheduler):
            finished[rid].append(token)
        if rng.random() < 0.1:
            rid = rng.randrange(30)
            if scheduler.abort_request(rid) is not None:
                aborted.add(rid)
        scheduler.check_integrity()
    assert scheduler.stats.num_preemptions > 0
    for rid, tokens in finished.items():
        if rid not in aborted:
            assert tokens == expected[rid], rid
        else:
            assert tokens == expected[rid][: len(tokens)]
    kv = scheduler.kv
    assert kv.allocator.num_free + len(kv.prefix_cache.cached_pages()) == kv.num_pages


@pytest.mark.parametrize("page_size", [1, 4])
def test_decode_steps_that_admit_a_request_write_its_tables_with_graphs_on(
    model_path, page_size: int
) -> None:
    """A step of decodes only can still carry table writes: a one-token prompt admitted while
    another request decodes writes its id into the token table, and a preempted request coming
    back writes its cached pages into the page table. The graph runner must apply them."""
    rng = random.Random(page_size)
    prompts = [[rng.randrange(512) for _ in range(n)] for n in (90, 1, 1, 60)]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = LLM(str(model_path), device=DEVICE, dtype="float32", max_kv_tokens=1024, **PLAIN)
    expected = [alone.generate([p], sp, use_tqdm=False)[0]["token_ids"] for p in prompts]
    llm = LLM(
        str(model_path), device=DEVICE, dtype="float32", max_kv_tokens=160, max_model_len=160,
        page_size=page_size, cuda_graph_max_bs=4,
    )  # fmt: skip
    scheduler, outputs = llm.scheduler, {rid: [] for rid in range(len(prompts))}
    for rid, prompt in enumerate(prompts):
        scheduler.add_requests([(rid, prompt, sp)])
        for _ in range(3):  # the earlier requests are decoding when the next one arrives
            for out_rid, token in step_tokens(scheduler):
                outputs[out_rid].append(token)
    while scheduler.has_work:
        for rid, token in step_tokens(scheduler):
            outputs[rid].append(token)
        scheduler.check_integrity()
    assert scheduler.stats.num_preemptions > 0
    assert list(outputs.values()) == expected


def test_repeated_seeded_requests_sample_the_same_tokens_with_graphs_and_overlap_on_or_off(
    model_path,
) -> None:
    """The server's sequence in test_server_chat (one request, then the same prompt with another
    seed three times): every repeat samples the same 64 tokens, from the same cached prefix, and
    CUDA graphs and overlap scheduling do not change them."""
    rng = random.Random(3)
    prompt = [rng.randrange(512) for _ in range(30)]
    sampled = {}
    for options in (
        {"cuda_graph_max_bs": 16},  # captured graphs on a GPU, their CPU twin on the CPU
        {"cuda_graph_max_bs": 16, "overlap": False},
        {"cuda_graph_max_bs": 0},
    ):
        llm = LLM(str(model_path), device=DEVICE, dtype="float32", max_kv_tokens=512, **options)
        first = SamplingParams(seed=11, max_tokens=20, ignore_eos=True)
        llm.generate([prompt], first, use_tqdm=False)
        repeat = SamplingParams(seed=1, max_tokens=64, ignore_eos=True)
        runs = [llm.generate([prompt], repeat, use_tqdm=False)[0]["token_ids"] for _ in range(3)]
        assert runs[1] == runs[0] and runs[2] == runs[0], options
        sampled[str(options)] = runs[0]
    assert len({tuple(tokens) for tokens in sampled.values()}) == 1, sampled


def test_graph_runner_pads_what_a_smaller_batch_leaves_of_a_larger_ones_inputs(model_path) -> None:
    """Two decode batches replay the same captured size (16): 12 requests with a page write
    each, then 9 with 2 writes. The second must not inherit the first's inputs: its rows past 9
    and its page writes past 2 are the padding's (the dummy slot, the dummy page's entry), else
    the graph would recompute stale rows and re-point page-table entries of reused slots. A
    request that starts a new page writes the page's 4 entries: its graph runs them too."""
    llm = LLM(
        str(model_path), device=DEVICE, dtype="float32", max_kv_tokens=512, page_size=4,
        cuda_graph_max_bs=16,
    )  # fmt: skip
    engine, runner = llm.engine, llm.engine.graph_runner
    width = engine.page_table.shape[1]

    def decode(size: int, num_writes: int) -> None:
        reqs = [Req(i, [1], SamplingParams(), seed=0, slot=i) for i in range(size)]
        writes = (np.arange(num_writes) * width + 8, np.arange(num_writes) + 8)
        batch = build_batch(reqs, [8] * size, [1] * size, engine.layout, None, writes)
        assert runner.can_run(batch)
        _, _, inputs = runner.run(batch, None)
        assert inputs.slots.tolist() == list(range(size))  # the batch's own rows of the inputs

    decode(1, 4)
    decode(12, 12)
    decode(9, 2)
    static = runner.static_inputs(16, 16, 16 * 4)  # all of them
    dummy_slot = engine.layout.sink_slot
    dummy_entry = dummy_slot * width
    assert static.slots.tolist() == list(range(9)) + [dummy_slot] * 7
    assert static.positions.tolist() == [8] * 9 + [0] * 7
    assert static.longest_first.tolist() == list(range(16))
    assert static.page_write_entries.tolist() == [8, width + 8] + [dummy_entry] * 62
    assert static.page_write_values.tolist() == [8, 9] + [engine.pool.dummy_loc] * 62


def test_generate_reports_when_each_request_got_its_first_and_last_token(model_path) -> None:
    """`metrics`: submission, first token and last token times, in that order; a one-token
    request gets its only token in the step that finishes it."""
    llm = LLM(str(model_path), device=DEVICE, dtype="float32", max_kv_tokens=512)
    lengths = [1, 8]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    outs = llm.generate([[1, 2, 3], [4, 5, 6, 7]], params, use_tqdm=False)
    metrics = [out["metrics"] for out in outs]
    assert metrics[0]["arrival_time"] == metrics[1]["arrival_time"]
    for m in metrics:
        assert m["arrival_time"] < m["first_token_time"] <= m["finished_time"]
    assert metrics[0]["first_token_time"] == metrics[0]["finished_time"]
    assert metrics[1]["first_token_time"] < metrics[1]["finished_time"]
    assert [len(out["token_ids"]) for out in outs] == lengths


_TOKENS_SCRIPT = """
import json, sys
from minisgl import LLM, SamplingParams
llm = LLM(device="cpu", max_kv_tokens=4096, max_model_len=1024, page_size=4, chunk_size=16)
params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
prompts = ["Once upon a time", "The dog ran", "Once upon a time, there"]
first = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
again = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]  # prefix hits
llm.scheduler.check_integrity()
kv = llm.scheduler.kv
print(json.dumps([first, again, kv.used_pages == kv.prefix_cache.num_cached_pages]))
"""


def test_optimized_python_gives_the_same_tokens_and_accounting() -> None:
    """Asserts only check: `python -O` drops them, and nothing the engine does may go with them."""
    procs = [
        subprocess.Popen([sys.executable, *flag, "-c", _TOKENS_SCRIPT], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
        for flag in ([], ["-O"])
    ]  # fmt: skip
    runs = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        runs.append(json.loads(out.splitlines()[-1]))
    assert runs[0] == runs[1]
    first, again, pages_held_only_by_the_cache = runs[0]
    assert first == again and pages_held_only_by_the_cache


@pytest.mark.parametrize(("stop", "text", "tokens"), [(" there", "", 1), (" was", " there", 2)])
def test_a_stop_string_ends_the_request_where_it_matched(stop: str, text: str, tokens: int) -> None:
    """The embedded model continues "Once upon a time," with " there was a": a stop string in
    its first token or later ends the text before it, and no token past it is returned."""
    llm = LLM(device=DEVICE, dtype="float32", max_kv_tokens=4096, max_model_len=2048)
    params = SamplingParams(temperature=0, max_tokens=12, stop=stop)
    out = llm.generate(["Once upon a time,"], params, use_tqdm=False)[0]
    assert (out["text"], out["finish_reason"], len(out["token_ids"])) == (text, "stop", tokens)
    assert not llm.scheduler.has_work
    llm.scheduler.check_integrity()


def test_the_warm_up_prefills_leave_requests_and_pages_untouched(model_path) -> None:
    """Scheduler.warm_up (run on a GPU at start-up) computes in the padding slot only: a request
    running across it gets the tokens it gets without it, and no page changes hands."""
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompt = list(range(40))
    want = LLM(str(model_path), device=DEVICE, dtype="float32", max_kv_tokens=1024, **PLAIN)
    expected = want.generate([prompt], params, use_tqdm=False)[0]["token_ids"]
    llm = LLM(str(model_path), device=DEVICE, dtype="float32", max_kv_tokens=1024, **PLAIN)
    scheduler = llm.scheduler
    scheduler.add_requests([(0, prompt, params)])
    tokens = [t for _ in range(3) for _, t in step_tokens(scheduler)]
    free_before = scheduler.kv.allocator.num_free
    scheduler.warm_up()
    assert scheduler.kv.allocator.num_free == free_before
    while scheduler.has_work:
        tokens += [t for _, t in step_tokens(scheduler)]
    assert tokens == expected
    scheduler.check_integrity()


def test_chat_renders_the_template_as_the_server_does() -> None:
    llm = LLM(device=DEVICE, dtype="float32", max_kv_tokens=4096)
    chat = [{"role": "user", "content": "Once upon a time"}]
    params = SamplingParams(temperature=0, max_tokens=8)
    ids = llm.tokenizer.encode(
        llm.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True),
        add_special_tokens=False,
    )
    want = llm.generate([ids], params, use_tqdm=False)[0]
    assert llm.chat(chat, params, use_tqdm=False)[0]["token_ids"] == want["token_ids"]
    assert len(llm.chat([chat, chat], params, use_tqdm=False)) == 2
    # OpenAI's message format, as the server reads it: text parts, the developer role
    parts = [{"role": "user", "content": [{"type": "text", "text": "Once upon a time"}]}]
    assert llm.chat(parts, params, use_tqdm=False)[0]["token_ids"] == want["token_ids"]
    developer = [{"role": "developer", "content": "Be brief."}, *chat]
    system = [{"role": "system", "content": "Be brief."}, *chat]
    as_system = [
        (r["token_ids"], r["prompt_tokens"])
        for r in llm.chat([developer, system, chat], params, use_tqdm=False)
    ]
    assert as_system[0] == as_system[1] and as_system[1][1] > as_system[2][1]
    with pytest.raises(ValueError, match="content is required"):
        llm.chat([{"role": "user"}], params, use_tqdm=False)
    # the template's own variables, as the server's chat_template_kwargs
    with pytest.raises(ValueError, match="may not set"):
        llm.chat(chat, params, use_tqdm=False, chat_template_kwargs={"messages": []})


def test_vllm_prompt_dicts_are_their_text_or_token_ids(stories_llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=6)
    want = stories_llm.generate(["Once upon a time"], params, use_tqdm=False)[0]
    ids = stories_llm.tokenizer.encode("Once upon a time")
    for prompt in ({"prompt": "Once upon a time"}, {"prompt_token_ids": ids}):
        assert stories_llm.generate(prompt, params, use_tqdm=False)[0]["text"] == want["text"]
        assert stories_llm.generate([prompt], params, use_tqdm=False)[0]["text"] == want["text"]
    with pytest.raises(ValueError, match="alone"):
        stories_llm.generate({"prompt": "a", "multi_modal_data": {}}, params, use_tqdm=False)


def test_use_tqdm_may_make_the_progress_bar_as_vllm_s(stories_llm: LLM) -> None:
    """vLLM's `use_tqdm` is a bool or what makes the bar (it was taken as True, the default bar
    drawn)."""
    bars: list[tqdm] = []

    def make_bar(**kwargs) -> tqdm:
        bars.append(tqdm(file=io.StringIO(), **kwargs))
        return bars[-1]

    params = SamplingParams(temperature=0, max_tokens=2)
    assert len(stories_llm.generate(["Once", "The"], params, use_tqdm=make_bar)) == 2
    assert [(bar.total, bar.n, bar.desc) for bar in bars] == [(2, 2, "generate")]
    with pytest.raises(ValueError, match="use_tqdm must be a bool"):
        stories_llm.generate(["Once"], params, use_tqdm="no")


def test_prompts_from_a_generator_are_each_generated(stories_llm: LLM) -> None:
    """Its first item was read (to tell token ids from prompts) and lost."""
    params = SamplingParams(temperature=0, max_tokens=6)
    prompts = ["Once upon a time", "Lily"]
    want = [r["text"] for r in stories_llm.generate(prompts, params, use_tqdm=False)]
    got = stories_llm.generate((p for p in prompts), params, use_tqdm=False)
    assert [r["text"] for r in got] == want


def test_token_ids_of_any_integer_type_are_a_prompt(stories_llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=6)
    ids = stories_llm.tokenizer.encode("Once upon a time")
    want = stories_llm.generate([ids], params, use_tqdm=False)[0]["token_ids"]
    as_numpy = list(np.array(ids))  # numpy's int64s, as a tokenizer's tensors give them
    assert stories_llm.generate([as_numpy], params, use_tqdm=False)[0]["token_ids"] == want
    for bad, name in (([1.0, 5], "float"), ([True, 5], "bool")):
        with pytest.raises(ValueError, match=f"must be an integer, not {name}"):
            stories_llm.generate([bad], params, use_tqdm=False)


def test_a_stop_token_as_the_last_allowed_token_is_a_stop(stories_llm: LLM) -> None:
    """As vLLM's: the eos and stop tokens are checked before max_tokens, so the last allowed
    token's text is left out when it is one (it ended "length" with the text in). The embedded
    model's story ends after 342 tokens (test_models.py) on its <s>, generation_config's second
    eos id (named as vLLM names it: below)."""
    at_eos, past_eos = stories_llm.generate(
        ["Once upon a time"] * 2,
        [SamplingParams(temperature=0, max_tokens=n) for n in (342, 343)],
        use_tqdm=False,
    )
    assert len(at_eos["token_ids"]) == len(past_eos["token_ids"]) == 342
    for out in (at_eos, past_eos):
        assert out["finish_reason"] == "stop" and out["stop_reason"] == 1
    greedy = SamplingParams(temperature=0, max_tokens=3)
    first, second, _ = stories_llm.generate(["Once upon a time"], greedy, use_tqdm=False)[0][
        "token_ids"
    ]
    stopped = stories_llm.generate(
        ["Once upon a time"],
        SamplingParams(temperature=0, max_tokens=2, stop_token_ids=[second]),
        use_tqdm=False,
    )[0]
    assert stopped["finish_reason"] == "stop" and stopped["stop_reason"] == second
    assert stopped["text"] == stories_llm.tokenizer.decode([first])


def test_stop_reason_names_every_stop_token_but_the_tokenizers_eos(stories_llm: LLM) -> None:
    """vLLM's: None for the tokenizer's eos, even one listed in stop_token_ids (the eos is
    checked first); the id for the model's other eos ids (generation_config's [2, 1] here),
    which vLLM makes stop tokens."""
    eos, other_eos = 2, 1
    assert stories_llm.tokenizer.eos_token_id == eos
    outs = stories_llm.generate(
        ["Once upon a time"] * 3,
        [
            SamplingParams(max_tokens=4, logit_bias={eos: 100}, stop_token_ids=[eos]),
            SamplingParams(max_tokens=4, logit_bias={other_eos: 100}),
            SamplingParams(
                max_tokens=4, logit_bias={eos: 100}, stop_token_ids=[eos], ignore_eos=True
            ),
        ],
        use_tqdm=False,
    )
    assert [(o["finish_reason"], o["stop_reason"]) for o in outs] == [
        ("stop", None),
        ("stop", other_eos),
        ("stop", eos),
    ]
    assert all(o["text"] == "" and len(o["token_ids"]) == 1 for o in outs)


def test_a_closed_llm_says_so() -> None:
    """After close() an LLM generates no more: under TP its group is gone (a ProcessGroup error
    named no cause), at TP 1 it went on, against its docstring."""
    llm = LLM(device=DEVICE, dtype="float32", max_kv_tokens=2048)
    assert llm.generate(["Once"], SamplingParams(max_tokens=2), use_tqdm=False)[0]["token_ids"]
    llm.close()
    for call in (lambda: llm.generate(["Once"], use_tqdm=False), llm.reset_prefix_cache):
        with pytest.raises(ValueError, match="this LLM is closed"):
            call()
