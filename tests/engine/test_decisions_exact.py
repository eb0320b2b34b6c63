"""Typed decisions through the engine equal the references: templates (pinned text, slots over several
blocks, a block pinned whole, a pinned stop id), allowed sets (one list, one per slot) and reads
(k = 1, 2), alone and batched beside free requests, for SDAR's reveal rules, LLaDA2's LowConfidence and
JointThreshold, and Fast-dLLM v2: tokens, step maps, finish reasons, raw logprobs and label masses.

The checkpoints and references are tests/support/decisions.py's fixtures."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from configs import EngineConfig
from engine import GenerationConfig, Response, pipeline
from engine.errors import RequestError
from engine.offline import Pipeline
from tests.support import decisions
from tests.support.decisions import Family

# the shared fixtures: the three families' checkpoints and references
sdar, llada2, fast, family = decisions.sdar, decisions.llada2, decisions.fast, decisions.family
TOL = 1e-4  # as the families' engine tests: kernels and the references differ by ~1e-5 on free requests
ENGINE = {"sdar": dict(dllm_block_length=4), "llada2": dict(dllm_block_length=8), "fast": dict(dllm_sub_block_length=4)}
# the reference's knob -> the request's field; LLaDA2's LowConfidence is the engine's low_confidence_dynamic
FIELDS = {"strategy": "dllm_unmasking_strategy", "rule": "dllm_unmasking_strategy",
          "denoising_steps": "dllm_denoising_steps", "threshold": "dllm_confidence_threshold",
          "edit_threshold": "dllm_edit_threshold", "max_post_edit_steps": "dllm_max_post_edit_steps",
          "penalty_lambda": "dllm_penalty_lambda"}
RULE_NAMES = {"low_confidence": "low_confidence_dynamic"}
RULES = {
    "sdar": {"low_confidence_dynamic": {}, "low_confidence_static": dict(strategy="low_confidence_static",
                                                                         denoising_steps=2),
             "sequential": dict(strategy="sequential", denoising_steps=4)},
    "llada2": {"low_confidence": {}, "joint_threshold": dict(rule="joint_threshold", edit_threshold=0.0,
                                                             max_post_edit_steps=4),
               "joint_threshold_damped": dict(rule="joint_threshold", edit_threshold=0.6, max_post_edit_steps=2,
                                              penalty_lambda=1.0)},
    "fast": {"threshold_0.7": {}, "threshold_0.9": dict(threshold=0.9)},
}
CASES = [(name, rule) for name, rules in RULES.items() for rule in rules]


@dataclass
class Case:
    """One request: its prompt's length and decisions, read by the engine and the reference alike."""

    prompt_len: int
    max_new_tokens: int
    template: list[int | None] | None = None
    allowed: list[int] | dict[int, list[int]] | None = None
    read_steps: int | None = None
    knobs: dict[str, Any] = field(default_factory=dict)  # the reference's rule knobs

    def params(self, family: Family) -> GenerationConfig:
        fields = {FIELDS[k]: RULE_NAMES.get(v, v) for k, v in (family.knobs | self.knobs).items() if k in FIELDS}
        read = dict(dllm_read_only=True, dllm_max_steps=self.read_steps) if self.read_steps else {}
        return GenerationConfig(max_new_tokens=self.max_new_tokens, logprobs=0, dllm_template=self.template,
                                dllm_allowed_token_ids=self.allowed, **read, **fields)

    def reference(self, family: Family) -> Any:
        return family.run(family.prompt(self.prompt_len), max_new_tokens=self.max_new_tokens, stop_ids=family.eos,
                          template=self.template, allowed=self.allowed, read_steps=self.read_steps, **self.knobs)


def spanning_template(family: Family, prompt_len: int, mask_marker: bool = False) -> list[int | None]:
    """Over the prompt's block and three more: text pinned at every third position, the second full
    block pinned whole, slots elsewhere (spelled -1 and the mask id too when `mask_marker`)."""
    b = family.block
    first = b - prompt_len % b  # output positions in the prompt's block
    template: list[int | None] = []
    for g in range(first + 3 * b - 1):
        if g >= first and (g - first) // b == 1:
            template.append(60 + g % 30)
        elif g % 3 == 1:
            template.append(40 + g)
        else:
            template.append([None, -1, family.mask_id][g % 3] if mask_marker else None)
    return template


def read_template(family: Family, prompt_len: int) -> list[int | None]:
    """Slots over the prompt's block and the next (the last slot there), then pinned text in the block after."""
    b = family.block
    first = b - prompt_len % b
    return [None if g % 4 else 45 + g for g in range(first + b - 1)] + [None, 81, 82]


def cases(family: Family, knobs: dict[str, Any]) -> list[Case]:
    """Free requests, templates, sets and reads, prompts ending at several places of a block."""
    b = family.block
    every = list(range(40, 90))
    p1, p2 = b + 2, 2 * b - 1
    t1 = spanning_template(family, p1)
    per_slot = {g: [50 + g, 70 + g, 90 + g] for g, t in enumerate(t1) if t is None and g % 2 == 0}
    read, read1 = read_template(family, p2), read_template(family, p1)
    return [Case(p1, 3 * b, knobs=knobs), Case(p2, 2 * b + 3, knobs=knobs),
            Case(p1, len(t1) + 3, t1, knobs=knobs),
            Case(p2, 3 * b + 4, spanning_template(family, p2, mask_marker=True), every, knobs=knobs),
            Case(p1, len(t1), t1, per_slot, knobs=knobs),
            Case(p2, 2 * b, None, {1: [41, 42], b + 1: [43, 44, 45]}, knobs=knobs),
            Case(p1, 3 * b, [None, None, min(family.eos)], knobs=knobs),  # a pinned stop id
            Case(p2, len(read) + 2, read, None, 1, knobs=knobs),
            Case(p1, len(read1), read1, every, 2, knobs=knobs),
            Case(p2, len(read), read, {g: [50 + g, 60 + g] for g in range(0, len(read), 2) if read[g] is None}, 1,
                 knobs=knobs)]


