"""Tiny random `llada2_moe` checkpoints in inclusionAI's on-disk format, for tests and benches.

`write_tiny_llada2` writes what a downloaded LLaDA2.x directory holds: `config.json` with the
field set of the published releases (`LLaDA2MoeModelLM`, `llada2_moe`), `generation_config.json`,
`model.safetensors` (or shards with an index) under inclusionAI's tensor names, and the tokenizer
files. The tokenizer is testing.tiny.tokenizer's byte-level BPE plus a `<|mask|>` special token, the
tokenizer's mask token (as in the releases, where config.json names no mask id). Transformers has
no class for this family and its published modeling file is remote code, so the weights are drawn
here directly, seeded: every tensor from `torch.manual_seed(seed)` in a fixed order.

`variant` picks the release whose config.json fields are written. "2.0" (the default) and "2.1" write
the same (LLaDA2.1's token editing reads nothing its predecessor's config lacks): routing by expert
groups at rope_theta 600000. "2.2" writes what LLaDA2.2's rules read: block routing
(`expert_capacity`, 4 of the 8 experts unless given, per `block_size` 32 positions), rope_theta 3e6,
and the Insert/Delete edit tokens of `joint_threshold_indel` (`delete_token_id`, `split_token_id`):
two special tokens added to the tokenizer, `<|delete|>` and `<|split|>` (this writer's names), whose
LM head rows are drawn like every other token's so that the model writes them now and then.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken

from testing.tiny.tokenizer import build_byte_tokenizer, reshard, write_tokenizer

MASK_TEXT = "<|mask|>"
DELETE_TEXT, SPLIT_TEXT = "<|delete|>", "<|split|>"  # the "2.2" variant's edit tokens
VARIANTS = ("2.0", "2.1", "2.2")
# Multiplies the final norm (so every logit): spreads greedy confidences at masked positions over
# (0, 1) with the other defaults, so both "above the threshold" and "most confident" unmask.
LLADA2_TEST_LOGIT_SCALE = 12.0


def write_tiny_llada2(
    path: str | Path,
    *,
    variant: str = "2.0",
    hidden_size: int = 64,
    num_hidden_layers: int = 3,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 16,
    intermediate_size: int = 128,
    moe_intermediate_size: int = 32,
    num_experts: int = 8,
    num_experts_per_tok: int = 2,
    n_group: int = 4,
    topk_group: int = 2,
    num_shared_experts: int = 1,
    first_k_dense_replace: int = 1,
    partial_rotary_factor: float = 0.5,
    routed_scaling_factor: float = 2.5,
    expert_capacity: int | None = None,
    block_size: int = 32,
    rope_theta: float | None = None,
    use_qkv_bias: bool = False,
    use_bias: bool = False,
    tie_word_embeddings: bool = False,
    max_position_embeddings: int = 4096,
    initializer_range: float = 0.1,
    logit_scale: float = LLADA2_TEST_LOGIT_SCALE,
    router_scale: float = 4.0,
    seed: int = 0,
    num_shards: int = 1,
    vocab_size: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write a tiny random llada2_moe checkpoint to `path` (created if needed) and return it.

    `variant` ("2.0", "2.1" or "2.2", see the module's doc) picks the release's fields; `rope_theta`
    defaults to the variant's. Weights are normal with std `initializer_range`, norm weights jittered
    around 1, the router's weights scaled by `router_scale` and its expert bias drawn too (so the bias
    changes which experts run), the final norm scaled by `logit_scale`; the LM head rows of `<|mask|>`
    and of the padding ids past the tokenizer are zero so greedy decoding never produces them. At the
    default vocabulary size the "2.2" variant draws the same tensors as the others for the same seed;
    only its edit tokens' LM head rows (padding ids there, zero) are kept."""
    if variant not in VARIANTS:
        raise ValueError(f"variant={variant!r}: one of {', '.join(VARIANTS)}")
    llada22 = variant == "2.2"
    if llada22 and expert_capacity is None:
        expert_capacity = 4  # of the 8 experts per routing block, as the tests' LLaDA2.2 models
    if rope_theta is None:
        rope_theta = 3e6 if llada22 else 600000.0
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "model.safetensors.index.json").unlink(missing_ok=True)
    tok = build_byte_tokenizer()
    tok.add_tokens([AddedToken(MASK_TEXT, special=True, normalized=False)], special_tokens=True)
    if llada22:
        tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in (DELETE_TEXT, SPLIT_TEXT)],
                       special_tokens=True)
    vocab_size = vocab_size or -(-len(tok) // 64) * 64
    eos_id, im_end_id = tok.convert_tokens_to_ids("<|endoftext|>"), tok.convert_tokens_to_ids("<|im_end|>")
    mask_id = tok.convert_tokens_to_ids(MASK_TEXT)

    torch.manual_seed(seed)

    def normal(*shape: int, std: float = initializer_range) -> torch.Tensor:
        return torch.randn(*shape) * std

    def norm_weight(dim: int) -> torch.Tensor:
        return 1.0 + 0.2 * torch.randn(dim)

    h, hd = hidden_size, head_dim
    qkv_rows = (num_attention_heads + 2 * num_key_value_heads) * hd
    t: dict[str, torch.Tensor] = {"model.word_embeddings.weight": normal(vocab_size, h)}
    for i in range(num_hidden_layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = norm_weight(h)
        t[p + "post_attention_layernorm.weight"] = norm_weight(h)
        t[p + "attention.query_key_value.weight"] = normal(qkv_rows, h)
        if use_qkv_bias:
            t[p + "attention.query_key_value.bias"] = normal(qkv_rows)
        t[p + "attention.query_layernorm.weight"] = norm_weight(hd)
        t[p + "attention.key_layernorm.weight"] = norm_weight(hd)
        t[p + "attention.dense.weight"] = normal(h, num_attention_heads * hd)
        if use_bias:
            t[p + "attention.dense.bias"] = normal(h)
        mlps = [(p + "mlp", intermediate_size)]
        if i >= first_k_dense_replace:
            t[p + "mlp.gate.weight"] = normal(num_experts, h, std=initializer_range * router_scale)
            t[p + "mlp.gate.expert_bias"] = normal(num_experts, std=0.1)
            mlps = [(f"{p}mlp.experts.{e}", moe_intermediate_size) for e in range(num_experts)]
            if num_shared_experts:
                mlps.append((p + "mlp.shared_experts", moe_intermediate_size * num_shared_experts))
        for prefix, inter in mlps:
            t[prefix + ".gate_proj.weight"] = normal(inter, h)
            t[prefix + ".up_proj.weight"] = normal(inter, h)
            t[prefix + ".down_proj.weight"] = normal(h, inter)
    t["model.norm.weight"] = norm_weight(h) * logit_scale
    never = [mask_id, *range(len(tok), vocab_size)]
    if tie_word_embeddings:
        t["model.word_embeddings.weight"][never] = 0.0
    else:
        t["lm_head.weight"] = normal(vocab_size, h)
        t["lm_head.weight"][never] = 0.0
    save_file({k: v.to(dtype).contiguous() for k, v in t.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    if num_shards > 1:
        reshard(path, num_shards)

    config = {
        "architectures": ["LLaDA2MoeModelLM"],
        "auto_map": {"AutoConfig": "configuration_llada2_moe.LLaDA2MoeConfig",
                     "AutoModel": "modeling_llada2_moe.LLaDA2MoeModel",
                     "AutoModelForCausalLM": "modeling_llada2_moe.LLaDA2MoeModelLM"},
        "model_type": "llada2_moe",
        "vocab_size": vocab_size, "hidden_size": h, "intermediate_size": intermediate_size,
        "num_hidden_layers": num_hidden_layers, "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads, "head_dim": hd, "hidden_act": "silu",
        "use_qkv_bias": use_qkv_bias, "use_qk_norm": True, "use_bias": use_bias, "rms_norm_eps": 1e-06,
        "norm_head": False, "tie_word_embeddings": tie_word_embeddings, "embedding_dropout": 0.0,
        "attention_dropout": 0.0, "output_dropout": 0.0, "initializer_range": initializer_range,
        "max_position_embeddings": max_position_embeddings, "rope_theta": rope_theta, "use_cache": True,
        "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28, "rope_scaling": None,
        "pad_token_id": eos_id, "eos_token_id": eos_id, "num_experts": num_experts,
        "num_shared_experts": num_shared_experts, "num_experts_per_tok": num_experts_per_tok, "n_group": n_group,
        "topk_group": topk_group, "routed_scaling_factor": routed_scaling_factor,
        "moe_intermediate_size": moe_intermediate_size, "first_k_dense_replace": first_k_dense_replace,
        "output_router_logits": False, "partial_rotary_factor": partial_rotary_factor,
        "score_function": "sigmoid", "moe_router_enable_expert_bias": True, "router_dtype": "fp32",
        "norm_topk_prob": True, "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if expert_capacity is not None:
        config |= {"expert_capacity": expert_capacity, "block_size": block_size}
    if llada22:
        config |= {"delete_token_id": tok.convert_tokens_to_ids(DELETE_TEXT),
                   "split_token_id": tok.convert_tokens_to_ids(SPLIT_TEXT)}
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"eos_token_id": [im_end_id, eos_id], "pad_token_id": eos_id}
    (path / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    write_tokenizer(tok, path, max_position_embeddings)
    tok_cfg = json.loads((path / "tokenizer_config.json").read_text())
    tok_cfg["mask_token"] = MASK_TEXT
    (path / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False) + "\n")
    return path
