"""Tiny random Fast-dLLM v2 checkpoints (`model_type: Fast_dLLM_Qwen`) in the published on-disk format.

A published Fast-dLLM v2 directory holds Qwen2 tensors (`model.layers.N.self_attn.{q,k,v}_proj.{weight,bias}`,
`o_proj.weight`, no q/k norm; `lm_head.weight` absent when `tie_word_embeddings`, as in the 1.5B), a
config.json naming `Fast_dLLM_QwenForCausalLM` with the block length in `bd_size` (and `auto_map`,
`conplemenrary_mask`, `max_window_layers`, which change nothing at inference), and a Qwen2 tokenizer
whose mask token `|<MASK>|` appears only among the additional special tokens (no `mask_token`, no
`mask_token_id` in config.json). `write_tiny_fast_dllm` writes exactly that, with the tokenizer of
testing.tiny.tokenizer and weights from a seeded Hugging Face `Qwen2ForCausalLM`;
`load_hf_qwen2` loads the directory back into `Qwen2ForCausalLM`, the oracle the tests compare against.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import transformers

from testing.tiny.tokenizer import build_byte_tokenizer, write_tokenizer

MASK_TEXT = "|<MASK>|"
# With the defaults below, spreads the confidences of the shifted rows over (0, 1) so that every
# threshold of the tests (0.3 to 0.9) reveals one token on some steps and several on others.
FAST_DLLM_TEST_LOGIT_SCALE = 12.0
_DROPPED_FOR_HF = ("bd_size", "auto_map", "conplemenrary_mask", "torch_dtype", "dtype", "transformers_version")


def write_tiny_fast_dllm(
    path: str | Path,
    *,
    tie_word_embeddings: bool = False,
    vocab_size: int | None = None,
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int = 128,
    bd_size: int = 32,
    max_position_embeddings: int = 4096,
    rope_theta: float = 1_000_000.0,
    initializer_range: float = 0.1,
    seed: int = 0,
    logit_scale: float = 1.0,
) -> Path:
    """Write a tiny Fast-dLLM v2 checkpoint to `path` (created if needed) and return it.

    Weights: a `Qwen2ForCausalLM` initialised under `torch.manual_seed(seed)` with std
    `initializer_range`; the q/k/v biases drawn too (Hugging Face would zero them), norm weights
    jittered around 1, the final norm scaled by `logit_scale` (which scales every logit), and the
    LM head rows of the mask token and of the padding ids past the tokenizer zeroed, so greedy
    decoding never picks them. head_dim is hidden_size / num_attention_heads, as in Qwen2.
    `vocab_size` defaults to the tokenizer length rounded up to a multiple of 64."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    hf_tok = build_byte_tokenizer()
    hf_tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", MASK_TEXT]})
    vocab_size = vocab_size or -(-len(hf_tok) // 64) * 64
    if vocab_size < len(hf_tok):
        raise ValueError(f"vocab_size={vocab_size} is smaller than the tokenizer ({len(hf_tok)} tokens)")
    eos_id = hf_tok.convert_tokens_to_ids("<|endoftext|>")
    im_end_id = hf_tok.convert_tokens_to_ids("<|im_end|>")
    mask_id = hf_tok.convert_tokens_to_ids(MASK_TEXT)
    config = transformers.Qwen2Config(
        vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads, num_key_value_heads=num_key_value_heads,
        intermediate_size=intermediate_size, max_position_embeddings=max_position_embeddings,
        initializer_range=initializer_range, rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        tie_word_embeddings=tie_word_embeddings, eos_token_id=im_end_id, pad_token_id=eos_id, bos_token_id=None,
        use_sliding_window=False,
    )
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(torch.randn_like(param), alpha=0.2)
            elif name.endswith("_proj.bias"):
                param.copy_(torch.randn_like(param) * initializer_range)
        model.model.norm.weight.mul_(logit_scale)
        model.get_output_embeddings().weight[[mask_id, *range(len(hf_tok), vocab_size)]] = 0.0
    model.generation_config = transformers.GenerationConfig(eos_token_id=[im_end_id, eos_id], pad_token_id=eos_id,
                                                            bos_token_id=None)
    model.save_pretrained(path)

    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg.update(model_type="Fast_dLLM_Qwen", architectures=["Fast_dLLM_QwenForCausalLM"], bd_size=bd_size,
               rope_theta=rope_theta, rope_scaling=None, torch_dtype="float32", conplemenrary_mask=False,
               max_window_layers=num_hidden_layers, sliding_window=None,
               layer_types=["full_attention"] * num_hidden_layers,
               auto_map={"AutoConfig": "configuration.Fast_dLLM_QwenConfig",
                         "AutoModelForCausalLM": "modeling.Fast_dLLM_QwenForCausalLM"})
    cfg.pop("dtype", None)
    (path / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")

    write_tokenizer(hf_tok, path, max_position_embeddings)
    tok_cfg = json.loads((path / "tokenizer_config.json").read_text())
    tok_cfg.pop("mask_token")  # the published tokenizer names the mask only as an additional special token
    tok_cfg["additional_special_tokens"] = ["<|im_start|>", "<|im_end|>", MASK_TEXT]
    tok_cfg["eos_token"] = "<|im_end|>"
    (path / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False) + "\n")
    return path


def load_hf_qwen2(path: str | Path, dtype: torch.dtype = torch.float32) -> transformers.Qwen2ForCausalLM:
    """Load a Fast-dLLM v2 directory into Hugging Face `Qwen2ForCausalLM` (eager attention, eval mode,
    float32 unless `dtype` says otherwise): its layers are Qwen2's, its config.json Qwen2's plus
    block-diffusion fields dropped here. Eager attention adds a float 4D mask as given, so callers
    pass a block-causal one."""
    path = Path(path)
    cfg = json.loads((path / "config.json").read_text())
    for key in _DROPPED_FOR_HF:
        cfg.pop(key, None)
    cfg.update(model_type="qwen2", architectures=["Qwen2ForCausalLM"])
    config = transformers.Qwen2Config(**cfg)
    model = transformers.Qwen2ForCausalLM.from_pretrained(os.fspath(path), config=config, dtype=dtype,
                                                          attn_implementation="eager")
    return model.eval()
