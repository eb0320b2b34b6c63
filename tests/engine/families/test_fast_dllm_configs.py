"""The published Fast-dLLM v2 configurations (1.5B: tied head; 7B: untied) read into the right network:
every field of their config.json, depth reduced to one layer, built on the meta device (no memory),
must give exactly the Qwen2 tensor names and shapes of the published weights; fields that would
change the math and are not honoured are refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.model.checkpoint import CheckpointError, load_model_spec
from engine.model.families import build_network
from engine.model.loading import checkpoint_names
from tools.published_checkpoints import PUBLISHED as RELEASES

PUBLISHED = {"1.5B": RELEASES["Fast_dLLM_v2_1.5B"], "7B": RELEASES["Fast_dLLM_v2_7B"]}


def qwen2_tensors(cfg: dict) -> dict[str, tuple[int, ...]]:
    """The tensor names and shapes of a published Qwen2-layer checkpoint with `cfg`'s dimensions."""
    d, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    head_dim = d // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    out = {"model.embed_tokens.weight": (vocab, d), "model.norm.weight": (d,)}
    if not cfg["tie_word_embeddings"]:
        out["lm_head.weight"] = (vocab, d)
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        out |= {p + "self_attn.q_proj.weight": (q, d), p + "self_attn.q_proj.bias": (q,),
                p + "self_attn.k_proj.weight": (kv, d), p + "self_attn.k_proj.bias": (kv,),
                p + "self_attn.v_proj.weight": (kv, d), p + "self_attn.v_proj.bias": (kv,),
                p + "self_attn.o_proj.weight": (d, q), p + "mlp.gate_proj.weight": (inter, d),
                p + "mlp.up_proj.weight": (inter, d), p + "mlp.down_proj.weight": (d, inter),
                p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,)}
    return out


def write_config(root: Path, cfg: dict) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(cfg))
    return root


@pytest.mark.parametrize("size", list(PUBLISHED))
def test_published_config_builds_the_published_tensors(tmp_path, size):
    cfg = {**PUBLISHED[size], "num_hidden_layers": 1, "layer_types": ["full_attention"]}
    spec = load_model_spec(write_config(tmp_path / size, cfg))
    assert spec.is_dllm and spec.family.predicts_next and spec.family.paradigm == "sub_block"
    assert (spec.block_size, spec.qk_norm, spec.attention_bias) == (32, False, True)
    assert spec.head_dim == cfg["hidden_size"] // cfg["num_attention_heads"] == 128
    assert spec.eos_token_ids == {151645} and spec.mask_token_id is None and spec.rope_scaling is None
    with torch.device("meta"):
        model = build_network(spec)
    params = dict(model.named_parameters())
    want = qwen2_tensors(cfg)
    assert sorted(checkpoint_names(model)) == sorted(want)
    for name, shape in want.items():
        assert tuple(params[name].shape) == shape, name
    assert model.model.layers[0].self_attn.o_proj.bias is None


@pytest.mark.parametrize(("field", "value"), [
    ("use_sliding_window", True),
    ("layer_types", ["sliding_attention"]),
    ("rope_scaling", {"rope_type": "linear", "factor": 2.0}),
])
def test_fields_not_honoured_are_refused_by_name(tmp_path, field, value):
    cfg = {**PUBLISHED["1.5B"], "num_hidden_layers": 1, field: value}
    with pytest.raises(CheckpointError, match=field):
        load_model_spec(write_config(tmp_path / field, cfg))

