"""LLaDA2.2's block routing (`llada2_moe` with `expert_capacity` and `block_size`): the engine equals
the full-recompute reference (testing/references/llada2_moe.py, which routes every
32-position block of the one sequence it recomputes) on a tiny checkpoint whose capacity (3 of 8
experts) really restricts routing; alone and batched with requests of other lengths (routing blocks
are per request, never over the flattened batch); through chunked prefills and prefix-cache hits;
and what it cannot compute is refused by name."""

from __future__ import annotations

import json

import pytest
import torch

from configs import EngineConfig
from engine import GenerationConfig, pipeline
from engine.model.checkpoint import CheckpointError, load_model_spec
from engine.model.families import build_network
from engine.model.families.llada2_moe.block_routing import check_segments
from engine.model.layers.parallel import TPContext
from engine.model.loading import checkpoint_names
from ops.attention.base import AttentionMetadata
from testing.references.llada2_moe import LLaDA2Reference, reference_generate
from testing.tiny_llada2 import write_tiny_llada2
from tests.support.llada2 import JOINT, assert_equal, prompt_of
from tools.published_checkpoints import PUBLISHED, write_published_config

LENGTHS = (1, 31, 32, 33, 70)  # below, at and across the routing blocks of 32
CAPACITY = 3  # of 8 experts, top-2 each
STOP = {"low_confidence": 205, "joint_threshold": 128}  # tokens these decodings write (some requests stop)
LLADA22 = dict(expert_capacity=CAPACITY, rope_theta=3e6, use_qkv_bias=True, use_bias=True, seed=0)


def _config(**overrides) -> EngineConfig:
    return EngineConfig(logprobs_mode="raw_logprobs", max_model_len=512, **overrides)


@pytest.fixture(scope="module")
def llada22(tmp_path_factory):
    path = write_tiny_llada2(tmp_path_factory.mktemp("llada22"), **LLADA22)
    with pipeline(str(path), _config()) as pipe:
        yield path, LLaDA2Reference(path), pipe


def _reference(ref: LLaDA2Reference, pipe, prompt: list[int], max_new: int, rule: str, **knobs):
    return reference_generate(ref, prompt, rule=rule, block_length=32, mask_id=pipe.engine.decoding.mask_id,
                              max_new_tokens=max_new, stop_ids={*pipe.engine.spec.eos_token_ids, STOP[rule]},
                              threshold=0.95, **knobs)


def _params(rule: str, max_new: int, **knobs) -> GenerationConfig:
    if rule == "low_confidence":
        return GenerationConfig(max_new_tokens=max_new, logprobs=0, stop_token_ids=[STOP[rule]])
    return GenerationConfig(max_new_tokens=max_new, logprobs=0, stop_token_ids=[STOP[rule]],
                            dllm_unmasking_strategy="joint_threshold", dllm_edit_threshold=knobs["edit_threshold"],
                            dllm_max_post_edit_steps=knobs["max_post_edit_steps"],
                            dllm_penalty_lambda=knobs["penalty_lambda"])


def test_the_checkpoint_routes_per_block(llada22):
    _, _, pipe = llada22
    extra = pipe.engine.spec.extra
    assert (extra.expert_capacity, extra.routing_block, extra.num_experts) == (CAPACITY, 32, 8)
    assert pipe.engine.spec.block_size == pipe.engine.block_length == 32


# ---- decoding equals the reference ------------------------------------------------------------


@pytest.mark.parametrize("rule,knobs", [("low_confidence", {}), *(("joint_threshold", k) for k in JOINT.values())],
                         ids=["low_confidence", *(f"joint_threshold-{v}" for v in JOINT)])
def test_decoding_equals_reference_batched_and_alone(llada22, rule, knobs):
    """Tokens, step_map, finish reasons and raw logprobs (the logits of every step that wrote a token):
    the ten requests of every length together, then the odd lengths each alone."""
    _, ref, pipe = llada22
    cases = [(prompt_of(n, n), m) for m in (5, 40) for n in LENGTHS]
    outs = pipe([p for p, _ in cases], [_params(rule, m, **knobs) for _, m in cases])
    alone = [(p, m, pipe(p, _params(rule, m, **knobs))) for p, m in cases[len(LENGTHS):][::2]]
    for (prompt, max_new), out in [*zip(cases, outs, strict=True), *(((p, m), o) for p, m, o in alone)]:
        assert_equal(out, _reference(ref, pipe, prompt, max_new, rule, **knobs), (rule, len(prompt), max_new))
    if rule == "low_confidence":
        assert {o.finish_reason for o in outs} == {"stop", "length"}


