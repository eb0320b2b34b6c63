"""The LLaDA2 family (`llada2_moe`): the published configs build the right model, the network and
both decoding rules (LowConfidence, JointThreshold token editing) equal the full-recompute reference
of testing/references/llada2_moe.py, and bad knobs are refused by name."""

from __future__ import annotations

import json
import math

import pytest
import torch
from pydantic import ValidationError

from configs import EngineConfig
from engine import GenerationConfig, pipeline
from engine.errors import RequestError
from engine.model.checkpoint import CheckpointError, load_model_spec
from engine.model.families import build_network
from engine.model.layers.parallel import TPContext
from engine.model.loading import checkpoint_names
from testing.references.llada2_moe import LLaDA2Reference, reference_generate
from testing.tiny_llada2 import write_tiny_llada2
from tests.support.llada2 import JOINT, TOL, assert_equal, prompt_of
from tests.support.ranks import gloo_rank
from tools.published_checkpoints import PUBLISHED as RELEASES

LENGTHS = (1, 3, 31, 32, 35)  # crossing the block boundary of B = 32
# a token these decodings write often (and JointThreshold sometimes edits away): the stop id of the cases
STOP = {"low_confidence": 241, "joint_threshold": 155}

PUBLISHED = {name: cfg for name, cfg in RELEASES.items() if cfg["model_type"] == "llada2_moe"}


@pytest.fixture(scope="module")
def llada2(tmp_path_factory):
    path = write_tiny_llada2(tmp_path_factory.mktemp("llada2"), use_qkv_bias=True, use_bias=True, seed=0)
    ref = LLaDA2Reference(path)
    with pipeline(str(path), EngineConfig(logprobs_mode="raw_logprobs", max_model_len=512)) as pipe:
        yield path, ref, pipe


def _reference(ref: LLaDA2Reference, pipe, prompt: list[int], max_new: int, rule: str, **knobs):
    return reference_generate(ref, prompt, rule=rule, block_length=32, mask_id=pipe.engine.decoding.mask_id,
                              max_new_tokens=max_new, stop_ids={*pipe.engine.spec.eos_token_ids, STOP[rule]},
                              threshold=0.95, **knobs)


# ---- the published configurations -------------------------------------------------------------


