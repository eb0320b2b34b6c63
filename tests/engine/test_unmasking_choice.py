"""The reveal choice of the confidence rules, against its definition: candidates ranked by confidence,
highest first, ties toward the lower position; `low_confidence_static` takes the first n of that order,
`low_confidence_dynamic` every candidate at least as confident as its threshold when there are n of
them, else the first n; `above_threshold_or_best` (Fast-dLLM v2's sub-blocks, token editing's reveals)
every candidate strictly above its threshold, else the first. Every choice is given ascending. Drawn
with many ties (a few distinct values), n = 1 included."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from configs import EngineConfig, GenerationConfig
from engine.core.decoding.rules import RULES, RevealRule
from engine.core.decoding.unmasking import (
    UnmaskingSettings,
    above_threshold_or_best,
    low_confidence_dynamic,
    low_confidence_static,
)

BLOCK = 8
SETTINGS = UnmaskingSettings.resolve(GenerationConfig(), EngineConfig(dllm_block_length=BLOCK), BLOCK)
VALUES = st.sampled_from([0.0, 0.25, 0.5, 0.85, 0.9, 1.0])


def _ranked(confidence: list[float]) -> list[int]:
    return sorted(range(len(confidence)), key=lambda i: (-confidence[i], i))


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_confidence_rules_choose_as_defined(data):
    confidence = data.draw(st.lists(VALUES, min_size=1, max_size=BLOCK))
    n = data.draw(st.integers(1, len(confidence)))
    threshold = data.draw(VALUES)
    assert low_confidence_static(confidence, None, n, SETTINGS, 0) == sorted(_ranked(confidence)[:n])
    knobs = dataclasses.replace(SETTINGS, confidence_threshold=threshold)
    sure = [i for i, c in enumerate(confidence) if c >= threshold]
    expected = sure if len(sure) >= n else sorted(_ranked(confidence)[:n])
    assert low_confidence_dynamic(confidence, None, n, knobs, 0) == expected
    above = [i for i, c in enumerate(confidence) if c > threshold]
    assert above_threshold_or_best(confidence, threshold) == (above or _ranked(confidence)[:1])


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_every_reveal_rule_chooses_ascending(data):
    """The block strategies write a choice as it comes: every reveal rule gives at least one candidate's
    index, none twice, ascending."""
    confidence = data.draw(st.lists(VALUES, min_size=1, max_size=BLOCK))
    entropy = data.draw(st.lists(st.sampled_from([0.0, 0.1, 0.5, 2.0]), min_size=len(confidence),
                                 max_size=len(confidence)))
    n = data.draw(st.integers(1, len(confidence)))
    knobs = dataclasses.replace(SETTINGS, confidence_threshold=data.draw(VALUES), entropy_threshold=1.0)
    for rule in RULES.values():
        if isinstance(rule, RevealRule):
            chosen = rule.choose(confidence, entropy, n, knobs, data.draw(st.integers(0, 2**62)))
            assert chosen == sorted(set(chosen)) and chosen and 0 <= chosen[0] and chosen[-1] < len(confidence)