@pytest.fixture(scope="module")
def pipes():
    """One engine per family, opened when first asked for."""
    opened: dict[str, Pipeline] = {}

    def get(family: Family) -> Pipeline:
        if family.name not in opened:
            config = EngineConfig(max_model_len=256, num_kv_blocks=256, kv_block_size=8, logprobs_mode="raw_logprobs",
                                  **ENGINE[family.name])
            opened[family.name] = pipeline(str(family.path), config)
        return opened[family.name]

    yield get
    for pipe in opened.values():
        pipe.close()


def assert_equal(out: Response, ref: Any, case: Case) -> None:
    what = (case.prompt_len, case.template, case.allowed, case.read_steps, case.knobs)
    assert out.token_ids == ref.token_ids, what
    assert out.step_map == ref.step_map, what
    assert out.finish_reason == ref.finish_reason, what
    got = [entry[token] for entry, token in zip(out.logprobs, out.token_ids, strict=True)]
    assert got == pytest.approx(ref.logprobs, abs=TOL), what
    if case.allowed is None:
        assert out.label_mass is None, what
    else:
        want = [ref.label_mass.get(g) for g in range(len(ref.token_ids))]
        assert [m is None for m in out.label_mass] == [m is None for m in want], what
        assert [m for m in out.label_mass if m is not None] == pytest.approx(
            [m for m in want if m is not None], abs=TOL), what


@pytest.mark.parametrize("name,rule", CASES)
def test_decisions_equal_reference_batched_and_alone(request, pipes, name, rule):
    family = request.getfixturevalue(name)
    pipe = pipes(family)
    batch = cases(family, RULES[name][rule])
    outs = pipe([family.prompt(c.prompt_len) for c in batch], [c.params(family) for c in batch])
    for case, out in zip(batch, outs, strict=True):
        assert_equal(out, case.reference(family), case)
    for case in batch[2::3]:  # some alone
        assert_equal(pipe(family.prompt(case.prompt_len), case.params(family)), case.reference(family), case)
    reasons = {o.finish_reason for o in outs}
    assert {"read", "stop"} <= reasons, reasons


def test_one_step_read_inside_one_block_is_one_forward(family, pipes):
    """A read of slots inside the prompt's block, k = 1, with pinned text in the blocks after: one step,
    one forward, every slot at step 1."""
    pipe, b = pipes(family), family.block
    case = Case(b if family.name == "sdar" else b + 3, b + 4, [None, 41, None, None, *range(50, 50 + b)],
                list(range(40, 80)), 1)
    before = pipe.engine.stats.forwards
    out = pipe(family.prompt(case.prompt_len), case.params(family))
    assert pipe.engine.stats.forwards - before == 1
    assert out.num_steps == 1
    assert out.step_map == [1, 0, 1, 1] + [0] * b
    assert_equal(out, case.reference(family), case)


def test_pinned_blocks_count_no_extra_step(sdar, pipes):
    """A template that pins whole blocks after the prompt's: the engine's step count is the request's
    (a block opened already final adds no step of its own)."""
    pipe, b = pipes(sdar), sdar.block
    template = [None] * b + list(range(50, 50 + 2 * b)) + [None]
    before = pipe.engine.stats.unmasking_steps
    out = pipe(sdar.prompt(b), GenerationConfig(max_new_tokens=len(template), ignore_eos=True, dllm_template=template))
    assert out.token_ids[b: 3 * b] == list(range(50, 50 + 2 * b))
    assert pipe.engine.stats.unmasking_steps - before == out.num_steps


@pytest.mark.parametrize(("fields", "field"), [
    ({"dllm_template": [10**6]}, "dllm_template"),
    ({"dllm_template": [None] * 9, "max_new_tokens": 8}, "dllm_template"),
    ({"dllm_template": [5, 6], "max_new_tokens": 2}, "dllm_template"),  # every output position pinned
    ({"dllm_allowed_token_ids": [10**6]}, "dllm_allowed_token_ids"),
    ({"dllm_template": [5, None], "dllm_allowed_token_ids": {0: [7]}}, "dllm_allowed_token_ids"),  # no slot
    ({"dllm_max_steps": 2}, "dllm_max_steps"),
    ({"dllm_read_only": True, "dllm_template": [5, 6]}, "dllm_template"),
])
def test_what_a_model_cannot_honour_is_refused_by_name_and_nothing_runs(sdar, pipes, fields, field):
    """Ids outside the vocabulary, a template longer than the output or pinning all of it, a set at no slot, a
    step budget without a read, a read without a slot: each refused naming its field."""
    engine = pipes(sdar).engine
    with pytest.raises(RequestError) as err:
        engine.add_request(sdar.prompt(5), GenerationConfig(**{"max_new_tokens": 8, **fields}))
    assert err.value.param == field and field in str(err.value)
    assert not engine.has_unfinished()


def test_a_trajectory_takes_no_decisions(sdar, pipes):
    """A trajectory is scored, not decoded: a read on it is refused naming the read's own field."""
    trajectory = {"output_ids": [5, 6, 7, 8], "step_map": [1, 2, 3, 4]}
    with pytest.raises(RequestError) as err:
        pipes(sdar).engine.add_request(sdar.prompt(4), GenerationConfig(
            max_new_tokens=0, logprobs=0, dllm_trajectory=trajectory, dllm_read_only=True))
    assert err.value.param == "dllm_read_only" and "trajectory" in str(err.value)
