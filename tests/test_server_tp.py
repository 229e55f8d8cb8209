"""`--tp 2` through the server: rank 0's scheduler process sends each step's messages to rank
1's. Each rank holds half of every layer's weights, so right answers need both ranks to run every
step together; greedy tokens must equal the single-process engine's for each dense architecture
and for a mixture of experts (each rank holding a slice of every expert), and over two nodes (two
launchers on loopback, a rank each). On the CPU (gloo), or on two GPUs when the suite runs on
CUDA and has them.

The random models' byte tokens are invalid UTF-8, whose text the streaming detokenizer and a
whole decode may render differently: their tokens are compared by logprob."""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from minisgl import LLM, SamplingParams

from .conftest import TP_DEVICE
from .server_process import ServerProcess, alive, children, free_port, wait_for
from .stress.checks import assert_clean
from .test_moe import MOE
from .test_structured_output import COSTLY_SCHEMA, GRAMMAR_TIMEOUT, SCHEMAS

DENSE = ("llama", "mistral", "qwen2", "qwen3")
PROMPTS = ["Once upon a time", "The little dog", "Lily and Tom went to the park. They"]
MAX_TOKENS = 24
SETTINGS = ("--device", TP_DEVICE, "--dtype", "float32", "--max-kv-tokens", "4096")
REFERENCE = dict(device=TP_DEVICE, dtype="float32", max_kv_tokens=4096)
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)


def assert_same_or_near_tie_by_logprob(choice, reference: dict) -> None:
    """The server's tokens are the reference's (`LLM.generate` with logprobs=2), seen through
    their logprobs; or they part after a near tie in the reference's logits (its top two within
    1e-4), which leaves the tied token's own logprob unchanged: the first to differ is then the
    tie's or the next one's."""
    got = choice.logprobs.token_logprobs
    want = [lp["logprob"] for lp in reference["logprobs"]]
    assert len(got) == len(want)
    i = next((i for i, (g, w) in enumerate(zip(got, want, strict=True)) if abs(g - w) > 1e-4), None)
    if i is None:
        return
    gaps = [
        (top[0]["logprob"] - top[1]["logprob"])
        for top in (reference["logprobs"][j]["top_logprobs"] for j in (i - 1, i) if j >= 0)
    ]
    assert min(gaps) < 1e-4, f"logprob {got[i]} at token {i}, want {want[i]}; top-2 gaps {gaps}"


@pytest.fixture(scope="module", params=DENSE)
def served(request: pytest.FixtureRequest, checkpoint, tmp_path_factory: pytest.TempPathFactory):
    """(the TP 2 server of one architecture's small random checkpoint, TP 1's results)."""
    path = str(checkpoint(request.param))
    want = LLM(path, **REFERENCE).generate(PROMPTS, GREEDY, use_tqdm=False)
    s = ServerProcess(tmp_path_factory.mktemp("tp"), path, *SETTINGS, "--tp", "2")
    yield s, path, want
    s.stop()