def _forward_logits(path, sequences: list[list[int]]) -> list[torch.Tensor]:
    """Each sequence's float32 logits of ONE forward over all of them (prefills from position 0, each in
    pages of its own): the flat batch mixes their routing blocks."""
    from engine.model.checkpoint import iter_weights
    from engine.model.loading import load_weights
    from ops.attention.torch_reference import TorchAttention

    spec = load_model_spec(path)
    with torch.device("meta"):
        model = build_network(spec, TPContext())
    model.materialize(torch.device("cpu"), torch.float32)
    load_weights(model, iter_weights(path))
    page, tables, slots, first = 16, [], [], 0
    for ids in sequences:
        tables.append(list(range(first, first + -(-len(ids) // page))))
        slots += [tables[-1][p // page] * page + p % page for p in range(len(ids))]
        first += len(tables[-1])
    width = max(map(len, tables))
    positions = torch.tensor([p for ids in sequences for p in range(len(ids))])
    meta = AttentionMetadata(q_lens=[len(s) for s in sequences], kv_lens=[len(s) for s in sequences],
                             positions=positions, slot_mapping=torch.tensor(slots),
                             page_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]), page_size=page,
                             dllm_block_length=32, page_table_lists=tables)
    shape = (2, first, page, spec.num_key_value_heads, spec.head_dim)
    caches = [torch.zeros(shape).unbind(0) for _ in range(spec.num_hidden_layers)]
    with torch.inference_mode():
        logits = model.logits(model(torch.tensor([t for s in sequences for t in s]), positions, caches, meta,
                                    TorchAttention()))
    return list(logits.split(meta.q_lens))


def test_one_forward_over_several_requests_equals_reference(llada22):
    """Three requests of 64, 32 and 96 tokens in one flat batch: each one's logits are its own forward's."""
    path, ref, _ = llada22
    sequences = [prompt_of(n, 100 + n) for n in (64, 32, 96)]
    for ids, logits in zip(sequences, _forward_logits(path, sequences), strict=True):
        torch.testing.assert_close(logits, ref.logits(ids, 32), atol=1e-4, rtol=1e-4)


def test_the_capacity_restricts_routing(llada22, tmp_path):
    """The same weights with the capacity at every expert (block routing restricting nothing) answer
    otherwise: the engine and the reference both."""
    path, ref, pipe = llada22
    free = write_tiny_llada2(tmp_path, **{**LLADA22, "expert_capacity": 8})
    ids = prompt_of(64, 7)
    assert not torch.allclose(ref.logits(ids, 32), LLaDA2Reference(free).logits(ids, 32), atol=1e-2)
    params = GenerationConfig(max_new_tokens=40, logprobs=0)
    prompts = [prompt_of(n, n) for n in LENGTHS]
    with pipeline(str(free), _config()) as unrestricted:
        assert [o.token_ids for o in pipe(prompts, params)] != [o.token_ids for o in unrestricted(prompts, params)]


# ---- every forward feeds whole routing blocks -------------------------------------------------


def test_chunked_prefills_and_prefix_hits_equal_reference(llada22):
    """Prefill chunks of at most 40 tokens (each ends on a block multiple: 32 here), and a prompt
    prefilled again from the prefix cache (hits of whole blocks), decode as the reference does."""
    path, ref, pipe = llada22
    params = _params("low_confidence", 40)
    prompts = [prompt_of(n, 200 + n) for n in (70, 101)]
    with pipeline(str(path), _config(max_prefill_token_num=40)) as chunked:
        for prompt, out in zip(prompts, chunked(prompts, params), strict=True):
            assert_equal(out, _reference(ref, pipe, prompt, 40, "low_confidence"), ("chunked", len(prompt)))
    hits = pipe.engine.kv.prefix_hit_tokens
    for prompt in prompts * 2:
        want = _reference(ref, pipe, prompt, 40, "low_confidence")
        assert_equal(pipe(prompt, params), want, ("cached", len(prompt)))
    assert pipe.engine.kv.prefix_hit_tokens - hits == 64 + 96


@pytest.mark.parametrize("page_size", [16, 32])
def test_a_prefix_hit_inside_a_block(llada22, page_size):
    """Prompt A cached, prompt B evicting the LRU page (the tail page of A's first block), A again: with
    pages of 16 the 16 cached tokens are half a routing block, so the page manager rounds the hit down
    to whole blocks and the forward feeds whole blocks. Pages of a multiple of 32 never split a block."""
    path, ref, pipe = llada22
    params = _params("low_confidence", 5)
    a, b = prompt_of(40, 1), prompt_of(40, 2)
    with pipeline(str(path), _config(kv_block_size=page_size, num_kv_blocks=-(-80 // page_size))) as small:
        small(a, params)
        small(b, params)
        assert_equal(small(a, params), _reference(ref, pipe, a, 5, "low_confidence"), page_size)


def _meta(q_lens: list[int], kv_lens: list[int], block_length: int = 32) -> AttentionMetadata:
    t = sum(q_lens)
    return AttentionMetadata(q_lens=q_lens, kv_lens=kv_lens, positions=torch.zeros(t, dtype=torch.long),
                             slot_mapping=torch.zeros(t, dtype=torch.long), page_tables=torch.zeros(len(q_lens), 1),
                             page_size=16, dllm_block_length=block_length)


def test_a_segment_covering_part_of_a_block_is_refused():
    """Two requests of 20 and 12 tokens fill 32 rows: one flat block, but no routing block of either."""
    check_segments(_meta([64, 32, 32], [64, 96, 32]), 32)
    for q_lens, kv_lens in (([20, 12], [20, 12]), ([32, 16], [32, 48]), ([48], [64])):
        with pytest.raises(ValueError, match="whole routing blocks of 32"):
            check_segments(_meta(q_lens, kv_lens), 32)


# ---- refusals and the published configuration -------------------------------------------------


@pytest.mark.parametrize("field,value,match", [
    ("expert_capacity", 1, "expert_capacity"), ("expert_capacity", 9, "expert_capacity"),
    ("expert_capacity", "3", "expert_capacity"), ("block_size", None, "block_size"), ("block_size", 0, "block_size"),
    ("delete_token_id", 10**6, "delete_token_id"), ("split_token_id", -1, "split_token_id"),
])
def test_fields_it_cannot_honour_are_refused_by_name(llada22, tmp_path, field, value, match):
    path, _, _ = llada22
    cfg = json.loads((path / "config.json").read_text())
    cfg[field] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=match):
        load_model_spec(tmp_path)


def test_equal_edit_tokens_are_refused(tmp_path):
    cfg = {**PUBLISHED["LLaDA2.2-flash"], "split_token_id": 156930}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="delete_token_id and split_token_id"):
        load_model_spec(tmp_path)


def test_another_block_length_is_refused(llada22):
    path, _, _ = llada22
    with pytest.raises(ValueError, match="dllm_block_length=16.*block_size=32"):
        pipeline(str(path), _config(dllm_block_length=16))


def test_published_llada22_flash(tmp_path):
    """LLaDA2.2-flash at reduced depth: block routing's fields, 128K positions at rope_theta 3e6, the edit
    tokens, both stop ids of generation_config.json; expert groups ignored (even ones that could not route)."""
    path = write_published_config("LLaDA2.2-flash", tmp_path, num_hidden_layers=2)
    spec = load_model_spec(path)
    extra = spec.extra
    assert (extra.expert_capacity, extra.routing_block, spec.block_size) == (48, 32, 32)
    assert (spec.max_position_embeddings, spec.rope_theta, spec.rope_scaling) == (131072, 3e6, None)
    assert (extra.delete_token_id, extra.split_token_id) == (156930, 156931)
    assert spec.eos_token_ids == {156892, 156900}
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "n_group": 3, "topk_group": 9}))
    with torch.device("meta"):
        model = build_network(load_model_spec(path), TPContext(rank=0, size=2))
    assert dict(model.named_parameters())["model.layers.1.mlp.w13"].shape == (256, 1024, 4096)
    assert "model.layers.1.mlp.gate.expert_bias" in checkpoint_names(model)
