"""What the LLaDA2 engine tests share (tests/engine/families/test_llada2*.py): SGLang's JointThreshold
settings, seeded prompts, and an engine output compared with the reference's (tokens, step map, finish
reason, logprobs within TOL)."""

from __future__ import annotations

import random

import pytest

TOL = 1e-4
# SGLang's JointThreshold, full editing (e = 0, the default budget), and the damped variant
JOINT = {"full": dict(edit_threshold=0.0, max_post_edit_steps=16, penalty_lambda=0.0),
         "damped": dict(edit_threshold=0.6, max_post_edit_steps=4, penalty_lambda=1.0)}


def prompt_of(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(300) for _ in range(length)]


def assert_equal(out, want, case) -> None:
    assert out.token_ids == want.token_ids, case
    assert out.step_map == want.step_map, case
    assert out.finish_reason == want.finish_reason, case
    got = [entry[t] for entry, t in zip(out.logprobs, out.token_ids, strict=True)]
    assert got == pytest.approx(want.logprobs, abs=TOL), case
