"""Structured output (xgrammar) on a random Qwen3 with the real Qwen3 tokenizer: every output
follows its constraint, through the server with the official `openai` client and offline; overlap
on and off give the same tokens; a constraint that does not compile is a 400, and the engine
keeps serving without a page leaked.

Random weights cannot be relied on to close a free-form JSON value, so the schemas are bounded
(maxLength, enum, maxItems, integer ranges, no extra properties) and max_tokens is above the
longest output each allows."""

import asyncio
import itertools
import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from minisgl import LLM, SamplingParams, StructuredOutput  # the package exports all three
from minisgl.messages import AddRequests
from minisgl.scheduler import grammar_cost
from minisgl.scheduler.grammar import Grammars
from minisgl.scheduler.regex_cost import MAX_SPLITS, regex_part, splits, too_costly
from minisgl.scheduler.unenforced import misread_in_regex, repeats_past_limit, unenforced_keyword
from minisgl.tokenizer.loader import load_tokenizer
from minisgl.utils import DEFAULT_MODEL_PATH

from .conftest import DEVICE
from .server_process import ServerProcess
from .stress.checks import assert_clean, delta, finished

MAX_KV_TOKENS = 1024  # also the context: the random Qwen3 knows 1024 positions
SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
            "ok": {"type": "boolean"},
        },
        "required": ["tags", "ok"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": -5, "maximum": 5},
                    "y": {"type": "number", "minimum": 0, "maximum": 1},
                },
                "required": ["x", "y"],
                "additionalProperties": False,
            },
            "label": {"enum": ["a", "b", None]},
        },
        "required": ["point", "label"],
        "additionalProperties": False,
    },
]
# a number's digits and a string's escapes are the unbounded part: \uXXXX is six characters
MAX_TOKENS = 400
# xgrammar 0.2.9 compiles it in 4.6 s with Qwen3's vocabulary on a 2-core CPU (400 optional
# properties: 0.9 s), far past the GRAMMAR_TIMEOUT of the servers and engines that refuse it here
COSTLY_SCHEMA = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(800)}}
GRAMMAR_TIMEOUT = 1.0


@pytest.fixture(scope="module")
def server(qwen3_path: str, tmp_path_factory: pytest.TempPathFactory):
    s = ServerProcess(
        tmp_path_factory.mktemp("structured"),
        "--model", qwen3_path, "--served-model-name", "q",
        "--max-kv-tokens", str(MAX_KV_TOKENS), "--max-model-len", str(MAX_KV_TOKENS),
        "--grammar-timeout", str(GRAMMAR_TIMEOUT),
    )  # fmt: skip
    yield s
    s.stop()


def test_fifty_sampled_json_schema_outputs_all_validate(server: ServerProcess) -> None:
    client = server.async_client()

    async def one(i: int) -> tuple[dict, str, str]:
        schema = SCHEMAS[i % len(SCHEMAS)]
        r = await client.chat.completions.create(
            model="q",
            messages=[{"role": "user", "content": f"Give me JSON number {i}"}],
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "s", "schema": schema, "strict": True},
            },
            max_tokens=MAX_TOKENS,
            temperature=1.0,
            seed=i,
        )
        return schema, r.choices[0].message.content, r.choices[0].finish_reason

    async def run_all() -> list[tuple[dict, str, str]]:
        try:
            return await asyncio.gather(*(one(i) for i in range(50)))
        finally:
            await client.close()

    results = asyncio.run(run_all())
    for schema, text, finish in results:
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), schema)
        # no free whitespace: one space after each separator, as json.dumps writes it
        outside_strings = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)
        assert not re.search(r"\s", re.sub(r"(?<=[,:]) ", "", outside_strings)), text
    assert len({text for _, text, _ in results}) > 25  # sampled, not one answer


def test_json_object_regex_and_choice_hold(server: ServerProcess, qwen3_path: str) -> None:
    client = server.client()
    tokens = {t: i for t, i in _vocab(qwen3_path).items() if t in ("{", "}")}
    # random weights never close a free-form object: the bias closes it, the grammar shapes it
    r = client.chat.completions.create(
        model="q",
        messages=[{"role": "user", "content": "JSON please"}],
        response_format={"type": "json_object"},
        logit_bias={str(i): 100 for i in tokens.values()},
        max_tokens=20,
    )
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    pattern = r"(yes|no), [0-9]{1,3}!"
    for seed in range(5):
        c = client.completions.create(
            model="q", prompt="Answer:", max_tokens=30, seed=seed,
            extra_body={"structured_outputs": {"regex": pattern}},
        )  # fmt: skip
        assert re.fullmatch(pattern, c.choices[0].text), c.choices[0].text
        assert c.choices[0].finish_reason == "stop"
    choices = ["alpha", "beta gamma", "δέλτα"]
    for seed in range(5):
        c = client.completions.create(
            model="q", prompt="Pick:", max_tokens=30, seed=seed,
            extra_body={"guided_choice": choices},
        )  # fmt: skip
        assert c.choices[0].text in choices


def test_a_constraint_refused_or_too_costly_is_a_400_and_the_server_serves_on(
    server: ServerProcess,
) -> None:
    client = server.client()
    before = server.metrics()
    # xgrammar's error for a number past a double's range has no text; the grammar's steps take
    # longer with each token matched, and the request ends in error as it runs
    for bad in ({"regex": "("}, {"json": '{"const": 1e400}'}, {"grammar": GROWING}):
        with pytest.raises(openai.BadRequestError, match=r"invalid structured output|too costly"):
            client.completions.create(
                model="q", prompt="x", max_tokens=64,
                extra_body={"structured_outputs": bad, "min_tokens": 64},
            )  # fmt: skip
    # the two that do not compile are refusals; the third ran, and ended in error
    assert delta(before, server.metrics(), finished("error")) == 1
    with pytest.raises(openai.BadRequestError, match="give one output constraint"):
        client.completions.create(
            model="q", prompt="x", max_tokens=5,
            extra_body={"guided_regex": "a", "guided_choice": ["a"]},
        )  # fmt: skip
    ok = client.completions.create(model="q", prompt="x", max_tokens=5)
    assert ok.usage.completion_tokens >= 1
    assert_clean(server, before, "q")  # no page leaked


