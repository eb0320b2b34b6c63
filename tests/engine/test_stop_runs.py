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


def _decide(checker: StopChecker, tokens: list[int], runs: list[int] | None):
    """Feed `tokens` (runs of the given lengths, or one at a time) until decided; the final state."""
    if runs is None:
        for t in tokens:
            if checker.consume(t) is not None:
                break
    else:
        final = 0
        for n in runs:
            final = min(len(tokens), final + n)
            if checker.consume_final(tokens, 0, final) is not None:
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