@pytest.mark.parametrize("name", PUBLISHED)
def test_published_config_builds_the_model(tmp_path, name):
    """Reduced depth (a dense first layer, one routed layer), the published widths, on the meta device."""
    cfg = dict(PUBLISHED[name], num_hidden_layers=2)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec = load_model_spec(tmp_path)
    extra = spec.extra
    assert (spec.head_dim, extra.rotary_dim, spec.rope_theta) == (128, 64, cfg["rope_theta"])
    assert (extra.n_group, extra.topk_group, extra.num_shared_experts, extra.routed_scaling_factor) == (8, 4, 1, 2.5)
    assert spec.family.default_block_length == 32 and spec.max_position_embeddings == cfg["max_position_embeddings"]
    assert spec.family.decoding_defaults == {"dllm_confidence_threshold": 0.95,
                                              "dllm_unmasking_strategy": "low_confidence_dynamic"}
    h, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    for tp in (1, 2):
        with torch.device("meta"):
            model = build_network(spec, TPContext(rank=0, size=tp))
        params = dict(model.named_parameters())
        assert params["model.layers.0.attention.query_key_value.weight"].shape == ((heads + 2 * kv) * 128 // tp, h)
        assert params["model.layers.0.mlp.gate_proj.weight"].shape == (cfg["intermediate_size"] // tp, h)
        assert params["model.layers.1.mlp.w13"].shape == (256, 2 * cfg["moe_intermediate_size"] // tp, h)
        assert params["model.layers.1.mlp.shared_experts.down_proj.weight"].shape == (
            h, cfg["moe_intermediate_size"] // tp)
        names = checkpoint_names(model)
        assert "model.word_embeddings.weight" in names and "model.layers.1.mlp.gate.expert_bias" in names
        assert "model.layers.1.mlp.experts.255.down_proj.weight" in names


@pytest.mark.parametrize("field,value", [("norm_head", True), ("score_function", "softmax"),
                                         ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}), ("n_group", 3),
                                         ("partial_rotary_factor", 0.01), ("hidden_act", "gelu")])
def test_fields_it_does_not_compute_are_refused_by_name(tmp_path, field, value):
    (tmp_path / "config.json").write_text(json.dumps({**PUBLISHED["LLaDA2.0-mini"], field: value}))
    with pytest.raises(CheckpointError, match=field):
        load_model_spec(tmp_path)


# ---- decoding equals the reference ------------------------------------------------------------


def test_low_confidence_equals_reference_batched_and_alone(llada2):
    """SGLang's LowConfidence is the family's default: t = 0.95, S = B = 32."""
    _, ref, pipe = llada2
    assert pipe.engine.block_length == 32 and pipe.engine.config.dllm_confidence_threshold == 0.95
    prompts = [prompt_of(n, n) for n in LENGTHS]
    cases = [(p, m) for m in (5, 40) for p in prompts]
    stop = [STOP["low_confidence"]]
    outs = pipe([p for p, _ in cases], [GenerationConfig(max_new_tokens=m, logprobs=0, stop_token_ids=stop)
                                        for _, m in cases])
    alone = [pipe(p, GenerationConfig(max_new_tokens=40, logprobs=0, stop_token_ids=stop)) for p in prompts[::2]]
    for (prompt, max_new), out in zip(cases, outs, strict=True):
        assert_equal(out, _reference(ref, pipe, prompt, max_new, "low_confidence"), (len(prompt), max_new))
    for prompt, out in zip(prompts[::2], alone, strict=True):
        assert_equal(out, _reference(ref, pipe, prompt, 40, "low_confidence"), len(prompt))
    assert {o.finish_reason for o in outs} == {"stop", "length"}


@pytest.mark.parametrize("variant", JOINT)
def test_joint_threshold_equals_reference(llada2, variant):
    """Tokens, step_map (last write), finish reasons, logprobs (raw, at the last write) and the step trace
    (every reveal and edit) equal the reference's; replaying the trace gives the output."""
    _, ref, pipe = llada2
    knobs = JOINT[variant]
    prompts = [prompt_of(n, n) for n in LENGTHS]
    cases = [(p, m) for m in (5, 40) for p in prompts]
    params = [GenerationConfig(max_new_tokens=m, logprobs=0, return_step_trace=True,
                               stop_token_ids=[STOP["joint_threshold"]],
                               dllm_unmasking_strategy="joint_threshold", dllm_edit_threshold=knobs["edit_threshold"],
                               dllm_max_post_edit_steps=knobs["max_post_edit_steps"],
                               dllm_penalty_lambda=knobs["penalty_lambda"]) for _, m in cases]
    outs = pipe([p for p, _ in cases], params)
    edited = 0
    for (prompt, max_new), out in zip(cases, outs, strict=True):
        want = _reference(ref, pipe, prompt, max_new, "joint_threshold", **knobs)
        assert_equal(out, want, (variant, len(prompt), max_new))
        assert out.step_trace == want.trace, (variant, len(prompt), max_new)
        replay: dict[int, tuple[int, int]] = {}
        for event in out.step_trace:
            for g, token in zip(event["positions"], event["token_ids"], strict=True):
                edited += g in replay
                replay[g] = (token, event["step"])
        assert [replay[g] for g in range(len(out.token_ids))] == list(zip(out.token_ids, out.step_map, strict=True))
    assert edited > 0, "the cases edit tokens"


@pytest.mark.parametrize("sampled", [False, True])
def test_joint_threshold_alone_equals_batched(llada2, sampled):
    """Greedy, and sampled with a seed (every row of the block drawn as block diffusion draws): a request
    decodes the same alone and in a batch."""
    _, _, pipe = llada2
    params = GenerationConfig(max_new_tokens=40, logprobs=0, dllm_unmasking_strategy="joint_threshold",
                              dllm_edit_threshold=0.6, dllm_max_post_edit_steps=4, dllm_penalty_lambda=1.0,
                              do_sample=sampled, temperature=0.8, top_k=20, random_seed=7)
    prompts = [prompt_of(n, n) for n in (3, 35)]
    out = pipe(prompts, params)[1]
    one = pipe(prompts[1], params)
    assert (one.token_ids, one.step_map, one.finish_reason) == (out.token_ids, out.step_map, out.finish_reason)
    assert [e[t] for e, t in zip(one.logprobs, one.token_ids, strict=True)] == pytest.approx(
        [e[t] for e, t in zip(out.logprobs, out.token_ids, strict=True)], abs=TOL)


# ---- refusals ---------------------------------------------------------------------------------


@pytest.mark.parametrize("field,value", [("dllm_edit_threshold", 1.5), ("dllm_edit_threshold", -0.1),
                                         ("dllm_max_post_edit_steps", -1), ("dllm_penalty_lambda", math.nan),
                                         ("dllm_penalty_lambda", -1.0), ("dllm_unmasking_strategy", "JointMagic")])
def test_bad_knobs_are_refused_by_name(field, value):
    with pytest.raises(ValidationError, match=field):
        GenerationConfig(**{field: value})


def test_editing_knobs_need_an_editing_rule(llada2):
    _, _, pipe = llada2
    with pytest.raises(RequestError, match="dllm_edit_threshold"):
        pipe([1, 2], GenerationConfig(max_new_tokens=4, dllm_edit_threshold=0.5))


def test_editing_knobs_are_refused_on_autoregressive_models(ar_ckpt):
    with pipeline(ar_ckpt, EngineConfig(max_model_len=64)) as pipe:
        for field, value in (("dllm_edit_threshold", 0.5), ("dllm_max_post_edit_steps", 2),
                             ("dllm_penalty_lambda", 1.0)):
            with pytest.raises(RequestError, match=field):
                pipe([1, 2], GenerationConfig(max_new_tokens=2, **{field: value}))


def test_trajectory_scoring_is_refused_under_editing(llada2):
    _, _, pipe = llada2
    params = GenerationConfig(max_new_tokens=0, logprobs=0, dllm_unmasking_strategy="joint_threshold",
                              dllm_trajectory={"output_ids": [5, 6], "step_map": [1, 2]})
    with pytest.raises(RequestError, match="dllm_trajectory"):
        pipe([1, 2, 3], params)


def test_sglang_dllm_algorithm_flags(tmp_path):
    from deployments.cli import app_args, build_parser

    algo = tmp_path / "algo.yaml"
    algo.write_text("threshold: 0.9\nedit_threshold: 0.6\nmax_post_edit_steps: 4\npenalty_lambda: 1.0\n"
                    "block_size: 32\n")
    argv = ["serve", "ckpt", "--dllm-algorithm", "JointThreshold", "--dllm-algorithm-config", str(algo),
            "--dllm-confidence-threshold", "0.8"]
    engine = app_args(build_parser().parse_args(argv))["engine"]
    assert EngineConfig(**engine).model_dump(include=set(engine)) == {
        "dllm_unmasking_strategy": "joint_threshold", "dllm_confidence_threshold": 0.8, "dllm_edit_threshold": 0.6,
        "dllm_max_post_edit_steps": 4, "dllm_penalty_lambda": 1.0, "dllm_block_length": 32}
    low = app_args(build_parser().parse_args(["serve", "ckpt", "--dllm-algorithm", "LowConfidence"]))["engine"]
    # SGLang's LowConfidence with SGLang's default threshold
    assert low == {"dllm_unmasking_strategy": "low_confidence_dynamic", "dllm_confidence_threshold": 0.95}
    algo.write_text("threshold: 0.9\nlambda: 1.0\n")
    with pytest.raises(SystemExit, match="lambda"):
        app_args(build_parser().parse_args(argv))


def _tp_logits(rank: int, size: int, path: str, ids: list[int]) -> torch.Tensor:
    """Rank `rank`'s full logits of one block-causal forward over `ids` (one sequence, pages 0.., no cache hit)."""
    from engine.model.checkpoint import iter_weights
    from engine.model.loading import load_weights
    from ops.attention.base import AttentionMetadata
    from ops.attention.torch_reference import TorchAttention

    spec = load_model_spec(path)
    with torch.device("meta"):
        model = build_network(spec, TPContext(rank, size))
    model.materialize(torch.device("cpu"), torch.float32)
    load_weights(model, iter_weights(path))
    t, page = len(ids), 16
    pages = list(range(-(-t // page)))
    meta = AttentionMetadata(q_lens=[t], kv_lens=[t], positions=torch.arange(t), slot_mapping=torch.arange(t),
                             page_tables=torch.tensor([pages]), page_size=page, dllm_block_length=32,
                             page_table_lists=[pages])
    shape = (2, len(pages), page, spec.num_key_value_heads // size, spec.head_dim)
    caches = [torch.zeros(shape).unbind(0) for _ in range(spec.num_hidden_layers)]
    with torch.inference_mode():
        return model.logits(model(torch.tensor(ids), torch.arange(t), caches, meta, TorchAttention()))


def _tp_rank(rank: int, port: int, path: str, ids: list[int], out: str) -> None:
    with gloo_rank(rank, port):
        logits = _tp_logits(rank, 2, path, ids)
        if rank == 0:
            torch.save(logits, out)


def test_tp2_network_equals_reference(llada2, tmp_path):
    """Two real ranks (gloo): the fused QKV split by head, dense's bias after the all-reduce, experts and
    shared experts split by intermediate dim, vocabulary-split embedding and head."""
    import socket

    import torch.multiprocessing as mp

    path, ref, pipe = llada2
    ids = prompt_of(35, 1) + [pipe.engine.decoding.mask_id] * 29
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / "tp2.pt")
    mp.spawn(_tp_rank, args=(port, str(path), ids, out), nprocs=2)
    want = ref.logits(ids, 32)
    for got in (_tp_logits(0, 1, str(path), ids), torch.load(out)):
        assert torch.allclose(got, want, atol=2e-4, rtol=1e-5), (got - want).abs().max()