def test_tp2_greedy_tokens_equal_tp1(served: tuple[ServerProcess, str, list[dict]]) -> None:
    server, model, want = served
    client = server.client()
    for prompt, reference in zip(PROMPTS, want, strict=True):
        got = client.completions.create(
            model=model, prompt=prompt, temperature=0, max_tokens=MAX_TOKENS, logprobs=2,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert_same_or_near_tie_by_logprob(got.choices[0], reference)
    # concurrent requests share batches across both ranks
    batch = client.completions.create(
        model=model, prompt=PROMPTS, temperature=0, max_tokens=MAX_TOKENS, logprobs=2,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    for choice, reference in zip(batch.choices, want, strict=True):
        assert_same_or_near_tie_by_logprob(choice, reference)
    assert "Warning" not in server.log(), server.log()  # torch's deprecations, once per rank


def test_sigterm_stops_every_rank_and_removes_the_ipc_files(
    served: tuple[ServerProcess, str, list[dict]],
) -> None:
    server = served[0]
    assert server.proc.poll() is None, server.log()  # still serving
    assert len([pid for pid in server.children if alive(pid)]) >= 4  # 2 ranks, tokenizer, API
    server.stop(signal.SIGTERM)


def test_tp2_moe_greedy_tokens_equal_tp1(checkpoint, tmp_path_factory) -> None:
    path = str(checkpoint("qwen3_moe", **MOE))
    want = LLM(path, **REFERENCE).generate(PROMPTS, GREEDY, use_tqdm=False)
    s = ServerProcess(tmp_path_factory.mktemp("tp-moe"), path, *SETTINGS, "--tp", "2")
    try:
        batch = s.client().completions.create(
            model=path, prompt=PROMPTS, temperature=0, max_tokens=MAX_TOKENS, logprobs=2,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
    finally:
        s.stop()
    for choice, reference in zip(batch.choices, want, strict=True):
        assert_same_or_near_tie_by_logprob(choice, reference)


def test_a_grammar_past_its_timeout_holds_no_rank_and_constraints_hold_on_both(
    qwen3_path: str, tmp_path: Path
) -> None:
    """Each rank compiles the grammars, a request starts once every rank has its grammar, and
    rank 0 alone says when one is too late: a costly schema holds neither rank's loop (before, every rank compiled it inside the step,
    and the server stood still for its 5 s), it ends in a 400 at --grammar-timeout, and
    constrained outputs hold with both ranks sampling under the masks."""
    s = ServerProcess(
        tmp_path, qwen3_path, *SETTINGS, "--tp", "2", "--max-model-len", "1024",
        "--grammar-timeout", str(GRAMMAR_TIMEOUT),
    )  # fmt: skip
    try:
        client = s.client()
        before = s.metrics()
        costly_body = {"guided_json": COSTLY_SCHEMA}
        with ThreadPoolExecutor(1) as pool:
            costly = pool.submit(
                client.completions.create,
                model=qwen3_path, prompt="x", max_tokens=5, extra_body=costly_body,
            )  # fmt: skip
            time.sleep(0.5)  # it reaches the scheduler first
            plain = client.completions.create(model=qwen3_path, prompt="x", max_tokens=4)
            assert not costly.done(), "answered after the costly grammar's end"
            assert httpx.get(s.url + "/health").status_code == 200
            with pytest.raises(openai.BadRequestError, match="too costly to compile"):
                costly.result()
        assert plain.usage.completion_tokens == 4
        for seed, schema in enumerate(SCHEMAS):
            out = client.completions.create(
                model=qwen3_path, prompt=f"Item {seed}:", max_tokens=400, seed=seed,
                extra_body={"guided_json": schema},
            )  # fmt: skip
            jsonschema.validate(json.loads(out.choices[0].text), schema)
        choice = client.completions.create(
            model=qwen3_path, prompt="Pick:", max_tokens=8, extra_body={"guided_regex": "(yes|no)"}
        )
        assert choice.choices[0].text in ("yes", "no")
        assert_clean(s, before, qwen3_path)
    finally:
        s.stop()


@contextlib.contextmanager
def _two_nodes(
    tmp_path: Path, *own: str
) -> Iterator[tuple[subprocess.Popen, Callable[[], ServerProcess]]]:
    """Node 1's launcher, started first (it waits for node 0; it takes the flags both nodes
    share and its `own`), and what starts node 0's: two launchers on loopback, as on two
    machines, a rank each. What a failure left running of either is killed at the end."""
    init = f"127.0.0.1:{free_port()}"
    nodes = (*SETTINGS, "--tp", "2", "--nnodes", "2", "--dist-init-addr", init)
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    if TP_DEVICE == "cuda":  # node 1's one GPU, as its first: the second of this machine
        env["CUDA_VISIBLE_DEVICES"] = "1"
    with open(tmp_path / "node1.log", "w") as log:
        node1 = subprocess.Popen(
            [sys.executable, "-m", "minisgl", *nodes, *own, "--node-rank", "1"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env,
        )  # fmt: skip
    started: list[ServerProcess] = []

    def start_node0() -> ServerProcess:
        started.append(ServerProcess(tmp_path, *nodes, "--node-rank", "0"))
        return started[-1]

    try:
        yield node1, start_node0
    finally:
        for node0 in started:
            node0.kill()
        if node1.poll() is None:
            os.killpg(node1.pid, signal.SIGKILL)
            node1.wait()


def test_two_nodes_of_a_rank_each_give_tp1s_tokens(tmp_path: Path) -> None:
    """Node 0 serves the API with rank 0, node 1 runs rank 1 only, which gets its messages over
    TCP at --dist-init-addr (no ipc socket crosses machines). When node 0 stops, node 1's
    launcher ends by itself, leaving nothing behind."""
    want = LLM(**REFERENCE).generate(PROMPTS, GREEDY, use_tqdm=False)
    with _two_nodes(tmp_path) as (node1, start_node0):
        node0 = start_node0()
        assert "node 0 of 2 runs TP ranks 0-0; waiting for the other nodes at" in node0.log()
        node1_children = children(node1.pid)
        batch = node0.client().completions.create(
            model="stories260K", prompt=PROMPTS, temperature=0, max_tokens=MAX_TOKENS, logprobs=2,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        for choice, reference in zip(batch.choices, want, strict=True):
            assert_same_or_near_tie_by_logprob(choice, reference)
        node0.stop(signal.SIGTERM)
        assert node1.wait(timeout=30) == 0, (tmp_path / "node1.log").read_text()
        wait_for(lambda: not [pid for pid in node1_children if alive(pid)], 10, "children left")


def test_nodes_started_unalike_stop_at_the_start_naming_the_setting(tmp_path: Path) -> None:
    """Node 1 with a smaller --chunk-size: both started and /health said 200, and the first
    prompt longer than its chunk broke a collective (gloo's size mismatch) and killed both."""
    why = "TP rank 1 was started with chunk_size 8 (rank 0: "
    with _two_nodes(tmp_path, "--chunk-size", "8") as (node1, start_node0):
        with pytest.raises(AssertionError, match=re.escape(why)):
            start_node0()  # its launcher exits during the start
        assert node1.wait(timeout=30) == 1 and why in (tmp_path / "node1.log").read_text()


def test_a_lost_node_ends_an_idle_server(tmp_path: Path) -> None:
    """Node 1 killed outright (its machine lost) while no request runs: node 0 ends within
    seconds, leaving nothing behind, instead of failing the next request."""
    with _two_nodes(tmp_path) as (node1, start_node0):
        node0 = start_node0()
        os.killpg(node1.pid, signal.SIGKILL)
        node1.wait()
        assert node0.wait_exit(timeout=15) == 1, node0.log()
        assert "another TP rank is gone" in node0.log()
