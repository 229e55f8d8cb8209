"""IncrementalDetokenizer: streamed pieces are final text only (no half characters, no text that
may still become a stop string) and always concatenate to the finished text."""

import codecs
import random

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from minisgl.core import SamplingParams
from minisgl.messages import Finished
from minisgl.tokenizer.detokenizer import IncrementalDetokenizer
from minisgl.utils import DEFAULT_MODEL_PATH

from .conftest import QWEN3_TOKENIZER


@pytest.fixture(scope="module")
def qwen3() -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(str(QWEN3_TOKENIZER))


def _stream(
    tokenizer: PreTrainedTokenizerBase,
    ids: list[int],
    stop: tuple[str, ...] = (),
    prompt: str = "Say:",
) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode(prompt), SamplingParams(stop=stop))
    last = len(ids) - 1
    pieces = [detok.step([t], _finished() if i == last else None)[0] for i, t in enumerate(ids)]
    return pieces, detok


def _finished(stop_token: int | None = None) -> Finished:
    """How a request ended: at max_tokens, or at a stop token."""
    reason = "length" if stop_token is None else "stop"
    return Finished(0, reason, stop_token, prompt_tokens=1, completion_tokens=1, cached_tokens=0)


@pytest.mark.parametrize("text", ["𠀋𠀌 and 🫠🫨 ok", "a 𝔘𝔫𝔦 b", "Ǆ ᾯ ꙮ"])
def test_characters_split_across_tokens_are_never_emitted_half(
    qwen3: PreTrainedTokenizerBase, text: str
) -> None:
    ids = qwen3.encode(text)
    assert any("\ufffd" in qwen3.decode([t]) for t in ids), "no character spans two tokens"
    pieces, detok = _stream(qwen3, ids)
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == detok.text == text
    at_once = IncrementalDetokenizer(qwen3, qwen3.encode("Say:"))
    assert at_once.step(ids, _finished()) == (text, False)


def test_a_stop_string_across_tokens_is_held_back_then_cut(
    qwen3: PreTrainedTokenizerBase,
) -> None:
    ids = qwen3.encode("one two three four five")  # "one", " two", " three", " four", " five"
    pieces, detok = _stream(qwen3, ids, stop=("o thr", "xx"))
    # the last 4 characters (a stop string's length but one) wait until they cannot begin one
    assert pieces[:3] == ["", "one", " tw"]
    assert "".join(pieces) == detok.text == "one tw"
    assert detok.num_tokens == 3 and detok.matched_stop == "o thr"
    no_match, detok = _stream(qwen3, ids, stop=("o thx",))
    assert "".join(no_match) == detok.text == "one two three four five"


def test_sentencepiece_word_starts_keep_their_space() -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(DEFAULT_MODEL_PATH))
    ids = tokenizer.encode("Once upon a time", add_special_tokens=False)
    pieces, _ = _stream(tokenizer, ids, prompt="Hello")
    assert pieces == [" Once", " upon", " a", " time"]


def test_a_finishing_stop_token_adds_no_text(qwen3: PreTrainedTokenizerBase) -> None:
    detok = IncrementalDetokenizer(qwen3, qwen3.encode("Hi"))
    first, _ = detok.step(qwen3.encode(" there"))
    end = qwen3.convert_tokens_to_ids("<|im_end|>")
    last, _ = detok.step([end], _finished(stop_token=end))
    assert (first, last, detok.text) == (" there", "", " there")


def test_a_stop_token_adds_its_text_with_include_stop_str_in_output(
    qwen3: PreTrainedTokenizerBase,
) -> None:
    dot = qwen3.convert_tokens_to_ids(".")
    include = SamplingParams(include_stop_str_in_output=True)
    detok = IncrementalDetokenizer(qwen3, qwen3.encode("Hi"), include)
    pieces = [detok.step(qwen3.encode(" there"))[0], detok.step([dot], _finished(dot))[0]]
    assert pieces == [" there", "."] and detok.text == " there."


def _split(
    tokenizer: PreTrainedTokenizerBase, text: str, by_character: bool, params: SamplingParams
) -> IncrementalDetokenizer:
    """`text` streamed as its tokens, or a token per character."""
    ids = [tokenizer.encode(c)[0] for c in text] if by_character else tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Say:"), params)
    for t in ids:
        detok.step([t])
    return detok


@pytest.mark.parametrize("by_character", [False, True])
def test_of_overlapping_stop_strings_the_one_completed_first_wins_however_tokenized(
    qwen3: PreTrainedTokenizerBase, by_character: bool
) -> None:
    detok = _split(qwen3, "hello world", by_character, SamplingParams(stop=("hello world", "o w")))
    assert (detok.text, detok.matched_stop) == ("hell", "o w")


def test_a_stop_string_that_begins_in_the_min_tokens_text_and_ends_after_it_counts(
    qwen3: PreTrainedTokenizerBase,
) -> None:
    assert [qwen3.decode([t]) for t in qwen3.encode("hello world")] == ["hello", " world"]
    straddling = _split(qwen3, "hello world", False, SamplingParams(stop=("o w",), min_tokens=1))
    assert (straddling.text, straddling.matched_stop) == ("hell", "o w")
    within = _split(qwen3, "hello world", False, SamplingParams(stop=("ell",), min_tokens=1))
    assert (within.text, within.matched_stop) == ("hello world", None)


