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

import itertools
import json
import os
from collections import Counter
from pathlib import Path
from typing import Literal

import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>"]

# `logit_scale` for DLLM tests: with the other defaults of `write_tiny_checkpoint(model_type="sdar")`
# it spreads greedy confidences at masked positions over (0, 1). Measured with
# `tests/dllm_reference.py`, seeds 0-3 x 6 short English/arithmetic prompts, 32 new tokens,
# `low_confidence_dynamic`, B=4, S=4, threshold 0.85 (1238 masked-position confidences): 39 % are
# >= 0.85, median 0.78, 10th percentile 0.44, 90th 0.99. Of 163 full blocks, 32 took 1 step
# (all four above the threshold), 49 took 2, 37 took 3 and 45 took 4 (n_s fallback every step);
# 4 of the 24 generations stopped on an eos id. Tied embeddings: 29 % >= 0.85, median 0.68.
DLLM_TEST_LOGIT_SCALE = 12.0

_NUM_MERGES = 64

_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_CORPUS = """\
The quick brown fox jumps over the lazy dog. The dog was not amused, and the fox ran into the forest.
Once upon a time there was a little model that wanted to learn how to count and how to add numbers.
It read the same sentences again and again, and then it answered the questions in the right order.
Question: what is 12 + 30? Answer: 12 + 30 = 42. Question: what is 7 * 8? Answer: 7 * 8 = 56.
1 + 1 = 2, 2 + 2 = 4, 3 + 3 = 6, 4 + 4 = 8, 5 + 5 = 10, 10 + 10 = 20, 100 - 1 = 99, 9 * 9 = 81.
Hello, world! How are you today? I am fine, thank you. The weather is nice and the sun is shining.
"""


def _learn_merges(text: str, num_merges: int) -> list[tuple[str, str]]:
    """Plain BPE training on `text`, deterministic: the most frequent pair wins, ties go to the
    lexicographically smallest pair."""
    pre = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    words = Counter(piece for piece, _ in pre.pre_tokenize_str(text))
    split = {word: list(word) for word in words}
    merges: list[tuple[str, str]] = []
    for _ in range(num_merges):
        pairs: Counter[tuple[str, str]] = Counter()
        for word, count in words.items():
            symbols = split[word]
            for pair in itertools.pairwise(symbols):
                pairs[pair] += count
        if not pairs:
            break
        best = min(pairs, key=lambda pair: (-pairs[pair], pair))
        merges.append(best)
        for word, symbols in split.items():
            merged: list[str] = []
            i = 0
            while i < len(symbols):
                if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == best:
                    merged.append(symbols[i] + symbols[i + 1])
                    i += 2
                else:
                    merged.append(symbols[i])
                    i += 1
            split[word] = merged
    return merges


def build_byte_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A deterministic byte-level BPE tokenizer: the 256-symbol ByteLevel alphabet, `_NUM_MERGES`
    merges learnt from a built-in English/arithmetic text, then `SPECIAL_TOKENS` as special tokens.
    `<|endoftext|>` is eos and pad, `<|MASK|>` the mask token. Round-trips any UTF-8 text."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())  # the 256 byte symbols
    merges = _learn_merges(_CORPUS, _NUM_MERGES)
    vocab = {symbol: i for i, symbol in enumerate(alphabet)}
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    hf_tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        mask_token="<|MASK|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        clean_up_tokenization_spaces=False,
    )
    hf_tok.chat_template = _CHAT_TEMPLATE
    return hf_tok


def write_tokenizer(hf_tok: transformers.PreTrainedTokenizerFast, path: Path, model_max_length: int) -> None:
    """Write `tokenizer.json` and a self-contained `tokenizer_config.json` (chat template inline)."""
    hf_tok.backend_tokenizer.save(str(path / "tokenizer.json"))
    added = {
        str(token_id): {
            "content": token.content,
            "lstrip": token.lstrip,
            "normalized": token.normalized,
            "rstrip": token.rstrip,
            "single_word": token.single_word,
            "special": token.special,
        }
        for token_id, token in sorted(hf_tok.added_tokens_decoder.items())
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "mask_token": "<|MASK|>",
        "unk_token": None,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": hf_tok.chat_template or _CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def _reshard(path: Path, num_shards: int) -> None:
    """Split `model.safetensors` into `num_shards` files named and indexed like `save_pretrained`."""
    single = path / "model.safetensors"
    with safe_open(str(single), framework="pt") as f:
        keys = f.keys()
        tensors = {name: f.get_tensor(name) for name in keys}
        metadata = f.metadata()
    names = list(tensors)
    if num_shards > len(names):
        raise ValueError(f"num_shards={num_shards} exceeds the {len(names)} tensors of the model")
    sizes = [tensors[n].numel() * tensors[n].element_size() for n in names]
    total_size = sum(sizes)
    # Contiguous groups of roughly equal bytes, in file order; no shard is left empty.
    groups: list[list[str]] = [[] for _ in range(num_shards)]
    running, shard = 0, 0
    for i, (name, size) in enumerate(zip(names, sizes, strict=True)):
        if i:
            by_bytes = min(running * num_shards // total_size, num_shards - 1)
            target = max(by_bytes, num_shards - (len(names) - i))  # one tensor left per later shard
            shard = min(max(target, shard), shard + 1)  # never go back, never skip a shard
        groups[shard].append(name)
        running += size
    weight_map: dict[str, str] = {}
    for k, group in enumerate(groups):
        filename = f"model-{k + 1:05d}-of-{num_shards:05d}.safetensors"
        save_file({n: tensors[n] for n in group}, str(path / filename), metadata=metadata)
        weight_map.update(dict.fromkeys(group, filename))
    total_parameters = sum(t.numel() for t in tensors.values())
    index = {
        "metadata": {"total_parameters": total_parameters, "total_size": total_size},
        "weight_map": dict(sorted(weight_map.items())),
    }
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    single.unlink()


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
        _reshard(path, num_shards)

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
