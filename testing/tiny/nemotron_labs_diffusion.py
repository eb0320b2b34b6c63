"""Tiny random Nemotron-Labs-Diffusion checkpoints in the released on-disk format, and the transformers
model the tests compare the engine against.

`write_tiny_nemotron_labs_diffusion` writes what a release directory holds: config.json as released
(`NemotronLabsDiffusionModel`, its `auto_map`, `dlm_paradigm`, `mask_token_id`, `block_size`, YaRN
`rope_parameters` with Llama-4 query scaling), generation_config.json, `model.safetensors` with the
release's 9 * layers + 3 tensor names (`encoder.*`, the untied `diffusion_head.weight`), and the tiny
byte-level tokenizer (testing.tiny.tokenizer) with the release's ChatML chat template
(`chat_template.jinja`, thinking off unless `enable_thinking`), `<|im_end|>` as eos and `<|MASK|>` as
the mask token. The weights are a seeded transformers `Ministral3ForCausalLM`, renamed.

The defaults make the scaled regimes show inside a short test: `original_max_position_embeddings` 32
with YaRN factor 8, so the context is 256 positions and the query factor changes at positions 32, 64,
96, ...; and `head_dim` 32 with hidden 64 and 4 heads (head_dim is not hidden / heads, as in the 14B).

`load_ministral3` loads such a directory (or a release, sharded or not) into `Ministral3ForCausalLM`: `encoder.` ->
`model.`, `diffusion_head.weight` -> `lm_head.weight`.

`write_tiny_linear_spec_lora` adds the release's draft adapter folder (`linear_spec_lora/`, PEFT's
layout) to such a directory, and `DraftAdaptedMinistral3` runs a loaded model as the release runs it with
that adapter, for the reference loops: the adapter on a draft pass's block rows only.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file

from engine.model.checkpoint import iter_weights
from engine.model.families.nemotron_labs_diffusion.lora import (
    ADAPTER_DIR,
    CONFIG_FILE,
    WEIGHTS_FILE,
    DraftAdapter,
    read_draft_lora,
)
from testing.tiny.tokenizer import build_byte_tokenizer, write_tokenizer

MASK_TEXT = "<|MASK|>"
EOS_TEXT = "<|im_end|>"
# The release's chat layout: an (empty by default) system turn, the turns, then the assistant turn
# opened with an empty think span, or with `<think>\n` when thinking is switched on.
CHAT_TEMPLATE = (
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{%- set system = messages[0]['content'] %}{%- set turns = messages[1:] %}"
    "{%- else %}{%- set system = '' %}{%- set turns = messages %}{%- endif %}"
    "{{ '<|im_start|>system\\n' + system + '<|im_end|>\\n' }}"
    "{%- for message in turns %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking %}{{ '<think>\\n' }}"
    "{%- else %}{{ '<think></think>' }}{%- endif %}{%- endif %}"
)
AUTO_MAP = {"AutoConfig": "configuration_nemotron_labs_diffusion.NemotronLabsDiffusionConfig",
            "AutoModel": "modeling_nemotron_labs_diffusion.NemotronLabsDiffusionModel"}
# config.json fields of the release that transformers' Ministral3Config does not take
_RELEASE_ONLY = ("architectures", "model_type", "auto_map", "mask_token_id", "block_size", "dlm_paradigm",
                 "attn_implementation", "ar_loss_weight", "dlm_loss_weight", "dp_varying_mask_ratio",
                 "attention_bias", "mlp_bias", "torch_dtype", "transformers_version")


def to_released_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Ministral3ForCausalLM state dict under the release's tensor names."""
    return {("diffusion_head.weight" if name == "lm_head.weight" else "encoder." + name.removeprefix("model.")):
            tensor for name, tensor in state.items()}


def to_ministral3_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Released tensors under Ministral3ForCausalLM's names."""
    return {("lm_head.weight" if name == "diffusion_head.weight" else "model." + name.removeprefix("encoder.")):
            tensor for name, tensor in state.items()}


