"""Structured output under offline TP: each rank compiles the grammars, rank 0 alone says which
requests start and which are refused (a grammar that fails, or is not ready within
grammar_timeout), and rank 1 follows its word. A module of its own: an offline TP LLM holds the
process's default group, which test_tp's engines hold until that module ends."""

import json

import jsonschema
import pytest

from minisgl import LLM, SamplingParams
from minisgl.core import StructuredOutput

from .test_structured_output import COSTLY_SCHEMA, GRAMMAR_TIMEOUT, SCHEMAS
from .test_tp import SETTINGS


def test_constraints_hold_on_both_ranks_and_a_bad_or_costly_grammar_raises(qwen3_path: str) -> None:
    """Offline, rank 0 waits for every grammar up to grammar_timeout and tells rank 1 which
    requests start: constrained outputs hold, a grammar that fails or comes too late raises, and
    both ranks go on in step."""
    settings = dict(SETTINGS, max_kv_tokens=1024, max_model_len=1024)
    with LLM(qwen3_path, tp_size=2, grammar_timeout=GRAMMAR_TIMEOUT, **settings) as llm:
        params = [
            SamplingParams(seed=i, max_tokens=400, structured=StructuredOutput(json_schema=s))
            for i, s in enumerate(map(json.dumps, SCHEMAS))
        ]
        results = llm.generate([f"Item {i}:" for i in range(3)], params, use_tqdm=False)
        for result, schema in zip(results, SCHEMAS, strict=True):
            jsonschema.validate(json.loads(result["text"]), schema)
        for bad, match in (
            (StructuredOutput(regex="("), "invalid structured output"),
            (StructuredOutput(json_schema=json.dumps(COSTLY_SCHEMA)), "too costly to compile"),
        ):
            with pytest.raises(ValueError, match=match):
                llm.generate(
                    ["a", "b"], [SamplingParams(max_tokens=4), SamplingParams(structured=bad)],
                    use_tqdm=False,
                )  # fmt: skip
            assert not llm.scheduler.has_work
        greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        assert len(llm.generate(["c"], greedy, use_tqdm=False)[0]["token_ids"]) == 4
        llm.scheduler.check_integrity()
