"""Released Nemotron-Labs-Diffusion configurations read into the right network: the 8B and 14B
config.json fields (the 8B as released, the 14B's geometry and rope), depth reduced to one layer, built
on the meta device, give exactly the release's 9 * layers + 3 tensor names and shapes; the Llama-4
query factor is 1 below the original context; fields whose values the engine does not compute are
refused by name."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from engine.model.checkpoint import CheckpointError, load_model_spec
from engine.model.families import build_network
from engine.model.families.nemotron_labs_diffusion.config import llama_4_query_scale
from engine.model.loading import checkpoint_names

ROPE = {"rope_type": "yarn", "rope_theta": 1_000_000.0, "factor": 16.0, "original_max_position_embeddings": 16384,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1}
RELEASE_8B = {
    "architectures": ["NemotronLabsDiffusionModel"], "model_type": "nemotron_labs_diffusion",
    "auto_map": {"AutoConfig": "configuration_nemotron_labs_diffusion.NemotronLabsDiffusionConfig",
                 "AutoModel": "modeling_nemotron_labs_diffusion.NemotronLabsDiffusionModel"},
    "vocab_size": 131072, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 34,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 262144,
    "rope_parameters": ROPE, "mask_token_id": 100, "block_size": 32, "dlm_paradigm": "bidirectional",
    "attn_implementation": "sdpa", "ar_loss_weight": 1.0, "dlm_loss_weight": None, "dp_varying_mask_ratio": False,
    "attention_bias": False, "mlp_bias": False, "sliding_window": None, "hidden_act": "silu", "rms_norm_eps": 1e-5,
    "use_cache": False, "torch_dtype": "bfloat16", "tie_word_embeddings": False, "bos_token_id": 1,
    "eos_token_id": 11, "transformers_version": "5.0.0",
}
RELEASE_14B = {**RELEASE_8B, "hidden_size": 5120, "intermediate_size": 16384, "num_hidden_layers": 40,
               "rope_parameters": {**ROPE, "rope_theta": 1e9}}


def write_config(root: Path, cfg: dict, generation: dict | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(cfg))
    if generation is not None:
        (root / "generation_config.json").write_text(json.dumps(generation))
    return root


def released_tensors(cfg: dict) -> dict[str, tuple[int, ...]]:
    d, inter, vocab, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    out = {"encoder.embed_tokens.weight": (vocab, d), "encoder.norm.weight": (d,), "diffusion_head.weight": (vocab, d)}
    for n in range(cfg["num_hidden_layers"]):
        p = f"encoder.layers.{n}."
        out |= {p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                p + "self_attn.q_proj.weight": (q, d), p + "self_attn.k_proj.weight": (kv, d),
                p + "self_attn.v_proj.weight": (kv, d), p + "self_attn.o_proj.weight": (d, q),
                p + "mlp.gate_proj.weight": (inter, d), p + "mlp.up_proj.weight": (inter, d),
                p + "mlp.down_proj.weight": (d, inter)}
    return out


@pytest.mark.parametrize("size", ["8B", "14B"])
def test_release_config_builds_the_released_tensors(tmp_path, size):
    cfg = {**(RELEASE_8B if size == "8B" else RELEASE_14B), "num_hidden_layers": 2}
    spec = load_model_spec(write_config(tmp_path / size, cfg, {"eos_token_id": 11}))
    assert spec.is_dllm and spec.family.predicts_next and spec.family.paradigm == "seeded_block"
    assert (spec.head_dim, spec.qk_norm, spec.attention_bias, spec.tie_word_embeddings) == (128, False, False, False)
    assert (spec.block_size, spec.mask_token_id, spec.eos_token_ids) == (32, 100, {11})
    assert spec.rope_theta == cfg["rope_parameters"]["rope_theta"]
    scaling = spec.rope_scaling
    assert (scaling.factor, scaling.original_max_position_embeddings, scaling.attention_factor) == (16.0, 16384, 1.0)
    assert (spec.extra.llama_4_scaling_beta, spec.extra.original_max_position_embeddings) == (0.1, 16384)
    with torch.device("meta"):
        model = build_network(spec)
    params = dict(model.named_parameters())
    want = released_tensors(cfg)
    assert sorted(checkpoint_names(model)) == sorted(want) and len(want) == 9 * 2 + 3
    assert {name: tuple(p.shape) for name, p in params.items()} == want


def test_llama_4_query_factor():
    positions = torch.tensor([0, 1, 31, 32, 16383, 16384, 32767, 32768, 49152])
    got = llama_4_query_scale(positions, 0.1, 16384)
    want = [1.0] * 5 + [1 + 0.1 * math.log(2)] * 2 + [1 + 0.1 * math.log(3)] + [1 + 0.1 * math.log(4)]
    torch.testing.assert_close(got, torch.tensor(want), atol=1e-7, rtol=0)
    assert bool((got[:5] == 1).all()), "exactly 1 inside the original context"


@pytest.mark.parametrize(("field", "value"), [
    ("dlm_paradigm", "block_diff"),
    ("sliding_window", 4096),
    ("attention_bias", True),
    ("mlp_bias", True),
    ("tie_word_embeddings", True),
    ("hidden_act", "gelu"),
    ("mask_token_id", 131072),
    ("mask_token_id", -1),
    ("rope_parameters", {**ROPE, "rope_type": "longrope"}),
])
def test_fields_not_honoured_are_refused_by_name(tmp_path, field, value):
    cfg = {**RELEASE_8B, "num_hidden_layers": 1, field: value}
    with pytest.raises(CheckpointError, match=field):
        load_model_spec(write_config(tmp_path / "cfg", cfg))


def test_query_scaling_without_its_context_is_refused(tmp_path):
    rope = {k: v for k, v in ROPE.items() if k != "original_max_position_embeddings"}
    cfg = {**RELEASE_8B, "num_hidden_layers": 1, "rope_parameters": {**rope, "rope_type": "default"}}
    with pytest.raises(CheckpointError, match="llama_4_scaling_beta .*original_max_position_embeddings"):
        load_model_spec(write_config(tmp_path / "cfg", cfg))
