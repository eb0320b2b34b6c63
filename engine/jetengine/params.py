"""JetEngine's settings with JetEngine's names and defaults, and what each becomes here.

`SamplingParams` is a plain dataclass, as JetEngine's is (an unknown name is a TypeError, fields can
be set after construction); `LLM(model, **config)` takes the fields of JetEngine's `Config`. The
values are checked when they become this engine's `EngineConfig` / `GenerationConfig`, with errors
naming JetEngine's field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from configs import EngineConfig, GenerationConfig
from configs.knobs import upstream_names
from engine.upstream_fields import HALF_DTYPES, engine_dtype, refuse_unsupported, validated


@dataclass
class SamplingParams:
    """JetEngine's per-request settings, with its defaults. `stop_words` are token ids; None = the
    model's end-of-sequence ids. `seed` is this engine's addition: it seeds sampling and the `random`
    remasking order (None = fresh randomness per request)."""

    temperature: float = 1.0
    max_tokens: int = 64
    ignore_eos: bool = False
    block_length: int = 4
    denoising_steps: int = 4
    dynamic_threshold: float = 0.9
    eb_threshold: float = 0.35
    topk: int = 0
    topp: float = 1.0
    repetition_penalty: float = 1.0
    remasking_strategy: str = "low_confidence_static"
    stop_words: list[int] | None = None
    seed: int | None = None


_SAMPLING_NAMES = {"max_new_tokens": "max_tokens", "top_k": "topk", "top_p": "topp", "stop_token_ids": "stop_words",
                   "random_seed": "seed", **upstream_names("jetengine.sampling")}


def to_generation_config(sp: SamplingParams) -> GenerationConfig:
    """What one SamplingParams asks of the engine. Greedy at temperature 0. JetEngine stops on
    `stop_words` when given, else on end-of-sequence; `ignore_eos` turns both off. The text keeps
    special tokens and the stop token, as JetEngine decodes every output token; `return_dllm_replay`
    lets the adapter score the rollout for its logprobs and entropies."""
    stop_ids = None if sp.ignore_eos or sp.stop_words is None else list(sp.stop_words)
    values = dict(max_new_tokens=sp.max_tokens, do_sample=True, temperature=sp.temperature, top_k=sp.topk,
                  top_p=sp.topp, repetition_penalty=sp.repetition_penalty, random_seed=sp.seed,
                  ignore_eos=sp.ignore_eos or sp.stop_words is not None, stop_token_ids=stop_ids,
                  skip_special_tokens=False, include_stop_str_in_output=True, return_dllm_replay=True,
                  **{knob: getattr(sp, name) for knob, name in upstream_names("jetengine.sampling").items()})
    return validated(GenerationConfig, values, "SamplingParams", _SAMPLING_NAMES)


@dataclass
class Config:
    """JetEngine's `Config` without `model`: the keyword arguments `LLM(model, **config)` takes, with
    JetEngine's defaults (an unknown name is a TypeError naming it)."""

    max_num_batched_tokens: int = 1024 * 128
    max_num_seqs: int = 512
    max_model_len: int = 4096
    gpu_memory_utilization: float = 0.8
    tensor_parallel_size: int = 1
    enforce_eager: bool = False
    diversity_enforce: bool = False
    epsilon_greedy: bool = False
    epsilon: float = 0.1
    diversity_enforce_barrier: int = 100
    hf_config: Any = None
    eos: int = -1
    kvcache_block_size: int = 256
    num_kvcache_blocks: int = -1
    mask_token_id: int = -1
    block_length: int = 4
    dtype: str = "auto"


# Sampling switches this engine does not implement, and fields JetEngine fills in itself; `epsilon`
# and `diversity_enforce_barrier` only tune the switches, so any value of theirs asks for nothing.
_CONFIG_UNSUPPORTED = {"diversity_enforce": False, "epsilon_greedy": False, "hf_config": None, "eos": -1}

_CONFIG_NAMES = {"max_prefill_token_num": "max_num_batched_tokens", "max_batch_size": "max_num_seqs",
                 "tp": "tensor_parallel_size", "cuda_graphs": "enforce_eager", "kv_block_size": "kvcache_block_size",
                 "num_kv_blocks": "num_kvcache_blocks", **upstream_names("jetengine.config")}


def to_engine_config(config: Config, model_max_len: int, on_cuda: bool) -> EngineConfig:
    """The EngineConfig JetEngine's Config means. `max_model_len` is clamped to the model's length;
    `gpu_memory_utilization` is the KV share of free memory (on CPU of the engine's CPU KV budget)
    unless `num_kvcache_blocks` names a page count; `mask_token_id` is used when the checkpoint names
    none (and must agree with the one it names)."""
    refuse_unsupported(config, _CONFIG_UNSUPPORTED)
    if config.dtype not in ("auto", "float32", *HALF_DTYPES):
        raise ValueError(f"Config.dtype={config.dtype!r}: use 'auto', 'bfloat16', 'float16' or 'float32'")
    if not 0.0 < config.gpu_memory_utilization <= 1.0:
        raise ValueError(f"Config.gpu_memory_utilization={config.gpu_memory_utilization!r}: must be in (0, 1]")
    values = dict(
        dtype=engine_dtype(config.dtype, on_cuda), tp=config.tensor_parallel_size, max_batch_size=config.max_num_seqs,
        max_model_len=min(config.max_model_len, model_max_len), max_prefill_token_num=config.max_num_batched_tokens,
        kv_block_size=config.kvcache_block_size, cuda_graphs=not config.enforce_eager,
        num_kv_blocks=config.num_kvcache_blocks if config.num_kvcache_blocks > 0
        else float(config.gpu_memory_utilization),
        dllm_mask_token_id=None if config.mask_token_id == -1 else config.mask_token_id,
        dllm_block_length=config.block_length)
    return validated(EngineConfig, values, "Config", _CONFIG_NAMES)
