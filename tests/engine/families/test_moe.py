"""Mixture-of-experts models (`qwen3_moe` AR, `sdar_moe` block diffusion) against Hugging Face
`Qwen3MoeForCausalLM`, on tiny checkpoints in the published per-expert layout.

AR: greedy tokens and logprobs vs `generate`, scoring rows vs a full forward. Block diffusion: the
full-recompute reference of testing/references/sdar.py running the HF MoE model under a block-causal mask.
Routing is made decisive (router weights scaled up) so that tokens of one block go to different
experts and a wrong token-to-expert grouping changes the outputs. tp=2 over Ray (gloo) equals tp=1, in
generation and in trajectory scoring.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from configs.trajectory import DllmTrajectory
from engine import EngineConfig, GenerationConfig, pipeline
from engine.model.checkpoint import CheckpointError
from testing.references.sdar import STRATEGIES, block_causal_mask, reference_dllm_generate
from testing.tiny_checkpoint import DLLM_TEST_LOGIT_SCALE, load_hf_reference, write_tiny_checkpoint
from tests.support.ray_env import SERVE_ENGINE
from tests.support.serve import deploy

TOL = 1e-4
NEW_TOKENS = 8
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, router_scale=6.0)


def prompt_of(length: int, seed: int) -> list[int]:
    return torch.randint(0, 320, (length,), generator=torch.Generator().manual_seed(500 + seed)).tolist()


@pytest.fixture(scope="module")
def ar_moe(tmp_path_factory):
    """qwen3_moe, 3 layers, layer 1 dense (`mlp_only_layers`), sharded over 2 files."""
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("qwen3_moe"), model_type="qwen3_moe", seed=60,
                                 logit_scale=2.0, num_hidden_layers=3, mlp_only_layers=(1,), num_shards=2, **MOE)
    hf = load_hf_reference(path)
    hf.generation_config.eos_token_id = None
    return path, hf


@pytest.fixture(scope="module")
def dllm_moe(tmp_path_factory):
    """sdar_moe with every other layer routed (`decoder_sparse_step=2`: layers 1 and 3)."""
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("sdar_moe"), model_type="sdar_moe", seed=62,
                                 logit_scale=DLLM_TEST_LOGIT_SCALE, num_hidden_layers=4, decoder_sparse_step=2,
                                 norm_topk_prob=False, **MOE)
    cfg = json.loads((path / "config.json").read_text())
    gen = json.loads((path / "generation_config.json").read_text())
    return path, load_hf_reference(path), cfg["mask_token_id"], {cfg["eos_token_id"], *gen["eos_token_id"]}


def hf_greedy(hf, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                          return_dict_in_generate=True, output_logits=True)
    return out.sequences[0, len(prompt):].tolist(), torch.stack(out.logits, 1)[0].float().log_softmax(-1)


def test_checkpoint_is_in_the_published_per_expert_layout(ar_moe):
    path, hf = ar_moe
    names = set()
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            names |= set(f.keys())
    assert "model.layers.0.mlp.gate.weight" in names and "model.layers.1.mlp.gate.weight" not in names
    for layer in (0, 2):
        for e in range(MOE["num_experts"]):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                assert f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight" in names
    assert not [n for n in names if "gate_up_proj" in n or n.endswith("experts.down_proj")]
    assert "model.layers.1.mlp.up_proj.weight" in names  # the dense layer
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["num_experts"] == MOE["num_experts"] and cfg["mlp_only_layers"] == [1]
    assert type(hf.model.layers[1].mlp).__name__ == "Qwen3MoeMLP"
    assert type(hf.model.layers[0].mlp).__name__ == "Qwen3MoeSparseMoeBlock"


def test_ar_greedy_and_logprobs_equal_hf(ar_moe):
    path, hf = ar_moe
    prompts = [prompt_of(n, i) for i, n in enumerate((1, 5, 17, 33))]
    with pipeline(str(path), EngineConfig(max_model_len=128, logprobs_mode="raw_logprobs")) as pipe:
        outs = pipe(prompts, GenerationConfig(max_new_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0))
        model = pipe.engine.executor.runner.model
        kinds = [type(layer.mlp).__name__ for layer in model.model.layers]
        stats = model.moe_stats
    assert kinds == ["SparseMoeBlock", "MLP", "SparseMoeBlock"]
    for prompt, out in zip(prompts, outs, strict=True):
        want, logprobs = hf_greedy(hf, prompt, NEW_TOKENS)
        assert out.token_ids == want, len(prompt)
        for step, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
            assert abs(entry[tok] - float(logprobs[step, tok])) < TOL
    # routed work only: every token through exactly top-k experts, never every expert
    assert stats.routed_rows == stats.tokens * MOE["num_experts_per_tok"] > 0


def test_scoring_rows_equal_hf(ar_moe):
    path, hf = ar_moe
    ids, n = prompt_of(40, 9), 6
    with pipeline(str(path), EngineConfig(max_model_len=128, logprobs_mode="raw_logprobs",
                                          max_prefill_token_num=16)) as pipe:
        resp = pipe(ids, GenerationConfig(max_new_tokens=0, logprob_start_len=n, logprobs=3))
    with torch.inference_mode():
        want = hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)[n:-1]
    rows = resp.input_token_logprobs
    assert [t for _, t in rows] == ids[n + 1:]
    target = torch.tensor(ids[n + 1:])[:, None]
    torch.testing.assert_close(torch.tensor([v for v, _ in rows]), want.gather(1, target)[:, 0], atol=TOL, rtol=0)
    top_v, top_i = torch.topk(want, 3, dim=-1)
    assert [[t for _, t in row] for row in resp.input_top_logprobs] == top_i.tolist()


def test_tokens_of_one_block_route_to_different_experts(dllm_moe):
    """The routing the DLLM tests below run under: inside a block, tokens disagree on their experts."""
    _, hf, _, _ = dllm_moe
    ids = prompt_of(16, 3)
    chosen = []  # per routed layer: the experts [T, k] each token went to
    routers = [layer.mlp.gate for layer in hf.model.layers if hasattr(layer.mlp, "gate")]
    hooks = [r.register_forward_hook(lambda _m, _i, out: chosen.append(out[2])) for r in routers]
    try:
        with torch.inference_mode():
            hf(torch.tensor([ids]), attention_mask=block_causal_mask(16, 4))
    finally:
        for h in hooks:
            h.remove()
    assert len(chosen) == 2
    for experts in chosen:
        sets = [frozenset(row) for row in experts.tolist()]
        assert len(set().union(*sets)) >= 4, "tokens spread over several experts"
        for b in range(4):  # in every block, the tokens do not all share one set of experts
            assert len(set(sets[4 * b : 4 * b + 4])) >= 2, experts


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_block_diffusion_equals_reference(dllm_moe, strategy):
    path, hf, mask_id, stop_ids = dllm_moe
    prompts = [prompt_of(n, 20 + n) for n in (3, 8, 9, 14)]
    cfg = EngineConfig(max_model_len=256, num_kv_blocks=128, kv_block_size=8, dllm_block_length=4,
                       dllm_unmasking_strategy=strategy, dllm_denoising_steps=3, logprobs_mode="raw_logprobs")
    with pipeline(str(path), cfg) as pipe:
        outs = pipe(prompts, GenerationConfig(max_new_tokens=13, logprobs=0, random_seed=11))  # seeds `random`
    for prompt, out in zip(prompts, outs, strict=True):
        ref = reference_dllm_generate(hf, prompt, block_length=4, mask_id=mask_id, max_new_tokens=13,
                                      stop_ids=stop_ids, strategy=strategy, denoising_steps=3, threshold=0.85,
                                      seed=11)
        assert out.token_ids == ref.token_ids, (strategy, len(prompt))
        assert out.step_map == ref.step_map, (strategy, len(prompt))
        assert out.finish_reason == ref.finish_reason
        for entry, tok, ref_lp in zip(out.logprobs, out.token_ids, ref.logprobs, strict=True):
            assert abs(entry[tok] - ref_lp) < TOL


def test_tp2_over_ray_equals_tp1(serve_cluster, dllm_moe):
    from ray import serve

    path = dllm_moe[0]
    engine = dict(SERVE_ENGINE, logprobs_mode="raw_logprobs")
    prompts = [prompt_of(n, 40 + n) for n in (5, 11)]
    with pipeline(str(path), EngineConfig(**engine)) as pipe:
        want = pipe(prompts, GenerationConfig(max_new_tokens=14, logprobs=0, return_dllm_replay=True))
    app = deploy(serve_cluster, "sdar_moe_tp2", path, dict(engine, tp=2))
    try:
        handle = serve.get_app_handle(app.name)
        stats = handle.engine_stats.remote().result()
        assert [(s["tp"], s["tp_backend"]) for s in stats] == [(2, "gloo")]
        for prompt, one in zip(prompts, want, strict=True):
            body = {"input_ids": prompt, "max_tokens": 14, "temperature": 0, "return_logprob": True}
            two = handle.generate.remote(body).result()
            assert two["output_ids"] == one.token_ids
            assert two["meta_info"]["step_map"] == one.step_map
            got = [row[0] for row in two["meta_info"]["output_token_logprobs"]]
            assert got == pytest.approx([e[t] for e, t in zip(one.logprobs, one.token_ids, strict=True)], abs=TOL)
        # the tp=1 rollouts' trajectories scored at tp=2, both in one call: the values tp=1 logged
        body = {"input_ids": prompts, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
                "dllm_trajectory": [DllmTrajectory.from_response(o).model_dump(exclude_none=True) for o in want]}
        scored = handle.generate.remote(body).result()
        for got, one in zip(scored, want, strict=True):
            assert got["output_ids"] == one.token_ids and got["meta_info"]["step_map"] == one.step_map
            values = [row[0] for row in got["meta_info"]["output_token_logprobs"]]
            assert values == pytest.approx([e[t] for e, t in zip(one.logprobs, one.token_ids, strict=True)], abs=TOL)
    finally:
        serve.delete(app.name)


# ---- refused at load --------------------------------------------------------------------------


def _rewrite_without(path: Path, name: str) -> None:
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
            metadata = f.metadata()
        if name in tensors:
            del tensors[name]
            save_file(tensors, str(file), metadata=metadata)
            return
    raise AssertionError(f"{name} not in the checkpoint")


def test_missing_expert_tensor_is_named(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "m", model_type="qwen3_moe", seed=64, num_hidden_layers=2, **MOE)
    _rewrite_without(path, "model.layers.1.mlp.experts.5.up_proj.weight")
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.experts\.5\.up_proj\.weight"):
        pipeline(str(path))


def test_top_k_above_num_experts_is_refused(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "m", model_type="sdar_moe", seed=63, num_hidden_layers=2, **MOE)
    cfg = json.loads((path / "config.json").read_text())
    cfg["num_experts_per_tok"] = MOE["num_experts"] + 1
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="num_experts_per_tok"):
        pipeline(str(path))