def test_a_stop_string_in_the_first_token_ends_the_text_there(
    qwen3: PreTrainedTokenizerBase,
) -> None:
    ids = qwen3.encode(" there was a cat")
    pieces, detok = _stream(qwen3, ids, stop=(" there",))
    assert pieces == [""] * len(ids) and detok.text == ""
    assert (detok.matched_stop, detok.num_tokens) == (" there", 1)  # later tokens add nothing


def test_a_stop_string_across_a_multi_byte_character_is_matched_when_it_completes(
    qwen3: PreTrainedTokenizerBase,
) -> None:
    ids = qwen3.encode("ab 🫠🫨 cd")
    assert any("\ufffd" in qwen3.decode([t]) for t in ids), "no character spans two tokens"
    pieces, detok = _stream(qwen3, ids, stop=("🫨",))
    assert "".join(pieces) == detok.text == "ab 🫠"
    assert all("\ufffd" not in p for p in pieces)
    whole = qwen3.encode("ab 🫠🫨")
    assert detok.num_tokens == len(whole)  # up to the token that completed the character


def test_of_stop_strings_the_one_that_ends_first_wins_and_ends_the_request(
    qwen3: PreTrainedTokenizerBase,
) -> None:
    ids = qwen3.encode("one two three four")
    detok = IncrementalDetokenizer(
        qwen3, qwen3.encode("Say:"), SamplingParams(stop=("three four", "two t", "xyz"))
    )
    steps = [detok.step([t]) for t in ids]
    assert detok.text == "one " and detok.matched_stop == "two t"
    # the token that completed it asks for the request to stop, once; later ones add nothing
    assert [stop for _, stop in steps] == [False, False, True, False]
    assert "".join(piece for piece, _ in steps) == "one "


def test_output_that_completes_a_character_the_prompt_began_keeps_all_its_text() -> None:
    stories = AutoTokenizer.from_pretrained(str(DEFAULT_MODEL_PATH))
    e4, b8, ad = (stories.convert_tokens_to_ids(f"<0x{b:02X}>") for b in (0xE4, 0xB8, 0xAD))
    assert stories.decode([e4, b8, ad]) == "中"
    bang = stories.convert_tokens_to_ids("!")
    prompt = stories.encode("hi") + [e4, b8]  # token ids that end inside a character
    output = [ad, bang, bang, bang]
    detok = IncrementalDetokenizer(stories, prompt)
    pieces = [detok.step([t])[0] for t in output[:-1]] + [detok.step(output[-1:], _finished())[0]]
    assert "".join(pieces) == detok.text == "中!!!"
    at_once = IncrementalDetokenizer(stories, prompt)
    assert at_once.step(output, _finished()) == ("中!!!", False)


def _whole(tokenizer: PreTrainedTokenizerBase, ids: list[int], prompt: str = "Say:") -> str:
    """The output's text as the whole sequence decodes."""
    prompt_ids = tokenizer.encode(prompt)
    skip = len(tokenizer.decode(prompt_ids, skip_special_tokens=True))
    return tokenizer.decode(prompt_ids + ids, skip_special_tokens=True)[skip:]


def test_a_run_of_tokens_that_decode_to_u_fffd_streams_as_it_comes(
    qwen3: PreTrainedTokenizerBase,
) -> None:
    """A lone byte no character continues is U+FFFD for good once three more tokens (a byte each
    at least) leave it so: it goes out then, rather than at the end of the run."""
    lone = next(t for t in range(qwen3.vocab_size) if qwen3.decode([t]) == "\ufffd")
    ids = [lone] * 200 + qwen3.encode(" ok")
    pieces, detok = _stream(qwen3, ids)
    assert all(pieces[3:200]), pieces[:8]  # each step's token, three steps later
    assert "".join(pieces) == detok.text == _whole(qwen3, ids)


def test_tokens_without_bytes_do_not_settle_a_character_they_split(
    qwen3: PreTrainedTokenizerBase,
) -> None:
    """Ids past the tokenizer's vocabulary (the model's is larger) and special tokens decode to
    nothing: three of them between a character's bytes leave it to be completed."""
    first, rest = qwen3.encode("𠀋")[:1], qwen3.encode("𠀋")[1:]
    assert rest, "𠀋 is one token"
    for gap in ([len(qwen3)] * 3, [qwen3.convert_tokens_to_ids("<|im_end|>")] * 3):
        ids = first + gap + rest + qwen3.encode(" ok")
        pieces, _ = _stream(qwen3, ids)
        assert "".join(pieces) == _whole(qwen3, ids) == "𠀋 ok", pieces


