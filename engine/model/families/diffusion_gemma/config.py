"""config.json of a `diffusion_gemma` checkpoint -> `GemmaSpec`: every field that changes the math is
honoured here or refused with a CheckpointError naming it.

Two forms describe the full-attention layers' geometry: `per_layer_config` (what transformers' own
`save_pretrained` writes: `{layer index: {head_dim, num_key_value_heads}}`) and the release's
`global_head_dim` (default 512) / `num_global_key_value_heads`. The encoder's text attention is
causal under `use_bidirectional_attention` "vision" or null (vision tokens are the only ones the
"vision" mode makes bidirectional, and images are not served); "all" is refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from engine.errors import CheckpointError

SLIDING, FULL = "sliding_attention", "full_attention"
_DEFAULT_ROPE = {
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}
_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_tanh")
# Gemma-4 text fields the diffusion network does not implement: refused unless neutral.
_NEUTRAL = {
    "attn_logit_softcapping": (None,),
    "hidden_size_per_layer_input": (None, 0),
    "num_kv_shared_layers": (None, 0),
    "use_double_wide_mlp": (None, False),
    "query_pre_attn_scalar": (None,),
    "enable_moe_block": (None, True),
}


@dataclass(frozen=True)
class LayerGeometry:
    """One attention layer: its kind, head size and K/V heads, and its rotary frequencies' recipe."""

    kind: str  # SLIDING or FULL
    head_dim: int
    num_kv_heads: int
    has_v_proj: bool  # full layers have none: V is k_proj's output, v-normed
    rope_theta: float
    rotated_pairs: int  # frequency pairs that rotate (the rest have frequency 0)
    rope_dim: int  # the d of 1/theta^(2i/d)
    rope_factor: float


@dataclass(frozen=True)
class GemmaSpec:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    layers: tuple[LayerGeometry, ...]
    sliding_window: int
    rms_norm_eps: float
    num_experts: int
    top_k_experts: int
    moe_intermediate_size: int
    final_logit_softcapping: float | None
    canvas_length: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None

    @property
    def num_hidden_layers(self) -> int:
        return len(self.layers)


def _refuse(field: str, value: object, why: str) -> CheckpointError:
    return CheckpointError(f"config.json: {field}={value!r} is not supported: {why}")


def _layer_types(text: dict, n: int) -> list[str]:
    types = text.get("layer_types")
    if types is None:  # transformers' default: five sliding layers, then one full
        types = [SLIDING if (i + 1) % 6 else FULL for i in range(n)]
    types = list(types)
    if len(types) != n or any(t not in (SLIDING, FULL) for t in types):
        raise _refuse("text_config.layer_types", types,
                      f"{n} entries of {SLIDING!r} / {FULL!r} expected")
    types[-1] = FULL  # transformers forces the last layer to full attention
    return types


def _full_overrides(text: dict, types: list[str]) -> dict[int, dict]:
    """{layer: {head_dim?, num_key_value_heads?}} from either config form."""
    if "per_layer_config" in text:
        out = {}
        for key, value in (text["per_layer_config"] or {}).items():
            extra = sorted(set(value) - {"head_dim", "num_key_value_heads"})
            if extra:
                raise _refuse(f"text_config.per_layer_config.{key}.{extra[0]}", value[extra[0]],
                              "only head_dim and num_key_value_heads may differ per layer")
            out[int(key)] = dict(value)
        return out
    override = {"head_dim": text.get("global_head_dim", 512)}
    kv = text.get("num_global_key_value_heads")
    if kv is not None and text.get("attention_k_eq_v", True):
        override["num_key_value_heads"] = kv
    return {i: override for i, t in enumerate(types) if t == FULL}