BAD_PATTERN = {"type": "string", "pattern": "("}  # compiles in the scheduler, and fails there


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "("}},
         "structured_outputs.regex"),
        ("/v1/completions", {"prompt": "x", "guided_json": BAD_PATTERN}, "guided_json"),
        ("/v1/chat/completions",
         {"messages": [{"role": "user", "content": "x"}],
          "response_format": {"type": "json_schema",
                              "json_schema": {"name": "s", "schema": BAD_PATTERN}}},
         "response_format.json_schema.schema"),
        ("/v1/chat/completions",
         {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required",
          "tools": [{"type": "function", "function": {
              "name": "f", "parameters": {"type": "object", "properties": {"a": BAD_PATTERN}}}}]},
         "tools"),
    ],
    ids=["structured_outputs", "guided_json", "response_format", "tools"],
)  # fmt: skip
def test_a_constraint_the_scheduler_refuses_names_the_field_that_gave_it(
    server: ServerProcess, route: str, body: dict, param: str
) -> None:
    before = server.metrics()
    response = server.post(route, json={"model": "q", "max_tokens": 4, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and "invalid structured output" in error["message"], error
    assert delta(before, server.metrics(), finished("error")) == 0  # a refusal, as a 400 before
    assert_clean(server, before, "q")


def test_a_grammar_past_its_timeout_is_a_400_and_the_server_serves_on(
    server: ServerProcess,
) -> None:
    """A grammar still compiling at --grammar-timeout ends its request in error (it waited for
    good before); a quick one sent after it, and the server's every other request, go on."""
    client = server.client()
    before = server.metrics()
    with pytest.raises(openai.BadRequestError, match=r"too costly to compile: .* within 1 s"):
        client.completions.create(
            model="q", prompt="x", max_tokens=5, extra_body={"guided_json": COSTLY_SCHEMA}
        )
    assert delta(before, server.metrics(), finished("error")) == 1  # queued, then ended in error
    quick = client.completions.create(
        model="q", prompt="x", max_tokens=5, extra_body={"guided_regex": "(yes|no)"}
    )
    assert quick.choices[0].text in ("yes", "no")
    assert_clean(server, before, "q")


def _vocab(qwen3_path: str) -> dict[str, int]:
    return load_tokenizer(Path(qwen3_path)).get_vocab()


@pytest.fixture(scope="module")
def llms(qwen3_path: str) -> dict[bool, LLM]:
    return {
        overlap: LLM(
            qwen3_path,
            device=DEVICE,
            dtype="float32",
            max_kv_tokens=MAX_KV_TOKENS,
            max_model_len=MAX_KV_TOKENS,
            overlap=overlap,
        )
        for overlap in (True, False)
    }


def test_offline_constrained_batch_is_the_same_with_overlap_on_and_off(
    llms: dict[bool, LLM],
) -> None:
    """Constrained and free rows in one batch: the constrained ones follow their schemas, and
    every row's tokens are the same whether step k+1 is built while step k computes or not."""
    params = [
        SamplingParams(
            seed=i, max_tokens=MAX_TOKENS,
            structured=StructuredOutput(json_schema=json.dumps(SCHEMAS[i % 3])),
        )
        for i in range(6)
    ] + [SamplingParams(seed=9, max_tokens=40), SamplingParams(temperature=0, max_tokens=40)]  # fmt: skip
    prompts = [f"Item {i}:" for i in range(len(params))]
    runs = {k: llm.generate(prompts, params, use_tqdm=False) for k, llm in llms.items()}
    assert [r["token_ids"] for r in runs[True]] == [r["token_ids"] for r in runs[False]]
    for i, result in enumerate(runs[True][:6]):
        jsonschema.validate(json.loads(result["text"]), SCHEMAS[i % 3])
    for llm in llms.values():
        llm.scheduler.check_integrity()
        assert llm.scheduler.kv.used_pages == llm.scheduler.kv.prefix_cache.num_cached_pages


@pytest.mark.parametrize(
    "constraint",
    [
        StructuredOutput(grammar="root ::= undefined_rule"),
        StructuredOutput(json_schema='{"type": "number", "maximum": -1e400}'),
        StructuredOutput(structural_tag="[1]"),  # xgrammar's TypeError before
        StructuredOutput(json_schema='{"type": "object", "required": [["a"]]}'),
        StructuredOutput(grammar="root ::= root"),  # no token allowed: token 0 came out before
        StructuredOutput(regex="[^\\s\\S]"),
        # text after the schema: xgrammar compiled the first value, unchecked (uniqueItems)
        StructuredOutput(json_schema='{"type": "array", "uniqueItems": true} x'),
    ],
)
def test_offline_constraint_that_does_not_compile_raises_and_leaks_nothing(
    llms: dict[bool, LLM], constraint: StructuredOutput
) -> None:
    llm = llms[True]
    bad = SamplingParams(structured=constraint)
    with pytest.raises(ValueError, match="invalid structured output"):
        llm.generate(["a", "b"], [SamplingParams(max_tokens=5), bad], use_tqdm=False)
    assert not llm.scheduler.has_work
    llm.scheduler.check_integrity()
    assert llm.scheduler.kv.used_pages == llm.scheduler.kv.prefix_cache.num_cached_pages


# xgrammar matches these in time that grows: the first in its first mask (0.58 s on a 2-core CPU
# with Qwen3's vocabulary; its counts multiply to 32, which the grammar's reading lets pass), the
# second with every token it accepts (past 0.25 s a step by ~30 characters); the third takes ~28
# ms a step, which 32 choices of one request add up to
SLOW_START = "root ::= ((([a-z]{1,5}){1,4}){1,2}){1,4}"
GROWING = "root ::= x\nx ::= x x | [a-z]"
WORDS = "([a-z]+ ?)*"


def test_a_grammar_too_costly_to_match_is_refused_or_ended_and_the_engine_serves_on(
    llms: dict[bool, LLM],
) -> None:
    """A grammar whose first mask takes longer than a request's matcher steps may take in a step
    is refused; one whose steps grow past it ends in error as it runs (min_tokens holds its eos
    back)."""
    for llm in llms.values():
        slow_start = StructuredOutput(grammar=SLOW_START)
        with pytest.raises(ValueError, match=r"too costly to match .*first token"):
            llm.generate(["a"], SamplingParams(structured=slow_start), use_tqdm=False)
        growing = SamplingParams(
            temperature=0,
            max_tokens=64,
            min_tokens=64,
            structured=StructuredOutput(grammar=GROWING),
        )
        with pytest.raises(ValueError, match="too costly to match: its masks"):
            llm.generate(["a", "b"], [SamplingParams(max_tokens=8), growing], use_tqdm=False)
        assert llm.generate(["c"], SamplingParams(max_tokens=4), use_tqdm=False)[0]["token_ids"]
        llm.scheduler.check_integrity()
        assert llm.scheduler.kv.used_pages == llm.scheduler.kv.prefix_cache.num_cached_pages


def test_the_matcher_steps_of_a_request_s_choices_add_up_to_its_bound(
    llms: dict[bool, LLM],
) -> None:
    """One choice of WORDS is well within a request's matcher time a step; 32 choices of one
    request are not (each step under the bound, they held every other request 107 s before)."""
    llm = llms[True]
    words = StructuredOutput(regex=WORDS)
    one = SamplingParams(max_tokens=16, min_tokens=16, structured=words)
    assert len(llm.generate(["a"], one, use_tqdm=False)[0]["token_ids"]) == 16
    many = replace(one, n=32)
    with pytest.raises(ValueError, match=r"too costly to match: its masks \(all its prompts"):
        llm.generate(["a", "b"], [SamplingParams(max_tokens=8), many], use_tqdm=False)
    assert not llm.scheduler.has_work
    llm.scheduler.check_integrity()
    assert llm.scheduler.kv.used_pages == llm.scheduler.kv.prefix_cache.num_cached_pages


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no overlap"])
def test_the_rows_of_a_request_past_its_bound_send_nothing_outside_its_grammar(
    llms: dict[bool, LLM], qwen3_path: str, overlap: bool
) -> None:
    """Its rows' masks are skipped once it is past its time, and it is ended before the step's
    tokens are taken: with overlap off these are taken in the turn that filled the masks, and
    23 of 32 rows finished "stop" with tokens the regex refuses before."""
    llm = llms[overlap]
    params = SamplingParams(max_tokens=16, min_tokens=16, structured=StructuredOutput(regex=WORDS))
    rids = list(range(10**6, 10**6 + 32))
    messages: list = [AddRequests([[1, 2, 3]], [rids], [[params] * len(rids)])]
    tokens: dict[int, list[int]] = {rid: [] for rid in rids}
    errors: dict[int, str] = {}
    while messages or llm.scheduler.has_work:
        out = llm._worker.step(messages)
        messages = []
        for rid, token in zip(out.rids, out.token_ids, strict=True):
            tokens[rid].append(token)
        assert not {f.rid for f in out.finished} & set(rids)
        errors |= {e.rid: e.message for e in out.errors}
    assert set(errors) == set(rids), errors
    assert all("too costly to match: its masks" in message for message in errors.values())
    tokenizer = load_tokenizer(Path(qwen3_path))
    for rid in rids:  # what came out is a prefix of a match, which matches: a word is one
        assert re.fullmatch(WORDS, tokenizer.decode(tokens[rid])), tokenizer.decode(tokens[rid])
    llm.scheduler.check_integrity()


def test_a_batch_of_prompts_offline_bounds_each_prompt_s_matcher_time_apart(
    llms: dict[bool, LLM],
) -> None:
    """Offline, a batch is no client's request: 12 prompts of WORDS, ~28 ms a row a step, are
    served, though they take more than a request's bound a step together."""
    params = SamplingParams(max_tokens=8, min_tokens=8, structured=StructuredOutput(regex=WORDS))
    results = llms[True].generate([f"p{i}" for i in range(12)], params, use_tqdm=False)
    assert all(len(result["token_ids"]) == 8 for result in results)


# (pattern, its splits): counts over parts of varying length multiply, nested or side by side
SPLITS = [
    ("[a-z]{0,1000}", 1), (r"\d{3}-\d{3}-\d{4}", 1), ("([a-z]+ ?)*", 4), ("(a|b){5}", 1),
    (r"(\d{1,3}\.){3}\d{1,3}", 1), ("(a|bc){5}", 1), ("(ab?){3,}", 1), ("([a-z]{1,5}){1,32}", 32),
    (r"(\d+,){1,100}", 1), ("[A-Z][a-z]+(, [A-Z][a-z]+){0,49}", 1), (r"(-?\d+(\.\d+)?,){0,33}", 1),
    ("([A-Za-z]+ ){0,63}[A-Za-z]+", 1), (r"(\u0041|b){40}", 1), (r"((\w+ )*\w+\. )*", 1),
    ("(([a-z]+ ?)+){0,8}", 32), ("(([a-z]+ ?)*){0,8}", 33), ("((a|bc)+){0,8}", 8), ("[]a]{3}", 1), ("a{2}{3}", 1), ("(", 1), ("", 1),
    ("([a-z]{1,5}){1,33}", 33), ("(([a-z]+ ?){1,10}){1,10}", 33), ("x(([a-z]+)*)*(a|bc){3}", 33),
    ("([a-z]?){0,2}", 33), ("x(([a-z]?)*){0,2}", 33), ("(?:x*){2}", 33), ("x|(y?){40}", 33),
    ("(" * 65 + "a" + ")" * 65, 33), ("x(?<Z>[a-z]?){0,40}(?<Y>[a-z]?){0,40}", 33),
    ("((a+){1,8}){1,8}", 33), (r"(é\W*){1,1000}", 33), (r"(\U00000061[a-z]*){1,64}", 33),
    ("x([a-z]?){0,40}([a-z]?){0,40}(a|bc){0}", 33),  # a count of 0 cancelled the rest: 11.06 s
    # where a copy may end, the next character tells whether it goes on: under 1 ms a mask
    (r'("[^"]*",){0,59}', 1), (r'("([^"\\]|\\.)*", ?){0,60}', 1), ("(a|ab){40}", 1),
    ("(,[a-z]*[a-z]){0,40}", 1),
    ("(ab|a|b){40}", 33), ("([a-z]|[a-z][a-z]){40}", 33),  # "ab" is one copy or two
    # xgrammar reads `\N{...}` as its letters (1.93 s a mask), `[^]` as any character (6.54 s)
    (r"([a-z][\N{latin capital letter a with circumflex and hook above}]{0,4}){1,64}", 33),
    ("x[^]([a-z]{1,5}){1,64}]", 33),
    ("x((?=a)[a-z]?){0,2}", 33),  # xgrammar matches a lookahead as nothing, as `([a-z]?){0,2}`
]  # fmt: skip


@pytest.mark.parametrize(("pattern", "expected"), SPLITS)
def test_a_regex_s_splits_count_its_varying_repetitions(pattern: str, expected: int) -> None:
    assert splits(pattern) == expected
    assert (too_costly(pattern) is None) == (expected <= MAX_SPLITS)


_SMALL_REGEX = st.recursive(
    st.sampled_from(["a", "b", "c", "[ab]", "[bc]", "[^a]"]),
    lambda inner: st.one_of(
        st.tuples(inner, inner).map("".join),
        st.tuples(inner, inner).map("({0[0]}|{0[1]})".format),
        st.tuples(inner, st.sampled_from(["?", "*", "+", "{2}", "{0,2}", "{1,3}", "{2,}"])).map(
            "({0[0]}){0[1]}".format
        ),
    ),
    max_leaves=6,
)
_TEXTS = ["".join(t) for n in range(6) for t in itertools.product("abc", repeat=n)]


@settings(max_examples=2000, deadline=None)
@given(_SMALL_REGEX)
@example("(ab)?a")  # a copy of `ab` goes on past the `a` after it
@example("(a|aa)")
def test_a_regex_s_reading_holds_every_character_its_matches_start_hold_and_go_on_with(
    pattern: str,
) -> None:
    """Against Python's own matches of every text of up to 5 characters: a copy's end is told
    from the next character only where these sets hold all the characters that can be there."""
    part = regex_part(pattern)
    matches = [text for text in _TEXTS if re.fullmatch(pattern, text)]
    starts = {m[0] for m in matches if m}
    later = {c for m in matches for c in m[1:]}
    goes_on = {m[len(p)] for p in matches for m in matches if len(m) > len(p) and m.startswith(p)}
    for chars, atoms in ((starts, part.firsts), (later, part.later), (goes_on, part.continues)):
        assert all(any(re.fullmatch(atom, c) for atom in atoms) for c in chars), (chars, atoms)
    assert all(part.shortest <= len(m) for m in matches)


# 5,000 rules, each inside the one before: read without recursion
DEEP_GRAMMAR = (
    "root ::= r0\n" + "".join(f"r{i} ::= [a-z]? r{i + 1}\n" for i in range(5_000)) + 'r5000 ::= "a"'
)
# (grammar, its splits): counts multiply as a regex's; a cycle of rules that may match nothing,
# or a count over a rule that may, is past any bound
GRAMMAR_SPLITS = [
    ('root ::= "x" ([a-z]?){0,40} ([a-z]?){0,40}', 33),  # 12.1 s for its second mask
    ('root ::= "x" r r\nr ::= [a-z]? r | ""', 33),  # 3.4 s a mask
    ('root ::= "x" r\nr ::= r r | [a-z] | ""', 33),  # 3.8 s
    ('root ::= "x" r\nr ::= s r | ""\ns ::= [a-z]?', 33),
    ('root ::= "x" ([a-z]?)* ([a-z]?)*', 33),  # 3.7 s
    ("root ::= (([a-z]?){0,20}){0,20}", 33),  # 2.0 s for its first mask
    ('root ::= "x" (r " "?){0,33}\nr ::= [a-z] r | [a-z]', 33),
    ('root ::= "x" (r " "?){0,32}\nr ::= [a-z] r | [a-z]', 32),
    ("root ::= ((([a-z]{1,5}){1,4}){1,2}){1,4}", 32),
    ('root ::= "x" r r r r r r r r\nr ::= [a-z] r | ""', 1),  # 55 ms
    ('root ::= "x" r\nr ::= "(" r ")" r | [a-z]?', 1),
    ("root ::= x\nx ::= x x | [a-z]", 1),  # grows with the output: ended as it runs
    ('root ::= expr ("=" expr)*\nexpr ::= term ([-+*/] term)*\nterm ::= num | "(" expr ")"\n'
     "num ::= [0-9]+", 1),
    ('root ::= "a" (= "b") [b-c]{0,5}', 1), ("root ::= root", 33), ("root ::= (", 1),
    (DEEP_GRAMMAR, 1),
    ('root ::= TagDispatch(("<a>", r))\nr ::= "q" [a-z]*', 1),
    ('root ::= TagDispatch(("<a>", r))\nr ::= [a-z]? r | ""', 33),  # a macro is no hiding place
    ('root ::= TagDispatch(("<a>", b))\nb ::= root', 1),  # each time round matches its tag
    # text that cannot hold `</s>`, then `</s>`: it ends there (a tag's any text, 0.1 ms a mask);
    # then `</s` alone: where the text ends is not known
    ('root ::= t{1,40}\nt ::= "<s>" a "</s>"\na ::= TagDispatch(excludes=("</s>"))', 1),
    ('root ::= t{1,40}\nt ::= "<s>" a "</s"\na ::= TagDispatch(excludes=("</s>"))', 33),
    ('root ::= "x" r r\nr ::= [a-z]? r | "" | Token(1)', 33),  # 1.75 s a mask
    ('root ::= "x" Regex("([a-z]?){0,40}([a-z]?){0,40}")', 33), ('root ::= "x" Regex("[a-z]+")', 1),
    ('root ::= "x" .r{0,40} .r{0,40}\n.r ::= [a-z]?', 33),  # 11 s: names may begin with a dot
    ('root ::= "x" r r\nr[max_tokens=100000] ::= [a-z]? r | ""', 33),  # 1.26 s
    ('root ::= "x" ([a-z]?){0,40} ([a-z]?){0,40} ("a" | "bc"){0}', 33),  # 11.0 s
    ('root ::= "x" r\nr ::= [a-z] r{0,32}', 33),  # 2.4-3.2 s by its 14th token
    # 17.5 s a mask after `y`, in either order of root's alternatives
    ('root ::= "w" A | "y" B\nA ::= "(" X ")" | S\nX ::= A | "z"\nS ::= ([a-z]{1,5}){1,32}\n'
     "B ::= X{0,32}", 33),
    ('root ::= "y" B | "w" A\nA ::= "(" X ")" | S\nX ::= A | "z"\nS ::= ([a-z]{1,5}){1,32}\n'
     "B ::= X{0,32}", 33),
    ('root ::= ([a-z]+ ","){1,40}', 1), ('root ::= email (", " email){0,40}\n'
     'email ::= [a-z0-9._]+ "@" [a-z0-9]+ ("." [a-z]+)+', 1),  # 2.1 and 1.8 ms a mask
    # counts over quoted items, a table's rows: 0.1-110 ms a mask
    ('root ::= "| Name | Age |\\n" row{1,50}\nrow ::= "| " cell " | " cell " |\\n"\n'
     "cell ::= [^|\\n]+", 1),
    ('root ::= "{" space "\\"name\\": " name "}"\nname ::= "\\"" char{1,50} "\\""\n'
     'char ::= [^"\\\\\\x7F\\x00-\\x1F] | [\\\\] (["\\\\bfnrt] | "u" [0-9a-fA-F]{4})\n'
     'space ::= "" | " " | "\\n" [ \\t]{0,20}', 1),
    ('root ::= "[" (item (", " item){0,63})? "]"\nitem ::= "\'" [^\'\\\\]* "\'"', 1),
    ('root ::= "[" ws (str (ws "," ws str){0,59})? ws "]"\n'
     'str ::= "\\"" ([^"\\\\] | "\\\\" ["\\\\/bfnrtu])* "\\""\nws ::= [ ]?', 1),
    # counts over a rule of a cycle that may match nothing (its cycle had read it as not): the
    # first took over 24 s a mask
    ('root ::= "x" z{0,16} z{0,2}\nz ::= y{1,}\ny ::= x x\nx ::= "(" y ")" | [a-z] | ""', 33),
    ('root ::= "x" y{0,5} y{0,5}\ny ::= x x\nx ::= "(" y ")" | [a-z] | ""', 33),
    # xgrammar matches a lookahead as nothing: 2.56 s a mask by step 15
    ('root ::= "x" r{0,} r{0,}\nr ::= Regex("(?=a)[a-z]?")', 33),
]  # fmt: skip


@pytest.mark.parametrize(
    ("grammar", "expected"), GRAMMAR_SPLITS, ids=[g[:48] for g, _ in GRAMMAR_SPLITS]
)
def test_a_grammar_s_splits_count_its_varying_repetitions(grammar: str, expected: int) -> None:
    assert grammar_cost.splits(grammar) == expected
    assert (grammar_cost.too_costly(grammar) is None) == (expected <= MAX_SPLITS)


def test_xgrammar_s_own_json_grammar_passes() -> None:
    import xgrammar

    assert grammar_cost.splits(str(xgrammar.Grammar.builtin_json_grammar())) <= MAX_SPLITS


COSTLY = "too costly to match: the counts of its repetitions"
# `x`, then two runs of up to 40 optional letters: as `x([a-z]?){0,40}([a-z]?){0,40}`
COSTLY_REPEATS = {
    "type": "sequence",
    "elements": [
        {"type": "const_string", "value": "x"},
        *[
            {
                "type": "repeat",
                "min": 0,
                "max": 40,
                "content": {"type": "regex", "pattern": "[a-z]?"},
            }
        ]
        * 2,
    ],
}
COSTLY_LARK = {"type": "grammar", "syntax": "lark", "grammar": 'start: "x" a a\na: /[a-z]?/*'}
# with no property required, a schema's XML may be empty: two repeats of it took 1.77 s a mask
XML_SCHEMA = {
    "type": "qwen_xml_parameter",
    "json_schema": {"type": "object", "properties": {"a": {}}},
}
COSTLY_XML_REPEATS = {**COSTLY_REPEATS, "elements": [
    {"type": "const_string", "value": "x"},
    *[{"type": "repeat", "min": 0, "max": 40, "content": XML_SCHEMA}] * 2]}  # fmt: skip


def _tag(form: dict[str, Any]) -> dict[str, Any]:
    return {"type": "structural_tag", "format": form}


LONG_PATTERN = "[a-z]" * 12_000  # 60,000 characters


@pytest.mark.parametrize(
    ("constraint", "match"),
    [
        (StructuredOutput(regex="([a-z]?){0,40}([a-z]?){0,40}"), COSTLY),  # 12.4 s a mask
        (StructuredOutput(regex="x(([a-z]?)*){0,16}(([a-z]?)*){0,2}"), COSTLY),  # 76 s
        (
            StructuredOutput(
                json_schema=json.dumps({"type": "string", "pattern": "(([a-z]?){0,70}){0,70}"})
            ),
            COSTLY,
        ),
        (StructuredOutput(regex="a" * 100_001), "over 100000 characters of regex in all"),
        (
            StructuredOutput(
                json_schema=json.dumps(
                    {
                        "type": "object",
                        "properties": {
                            name: {"type": "string", "pattern": LONG_PATTERN} for name in "ab"
                        },
                    }
                )
            ),
            "over 100000 characters of regex in all",
        ),
        (StructuredOutput(grammar='root ::= "x" ([a-z]?){0,40} ([a-z]?){0,40}'), COSTLY),
        (
            StructuredOutput(
                structural_tag=json.dumps(
                    {
                        "type": "structural_tag",
                        "format": {
                            "type": "grammar",
                            "grammar": 'root ::= "x" r r\nr ::= [a-z]? r | ""',
                        },
                    }
                )
            ),
            COSTLY,
        ),
        (StructuredOutput(structural_tag=json.dumps(_tag(COSTLY_REPEATS))), COSTLY),
        (StructuredOutput(structural_tag=json.dumps(_tag(COSTLY_LARK))), COSTLY),
        (StructuredOutput(structural_tag=json.dumps(_tag(COSTLY_XML_REPEATS))), COSTLY),
    ],
    ids=[
        "regex",
        "star under a count",
        "schema pattern",
        "long regex",
        "long patterns",
        "grammar",
        "structural tag's grammar",
        "structural tag's repeats",
        "structural tag's Lark grammar",
        "structural tag's repeats of XML",
    ],
)
def test_a_regex_too_costly_to_match_is_refused_before_it_compiles(
    llms: dict[bool, LLM], constraint: StructuredOutput, match: str
) -> None:
    llm = llms[True]
    with pytest.raises(ValueError, match=match):
        llm.generate(["a"], SamplingParams(max_tokens=4, structured=constraint), use_tqdm=False)
    assert not llm.scheduler.has_work


def _tagged(content: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Structural tags of every kind that holds a part, each around `content`."""
    tag = {"type": "tag", "begin": "<a>", "content": content, "end": "</a>"}
    by_token = {"type": "tag", "begin": {"type": "token", "token": "<tool_call>"}, "content": content,
                "end": {"type": "token", "token": "</tool_call>"}}  # fmt: skip
    excluded = {"exclude_tokens": ["<|im_end|>"]}
    return {
        "sequence": {
            "type": "sequence",
            "elements": [{"type": "const_string", "value": "x"}, content],
        },
        "tag of tokens": by_token,
        "triggered tags": {"type": "triggered_tags", "triggers": ["<a"], "tags": [tag]},
        "token-triggered tags": {
            "type": "token_triggered_tags",
            "trigger_tokens": ["<tool_call>", "<think>"],
            "tags": [by_token, {**by_token, "begin": {"type": "token", "token": "<think>"}}],
            **excluded,
        },
        "tags with separator": {"type": "tags_with_separator", "separator": ",", "tags": [tag]},
        "dispatch": {"type": "dispatch", "rules": [["<a>", content]]},
        "token dispatch": {
            "type": "token_dispatch",
            "rules": [["<tool_call>", content]],
            **excluded,
        },
        "plus": {"type": "plus", "content": content},
        "after any tokens": {
            "type": "sequence",
            "elements": [{"type": "any_tokens", "max_tokens": 5, **excluded}, content],
        },
        "after a Lark grammar with a token": {
            "type": "sequence",
            "elements": [
                {"type": "grammar", "syntax": "lark", "grammar": 'start: "a" | <|im_end|>'},
                content,
            ],
        },
        "after a Qwen XML parameter": {
            "type": "sequence",
            "elements": [
                {"type": "qwen_xml_parameter", "json_schema": {"type": "object"}},
                content,
            ],
        },
    }


CHEAP_REPEATS = {  # `([a-z]+,){1,40}`: not empty (a `plus` of what may be is refused)
    "type": "repeat",
    "min": 1,
    "max": 40,
    "content": {"type": "regex", "pattern": "[a-z]+,"},
}


@pytest.mark.parametrize("kind", list(_tagged(COSTLY_REPEATS)))
def test_a_structural_tag_is_read_whole_before_it_compiles(
    llms: dict[bool, LLM], kind: str
) -> None:
    """Its parts are read as xgrammar builds them from the tag, inside any kind of part: the costly
    repeats are refused, cheap ones (copies that split one way) pass."""
    llm = llms[True]
    costly = StructuredOutput(structural_tag=json.dumps(_tag(_tagged(COSTLY_REPEATS)[kind])))
    with pytest.raises(ValueError, match="a structural tag too costly to match"):
        llm.generate(["a"], SamplingParams(max_tokens=4, structured=costly), use_tqdm=False)
    cheap = StructuredOutput(structural_tag=json.dumps(_tag(_tagged(CHEAP_REPEATS)[kind])))
    assert llm.generate(["a"], SamplingParams(max_tokens=4, structured=cheap), use_tqdm=False)
    assert not llm.scheduler.has_work


def test_repeated_tags_of_any_text_pass(llms: dict[bool, LLM]) -> None:
    """The text between `<step>` and `</step>` cannot hold `</step>`: each step ends at its first
    `</step>`, so 40 of them split one way (0.1 ms a mask)."""
    step = {"type": "tag", "begin": "<step>", "content": {"type": "any_text"}, "end": "</step>"}
    steps = {"type": "repeat", "min": 1, "max": 40, "content": step}
    constraint = StructuredOutput(structural_tag=json.dumps(_tag(steps)))
    params = SamplingParams(max_tokens=4, structured=constraint)
    assert llms[True].generate(["a"], params, use_tqdm=False)[0]["text"].startswith("<step")


LARK_JSON = """?start: value
?value: dict | list | ESCAPED_STRING | SIGNED_NUMBER | "true" | "false" | "null"
list: "[" [value ("," value)*] "]"
dict: "{" [pair ("," pair)*] "}"
pair: ESCAPED_STRING ":" value
%import common.ESCAPED_STRING
%import common.SIGNED_NUMBER
%import common.WS
%ignore WS"""


@pytest.mark.parametrize(
    "lark", ['start: list\nlist: "[" (list ("," list)*)? "]"', LARK_JSON], ids=["list", "JSON"]
)
def test_a_lark_grammar_s_repeats_pass(llms: dict[bool, LLM], lark: str) -> None:
    """Lark prints `*` as a count (`list_repeat{0, -1}`), EBNF as recursion: read alike, once
    (Lark's JSON example, whitespace ignored throughout: 0.3 ms a mask)."""
    part = {"type": "grammar", "syntax": "lark", "grammar": lark}
    constraint = StructuredOutput(structural_tag=json.dumps(_tag(part)))
    params = SamplingParams(max_tokens=4, structured=constraint)
    assert llms[True].generate(["a"], params, use_tqdm=False)[0]["token_ids"]


def test_a_grammar_that_dead_ends_ends_its_request_in_error(llms: dict[bool, LLM]) -> None:
    """`ab[^\\s\\S]` allows "a", then "b", then nothing: the sampler gave token 0 after them."""
    for llm in llms.values():
        dead_end = SamplingParams(max_tokens=8, structured=StructuredOutput(regex=r"ab[^\s\S]"))
        with pytest.raises(ValueError, match="allows no next token"):
            llm.generate(["a", "b"], [SamplingParams(max_tokens=8), dead_end], use_tqdm=False)
        assert llm.generate(["c"], SamplingParams(max_tokens=4), use_tqdm=False)[0]["token_ids"]
        llm.scheduler.check_integrity()
        assert llm.scheduler.kv.used_pages == llm.scheduler.kv.prefix_cache.num_cached_pages


# each with an output text that xgrammar 0.2.9's grammar judges the other way (valid: it is JSON
# and the schema holds)
REFUSED = [
    ({"type": "array", "items": {"type": "string"}, "uniqueItems": True}, "#/uniqueItems",
     '["a", "a"]', False),
    ({"type": "number", "multipleOf": 0.5}, "#/multipleOf", "0.3", False),
    ({"properties": {"a": {"not": {"type": "string"}}}}, "#/properties/a/not", '{"a": "x"}',
     False),
    ({"anyOf": [{"type": "integer"}, {"type": "string", "pattern": "a+", "maxLength": 3}]},
     "#/anyOf/1/pattern with minLength or maxLength", '"aaaa"', False),
    ({"$defs": {"A": {"if": {"type": "integer"}, "then": {"minimum": 5}}}, "$ref": "#/$defs/A"},
     "#/$defs/A/if", "3", False),
    ({"properties": {"a": {}}, "dependentRequired": {"a": ["b"]}}, "#/dependentRequired",
     '{"a": 1}', False),
    ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "#/allOf of more than one schema",
     '"a"', False),
    ({"type": "object", "properties": {"b": {}}, "required": ["a"],
      "additionalProperties": True}, '#/required "a" outside its properties', '{"b": 1}', False),
    ({"type": "array", "items": {"type": "object", "required": ["a"]}},
     '#/items/required "a" outside its properties', "[{}]", False),
    # keywords beside a combining one are dropped
    ({"type": "string", "maxLength": 2, "anyOf": [{"type": "string"}]},
     "#/anyOf beside maxLength", '"abc"', False),
    ({"type": "string", "anyOf": [{"type": "integer"}, {"type": "string"}]},
     "#/anyOf beside type", "1", False),
    ({"$defs": {"a": {"type": "integer"}}, "$ref": "#/$defs/a", "minimum": 5},
     "#/$ref beside minimum", "3", False),
    ({"anyOf": [{"type": "string"}], "oneOf": [{"type": "integer"}]}, "#/anyOf beside oneOf",
     '"a"', False),
    # an enum's or a const's values are written whatever the keywords beside them say
    ({"type": "integer", "enum": [1, 1.5]}, '#/enum value 1.5 is not of type "integer"', "1.5",
     False),
    ({"type": "string", "const": "abc", "pattern": "^x"}, "#/const beside pattern", '"abc"',
     False),
    ({"enum": [12345678901234567890123]}, "#/enum with an integer past 64 bits",
     "1.2345678901234568e+22", False),
    # a keyword of one type's values is dropped where no type is named
    ({"type": "object", "properties": {"a": {"maxLength": 2}}, "required": ["a"]},
     "#/properties/a/maxLength without a type", '{"a": "abc"}', False),
    ({"type": []}, "#/type [] naming no JSON type", "1", False),
    # counts are read modulo 2^32
    ({"type": "array", "maxItems": 2**32 + 1}, "#/maxItems past 2147483647", "[1, 2]", True),
    ({"type": "string", "pattern": "^a{4294967297}$"},
     "#/pattern: a repetition count past 2147483647", '"a"', False),
    # an integer's multipleOf is dropped past 1024, with one bound, or over 10,000 integers
    ({"type": "integer", "multipleOf": 2000}, "#/multipleOf past 1024", "3", False),
    ({"type": "integer", "multipleOf": 5, "minimum": 0},
     "#/multipleOf with a bound on one side only", "3", False),
    ({"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 10000},
     "#/multipleOf within bounds spanning over 10000 integers", "3", False),
    # a format wins over lengths and patterns
    ({"type": "string", "format": "date", "maxLength": 3}, "#/format beside maxLength",
     '"2020-01-01"', False),
    # a pattern is matched against the string as JSON writes it
    ({"type": "string", "pattern": "^\\x22$"}, '#/pattern: the escape "\\\\x"', '"""', False),
    ({"type": "string", "pattern": "^\u00e9[^x]*$"}, '#/pattern: the character "\\u00e9"',
     '"\u00e9a"b"', False),
    # names: a pattern's schema loses to a property's, an escaped name passes as another
    ({"type": "object", "properties": {"a": {"type": "integer"}},
      "patternProperties": {"^[a-z]$": {"type": "string"}}}, "#/patternProperties",
     '{"a": "x"}', False),
    ({"type": "object", "properties": {"abc": {"type": "integer"}},
      "propertyNames": {"type": "string", "maxLength": 2}}, "#/propertyNames", '{"abc": 1}',
     False),
    ({"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 2},
     "#/minProperties where other properties are allowed", '{"a": 1, "a": 2}', False),
    # references xgrammar resolves to another schema, or to any value
    ({"$ref": "#foo", "$defs": {"x": {"$anchor": "foo", "type": "integer"}}},
     "#/$ref to other than a JSON pointer in this document", '"x"', False),
    ({"$ref": "#/$defs/a", "$defs": {"a": {"$dynamicRef": "#/$defs/b"}, "b": {"type": "integer"}}},
     "#/$defs/a/$dynamicRef", '"x"', False),
    # no value matches an empty anyOf or oneOf: xgrammar's grammar ends at once
    ({"anyOf": []}, "#/anyOf of no schema", "", False),
    ({"type": "object", "properties": {"a": {"oneOf": []}}, "required": ["a"]},
     "#/properties/a/oneOf of no schema", '{"a": }', False),
    # an anchor xgrammar ignores where it matters
    ({"type": "string", "pattern": "a^b"}, "#/pattern: ^ where text may come before it",
     '"ab"', False),
    ({"$ref": "#/$defs/x", "$defs": {"x": {"$id": "http://e/x", "$ref": "#/$defs/y",
                                           "$defs": {"y": {"type": "string"}}},
                                     "y": {"type": "integer"}}},
     "#/$defs/x/$id below the root", "1", False),
]  # fmt: skip


@pytest.mark.parametrize(("schema", "found", "text", "valid"), REFUSED)
def test_schemas_xgrammar_would_not_enforce_are_refused(
    llms: dict[bool, LLM], schema: dict, found: str, text: str, valid: bool
) -> None:
    """Refused, not compiled into a grammar that lets outputs break them."""
    params = SamplingParams(max_tokens=5, structured=StructuredOutput(json_schema=schema))
    with pytest.raises(ValueError, match=f"invalid structured output: {re.escape(found)}"):
        llms[True].generate(["a"], params, use_tqdm=False)


@pytest.mark.parametrize(("schema", "found", "text", "valid"), REFUSED)
def test_each_refused_schema_is_one_xgrammar_gets_wrong(
    schema: dict, found: str, text: str, valid: bool
) -> None:
    """The text shows why (and fails here once an xgrammar enforces the schema)."""
    import xgrammar
    from xgrammar.testing import _is_grammar_accept_string

    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        assert not valid
    else:  # Python's re refuses counts past 2^32 - 1
        if "{4294967297}" not in json.dumps(schema):
            assert jsonschema.Draft202012Validator(schema).is_valid(value) == valid
    grammar = xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    assert _is_grammar_accept_string(grammar, text) != valid


@pytest.mark.parametrize(
    ("constraint", "text"),
    [
        ("regex", "(ab){4294967297}"),
        ("regex", "a{0,99999999999999999999}"),
        ("grammar", 'root ::= "a"{4294967297}'),
        ("grammar", 'root ::= "a"{0, 4294967297}'),  # EBNF's spaces: missed before
        ("grammar", 'root ::= "a"{ 4294967297 }'),
        ("structural_tag", json.dumps({"type": "structural_tag",
                                       "format": {"type": "regex", "pattern": "a{2,4294967297}"}})),
    ],
)  # fmt: skip
def test_repetition_counts_xgrammar_reads_modulo_2_32_are_refused(
    llms: dict[bool, LLM], constraint: str, text: str
) -> None:
    params = SamplingParams(max_tokens=5, structured=StructuredOutput(**{constraint: text}))
    with pytest.raises(ValueError, match="a repetition count past 2147483647"):
        llms[True].generate(["a"], params, use_tqdm=False)


@pytest.mark.parametrize(
    "schema", [{"type": [["string"]], "enum": ["a"]}, {"type": [{"a": 1}], "const": 1}]
)
def test_a_type_that_names_no_type_is_refused_and_the_engine_serves_on(
    llms: dict[bool, LLM], schema: dict
) -> None:
    """Its TypeError (an unhashable type name) ended the scheduler: a server went down."""
    llm = llms[True]
    params = SamplingParams(max_tokens=5, structured=StructuredOutput(json_schema=schema))
    with pytest.raises(ValueError, match="naming no JSON type"):
        llm.generate(["a"], params, use_tqdm=False)
    assert llm.generate(["c"], SamplingParams(max_tokens=4), use_tqdm=False)[0]["token_ids"]
    llm.scheduler.check_integrity()


# each with a text Python's fullmatch and xgrammar's grammar judge apart
MISREAD_REGEXES = [
    ("a^b", "^ where text may come before it", "ab"),
    ("x(a|^b)", "^ where text may come before it", "xb"),
    ("a?^b", "^ where text may come before it", "ab"),
    ("(^a)*", "^ where text may come before it", "aa"),
    ("a$b", "$ where text may follow it", "ab"),
    ("(a|b$)c", "$ where text may follow it", "bc"),
    ("(a$)+", "$ where text may follow it", "aa"),
    ("a\\Z", "the escape \\Z, which xgrammar reads as its letter", "a"),
    ("\\Aa", "the escape \\A, which xgrammar reads as its letter", "a"),
]


@pytest.mark.parametrize(("regex", "found", "text"), MISREAD_REGEXES)
def test_a_regex_xgrammar_reads_otherwise_is_refused(
    llms: dict[bool, LLM], regex: str, found: str, text: str
) -> None:
    """It was compiled, and the output held to xgrammar's reading: `a^b` gave "ab"."""
    import xgrammar
    from xgrammar.testing import _is_grammar_accept_string

    grammar = xgrammar.Grammar.from_regex(regex)
    assert _is_grammar_accept_string(grammar, text) != (re.fullmatch(regex, text) is not None)
    params = SamplingParams(max_tokens=5, structured=StructuredOutput(regex=regex))
    with pytest.raises(ValueError, match=re.escape(f"a regex with {found}")):
        llms[True].generate(["a"], params, use_tqdm=False)


def test_anchors_where_they_hold_anyway_pass() -> None:
    for regex in ("^ab$", "(^a|b)c", "ab|^c", "^(a|b)+$", "a$|b", "(?:^a)", "(a$)?", "a\\\\z",
                  "[\\U0001F600-\\U0001F64F]+"):  # fmt: skip
        assert misread_in_regex(regex) is None, regex
    for letter in "zhUN":  # PCRE's and Python's escapes xgrammar reads as the letter
        assert misread_in_regex(f"a\\{letter}") is not None, letter


def test_repetition_counts_in_classes_strings_and_comments_are_text() -> None:
    huge = "{99999999999}"
    for regex in (f"[a{huge}]", "a\\" + huge, "a{2,}b{3}"):
        assert not repeats_past_limit(regex), regex
    for grammar in (f'root ::= "{huge}"', f"root ::= [a{huge}]", f'root ::= "a" # {huge}\n'):
        assert not repeats_past_limit(grammar, ebnf=True), grammar
    assert repeats_past_limit(f"a{huge}")
    assert repeats_past_limit(f'"{huge}"')  # a regex's quote is a character
    assert repeats_past_limit(f'root ::= "{huge}" # x\n  "a"{huge}', ebnf=True)
    assert repeats_past_limit("a{" + "9" * 5000 + "}")  # past int()'s limit on digits


def test_schemas_xgrammar_enforces_compile() -> None:
    """Keywords by those names where they are no keywords, and the forms xgrammar does hold
    (pydantic's among them)."""
    schemas = [
        {"type": "object", "properties": {"not": {"type": "integer"}, "if": {"type": "string"}},
         "required": ["not"]},
        {"type": "integer", "multipleOf": 3},
        {"type": "string", "pattern": "^[a-z]+$"},
        {"type": "string", "minLength": 1, "maxLength": 4},
        {"$defs": {"A": {"type": "integer"}}, "allOf": [{"$ref": "#/$defs/A"}]},
        {"type": "array", "items": {"type": "string"}, "uniqueItems": False},
        {"type": "string", "enum": ["a", "b"], "title": "Letter"},
        {"const": 2.0, "type": "integer"},
        {"type": ["string", "null"], "enum": ["a", None]},
        {"anyOf": [{"type": "integer", "minimum": 5}, {"type": "null"}], "default": None},
        {"$defs": {"A": {"type": "integer"}}, "$ref": "#/$defs/A", "description": "an A"},
        {"type": "array", "maxItems": 2**31 - 1},
        {"type": "string", "pattern": "^a{2147483647}$"},
        {"type": "string", "pattern": "^\\d{3}-[a-z]+\\.[^\\s]$"},
        {"type": "string", "format": "date"},
        {"type": "integer", "multipleOf": 1024},
        {"type": "integer", "multipleOf": 5, "exclusiveMinimum": 0, "exclusiveMaximum": 10001},
        {"$id": "https://example.com/s", "$defs": {"A": {"type": "integer"}}, "$ref": "#/$defs/A"},
        {"type": "object", "anyOf": [
            {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
            {"type": "object", "properties": {"b": {"type": "string"}}, "required": ["b"]}]},
    ]  # fmt: skip
    for schema in schemas:
        assert unenforced_keyword(schema, "#") is None, schema


def test_a_slow_schema_does_not_hold_a_quick_one(qwen3_path: str) -> None:
    """Compiles run side by side: a regex sent after a 12,000-value enum (0.7 s here) is ready
    while the enum still compiles."""
    grammars = Grammars(Path(qwen3_path), 151936, [])
    grammars.compile(StructuredOutput(regex="warm")).result()  # the tokenizer's tables
    slow = grammars.compile(
        StructuredOutput(json_schema={"enum": [f"v-{i}" for i in range(12000)]})
    )
    grammars.compile(StructuredOutput(regex="yes|no")).result()
    assert not slow.done()
    slow.result()


def test_an_abandoned_compile_that_has_not_begun_is_dropped() -> None:
    """A compile no request waits for any more (its request refused or gone) leaves the queue
    if no grammar thread has taken it yet, so that the threads do not spend their time on
    grammars nobody will use; one already taken runs on (nothing can stop it) and stays cached,
    so that a retry finds it rather than starting a second compile."""
    grammars = Grammars(DEFAULT_MODEL_PATH, 512, [])
    grammars.compile(StructuredOutput(regex="warm")).result()  # the compiler

    def schema(i: int, size: int) -> StructuredOutput:  # 600 properties: ~0.2 s to compile
        properties = {f"p{i}-{j}": {"type": "string"} for j in range(size)}
        return StructuredOutput(json_schema={"type": "object", "properties": properties})

    # four compiles take the four threads, long enough that none ends before the abandons (CI
    # once stalled this thread past a 0.2 s compile; 1,000 properties: 5.9 s for the test on a
    # 2-core CPU); two wait behind them
    specs = [schema(i, 1000 if i < 4 else 600) for i in range(6)]
    compiles = [grammars.compile(spec) for spec in specs]
    grammars.abandon(specs[4], compiles[4])
    grammars.abandon(specs[0], compiles[0])
    assert compiles[4].cancelled() and not compiles[0].cancelled()
    again = grammars.compile(specs[4])
    assert again is not compiles[4]
    assert grammars.compile(specs[0]) is compiles[0]
    for future in (*compiles[:4], compiles[5], again):
        future.result()


def test_a_grammar_that_can_only_end_ends_before_min_tokens(stories_llm: LLM) -> None:
    # min_tokens holds back the eos that ends the grammar: once nothing else may follow, it yields
    choice = SamplingParams(
        temperature=0, max_tokens=20, structured=StructuredOutput(choice=["Lily"])
    )
    free = stories_llm.generate(["Once upon a time"], choice, use_tqdm=False)[0]
    held = stories_llm.generate(
        ["Once upon a time"], replace(choice, min_tokens=10), use_tqdm=False
    )[0]
    assert held["text"] == free["text"] == "Lily"
    assert held["token_ids"] == free["token_ids"] and held["finish_reason"] == "stop"
    assert free["token_ids"][-1] in stories_llm.scheduler.eos_ids


def test_a_grammar_that_ends_under_ignore_eos_names_no_stop_token(stories_llm: LLM) -> None:
    """Its last token is an eos that ignore_eos made no stop token; without ignore_eos it is
    named as a stop token is (the model's second eos, 1, here)."""
    choice = SamplingParams(
        temperature=0, max_tokens=20, structured=StructuredOutput(choice=["Lily"])
    )
    outs = stories_llm.generate(
        ["Once upon a time"] * 2, [choice, replace(choice, ignore_eos=True)], use_tqdm=False
    )
    assert [(o["text"], o["finish_reason"], o["stop_reason"]) for o in outs] == [
        ("Lily", "stop", 1),
        ("Lily", "stop", None),
    ]
    assert outs[0]["token_ids"] == outs[1]["token_ids"]


def test_offline_a_constraint_after_a_token_holds_only_what_follows_it(
    llms: dict[bool, LLM], qwen3_path: str
) -> None:
    """`after="</think>"`: the tokens up to the first `</think>` are free, those after it follow
    the regex; with overlap on and off alike. A forced `</think>` (logit_bias) is free to come
    first only because the grammar waits for it."""
    end = load_tokenizer(Path(qwen3_path)).convert_tokens_to_ids("</think>")
    held = StructuredOutput(regex="ab", after="</think>")
    forced = SamplingParams(temperature=0, max_tokens=8, logit_bias={end: 100.0}, structured=held)
    free = SamplingParams(seed=4, max_tokens=6, structured=held)  # random weights: no `</think>`
    for llm in llms.values():
        got, thinking = llm.generate(["Q:", "Q:"], [forced, free], use_tqdm=False)
        assert got["text"] == "</think>ab" and got["finish_reason"] == "stop", got
        assert end not in thinking["token_ids"] and thinking["finish_reason"] == "length"
        assert "ab" not in thinking["text"]  # no grammar held it
        llm.scheduler.check_integrity()
        assert llm.scheduler.kv.used_pages == llm.scheduler.kv.prefix_cache.num_cached_pages
    grammars = llms[True].scheduler.grammars  # one compile, whatever token it starts after
    assert grammars.compile(held) is grammars.compile(replace(held, after=None))
    with pytest.raises(ValueError, match="not one"):
        bad = StructuredOutput(regex="ab", after="</thinking>")
        llms[True].generate(["Q:"], SamplingParams(structured=bad), use_tqdm=False)
