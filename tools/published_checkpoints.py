"""Reduced-depth random checkpoints of published model configurations, in the real on-disk format.

`PUBLISHED` holds the config.json of releases this engine serves (every field they carry), and
`GENERATION` the generation_config.json fields that change what the engine does (stop ids) where a
release's differ from its config.json; `write_published(name, path, num_hidden_layers)` writes that
configuration with fewer layers and random weights of exactly the published tensor names and shapes
(sharded safetensors with an index, bfloat16 as released), plus the tiny byte-level tokenizer of
testing/tiny/tokenizer.py (`write_published_config`: the same without the weights).
They check that a published configuration loads (names, shapes, the family's fields) and what
loading costs, without downloading anything.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.model.checkpoint import load_model_spec
from engine.model.families import build_network
from engine.model.loading import checkpoint_names, destination
from testing.tiny.tokenizer import build_byte_tokenizer, write_tokenizer

# inclusionAI's LLaDA2 releases (LLaDA2.1 adds nothing that changes the math)
_LLADA2 = {
    "architectures": ["LLaDA2MoeModelLM"], "model_type": "llada2_moe",
    "auto_map": {"AutoConfig": "configuration_llada2_moe.LLaDA2MoeConfig",
                 "AutoModel": "modeling_llada2_moe.LLaDA2MoeModel",
                 "AutoModelForCausalLM": "modeling_llada2_moe.LLaDA2MoeModelLM"},
    "vocab_size": 157184, "head_dim": 128, "hidden_act": "silu", "use_qkv_bias": False, "use_qk_norm": True,
    "use_bias": False, "rms_norm_eps": 1e-06, "norm_head": False, "tie_word_embeddings": False,
    "embedding_dropout": 0.0, "attention_dropout": 0.0, "output_dropout": 0.0, "initializer_range": 0.02,
    "rope_theta": 600000, "use_cache": True, "use_sliding_window": False, "sliding_window": 4096,
    "max_window_layers": 28, "rope_scaling": None, "pad_token_id": 156892, "eos_token_id": 156892,
    "num_experts": 256, "num_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4,
    "routed_scaling_factor": 2.5, "first_k_dense_replace": 1, "output_router_logits": False,
    "partial_rotary_factor": 0.5, "score_function": "sigmoid", "moe_router_enable_expert_bias": True,
    "router_dtype": "fp32", "norm_topk_prob": True, "torch_dtype": "bfloat16",
}
# LLaDA2.2-flash: LLaDA2.0-flash's widths (not checked against the release) with LLaDA2.2's block
# routing (48 experts per block of 32), 128K positions at rope_theta 3e6 and the Insert/Delete edit tokens
_LLADA22_FLASH = {
    **_LLADA2, "hidden_size": 4096, "intermediate_size": 9216, "moe_intermediate_size": 1024,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 4,
    "max_position_embeddings": 131072, "rope_theta": 3000000.0, "expert_capacity": 48, "block_size": 32,
    "delete_token_id": 156930, "split_token_id": 156931,
}
# NVIDIA's Fast-dLLM v2 releases
_FAST_DLLM = {
    "architectures": ["Fast_dLLM_QwenForCausalLM"], "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration.Fast_dLLM_QwenConfig",
                 "AutoModelForCausalLM": "modeling.Fast_dLLM_QwenForCausalLM"},
    "bd_size": 32, "bos_token_id": 151643, "conplemenrary_mask": False, "eos_token_id": 151645, "hidden_act": "silu",
    "initializer_range": 0.02, "max_position_embeddings": 32768, "model_type": "Fast_dLLM_Qwen",
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "sliding_window": None,
    "torch_dtype": "bfloat16", "transformers_version": "4.53.0", "use_cache": True, "use_sliding_window": False,
}
# Google's DiffusionGemma release: the Gemma-4 26B-A4B text stack nested in text_config (in the
# release's form: global_head_dim / num_global_key_value_heads), the canvas length at the root
_SLIDING, _FULL = "sliding_attention", "full_attention"
_DIFFUSION_GEMMA = {
    "architectures": ["DiffusionGemmaForBlockDiffusion"], "model_type": "diffusion_gemma", "canvas_length": 256,
    "boi_token_id": 255999, "eoi_token_id": 258882, "image_token_id": 258880, "initializer_range": 0.02,
    "tie_word_embeddings": True, "dtype": "bfloat16",
    "text_config": {
        "model_type": "diffusion_gemma_text", "vocab_size": 262144, "hidden_size": 2816, "intermediate_size": 2112,
        "num_hidden_layers": 30, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256,
        "num_global_key_value_heads": 2, "global_head_dim": 512, "num_experts": 128, "top_k_experts": 8,
        "moe_intermediate_size": 704, "sliding_window": 1024, "max_position_embeddings": 262144,
        "hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": 30.0, "rms_norm_eps": 1e-06,
        "attention_bias": False, "attention_k_eq_v": True, "enable_moe_block": True, "use_double_wide_mlp": False,
        "num_kv_shared_layers": 0, "hidden_size_per_layer_input": 0, "use_bidirectional_attention": "vision",
        "tie_word_embeddings": True, "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2,
        "layer_types": ([_SLIDING] * 5 + [_FULL]) * 5,
        "rope_parameters": {_SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
                            _FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                    "rope_theta": 1000000.0}},
    },
}
PUBLISHED: dict[str, dict] = {
    "DiffusionGemma-26B-A4B": _DIFFUSION_GEMMA,
    "LLaDA2.0-mini": {**_LLADA2, "hidden_size": 2048, "intermediate_size": 5120, "moe_intermediate_size": 512,
                      "num_hidden_layers": 20, "num_attention_heads": 16, "num_key_value_heads": 4,
                      "max_position_embeddings": 16384},
    "LLaDA2.1-mini": {**_LLADA2, "hidden_size": 2048, "intermediate_size": 5120, "moe_intermediate_size": 512,
                      "num_hidden_layers": 20, "num_attention_heads": 16, "num_key_value_heads": 4,
                      "max_position_embeddings": 32768},
    "LLaDA2.0-flash": {**_LLADA2, "hidden_size": 4096, "intermediate_size": 9216, "moe_intermediate_size": 1024,
                       "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 4,
                       "max_position_embeddings": 16384},
    "LLaDA2.2-flash": _LLADA22_FLASH,
    "Fast_dLLM_v2_1.5B": {**_FAST_DLLM, "hidden_size": 1536, "intermediate_size": 8960, "num_attention_heads": 12,
                          "num_key_value_heads": 2, "num_hidden_layers": 28, "max_window_layers": 21,
                          "tie_word_embeddings": True, "vocab_size": 151936},
    "Fast_dLLM_v2_7B": {**_FAST_DLLM, "hidden_size": 3584, "intermediate_size": 18944, "num_attention_heads": 28,
                        "num_key_value_heads": 4, "num_hidden_layers": 28, "max_window_layers": 28,
                        "tie_word_embeddings": False, "vocab_size": 152064},
}

GENERATION: dict[str, dict] = {"LLaDA2.2-flash": {"eos_token_id": [156892, 156900]}}


def _with_depth(config: dict, num_hidden_layers: int) -> dict:
    """`config` with `num_hidden_layers` layers (where a multimodal layout nests them: in its
    text_config); a list of layer types keeps its first layers and its last one (a full-attention one)."""
    text = dict(config.get("text_config", config))
    text["num_hidden_layers"] = num_hidden_layers
    if "layer_types" in text:
        text["layer_types"] = text["layer_types"][: num_hidden_layers - 1] + text["layer_types"][-1:]
    return {**config, "text_config": text} if "text_config" in config else text


def write_published_config(name: str, path: str | Path, num_hidden_layers: int) -> Path:
    """Release `name`'s config.json with `num_hidden_layers` layers, its generation_config.json (where
    `GENERATION` has one) and the tiny tokenizer, in `path` (created); returns it."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = _with_depth(PUBLISHED[name], num_hidden_layers)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    if name in GENERATION:
        (path / "generation_config.json").write_text(json.dumps(GENERATION[name], indent=2))
    write_tokenizer(build_byte_tokenizer(), path, config.get("text_config", config)["max_position_embeddings"])
    return path


