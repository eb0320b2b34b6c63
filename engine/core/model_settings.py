"""What the engine derives from a checkpoint and its EngineConfig before serving, and what it counts.

`max_model_len` is bounded by the checkpoint's `max_position_embeddings`; a block-diffusion model's
mask token is looked up in a fixed order (config.json, the tokenizer, the vocabulary, the engine
config). `engine_setup` is all of it, as the engine starts; `check_engine_config` asks the same of a
checkpoint directory without loading a weight (`blockserve serve` before it starts a cluster).
`EngineStats` are the replica's counters (metrics, benches).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from configs import EngineConfig
from configs.knobs import ENGINE_WIDE_IGNORED, MASKED, PARADIGMS, rules_of, unusable
from engine.core.decoding import DecodingStrategy, describe_paradigm, paradigm_of, strategy_for
from engine.model.checkpoint import ModelSpec, load_model_spec
from engine.model.families import build_network
from engine.model.interfaces import fixes_block_length
from engine.tokenizer import load_tokenizer

log = logging.getLogger(__name__)


@dataclass
class EngineStats:
    steps: int = 0
    forwards: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    unmasking_steps: int = 0
    forward_seconds: float = 0.0
    step_seconds: float = 0.0
    last_step_time: float = 0.0
    isolated_failures: int = 0  # requests ended because their own step failed
    weight_updates: int = 0  # weight updates applied since start


def resolve_max_model_len(config: EngineConfig, spec: ModelSpec) -> int:
    """`max_model_len`, defaulting to and bounded by the checkpoint's max_position_embeddings."""
    limit = spec.max_position_embeddings
    if config.max_model_len is None:
        return limit
    if config.max_model_len > limit:
        raise ValueError(f"max_model_len={config.max_model_len} exceeds the checkpoint's max_position_embeddings="
                         f"{limit}; lower max_model_len (or leave it unset to use {limit})")
    return config.max_model_len


def resolve_block_length(config: EngineConfig, spec: ModelSpec) -> int | None:
    """A block-diffusion model's block length: EngineConfig's, else config.json's (the family's field
    for it), else the family's default. None for autoregressive models."""
    if not spec.is_dllm:
        return None
    return config.dllm_block_length or spec.block_size or spec.family.default_block_length


def check_engine_knobs(config: EngineConfig, spec: ModelSpec) -> None:
    """Each engine-wide `dllm_*` knob set (to anything but its default) must be one the model's paradigm
    reads, and the unmasking rule one it decodes with (the knob table, `configs.knobs`); a ValueError
    names the field otherwise. A paradigm in `ENGINE_WIDE_IGNORED` logs the knobs it ignores instead."""
    paradigm, model_type = paradigm_of(spec.family), spec.family.model_type
    if paradigm not in PARADIGMS:
        return  # no decoding strategy: `strategy_for` refuses the model
    what = describe_paradigm(paradigm)
    unused = {k.name: (k, getattr(config, k.name)) for k in unusable(paradigm) if k.name in config.model_fields_set}
    unused = {name: (k, v) for name, (k, v) in unused.items() if v != k.default}
    if unused and paradigm in ENGINE_WIDE_IGNORED:
        log.warning("model_type %r is %s: it ignores the engine settings %s", model_type, what,
                    ", ".join(f"{name}={v!r}" for name, (_, v) in unused.items()))
        return
    if unused:
        name, (knob, value) = next(iter(unused.items()))
        raise ValueError(f"{name}={value!r} does not apply to this model: model_type {model_type!r} is {what} and "
                         f"{name} is read by {' and '.join(knob.used_by)} decoding; leave it unset")
    rules, rule = rules_of(paradigm), config.dllm_unmasking_strategy
    if rules and rule not in rules:
        raise ValueError(f"dllm_unmasking_strategy={rule!r} does not apply to this model: model_type "
                         f"{model_type!r} is {what}, which decodes with {' or '.join(rules)}; leave it unset")


