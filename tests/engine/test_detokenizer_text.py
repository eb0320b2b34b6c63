"""The detokenizer keeps its text as settled pieces and a recent tail (so that a token's text is added
without copying the whole output); what it reads back must be the text a plain string would hold.

With the tail limits set to a few characters, so that random streams settle pieces often: the whole
text, its length and any slice equal those of the decoded tokens, and the stop rule reaches the
decision it reaches with the default limits, stop strings longer than the kept tail included.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerFast

import engine.core.detokenizer as detokenizer
from configs import GenerationConfig
from engine.core.detokenizer import IncrementalDetokenizer
from engine.core.stopping import StopChecker
from engine.core.token_pieces import pieces_of
from testing.tiny.tokenizer import build_byte_tokenizer

ALPHABET = "ab é€😀\n"


@pytest.fixture(scope="module")
def tokenizer():
    return build_byte_tokenizer()


@pytest.fixture(scope="module")
def tokenizer_with_added():
    """The tiny tokenizer plus added tokens: two whose bytes are parts of characters ('é' is the
    alphabet's symbol of the byte 0xE9, a lead byte), one with a character outside the alphabet (its
    text is its own UTF-8), and one holding a replacement character, which the table has no bytes for."""
    tokenizer = build_byte_tokenizer()
    tokenizer.backend_tokenizer.add_tokens(["\u00e9x", "\u00e9", "\u00e2\u0082", "a\ufffd"])
    pieces = pieces_of(tokenizer, skip_special_tokens=True)
    assert pieces.fill(tokenizer.backend_tokenizer.token_to_id("a\ufffd")) is None
    assert isinstance(pieces.fill(tokenizer.backend_tokenizer.token_to_id("\u00e9x")), bytes)
    return tokenizer


@contextmanager
def _small_tail(max_chars: int, keep: int):
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(detokenizer, "_TAIL_MAX", max_chars)
        patch.setattr(detokenizer, "_TAIL_KEEP", keep)
        yield


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_settled_text_reads_as_one_string(tokenizer, data):
    tokens = tokenizer.encode(data.draw(st.text(alphabet=ALPHABET, min_size=1, max_size=60)), add_special_tokens=False)
    runs = data.draw(st.lists(st.integers(1, 5), min_size=len(tokens), max_size=len(tokens)))
    keep = data.draw(st.integers(0, 4))
    with _small_tail(keep + data.draw(st.integers(1, 6)), keep):
        detok, at = IncrementalDetokenizer(tokenizer, skip_special_tokens=True), 0
        plain = ""
        for n in runs:
            if at >= len(tokens):
                break
            old = detok.length
            ends = detok.add(tokens[at: at + n])
            at += n
            plain = detok.text
            assert detok.length == len(plain) == ends[-1]
            start = data.draw(st.integers(0, len(plain)))
            end = data.draw(st.integers(start, len(plain)))
            assert detok.slice(start, end) == plain[start:end]
            assert detok.slice(old) == plain[old:]
        detok.flush()
    assert detok.text == tokenizer.decode(tokens[:at], skip_special_tokens=True, clean_up_tokenization_spaces=False)


@pytest.mark.parametrize("tail", [None, (6, 2)])
def test_long_runs_of_whole_characters_add_what_tokens_one_by_one_add(tokenizer, tail):
    """A run of 16 tokens or more whose pieces the table holds as whole characters is looked up at once:
    the same text and lengths as token by token, after text already added, with the tail settling
    (`tail`: small limits) or not."""
    ids = tokenizer.encode("ab ba\nbb a " * 40, add_special_tokens=False)
    with _small_tail(*tail) if tail else nullcontext():
        one = IncrementalDetokenizer(tokenizer, skip_special_tokens=True)  # fills the table too
        expected = [end for token_id in ids for end in one.add([token_id])]
        runs, got, at = IncrementalDetokenizer(tokenizer, skip_special_tokens=True), [], 0
        for n in (1, 17, 3, 40, 16, len(ids)):
            got += runs.add(ids[at: at + n])
            at += n
        assert got == expected and runs.length == one.length
        assert runs.text == one.text == tokenizer.decode(ids, clean_up_tokenization_spaces=False)


def _decide(checker: StopChecker, tokens: list[int], runs: list[int]):
    final = 0
    for n in runs:
        final = min(len(tokens), final + n)
        if checker.consume_final(tokens, 0, final) is not None:
            break
    if checker.decision is None:
        checker.end_from_outside()
    return checker.decision, checker.num_consumed, checker.text[: checker.visible_end()]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_stop_rule_decides_as_with_the_default_tail(tokenizer, data):
    tokens = tokenizer.encode(data.draw(st.text(alphabet=ALPHABET, min_size=4, max_size=60)), add_special_tokens=False)
    words = data.draw(st.lists(st.text(alphabet="ab é€", min_size=1, max_size=8), max_size=3))
    params = GenerationConfig(max_new_tokens=len(tokens) + 1, stop_words=words or None,
                              include_stop_str_in_output=data.draw(st.booleans()))
    runs = data.draw(st.lists(st.integers(1, 6), min_size=len(tokens), max_size=len(tokens)))
    expected = _decide(StopChecker(tokenizer, params, frozenset()), tokens, runs)
    with _small_tail(data.draw(st.integers(2, 6)), data.draw(st.integers(0, 2))):
        assert _decide(StopChecker(tokenizer, params, frozenset()), tokens, runs) == expected


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_table_adds_what_the_stream_adds(tokenizer_with_added, data):
    """A byte-level tokenizer's text comes from its table of pieces: token for token, the same text (or
    the same nothing) as tokenizers' own DecodeStream, over any ids -- parts of multi-byte characters,
    bytes that never complete, special tokens skipped or not, added tokens the table has no bytes for
    (a stream takes over from the last whole character), in runs."""
    tokenizer = tokenizer_with_added
    vocab = tokenizer.backend_tokenizer.get_vocab_size()
    ids = data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=40))
    skip = data.draw(st.booleans())
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
    assert detok._pieces is not None  # the tiny tokenizer is byte-level: the table is used
    stream, backend, at = DecodeStream(skip_special_tokens=skip), tokenizer.backend_tokenizer, 0
    expected, text = [], ""
    for token_id in ids:
        text += stream.step(backend, token_id) or ""
        expected.append(len(text))
    got = []
    for n in data.draw(st.lists(st.integers(1, 4), min_size=len(ids), max_size=len(ids))):
        got += detok.add(ids[at: at + n])
        at += n
    assert got == expected
    assert detok.text == text


def test_other_decoders_use_the_stream():
    """A decoder that is not byte-level (here sentencepiece's Metaspace, which drops a lone token's
    leading space) never uses a table."""
    from tokenizers import Tokenizer, decoders, models

    backend = Tokenizer(models.WordLevel({"▁a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    backend.decoder = decoders.Metaspace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=True)
    assert detok._pieces is None
    detok.add([1, 0, 0])
    assert detok.text == "b a a"


def test_the_table_takes_over_again_after_a_stream(tokenizer_with_added):
    """A token the table has no bytes for starts a stream; once the text ends on a whole character
    again, the next tokens come from the table (the stream's microsecond a token is paid only there)."""
    backend = tokenizer_with_added.backend_tokenizer
    detok = IncrementalDetokenizer(tokenizer_with_added, skip_special_tokens=True)
    odd, b = backend.token_to_id("a\ufffd"), tokenizer_with_added.encode("b", add_special_tokens=False)
    assert detok.add([odd]) == [0] and detok._stream is not None  # held: the text ends in U+FFFD
    assert detok.add(b) == [3] and detok._stream is None
    assert detok.text == "a\ufffdb"