class _Counted:
    """A tokenizer that notes the most ids it was asked to decode at once."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer, self.most = tokenizer, 0

    def __getattr__(self, name: str) -> object:
        return getattr(self.tokenizer, name)

    def __len__(self) -> int:
        return len(self.tokenizer)

    def decode(self, ids: list[int], **kwargs: bool) -> str:
        self.most = max(self.most, len(ids))
        return self.tokenizer.decode(ids, **kwargs)


def test_a_run_of_tokens_without_text_is_not_decoded_again_at_every_step(
    qwen3: PreTrainedTokenizerBase,
) -> None:
    """Special tokens (a model writing <|endoftext|> on under ignore_eos) and ids past the
    tokenizer's vocabulary decode to nothing; a run of them held for good would make each step
    decode it all again, in the detokenize thread all requests share."""
    counted = _Counted(qwen3)
    endoftext = qwen3.convert_tokens_to_ids("<|endoftext|>")
    ids = [endoftext] * 300 + [len(qwen3) + 3] * 300 + qwen3.encode(" ok 𠀋")
    pieces, detok = _stream(counted, ids)  # type: ignore[arg-type]
    assert "".join(pieces) == detok.text == _whole(qwen3, ids) == " ok 𠀋"
    assert counted.most < 16


def test_a_byte_fallback_run_streams_the_text_the_whole_run_decodes_to() -> None:
    """sentencepiece's ByteFallback makes every byte of an invalid run U+FFFD, valid ones too:
    the run's text waits for its end."""
    tokenizer = AutoTokenizer.from_pretrained(str(DEFAULT_MODEL_PATH))
    ids = tokenizer.convert_tokens_to_ids(["<0x8A>", "<0x41>", "<0x42>", "<0x43>", "<0x44>"])
    pieces, detok = _stream(tokenizer, ids, prompt="Hi")
    assert "".join(pieces) == detok.text == _whole(tokenizer, ids, prompt="Hi") == "\ufffd" * 5


def _as_given(run: list[int]) -> bytes:
    """A ByteFallback run's text as it is given out, as UTF-8: its characters as they complete;
    from the character that breaks (or ends unfinished), a U+FFFD a byte."""
    decoder, text, broken = codecs.getincrementaldecoder("utf-8")(), "", False
    for b in run:
        if broken:
            text += "\ufffd"
            continue
        held = len(decoder.getstate()[0])
        try:
            text += decoder.decode(bytes((b,)))
        except UnicodeDecodeError:
            text, broken = text + "\ufffd" * (held + 1), True
    if not broken:
        text += "\ufffd" * len(decoder.getstate()[0])
    return text.encode()


def test_byte_fallback_runs_stream_their_characters_as_they_complete() -> None:
    """Runs of byte tokens between words: whole characters, broken from their first byte or
    after some (then U+FFFD a byte from the broken character on, whatever follows), or ending
    inside a character. Streamed or given at once, the text is the same: the whole sequence's
    where every run is valid or broken from its first byte (tokenizer.decode makes a broken
    run's earlier characters U+FFFD too: 中 then a stray byte gave 中��� streamed and ���� at
    once). No step decodes a broken run again."""
    tokenizer = AutoTokenizer.from_pretrained(str(DEFAULT_MODEL_PATH))
    byte = [tokenizer.convert_tokens_to_ids(f"<0x{b:02X}>") for b in range(256)]
    words = tokenizer.encode(" once upon a time", add_special_tokens=False)
    assert not set(words) & set(byte)
    rng = random.Random(0)
    for _ in range(80):
        ids: list[int] = []
        given: list[int] = []  # the same with each run as its text given out
        whole_is_given = True
        for _ in range(rng.randint(1, 5)):
            word = rng.choice(words)
            ids.append(word)
            given.append(word)
            run = list("".join(rng.choices("é中𠀋a", k=rng.randint(0, 3))).encode())
            kind = rng.randrange(4)
            if kind == 1:  # broken from its first byte
                run = [0xFF] + [rng.randrange(256) for _ in range(rng.randint(0, 6))]
            elif kind == 2:  # broken after some characters
                run += [rng.choice([0xAD, 0xFF, 0x41])] + [rng.randrange(256) for _ in range(3)]
            elif kind == 3:  # ending inside a character
                run += list("𠀋".encode())[: rng.randint(1, 3)]
            whole_is_given &= kind < 2
            ids += [byte[b] for b in run]
            given += [byte[b] for b in _as_given(run)]
        want = _whole(tokenizer, given, prompt="Hi")
        pieces, detok = _stream(tokenizer, ids, prompt="Hi")
        at_once = IncrementalDetokenizer(tokenizer, tokenizer.encode("Hi"))
        assert at_once.step(ids, _finished())[0] == "".join(pieces) == detok.text == want, ids
        if whole_is_given:
            assert want == _whole(tokenizer, ids, prompt="Hi")
    counted = _Counted(tokenizer)
    ids = [byte[0xFF]] * 300 + words
    pieces, _ = _stream(counted, ids, prompt="Hi")  # type: ignore[arg-type]
    assert "".join(pieces) == _whole(tokenizer, ids, prompt="Hi") and all(pieces[1:300])
    assert counted.most < 16