def with_family_defaults(config: EngineConfig, spec: ModelSpec) -> EngineConfig:
    """`config`, its knobs checked (`check_engine_knobs`), with the model family's published decoding
    defaults for the `dllm_*` fields the user left unset (e.g. LLaDA2's threshold 0.95), and over
    those the checkpoint's own from generation_config.json (DiffusionGemma's schedule); fields the
    user set are kept."""
    check_engine_knobs(config, spec)
    published = {**spec.family.decoding_defaults, **spec.generation_defaults}
    defaults = {k: v for k, v in published.items() if k not in config.model_fields_set}
    return config.model_copy(update=defaults) if defaults else config


def resolve_mask_token_id(spec: ModelSpec, tokenizer, config: EngineConfig) -> int:
    """The mask token of a block-diffusion model: config.json `mask_token_id`, else the tokenizer's mask
    token, else the family's mask token text in the vocabulary (e.g. `<|MASK|>`), else
    `EngineConfig.dllm_mask_token_id`."""
    vocab = tokenizer.get_vocab()
    texts = spec.family.mask_token_texts
    in_vocab = [vocab[t] for t in texts if t in vocab]
    for candidate in (spec.mask_token_id, tokenizer.mask_token_id, *in_vocab, config.dllm_mask_token_id):
        if candidate is not None:
            return int(candidate)
    raise ValueError(f"{spec.path}: a block-diffusion model needs a mask token and none was found: set "
                     f"mask_token_id in config.json, a mask_token in tokenizer_config.json, a "
                     f"{' or '.join(texts) or 'mask'} token in the vocabulary, or EngineConfig.dllm_mask_token_id")


@dataclass(frozen=True)
class EngineSetup:
    """What an engine derives from its checkpoint and EngineConfig before it loads a weight."""

    config: EngineConfig  # the family's decoding defaults applied; max_model_len and dllm_block_length resolved
    knobs_set: frozenset[str]  # the fields the user set (a rule's own defaults yield to them)
    block_length: int | None  # the diffusion block (None: autoregressive)
    paradigm: str
    mask_id: int | None  # the mask token of a paradigm that unmasks
    decoding: DecodingStrategy


def engine_setup(config: EngineConfig, spec: ModelSpec, tokenizer) -> EngineSetup:
    """`config` resolved for the checkpoint `spec`: ValueError naming the field the model cannot take
    (a knob its paradigm does not read, max_model_len, the unmasking rule, a special token it lacks,
    a sub-block length that does not divide the block)."""
    block_length = resolve_block_length(config, spec)
    resolved = with_family_defaults(config, spec).model_copy(update={
        "max_model_len": resolve_max_model_len(config, spec), "dllm_block_length": block_length})
    paradigm = paradigm_of(spec.family)
    masked = paradigm in MASKED  # a paradigm that unmasks (renoising has no mask token)
    mask_id = resolve_mask_token_id(spec, tokenizer, resolved) if masked else None
    return EngineSetup(resolved, frozenset(config.model_fields_set), block_length, paradigm, mask_id,
                       strategy_for(spec, resolved, mask_id))


def check_engine_config(model_path: str, config: EngineConfig) -> None:
    """Raise what an engine for the checkpoint directory `model_path` would raise about `config` as it
    starts, without loading a weight: `engine_setup`'s ValueErrors, and a block length the network
    does not decode in (LLaDA2.2's block routing; the network is built on the meta device to ask it).
    A CheckpointError names what is wrong with the checkpoint itself."""
    spec = load_model_spec(model_path)
    setup = engine_setup(config, spec, load_tokenizer(model_path))
    if config.dllm_block_length is not None:  # not the checkpoint's own block: may its network take it?
        with torch.device("meta"):
            network = build_network(spec)
        if fixes_block_length(network):
            network.check_block_length(setup.block_length)
