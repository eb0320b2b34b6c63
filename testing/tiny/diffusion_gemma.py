"""Tiny random `diffusion_gemma` checkpoints written by transformers' own classes, for tests.

`write_tiny_diffusion_gemma` builds a `DiffusionGemmaForBlockDiffusion` from a small configuration
(both layer types with different head sizes and K/V heads, a small sliding window so prompts cross
it, routed experts on) and `save_pretrained`s it: config.json, generation_config.json and
model.safetensors are exactly what transformers writes, plus the tiny byte-level tokenizer
(testing.tiny.tokenizer). The random init is seeded; norms, router scales and layer
scalars (all ones after transformers' init) are jittered so each one matters. The vision tower is
the smallest Gemma-4 vision config, present in the files as in the release.
"""

from __future__ import annotations

from pathlib import Path

import torch

from testing.tiny.tokenizer import build_byte_tokenizer, write_tokenizer

SLIDING, FULL = "sliding_attention", "full_attention"
_VISION = {"model_type": "gemma4_vision", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
           "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 8}


def tiny_text_config(*, layer_types: tuple[str, ...] = (SLIDING, FULL, SLIDING, SLIDING, FULL),
                     sliding_window: int = 8, vocab_size: int | None = None, hidden_size: int = 64,
                     num_attention_heads: int = 4, num_key_value_heads: int = 2, head_dim: int = 16,
                     global_head_dim: int = 32, num_global_key_value_heads: int = 1, num_experts: int = 8,
                     top_k_experts: int = 3, max_position_embeddings: int = 8192) -> dict:
    """The text_config of a tiny DiffusionGemma in the release's form (`global_head_dim` /
    `num_global_key_value_heads`; transformers turns it into `per_layer_config` when it saves)."""
    return {
        "vocab_size": vocab_size or -(-len(build_byte_tokenizer()) // 64) * 64,
        "hidden_size": hidden_size, "intermediate_size": 2 * hidden_size, "num_hidden_layers": len(layer_types),
        "num_attention_heads": num_attention_heads, "num_key_value_heads": num_key_value_heads,
        "head_dim": head_dim, "global_head_dim": global_head_dim,
        "num_global_key_value_heads": num_global_key_value_heads, "sliding_window": sliding_window,
        "layer_types": list(layer_types), "num_experts": num_experts, "top_k_experts": top_k_experts,
        "moe_intermediate_size": hidden_size // 2, "max_position_embeddings": max_position_embeddings,
        "use_bidirectional_attention": "vision",
        "rope_parameters": {SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
                            FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                   "rope_theta": 1_000_000.0}},
    }


def build_tiny_model(text_config: dict, canvas_length: int = 16, seed: int = 0, initializer_range: float = 0.05):
    """The seeded random transformers model (float32)."""
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    tok = build_byte_tokenizer()
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    text = {**text_config, "eos_token_id": eos, "pad_token_id": eos, "bos_token_id": None,
            "initializer_range": initializer_range}
    config = DiffusionGemmaConfig(text_config=text, vision_config=_VISION, canvas_length=canvas_length,
                                  initializer_range=initializer_range)
    torch.manual_seed(seed)
    model = DiffusionGemmaForBlockDiffusion(config).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("router.scale") or name.endswith("per_expert_scale"):
                param.mul_(1.0 + 0.2 * torch.randn(param.shape, generator=generator))
        for decoder_layer, encoder_layer in zip(model.model.decoder.layers,
                                                model.model.encoder.language_model.layers, strict=True):
            value = 1.0 + 0.3 * torch.rand(1, generator=generator)
            decoder_layer.layer_scalar.copy_(value)
            encoder_layer.layer_scalar.copy_(value)
    return model


def write_tiny_diffusion_gemma(path: str | Path, *, canvas_length: int = 16, seed: int = 0,
                               dtype: torch.dtype = torch.float32, **text_kwargs) -> Path:
    """Write a tiny random diffusion_gemma checkpoint to `path` (created if needed) and return it."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model = build_tiny_model(tiny_text_config(**text_kwargs), canvas_length, seed).to(dtype)
    model.save_pretrained(str(path))
    write_tokenizer(build_byte_tokenizer(), path, model.config.text_config.max_position_embeddings)
    return path
