"""Self-checks of the typed decisions (template, allowed sets, reads) in the three block-diffusion
references: SDAR's (testing/references/sdar.py), LLaDA2's (testing/references/llada2_moe.py) and
Fast-dLLM v2's (testing/references/fast_dllm_qwen.py), each on a tiny checkpoint with small blocks.

The fixtures `sdar`, `llada2` and `fast` (a `Family` each) are tests/support/decisions.py's, shared with
tests/engine/test_decisions_exact.py."""

from __future__ import annotations

import math

import pytest
import torch

from testing.references import fast_dllm_qwen as fast_reference
from testing.references import sdar as sdar_reference
from testing.references.sdar import block_causal_logits
from tests.support import decisions
from tests.support.decisions import Family

# the shared fixtures: the three families' checkpoints and references
sdar, llada2, fast, family = decisions.sdar, decisions.llada2, decisions.fast, decisions.family
SDAR_RULES = ("low_confidence_dynamic", "low_confidence_static", "sequential", "entropy_bounded", "random")
LLADA2_RULES = ("low_confidence", "joint_threshold")
FULL_EDITING = dict(edit_threshold=0.0, max_post_edit_steps=4)


def record_forwards(family: Family, monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """The inputs of every forward the family's reference runs from now on."""
    seen: list[list[int]] = []
    if family.name == "llada2":
        real = family.model.logits
        monkeypatch.setattr(family.model, "logits", lambda ids, b: seen.append(list(ids)) or real(ids, b))
    else:
        module = fast_reference if family.name == "fast" else sdar_reference
        monkeypatch.setattr(module, "block_causal_logits",
                            lambda model, ids, b: seen.append(list(ids)) or block_causal_logits(model, ids, b))
    return seen


def family_rules(family: Family) -> list[dict]:
    """The reference knobs of each rule a family is checked under."""
    if family.name == "sdar":
        return [dict(strategy=s) for s in SDAR_RULES]
    if family.name == "llada2":
        return [dict(rule="low_confidence"), dict(rule="joint_threshold", **FULL_EDITING)]
    return [{}]


# ---- templates ---------------------------------------------------------------------------------


def test_all_slot_template_equals_no_template(family):
    """Slots spelled None, -1 and the mask id, over part of the output: the free decoding, to the byte."""
    for knobs in family_rules(family):
        for n in (3, 2 * family.block):
            prompt = family.prompt(n)
            free = family.run(prompt, max_new_tokens=13, stop_ids=family.eos, **knobs)
            template = [[None, -1, family.mask_id][g % 3] for g in range(9)]
            assert family.run(prompt, max_new_tokens=13, stop_ids=family.eos, template=template, **knobs) == free
            assert free.label_mass == {}


def test_singleton_sets_at_slots_reproduce_the_free_run(family):
    """Slots restricted to the token the free run wrote there, the other template positions pinned to
    it: the free run's tokens; a pinned position has step 0 and logprob 0.0, a slot's label mass is
    the raw probability of its token."""
    for knobs in family_rules(family):
        prompt = family.prompt(5)
        free = family.run(prompt, max_new_tokens=14, stop_ids=set(), **knobs)
        template = [None if g % 3 else t for g, t in enumerate(free.token_ids[:12])]
        sets = {g: [free.token_ids[g]] for g in range(12) if template[g] is None}
        out = family.run(prompt, max_new_tokens=14, stop_ids=set(), template=template, allowed=sets, **knobs)
        assert out.token_ids[:12] == free.token_ids[:12], knobs
        assert set(out.label_mass) == set(sets), knobs
        for g in range(12):
            if template[g] is None:
                assert out.step_map[g] > 0 and out.label_mass[g] == pytest.approx(math.exp(out.logprobs[g]))
            else:
                assert (out.step_map[g], out.logprobs[g]) == (0, 0.0)


def test_sequential_with_singleton_sets_is_the_free_run_to_the_logprob(sdar):
    """`sequential` reveals in the same order whatever the rows say: sets holding the free run's tokens
    change nothing but the label masses, one list for every slot (past the template too) or one per slot."""
    prompt = sdar.prompt(6)
    free = sdar.run(prompt, max_new_tokens=11, stop_ids=set(), strategy="sequential", denoising_steps=2)
    per_slot = sdar.run(prompt, max_new_tokens=11, stop_ids=set(), strategy="sequential", denoising_steps=2,
                        allowed={g: [t] for g, t in enumerate(free.token_ids)})
    assert (per_slot.token_ids, per_slot.step_map, per_slot.logprobs) == (free.token_ids, free.step_map,
                                                                         free.logprobs)
    assert per_slot.label_mass == pytest.approx({g: math.exp(lp) for g, lp in enumerate(free.logprobs)})
    # one list, the template's slots only: positions past the template take no set
    every = sorted(set(free.token_ids))
    out = sdar.run(prompt, max_new_tokens=11, stop_ids=set(), strategy="sequential", denoising_steps=2,
                   template=[None] * 5, allowed=every)
    assert set(out.label_mass) == set(range(5)) and all(t in every for t in out.token_ids[:5])


def test_sets_confine_the_slots(family):
    """A set the free run's tokens lie outside: every slot takes an id of its set, positions past the
    template are unconstrained, and the masses are probabilities."""
    for knobs in family_rules(family):
        prompt = family.prompt(3)
        free = family.run(prompt, max_new_tokens=12, stop_ids=set(), **knobs)
        every = [t for t in range(40, 60) if t not in free.token_ids[:8]][:5]
        out = family.run(prompt, max_new_tokens=12, stop_ids=set(), template=[None] * 8, allowed=every, **knobs)
        assert all(t in every for t in out.token_ids[:8]), knobs
        assert any(t not in every for t in out.token_ids[8:]), knobs
        assert set(out.label_mass) == set(range(8)) and all(0 < m < 1 for m in out.label_mass.values())


def test_pins_are_revealed_at_step_zero_and_never_edited(llada2):
    """Pinned ids the model would not write, under JointThreshold editing everything it disagrees with
    (edit threshold 0): they stay, at step 0, named by no step of the trace, while other tokens are edited."""
    prompt = llada2.prompt(5)
    template = [None, 97, None, None, 98, 99, None, None, 100, None, 101]
    out = llada2.run(prompt, rule="joint_threshold", max_new_tokens=20, stop_ids=set(), template=template,
                     **FULL_EDITING)
    pinned = [g for g, t in enumerate(template) if t is not None]
    assert [out.token_ids[g] for g in pinned] == [template[g] for g in pinned]
    assert all(out.step_map[g] == 0 and out.logprobs[g] == 0.0 for g in pinned)
    written = [g for event in out.trace for g in event["positions"]]
    assert not set(written) & set(pinned)
    assert len(written) > len(set(written)), "the decoding edits tokens"


def test_a_fully_pinned_block_takes_no_step(family, monkeypatch):
    """A block whose every generated position is pinned costs no step (and no forward of its own): the
    next block's steps follow the previous block's."""
    b = family.block
    prompt = family.prompt(b)  # blocks start at output positions 0, b, 2b
    template = [None] * b + list(range(60, 60 + b))
    free = family.run(prompt, max_new_tokens=3 * b, stop_ids=set())
    forwards = record_forwards(family, monkeypatch)
    out = family.run(prompt, max_new_tokens=3 * b, stop_ids=set(), template=template)
    if family.name != "fast":  # Fast-dLLM's next block inherits its first token from a forward over it
        assert len(prompt) + 2 * b not in {len(ids) for ids in forwards}
    assert out.token_ids[: 2 * b] == free.token_ids[:b] + template[b:]
    assert out.step_map[:b] == free.step_map[:b] and out.step_map[b : 2 * b] == [0] * b
    assert min(out.step_map[2 * b :]) == max(out.step_map[:b]) + 1


@pytest.mark.parametrize("where", ["first block", "later block"])
def test_a_pinned_stop_id_ends_the_output(family, where):
    stop = min(family.eos)
    g = 2 if where == "first block" else family.block + 3
    prompt = family.prompt(3)
    out = family.run(prompt, max_new_tokens=3 * family.block, stop_ids=family.eos,
                     template=[None] * g + [stop])
    assert out.finish_reason == "stop" and len(out.token_ids) == g + 1
    assert out.token_ids[-1] == stop and out.step_map[-1] == 0


# ---- reads -------------------------------------------------------------------------------------


def test_read_returns_the_template_and_ignores_stop_ids(family):
    """A read returns exactly the template's positions, finish reason "read", whatever the stop ids
    and max_new_tokens, and with a step budget no block needs it is the free decoding cut there."""
    for knobs in family_rules(family):
        prompt = family.prompt(3)
        free = family.run(prompt, max_new_tokens=2 * family.block + 2, stop_ids=set(), **knobs)
        template = [None] * (family.block + 4)
        read = family.run(prompt, max_new_tokens=40, stop_ids=set(free.token_ids), template=template,
                          read_steps=99, **knobs)
        n = len(template)
        assert read.finish_reason == "read" and len(read.token_ids) == n, knobs
        assert (read.token_ids, read.step_map, read.logprobs) == (free.token_ids[:n], free.step_map[:n],
                                                                 free.logprobs[:n]), knobs


def test_one_step_read_inside_one_block_is_one_forward(family, monkeypatch):
    """A read of slots inside the prompt's block, k = 1: one step (1) and one forward reveal them all,
    each the argmax of its row within its set with its raw logprob; the pinned positions after them,
    in later blocks too, cost nothing."""
    b = family.block
    prompt = family.prompt(b if family.name == "sdar" else b + 3)  # no inherited step: the block holds g 0..3
    every = list(range(40, 80))
    template = [None, 41, None, None, *range(50, 50 + b)]
    forwards = record_forwards(family, monkeypatch)
    read = family.run(prompt, max_new_tokens=len(template), stop_ids=set(), template=template, allowed=every,
                      read_steps=1)
    slots = [0, 2, 3]
    assert read.finish_reason == "read" and len(read.token_ids) == len(template)
    assert read.step_map == [1 if g in slots else 0 for g in range(len(template))]
    assert [read.token_ids[g] for g in range(len(template)) if g not in slots] == [t for t in template if t]
    assert set(read.label_mass) == set(slots)
    assert len(forwards) == 1
    for g in slots:
        row = family.proposer(forwards[0], len(prompt) + g)
        assert read.token_ids[g] == every[int(row[every].argmax())]
        assert read.logprobs[g] == pytest.approx(float(torch.log_softmax(row, -1)[read.token_ids[g]]), abs=1e-6)
        assert read.label_mass[g] == pytest.approx(float(torch.softmax(row, -1)[every].sum()), abs=1e-6)


def test_read_step_budget_in_the_last_slots_block(family):
    """k = 2 over slots spanning two blocks: the blocks before the last slot's decode as usual, the last
    slot's block takes at most two steps, and its second step reveals every slot it still masks."""
    for knobs in family_rules(family):
        prompt = family.prompt(3)
        b = family.block
        first = b - 3  # output positions of the prompt's block
        n = first + b - 1  # the last slot lies in the second block
        free = family.run(prompt, max_new_tokens=2 * b, stop_ids=set(), **knobs)
        read = family.run(prompt, max_new_tokens=n, stop_ids=set(), template=[None] * n, read_steps=2, **knobs)
        assert len(read.token_ids) == n and family.mask_id not in read.token_ids
        assert (read.token_ids[:first], read.step_map[:first]) == (free.token_ids[:first], free.step_map[:first])
        inherited = family.name == "fast"  # block 2 starts with an inherited step that k does not count
        before = max(free.step_map[:first])
        assert all(before < step <= before + 2 + inherited for step in read.step_map[first:]), knobs
