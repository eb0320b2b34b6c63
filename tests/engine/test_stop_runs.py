"""The stop rule reads a step's final tokens as a run (their text added at once, stop strings searched
once); its decision must be the one it reaches reading them one at a time, whatever the runs.

Random token streams over the tiny byte-level tokenizer (whose byte alphabet splits multi-byte
characters across tokens), random stop strings, stop ids, `min_new_tokens`, `max_new_tokens` and
`include_stop_str_in_output`, consumed in random run lengths and token by token.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from configs import GenerationConfig
from engine.core.stopping import StopChecker
from testing.tiny.tokenizer import build_byte_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_byte_tokenizer()


def _decide(checker: StopChecker, tokens: list[int], runs: list[int] | None, deltas: list[str] | None = None,
            eager: StopChecker | None = None):
    """Feed `tokens` (runs of the given lengths, or one at a time) until decided; the final state.
    `deltas`: read the visible text after each run, as a streamed request's chunks do, into it; what
    is visible then is what `eager`, fed the same tokens one at a time, shows."""
    if runs is None:
        for t in tokens:
            if checker.consume(t) is not None:
                break
    else:
        final = 0
        for n in runs:
            final = min(len(tokens), final + n)
            decided = checker.consume_final(tokens, 0, final) is not None
            if deltas is not None:
                while eager.decision is None and eager.num_consumed < checker.num_consumed:
                    eager.consume(tokens[eager.num_consumed])
                assert checker.visible_end() == eager.visible_end()
                sent = sum(map(len, deltas))
                deltas.append(checker.text_between(sent, max(sent, checker.visible_end())))
            if decided:
                break
    return checker.decision, checker.num_consumed, checker.text[: checker.visible_end()]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_runs_decide_as_token_by_token(tokenizer, data):
    text = data.draw(st.text(alphabet="ab é€😀\n", min_size=4, max_size=40))
    tokens = tokenizer.encode(text, add_special_tokens=False)
    stop_ids = frozenset(data.draw(st.sets(st.sampled_from(sorted(set(tokens))), max_size=2)))
    words = data.draw(st.lists(st.text(alphabet="ab é€", min_size=1, max_size=4), max_size=3))
    max_new = data.draw(st.integers(1, len(tokens) + 2))
    params = GenerationConfig(max_new_tokens=max_new, stop_words=words or None,
                              min_new_tokens=data.draw(st.integers(0, min(3, max_new))),
                              include_stop_str_in_output=data.draw(st.booleans()))
    runs = data.draw(st.lists(st.integers(1, 6), min_size=len(tokens), max_size=len(tokens)))
    one_by_one = _decide(StopChecker(tokenizer, params, stop_ids), tokens, None)
    in_runs = _decide(StopChecker(tokenizer, params, stop_ids), tokens, runs)
    assert in_runs == one_by_one
    # read between runs (without stop strings the text is made only when read): the same decision and
    # text, and the pieces read add up to it
    deltas: list[str] = []
    eager = StopChecker(tokenizer, params, stop_ids)
    assert _decide(StopChecker(tokenizer, params, stop_ids), tokens, runs, deltas, eager) == one_by_one
    assert "".join(deltas) == one_by_one[2]
