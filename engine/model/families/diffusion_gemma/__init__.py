"""DiffusionGemma (`model_type: diffusion_gemma`, Google's `DiffusionGemmaForBlockDiffusion`): Gemma-4
layers run as an encoder pass (causal, writes K/V: a prompt, or the commit of a finished canvas) and
a canvas pass (bidirectional over a canvas, reads the committed K/V without writing) on one set of
weights. `config` reads config.json, `network` is the layer stack, `attention` its paged attention
over per-layer-group caches (with the torch reference backend; `flex_attention` the FlexAttention
one), `kv_layout` the page geometry of the two layer groups. The testing kit's
testing/tiny/diffusion_gemma.py and testing/references/diffusion_gemma.py write tiny checkpoints with
transformers' classes and drive transformers' model pass by pass. The canvas length comes from
config.json's `canvas_length`."""

from __future__ import annotations

from configs.knobs import Paradigm, upstream_values
from engine.model.families.diffusion_gemma.config import FULL, SLIDING, parse_config
from engine.model.families.diffusion_gemma.network import DiffusionGemmaNetwork
from engine.model.family import ModelFamily


def diffusion_gemma_fields(cfg: dict) -> dict:
    """The ModelSpec fields of a diffusion_gemma config.json: the common ones as its text_config gives
    them, the sliding layers' head geometry as `head_dim` / `num_key_value_heads`, and the whole
    per-layer geometry in `extra` (a GemmaSpec)."""
    gemma = parse_config(cfg)
    sliding = next((g for g in gemma.layers if g.kind == SLIDING), None) or next(g for g in gemma.layers
                                                                               if g.kind == FULL)
    return {"extra": gemma, "head_dim": sliding.head_dim, "num_key_value_heads": sliding.num_kv_heads,
            "tie_word_embeddings": True, "max_position_embeddings": gemma.max_position_embeddings}


def generation_defaults(gen: dict) -> dict[str, object]:
    """The renoising knobs' defaults a generation_config.json sets (under transformers' key names, which
    the knob table names)."""
    return upstream_values("transformers", gen)


FAMILY = ModelFamily("diffusion_gemma", Paradigm.RENOISING, predicts_next=False,
                     block_length_keys=("canvas_length",), default_block_length=256,
                     generation_defaults=generation_defaults, config_fields=diffusion_gemma_fields,
                     network=DiffusionGemmaNetwork)
