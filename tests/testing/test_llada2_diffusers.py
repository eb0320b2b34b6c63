"""A second, independent reference for the LLaDA2 decoding loop: diffusers' `LLaDA2Pipeline` (with its
`BlockRefinementScheduler`), run over the full-recompute network of testing/references/llada2_moe.py, gives
the tokens that reference's own loop gives, on the cases both define: greedy, no λ penalty, the
output ending on a block boundary (diffusers masks the positions past it) and at least a block long
(diffusers caps its steps per block at the output's length, so a shorter output reveals more than one
token a step), no early stop.

Where they differ by design, the engine follows SGLang: diffusers disables editing at edit threshold 0
(SGLang: edit everything that changed). Their post-edit budgets count one apart: diffusers applies the
edits of the step that exceeds `max_post_steps` before ending the block, SGLang ends the block at that
step writing nothing, so diffusers' `max_post_steps=m` decodes what SGLang's `max_post_edit_steps=m+1`
does, blocks that run out of budget included."""

from __future__ import annotations

import json
import random
import types

import pytest
import torch

from bench.llada2 import run_diffusers
from testing.references.llada2_moe import LLaDA2Reference, reference_generate
from testing.tiny_llada2 import MASK_TEXT, write_tiny_llada2

B = 32


class _Network(torch.nn.Module):
    """The reference network under the call diffusers makes: `model(x, attention_mask, position_ids).logits`
    (x spans whole blocks: the reference's block-causal mask is the model's own)."""

    def __init__(self, ref: LLaDA2Reference):
        super().__init__()
        self.ref = ref
        self.device, self.dtype = torch.device("cpu"), torch.float32  # what the pipeline asks its modules

    def forward(self, x: torch.Tensor, attention_mask=None, position_ids=None) -> types.SimpleNamespace:
        return types.SimpleNamespace(logits=torch.stack([self.ref.logits(row.tolist(), B) for row in x]))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = write_tiny_llada2(tmp_path_factory.mktemp("llada2_diffusers"), use_qkv_bias=True, use_bias=True, seed=0)
    added = json.loads((path / "tokenizer.json").read_text())["added_tokens"]
    mask_id = next(t["id"] for t in added if t["content"] == MASK_TEXT)
    return LLaDA2Reference(path), mask_id


def _diffusers(ref: LLaDA2Reference, mask_id: int, prompt: list[int], gen: int, edit_threshold: float | None,
               max_post_steps: int = 16) -> list[int]:
    return run_diffusers(_Network(ref), [prompt], gen, mask_id, edit_threshold, max_post_steps)[0]


def _prompt(n: int) -> list[int]:
    return [random.Random(n).randrange(300) for _ in range(n)]


def _output_length(n: int) -> int:
    """At least one block, ending on a block boundary, after a prompt of n tokens."""
    return B + -n % B


@pytest.mark.parametrize("rule,edit_threshold", [("low_confidence", None), ("joint_threshold", 0.9)])
def test_reference_loop_equals_diffusers_pipeline(reference, rule, edit_threshold):
    ref, mask_id = reference
    edits = 0
    for n in (3, 35):
        gen = _output_length(n)
        knobs = {} if edit_threshold is None else {"edit_threshold": edit_threshold, "max_post_edit_steps": 17}
        want = reference_generate(ref, _prompt(n), rule=rule, block_length=B, mask_id=mask_id, max_new_tokens=gen,
                                  stop_ids=set(), threshold=0.95, **knobs)
        assert _diffusers(ref, mask_id, _prompt(n), gen, edit_threshold) == want.token_ids, (rule, n)
        edits += sum(len(e["positions"]) for e in want.trace) - len(want.token_ids)
    assert rule == "low_confidence" or edits > 0, "the editing cases edit tokens"


def test_diffusers_post_step_budget_m_is_sglangs_m_plus_one(reference):
    """With a budget of one post-edit step blocks run out of it (the same budget on both sides gives
    other tokens), and diffusers' 1 decodes what the reference's 2 does."""
    ref, mask_id = reference
    budget_mattered = False
    for n in (3, 35):
        gen = _output_length(n)
        theirs = _diffusers(ref, mask_id, _prompt(n), gen, 0.5, max_post_steps=1)
        knobs = {"rule": "joint_threshold", "block_length": B, "mask_id": mask_id, "max_new_tokens": gen,
                 "stop_ids": set(), "threshold": 0.95, "edit_threshold": 0.5}
        assert theirs == reference_generate(ref, _prompt(n), max_post_edit_steps=2, **knobs).token_ids, n
        budget_mattered |= theirs != reference_generate(ref, _prompt(n), max_post_edit_steps=1, **knobs).token_ids
    assert budget_mattered, "no block ran out of its post-edit budget: the case checks nothing"


def test_bench_sides_agree_under_low_confidence(tmp_path):
    """bench.llada2's two sides, small: diffusers' loop over the reference network and the engine give the
    same tokens (LowConfidence, one block of prompt, two blocks out)."""
    from bench.llada2 import CountingNetwork
    from engine import EngineConfig, GenerationConfig, pipeline

    path = write_tiny_llada2(tmp_path / "ckpt", seed=1)
    added = json.loads((path / "tokenizer.json").read_text())["added_tokens"]
    mask_id = next(t["id"] for t in added if t["content"] == MASK_TEXT)
    prompt = [random.Random(7).randrange(300) for _ in range(B)]
    net = CountingNetwork(LLaDA2Reference(path))
    theirs = run_diffusers(net, [prompt], 2 * B, mask_id, None)
    with pipeline(str(path), EngineConfig(max_model_len=4 * B, num_kv_blocks=32)) as pipe:
        mine = pipe(prompt, GenerationConfig(max_new_tokens=2 * B, ignore_eos=True))
    assert mine.token_ids == theirs[0] and net.calls > 2
