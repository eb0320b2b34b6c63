"""Weights drawn at random on the device for the large-shape parts: nothing large is written or read."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import torch

from bench.gpu_check.settings import BLOCK
from bench.models import DLLM_LOGIT_SCALE, BenchShape
from engine.model.checkpoint import ModelSpec
from engine.model.layers.decoder import PreNormDecoderLM
from engine.model.layers.parallel import TPContext
from engine.worker import runner as model_runner
from testing.tiny_checkpoint import write_tiny_checkpoint

TOKENIZER_IDS = 384  # the tiny checkpoints' vocabulary: the byte tokenizer's 324 tokens, rounded up


def write_config_only(root: Path, shape: BenchShape) -> Path:
    """An SDAR checkpoint directory of `shape` whose weights file is a tiny stand-in, for an engine that
    draws its weights on the device (`weights_on_device`): nothing large is written or read."""
    path = write_tiny_checkpoint(root / f"sdar-{shape.hidden_size}x{shape.num_hidden_layers}-config",
                                 model_type="sdar", block_size=BLOCK, seed=1, vocab_size=TOKENIZER_IDS)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update({k: v for k, v in asdict(shape).items() if k in cfg})
    (path / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return path


def fill_random(model: PreNormDecoderLM, spec: ModelSpec, seed: int, std: float = 0.1,
                logit_scale: float = DLLM_LOGIT_SCALE, tokenizer_ids: int = TOKENIZER_IDS) -> None:
    """Weights like `write_tiny_checkpoint`'s, drawn on the model's device: N(0, std) matrices, RMSNorm
    weights around 1, the final norm times `logit_scale`, and LM-head rows of zero for the mask token and
    the ids past the tokenizer (greedy never picks them)."""
    device = next(model.parameters()).device
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=g, device=device)
            param.copy_(1 + 0.2 * noise if name.endswith("norm.weight") else std * noise)
        model.model.norm.weight.mul_(logit_scale)
        never = [i for i in (spec.mask_token_id,) if i is not None]
        model.lm_head.weight[never] = 0
        model.lm_head.weight[tokenizer_ids:] = 0


@contextmanager
def weights_on_device(seed: int = 1, fill: Callable[[torch.nn.Module, ModelSpec, int], None] = fill_random,
                      ) -> Iterator[None]:
    """Model runners built inside this block draw their weights on their device (by `fill`) instead of
    loading them."""
    load = model_runner.build_model

    def build(spec: ModelSpec, device: torch.device, dtype: torch.dtype, tp: TPContext | None) -> PreNormDecoderLM:
        model = model_runner.allocate_model(spec, device, dtype, tp)
        fill(model, spec, seed)
        return model

    model_runner.build_model = build
    try:
        yield
    finally:
        model_runner.build_model = load