def write_published(name: str, path: str | Path, num_hidden_layers: int, shard_bytes: int = 1 << 30,
                    seed: int = 0) -> Path:
    """Write release `name` of `PUBLISHED` with `num_hidden_layers` layers and random bfloat16 weights
    (std 0.02) to `path`; returns it. Memory: one shard plus the largest tensor in float32."""
    path = write_published_config(name, path, num_hidden_layers)
    with torch.device("meta"):
        model = build_network(load_model_spec(path))
    params = dict(model.named_parameters(remove_duplicate=False))
    generator = torch.Generator().manual_seed(seed)
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}

    def flush() -> None:
        if shard:
            file = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
            save_file(shard, str(path / file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, file))
            shard.clear()

    size = 0
    for tensor_name in checkpoint_names(model):
        shape = tuple(destination(model, tensor_name, params)[0].shape)
        # one-element tensors are per-layer scalars: 1, as a fresh model has them (a random scale means nothing)
        value = torch.ones(shape) if shape == (1,) else torch.randn(shape, generator=generator) * 0.02
        shard[tensor_name] = value.to(torch.bfloat16)
        size += shard[tensor_name].numel() * 2
        if size >= shard_bytes:
            flush()
            size = 0
    flush()
    total = sum((path / f).stat().st_size for f in set(weight_map.values()))
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return path
