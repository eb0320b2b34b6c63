"""Tiny random checkpoints in the real Hugging Face on-disk format, for tests and local experiments.

`write_tiny_checkpoint` writes a directory exactly like a downloaded Qwen3 / SDAR / Qwen3-MoE /
SDAR-MoE checkpoint: `config.json`, `generation_config.json`, `model.safetensors` (or shards plus
`model.safetensors.index.json`), `tokenizer.json` and `tokenizer_config.json`. Everything is built
offline and deterministically: the tokenizer is byte-level BPE with merges learnt by a fixed
procedure from a built-in text, and the weights come from a seeded `Qwen3ForCausalLM` or
`Qwen3MoeForCausalLM`. MoE experts are stored as published checkpoints store them, one tensor per
expert (`model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight`): transformers 5 fuses them in
memory and `save_pretrained` splits them back on the way out.

`load_hf_reference` loads such a directory (SDAR included -- SDAR uses Qwen3 layers, SDAR-MoE
Qwen3-MoE layers) into Hugging Face `Qwen3ForCausalLM` / `Qwen3MoeForCausalLM`, the oracle that
engine tests compare against; `from_pretrained` fuses the per-expert tensors.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Literal

import torch
import transformers

from testing.tiny.tokenizer import build_byte_tokenizer, reshard, write_tokenizer

# `logit_scale` for DLLM tests: with the other defaults of `write_tiny_checkpoint(model_type="sdar")`
# it spreads greedy confidences at masked positions over (0, 1). Measured with the SDAR reference
# (testing/references/sdar.py), seeds 0-3 x 6 short English/arithmetic prompts, 32 new tokens,
# `low_confidence_dynamic`, B=4, S=4, threshold 0.85 (1238 masked-position confidences): 39 % are
# >= 0.85, median 0.78, 10th percentile 0.44, 90th 0.99. Of 163 full blocks, 32 took 1 step
# (all four above the threshold), 49 took 2, 37 took 3 and 45 took 4 (n_s fallback every step);
# 4 of the 24 generations stopped on an eos id. Tied embeddings: 29 % >= 0.85, median 0.68.
DLLM_TEST_LOGIT_SCALE = 12.0

MODEL_TYPES = ("qwen3", "sdar", "qwen3_moe", "sdar_moe")
_DLLM_ARCHITECTURES = {"sdar": "SDARForCausalLM", "sdar_moe": "SDARMoeForCausalLM"}


def _is_moe(model_type: str) -> bool:
    return model_type.endswith("_moe")


def write_tiny_checkpoint(
    path: str | Path,
    *,
    model_type: Literal["qwen3", "sdar", "qwen3_moe", "sdar_moe"] = "qwen3",
    tie_word_embeddings: bool = False,
    vocab_size: int | None = None,
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 16,
    intermediate_size: int = 128,
    block_size: int = 4,
    max_position_embeddings: int = 4096,
    rope_theta: float = 10000.0,
    initializer_range: float = 0.1,
    seed: int = 0,
    logit_scale: float = 1.0,
    num_shards: int = 1,
    num_experts: int = 8,
    num_experts_per_tok: int = 2,
    moe_intermediate_size: int = 32,
    norm_topk_prob: bool = True,
    mlp_only_layers: tuple[int, ...] = (),
    decoder_sparse_step: int = 1,
    router_scale: float = 1.0,
    rope_scaling: dict | None = None,
) -> Path:
    """Write a tiny random checkpoint to `path` (created if needed) and return it as a `Path`.

    The weights are a `Qwen3ForCausalLM` initialised under `torch.manual_seed(seed)` with std
    `initializer_range` (0.1 rather than Hugging Face's 0.02, so that outputs depend visibly on
    the context), RMSNorm weights jittered around 1, and the final norm multiplied by
    `logit_scale` -- which multiplies every logit by it, tied or not. The `lm_head` rows of
    `<|MASK|>` and of the padding ids past the tokenizer are zero (with tied embeddings, the
    embedding rows too), so greedy decoding never produces them. When tied, `lm_head.weight` is
    not stored. `vocab_size` defaults to the tokenizer length rounded up to a multiple of 64.
    For `model_type="sdar"` / `"sdar_moe"`, config.json names `SDARForCausalLM` /
    `SDARMoeForCausalLM` and carries `block_size` and `mask_token_id`; tensor names stay Qwen3's /
    Qwen3-MoE's. The MoE types take the Qwen3-MoE fields (`num_experts`, `num_experts_per_tok`,
    `moe_intermediate_size`, `norm_topk_prob`, `mlp_only_layers`, `decoder_sparse_step`); their
    router weights are multiplied by `router_scale` (large values make routing decisive, so
    neighbouring tokens pick different experts). `rope_scaling` (e.g. YaRN) goes into config.json
    as published Qwen3 configs carry it. `num_shards > 1` splits the weights into that many
    `model-0000k-of-0000n.safetensors` files plus `model.safetensors.index.json`.
    """
    if model_type not in MODEL_TYPES:
        raise ValueError(f"model_type must be one of {MODEL_TYPES}, got {model_type!r}")
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "model.safetensors.index.json").unlink(missing_ok=True)  # stale from an earlier write

    hf_tok = build_byte_tokenizer()
    if vocab_size is None:
        vocab_size = -(-len(hf_tok) // 64) * 64
    if vocab_size < len(hf_tok):
        raise ValueError(f"vocab_size={vocab_size} is smaller than the tokenizer ({len(hf_tok)} tokens)")
    eos_id = hf_tok.convert_tokens_to_ids("<|endoftext|>")
    im_end_id = hf_tok.convert_tokens_to_ids("<|im_end|>")
    mask_id = hf_tok.convert_tokens_to_ids("<|MASK|>")

    moe = dict(num_experts=num_experts, num_experts_per_tok=num_experts_per_tok,
               moe_intermediate_size=moe_intermediate_size, norm_topk_prob=norm_topk_prob,
               mlp_only_layers=list(mlp_only_layers), decoder_sparse_step=decoder_sparse_step)
    rope = {"rope_type": "default", "rope_theta": rope_theta, **(rope_scaling or {})}
    config_class, model_class = _hf_classes(model_type)
    config = config_class(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        initializer_range=initializer_range,
        rope_parameters=rope,
        tie_word_embeddings=tie_word_embeddings,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        bos_token_id=None,
        **(moe if _is_moe(model_type) else {}),
    )
    torch.manual_seed(seed)
    model = model_class(config).to(torch.float32)
    with torch.no_grad():
        # RMSNorm weights away from 1, so an implementation that ignores one of them shows.
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(torch.randn_like(param), alpha=0.2)
        model.model.norm.weight.mul_(logit_scale)  # logits = lm_head(norm(h)): scales them exactly
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):  # the MoE router
                param.mul_(router_scale)
        # Logit 0 for `<|MASK|>` and the padding ids past the tokenizer, so greedy never picks them.
        never = [mask_id, *range(len(hf_tok), vocab_size)]
        model.get_output_embeddings().weight[never] = 0.0
    model.generation_config = transformers.GenerationConfig(
        eos_token_id=[im_end_id, eos_id], pad_token_id=eos_id, bos_token_id=None
    )
    model.save_pretrained(path)
    if num_shards > 1:
        reshard(path, num_shards)

    # Post-process config.json like real checkpoints: top-level rope_theta (and rope_scaling when
    # set), both dtype spellings, and for SDAR the architecture name plus the DLLM constants.
    cfg = json.loads((path / "config.json").read_text())
    cfg["rope_theta"] = rope_theta
    if rope_scaling:  # published Qwen3 configs: `rope_scaling` next to a top-level `rope_theta`
        cfg.pop("rope_parameters", None)
        cfg["rope_scaling"] = dict(rope_scaling)
    cfg["dtype"] = cfg["torch_dtype"] = "float32"
    if "num_local_experts" in cfg:  # transformers 5's spelling; published configs say num_experts
        cfg["num_experts"] = cfg.pop("num_local_experts")
    if model_type in _DLLM_ARCHITECTURES:
        cfg["model_type"] = model_type
        cfg["architectures"] = [_DLLM_ARCHITECTURES[model_type]]
        cfg["block_size"] = block_size
        cfg["mask_token_id"] = mask_id
    (path / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")

    write_tokenizer(hf_tok, path, max_position_embeddings)
    return path


def _hf_classes(model_type: str) -> tuple[type, type]:
    """(config class, causal-LM class) of the Hugging Face model with the same layers."""
    if _is_moe(model_type):
        return transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM
    return transformers.Qwen3Config, transformers.Qwen3ForCausalLM


def load_hf_reference(
    path: str | Path, attn_implementation: str = "eager", dtype: torch.dtype = torch.float32
) -> transformers.PreTrainedModel:
    """Load a checkpoint written by `write_tiny_checkpoint` (any model type) into Hugging Face
    `Qwen3ForCausalLM` (qwen3, sdar) or `Qwen3MoeForCausalLM` (qwen3_moe, sdar_moe): float32 unless
    `dtype` says otherwise, eval mode, eager attention by default (the bench passes "sdpa").

    Eager attention adds a 4D float mask as-is (`scores + mask`), so callers can pass a custom
    `[1, 1, T, T]` additive mask (0 = attend, `torch.finfo(dtype).min` = blocked)."""
    path = Path(path)
    cfg = json.loads((path / "config.json").read_text())
    model_type = "qwen3_moe" if _is_moe(cfg["model_type"]) else "qwen3"
    config_class, model_class = _hf_classes(model_type)
    cfg["model_type"] = model_type
    cfg["architectures"] = [model_class.__name__]
    for key in ("block_size", "mask_token_id", "torch_dtype", "dtype", "transformers_version"):
        cfg.pop(key, None)
    config = config_class(**cfg)
    model = model_class.from_pretrained(
        os.fspath(path), config=config, dtype=dtype, attn_implementation=attn_implementation
    )
    return model.eval()
