"""Structured output under offline TP: each rank compiles the grammars; a request starts once
every rank has its grammar, and only rank 0 ends one in error (a grammar that fails there, or is
not ready within grammar_timeout, or whose matcher takes too long a step: only rank 0 times
them). A module of its own: an offline TP LLM holds the process's default group, which
test_tp's engines hold until that module ends."""

import json
import signal
import threading

import jsonschema
import pytest

from minisgl import LLM, SamplingParams
from minisgl.core import StructuredOutput

from .test_structured_output import COSTLY_SCHEMA, GRAMMAR_TIMEOUT, GROWING, SCHEMAS, SLOW_START
from .test_tp import SETTINGS

SETTINGS_1024 = dict(SETTINGS, max_kv_tokens=1024, max_model_len=1024)


def _raises_and_both_ranks_go_on(llm: LLM, bad: StructuredOutput, match: str) -> None:
    # min_tokens holds back the eos that would end a growing grammar's request
    constrained = SamplingParams(max_tokens=64, min_tokens=64, structured=bad)
    with pytest.raises(ValueError, match=match):
        llm.generate(["a", "b"], [SamplingParams(max_tokens=4), constrained], use_tqdm=False)
    assert not llm.scheduler.has_work
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    assert len(llm.generate(["c"], greedy, use_tqdm=False)[0]["token_ids"]) == 4
    llm.scheduler.check_integrity()


def test_constraints_hold_on_both_ranks_and_a_bad_or_costly_grammar_raises(qwen3_path: str) -> None:
    """Constrained outputs hold; a grammar that fails, or is too costly to match (its first
    mask, or a step as it runs: both ran untimed under TP before, for as long as they took)
    raises; and both ranks go on in step."""
    with LLM(qwen3_path, tp_size=2, **SETTINGS_1024) as llm:
        params = [
            SamplingParams(seed=i, max_tokens=400, structured=StructuredOutput(json_schema=s))
            for i, s in enumerate(map(json.dumps, SCHEMAS))
        ]
        results = llm.generate([f"Item {i}:" for i in range(3)], params, use_tqdm=False)
        for result, schema in zip(results, SCHEMAS, strict=True):
            jsonschema.validate(json.loads(result["text"]), schema)
        for bad, match in (
            (StructuredOutput(regex="("), "invalid structured output"),
            (StructuredOutput(grammar=SLOW_START), "too costly to match .*first token"),
            (StructuredOutput(grammar=GROWING), "too costly to match: its masks"),
        ):
            _raises_and_both_ranks_go_on(llm, bad, match)


def test_a_grammar_past_its_timeout_raises_and_both_ranks_go_on(qwen3_path: str) -> None:
    """Offline, rank 0 waits for each grammar up to grammar_timeout, then refuses it on both."""
    with LLM(qwen3_path, tp_size=2, grammar_timeout=GRAMMAR_TIMEOUT, **SETTINGS_1024) as llm:
        costly = StructuredOutput(json_schema=json.dumps(COSTLY_SCHEMA))
        _raises_and_both_ranks_go_on(llm, costly, "too costly to compile")


def test_ctrl_c_while_a_grammar_compiles_leaves_both_ranks_in_step(qwen3_path: str) -> None:
    """Ctrl-C while rank 0 waits for a grammar takes effect at the end of the turn. Before, it
    cut the turn short: rank 1 waited in the flags' all-reduce, rank 0's next turn in its
    broadcast, both for good."""
    with LLM(qwen3_path, tp_size=2, **SETTINGS_1024) as llm:
        costly = SamplingParams(
            max_tokens=4, structured=StructuredOutput(json_schema=json.dumps(COSTLY_SCHEMA))
        )
        timer = threading.Timer(1.0, signal.raise_signal, (signal.SIGINT,))
        timer.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                llm.generate(["a"], costly, use_tqdm=False)
        finally:
            timer.cancel()
        assert not llm.scheduler.has_work
        greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        assert len(llm.generate(["c"], greedy, use_tqdm=False)[0]["token_ids"]) == 4
        llm.scheduler.check_integrity()