def _rope(text: dict, kind: str, head_dim: int) -> tuple[float, int, int, float]:
    params = (text.get("rope_parameters") or _DEFAULT_ROPE).get(kind)
    if params is None:
        raise _refuse(f"text_config.rope_parameters.{kind}", None, "every layer type needs its rotary parameters")
    rope_type, theta = params.get("rope_type", "default"), float(params["rope_theta"])
    factor = float(params.get("factor", 1.0))
    p = float(params.get("partial_rotary_factor", 1.0))
    if rope_type == "default":
        for name, value, neutral in (("factor", factor, 1.0), ("partial_rotary_factor", p, 1.0)):
            if value != neutral:
                raise _refuse(f"text_config.rope_parameters.{kind}.{name}", value,
                              "default rotary turns the whole head")
        return theta, head_dim // 2, head_dim, 1.0
    if rope_type == "proportional":
        return theta, int(p * head_dim // 2), head_dim, factor
    raise _refuse(f"text_config.rope_parameters.{kind}.rope_type", rope_type, "'default' or 'proportional'")


def parse_config(cfg: dict) -> GemmaSpec:
    """The network's facts from a parsed config.json (root `diffusion_gemma`, `text_config`)."""
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise CheckpointError("config.json: a diffusion_gemma checkpoint needs its text_config")
    for name, value in (("tie_word_embeddings", cfg.get("tie_word_embeddings", True)),
                        ("text_config.tie_word_embeddings", text.get("tie_word_embeddings", True))):
        if value is not True:
            raise _refuse(name, value, "the LM head is the decoder's embedding")
    mode = text.get("use_bidirectional_attention")
    if mode not in (None, "vision"):
        raise _refuse("text_config.use_bidirectional_attention", mode,
                      "the encoder's text attention must be causal ('vision' or null)")
    act = text.get("hidden_activation", "gelu_pytorch_tanh")
    if act not in _ACTIVATIONS:
        raise _refuse("text_config.hidden_activation", act, "GeGLU with tanh GELU is the network")
    if text.get("attention_bias", False):
        raise _refuse("text_config.attention_bias", True, "the projections have no bias")
    for name, neutral in _NEUTRAL.items():
        if text.get(name, neutral[0]) not in neutral:
            raise _refuse(f"text_config.{name}", text[name], "a Gemma-4 feature the diffusion network has not")
    for name in ("num_experts", "top_k_experts", "moe_intermediate_size"):
        if not text.get(name):
            raise _refuse(f"text_config.{name}", text.get(name), "every layer runs its experts")
    n = int(text.get("num_hidden_layers", 30))
    types = _layer_types(text, n)
    overrides = _full_overrides(text, types)
    base_dim, base_kv = int(text.get("head_dim", 256)), int(text.get("num_key_value_heads", 4))
    layers = []
    for i, kind in enumerate(types):
        head_dim = int(overrides.get(i, {}).get("head_dim", base_dim))
        kv = int(overrides.get(i, {}).get("num_key_value_heads", base_kv))
        theta, pairs, rope_dim, factor = _rope(text, kind, head_dim)
        layers.append(LayerGeometry(kind, head_dim, kv, kind == SLIDING, theta, pairs, rope_dim, factor))
    heads = int(text.get("num_attention_heads", 8))
    for i, layer in enumerate(layers):
        if heads % layer.num_kv_heads:
            raise _refuse(f"layer {i} num_key_value_heads", layer.num_kv_heads,
                          f"must divide num_attention_heads={heads}")
    eos = text.get("eos_token_id", 1)
    canvas = cfg.get("canvas_length", 256)
    if not isinstance(canvas, int) or canvas < 1:
        raise _refuse("canvas_length", canvas, "a positive number of tokens")
    softcap = text.get("final_logit_softcapping", 30.0)
    return GemmaSpec(
        vocab_size=int(text.get("vocab_size", 262_144)), hidden_size=int(text.get("hidden_size", 2304)),
        intermediate_size=int(text.get("intermediate_size", 9216)), num_attention_heads=heads,
        layers=tuple(layers), sliding_window=int(text.get("sliding_window", 512)),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)), num_experts=int(text["num_experts"]),
        top_k_experts=int(text["top_k_experts"]), moe_intermediate_size=int(text["moe_intermediate_size"]),
        final_logit_softcapping=None if softcap is None else float(softcap), canvas_length=canvas,
        max_position_embeddings=int(text.get("max_position_embeddings", 131_072)),
        eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
        pad_token_id=text.get("pad_token_id", 0),
    )


def load_gemma_spec(path: str | Path) -> GemmaSpec:
    cfg = json.loads((Path(path) / "config.json").read_text())
    if cfg.get("model_type") != "diffusion_gemma":
        raise CheckpointError(f"config.json: model_type={cfg.get('model_type')!r}, expected 'diffusion_gemma'")
    return parse_config(cfg)
