"""The reveal choice of the confidence rules, against its definition: candidates ranked by confidence,
highest first, ties toward the lower position; `low_confidence_static` takes the first n of that order,
`low_confidence_dynamic` every candidate at least as confident as its threshold when there are n of
them, else the first n; `above_threshold_or_best` (Fast-dLLM v2's sub-blocks, token editing's reveals)
every candidate strictly above its threshold, else the first. Drawn with many ties (a few distinct
values), n = 1 included."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from configs import EngineConfig, GenerationConfig
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
    assert low_confidence_static(confidence, None, n, SETTINGS, 0) == _ranked(confidence)[:n]
    knobs = dataclasses.replace(SETTINGS, confidence_threshold=threshold)
    sure = [i for i, c in enumerate(confidence) if c >= threshold]
    expected = sure if len(sure) >= n else _ranked(confidence)[:n]
    assert low_confidence_dynamic(confidence, None, n, knobs, 0) == expected
    above = [i for i, c in enumerate(confidence) if c > threshold]
    assert above_threshold_or_best(confidence, threshold) == (above or _ranked(confidence)[:1])