def ministral3_config(cfg: dict) -> transformers.Ministral3Config:
    """The transformers configuration of the decoder a released config.json describes."""
    fields = {k: v for k, v in cfg.items() if k not in _RELEASE_ONLY}
    return transformers.Ministral3Config(**fields)


def write_tiny_nemotron_labs_diffusion(
    path: str | Path,
    *,
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 32,
    intermediate_size: int = 128,
    block_size: int = 8,
    rope_theta: float = 1_000_000.0,
    yarn_factor: float = 8.0,
    original_max_position_embeddings: int = 32,
    llama_4_scaling_beta: float = 0.1,
    initializer_range: float = 0.1,
    seed: int = 0,
    logit_scale: float = 1.0,
) -> Path:
    """Write a tiny random checkpoint to `path` (created if needed) and return it.

    Weights: a `Ministral3ForCausalLM` initialised under `torch.manual_seed(seed)` with std
    `initializer_range`, RMSNorm weights jittered around 1, the final norm scaled by `logit_scale`
    (which scales every logit), and the head rows of the padding ids past the tokenizer zeroed. The
    mask token's row is zeroed too, so AR decoding never emits it; the diffusion loops still treat it
    as a legal candidate, as the release does. The vocabulary is the tokenizer rounded up to 64."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = build_byte_tokenizer()
    tok.eos_token = EOS_TEXT
    tok.chat_template = CHAT_TEMPLATE
    vocab_size = -(-len(tok) // 64) * 64
    max_position_embeddings = int(yarn_factor * original_max_position_embeddings)  # as in the release
    eos_id, pad_id = tok.convert_tokens_to_ids(EOS_TEXT), tok.convert_tokens_to_ids("<|endoftext|>")
    mask_id = tok.convert_tokens_to_ids(MASK_TEXT)
    cfg = {
        "architectures": ["NemotronLabsDiffusionModel"], "model_type": "nemotron_labs_diffusion",
        "auto_map": AUTO_MAP, "vocab_size": vocab_size, "hidden_size": hidden_size,
        "intermediate_size": intermediate_size, "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": num_attention_heads, "num_key_value_heads": num_key_value_heads,
        "head_dim": head_dim, "hidden_act": "silu", "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-5, "initializer_range": initializer_range,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": rope_theta, "factor": yarn_factor,
                            "original_max_position_embeddings": original_max_position_embeddings,
                            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                            "llama_4_scaling_beta": llama_4_scaling_beta},
        "mask_token_id": mask_id, "block_size": block_size, "dlm_paradigm": "bidirectional",
        "attn_implementation": "sdpa", "ar_loss_weight": 1.0, "dlm_loss_weight": None,
        "dp_varying_mask_ratio": False, "attention_bias": False, "mlp_bias": False, "sliding_window": None,
        "tie_word_embeddings": False, "use_cache": False, "bos_token_id": None, "eos_token_id": eos_id,
        "pad_token_id": pad_id, "torch_dtype": "float32", "transformers_version": "5.0.0",
    }
    torch.manual_seed(seed)
    model = transformers.Ministral3ForCausalLM(ministral3_config(cfg)).to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(torch.randn_like(param), alpha=0.2)
        model.model.norm.weight.mul_(logit_scale)
        model.lm_head.weight[[mask_id, *range(len(tok), vocab_size)]] = 0.0
    state = {k: v.contiguous() for k, v in model.state_dict().items() if "rotary_emb" not in k}
    (path / "model.safetensors.index.json").unlink(missing_ok=True)
    save_file(to_released_names(state), str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    generation = {"bos_token_id": None, "eos_token_id": eos_id, "pad_token_id": pad_id,
                  "transformers_version": "5.0.0"}
    (path / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    write_tokenizer(tok, path, max_position_embeddings)
    tok_cfg = json.loads((path / "tokenizer_config.json").read_text())
    tok_cfg["eos_token"] = EOS_TEXT
    del tok_cfg["chat_template"]  # the release ships it as its own file
    (path / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False) + "\n")
    (path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return path


def load_ministral3(path: str | Path, dtype: torch.dtype = torch.float32) -> transformers.Ministral3ForCausalLM:
    """A released (or tiny) directory as transformers' `Ministral3ForCausalLM` with the diffusion head
    as its LM head: eval mode, eager attention (a 4D float mask is added to the scores as given, which
    the reference loops use for their bidirectional block passes)."""
    path = Path(path)
    cfg = json.loads((path / "config.json").read_text())
    config = ministral3_config(cfg)
    config._attn_implementation = "eager"
    model = transformers.Ministral3ForCausalLM(config).to(dtype)
    state = to_ministral3_names({name: weight[...] for name, weight in iter_weights(path)})
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or any("rotary_emb" not in name for name in missing):
        raise ValueError(f"{path}: tensors not matching Ministral3: missing {missing}, unexpected {unexpected}")
    return model.eval()


def write_tiny_linear_spec_lora(checkpoint: str | Path, *, r: int = 4, lora_alpha: float = 8.0, std: float = 0.2,
                                seed: int = 0) -> Path:
    """Write a random draft adapter as the release ships it into `checkpoint`/linear_spec_lora and return
    that folder: adapter_config.json (PEFT LoRA on `o_proj`, `r`, `lora_alpha`) and
    adapter_model.safetensors with each layer's `lora_A` [r, heads * head_dim] and `lora_B`
    [hidden, r] under PEFT's names. B is random too (PEFT starts it at zero, which would change nothing)."""
    checkpoint = Path(checkpoint)
    cfg = json.loads((checkpoint / "config.json").read_text())
    folder = checkpoint / ADAPTER_DIR
    folder.mkdir(exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    in_features, tensors = cfg["num_attention_heads"] * cfg["head_dim"], {}
    for layer in range(cfg["num_hidden_layers"]):
        prefix = f"base_model.model.encoder.layers.{layer}.self_attn.o_proj"
        tensors[f"{prefix}.lora_A.weight"] = torch.randn(r, in_features, generator=generator) * std
        tensors[f"{prefix}.lora_B.weight"] = torch.randn(cfg["hidden_size"], r, generator=generator) * std
    save_file(tensors, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(checkpoint), "r": r,
              "lora_alpha": lora_alpha, "lora_dropout": 0.0, "target_modules": ["o_proj"], "bias": "none",
              "use_rslora": False, "use_dora": False, "fan_in_fan_out": False, "inference_mode": True}
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return folder


class DraftAdaptedMinistral3:
    """A `Ministral3ForCausalLM` called as the reference loops call it, with the draft adapter in
    `adapter` run as the release runs it: on the block rows of a bidirectional pass (a draft) only. The
    rows before the block stand for the release's cache, which only causal forwards fill, so they run
    the plain weights, as every causal forward does."""

    def __init__(self, model: transformers.Ministral3ForCausalLM, adapter: str | Path):
        cfg = model.config
        lora = read_draft_lora(adapter, cfg.num_hidden_layers, cfg.num_attention_heads * cfg.head_dim,
                               cfg.hidden_size).to(model.device, model.dtype)
        self.model = model
        self.adapter = DraftAdapter(lora, [layer.self_attn.o_proj for layer in model.model.layers])

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **kwargs):
        """`attention_mask` is the loops' additive [1, 1, T, T] mask: the rows that see a later key are a
        bidirectional block's (all but its last row), and the block runs to the end."""
        sees_later = (attention_mask[0, 0] == 0).triu(1).any(-1)
        rows = None
        if sees_later.any():
            rows = torch.arange(len(sees_later)) >= int(sees_later.nonzero()[0])
        with self.adapter.rows(rows):
            return self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
