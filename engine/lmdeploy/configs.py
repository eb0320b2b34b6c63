"""lmdeploy's configuration types with lmdeploy's names and defaults, and what each becomes here.

They are plain dataclasses, as lmdeploy's are (an unknown name is a TypeError, fields can be set
after construction); the values are checked when they are turned into this engine's pydantic
`EngineConfig` / `GenerationConfig`, with errors naming lmdeploy's field. A field lmdeploy has for a
feature this engine lacks is accepted at its default and refused at any other value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from configs import EngineConfig
from configs import GenerationConfig as EngineGenerationConfig
from configs.knobs import upstream_names
from engine.upstream_fields import HALF_DTYPES, engine_dtype, refuse_unsupported, validated


@dataclass
class PytorchEngineConfig:
    """lmdeploy's PyTorch engine settings (the ones below the line are accepted at their defaults)."""

    dtype: str = "auto"
    tp: int = 1
    session_len: int | None = None
    max_batch_size: int | None = None
    cache_max_entry_count: float = 0.8
    block_size: int = 64
    num_gpu_blocks: int = 0
    max_prefill_token_num: int = 8192
    enable_prefix_caching: bool = False
    eager_mode: bool = False
    logprobs_mode: str | None = None
    dllm_block_length: int | None = None
    dllm_unmasking_strategy: str = "low_confidence_dynamic"
    dllm_denoising_steps: int | None = None
    dllm_confidence_threshold: float = 0.85
    # ---- lmdeploy features this engine does not have, or that change nothing here
    dp: int = 1
    dp_rank: int = 0
    ep: int = 1
    prefill_interval: int = 16
    kernel_block_size: int = -1
    num_cpu_blocks: int = 0
    adapters: dict[str, str] | None = None
    thread_safe: bool = False
    device_type: str = "cuda"
    custom_module_map: dict[str, str] | None = None
    download_dir: str | None = None
    revision: str | None = None
    quant_policy: int = 0
    distributed_executor_backend: str | None = None
    empty_init: bool = False
    enable_microbatch: bool = False
    enable_eplb: bool = False
    enable_metrics: bool = True
    hf_overrides: dict[str, Any] | None = None
    language_model_only: bool = False


# Accepted only at these values: what this engine cannot do. (prefill_interval, kernel_block_size,
# num_cpu_blocks, thread_safe, device_type, download_dir, revision, distributed_executor_backend,
# empty_init, enable_metrics and language_model_only change nothing a caller sees here.)
_ENGINE_UNSUPPORTED = {"dp": 1, "dp_rank": 0, "ep": 1, "adapters": None, "custom_module_map": None,
                       "quant_policy": 0, "enable_microbatch": False, "enable_eplb": False, "hf_overrides": None}


@dataclass
class GenerationConfig:
    """lmdeploy's per-request settings, with lmdeploy's defaults (greedy unless `do_sample`)."""

    n: int = 1
    max_new_tokens: int = 512
    do_sample: bool = False
    top_p: float = 1.0
    top_k: int = 50
    min_p: float = 0.0
    temperature: float = 0.8
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    random_seed: int | None = None
    stop_words: list[str] | None = None
    bad_words: list[str] | None = None
    stop_token_ids: list[int] | None = None
    bad_token_ids: list[int] | None = None
    min_new_tokens: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logprobs: int | None = None
    response_format: dict | None = None
    logits_processors: list | None = None
    output_logits: str | None = None
    output_last_hidden_state: str | None = None
    include_stop_str_in_output: bool = False
    return_ppl: bool = False
    with_cache: bool = False
    preserve_cache: bool = False
    migration_request: Any = None
    return_routed_experts: bool = False
    repetition_ngram_size: int = 0
    repetition_ngram_threshold: int = 0


_GENERATION_UNSUPPORTED = {"n": 1, "bad_words": None, "bad_token_ids": None, "response_format": None,
                           "logits_processors": None, "output_logits": None, "output_last_hidden_state": None,
                           "return_ppl": False, "with_cache": False, "preserve_cache": False,
                           "migration_request": None, "return_routed_experts": False,
                           "repetition_ngram_size": 0, "repetition_ngram_threshold": 0}


@dataclass
class ChatTemplateConfig:
    """lmdeploy's chat template settings. Prompts are rendered with the checkpoint's own chat template
    (lmdeploy's `hf` template); `meta_instruction` becomes the system message. The fields that spell
    out another template are refused when set."""

    model_name: str | None = None
    model_path: str | None = None
    system: str | None = None
    meta_instruction: str | None = None
    eosys: str | None = None
    user: str | None = None
    eoh: str | None = None
    assistant: str | None = None
    eoa: str | None = None
    tool: str | None = None
    eotool: str | None = None
    separator: str | None = None
    capability: str | None = None
    stop_words: list[str] | None = None


_TEMPLATE_UNSUPPORTED = {name: None for name in ("system", "eosys", "user", "eoh", "assistant", "eoa", "tool",
                                                 "eotool", "separator", "capability", "stop_words")}


_ENGINE_NAMES = {"max_model_len": "session_len", "kv_block_size": "block_size", "num_kv_blocks":
                 "cache_max_entry_count", "cuda_graphs": "eager_mode"}


def to_engine_config(config: PytorchEngineConfig, on_cuda: bool) -> EngineConfig:
    """The EngineConfig lmdeploy's settings mean. `cache_max_entry_count` is the KV share of free memory
    (on CPU of the engine's CPU KV budget) unless `num_gpu_blocks` names a page count."""
    refuse_unsupported(config, _ENGINE_UNSUPPORTED)
    if config.dtype not in ("auto", "float32", *HALF_DTYPES):
        raise ValueError(f"PytorchEngineConfig.dtype={config.dtype!r}: use 'auto', 'float16', 'bfloat16' or 'float32'")
    if not 0.0 < config.cache_max_entry_count <= 1.0:
        raise ValueError(f"PytorchEngineConfig.cache_max_entry_count={config.cache_max_entry_count!r}: "
                         "the KV share of free memory must be in (0, 1]")
    values: dict[str, Any] = dict(
        dtype=engine_dtype(config.dtype, on_cuda), tp=config.tp, max_model_len=config.session_len,
        kv_block_size=config.block_size, max_prefill_token_num=config.max_prefill_token_num,
        num_kv_blocks=config.num_gpu_blocks if config.num_gpu_blocks > 0 else float(config.cache_max_entry_count),
        enable_prefix_caching=config.enable_prefix_caching, cuda_graphs=not config.eager_mode,
        logprobs_mode=config.logprobs_mode,
        **{knob: getattr(config, name) for knob, name in upstream_names("lmdeploy").items()})
    if config.max_batch_size is not None:
        values["max_batch_size"] = config.max_batch_size
    return validated(EngineConfig, values, "PytorchEngineConfig", _ENGINE_NAMES)


_SHARED_GENERATION_FIELDS = ("max_new_tokens", "do_sample", "top_p", "top_k", "min_p", "temperature",
                             "repetition_penalty", "ignore_eos", "random_seed", "stop_words", "stop_token_ids",
                             "skip_special_tokens", "logprobs", "include_stop_str_in_output")


# filters that act only when sampling: a greedy request leaves them at the engine's defaults, so that a
# model that refuses them when set (e.g. Nemotron-Labs-Diffusion's diffusion mode) takes lmdeploy's defaults
_SAMPLING_OFF = {"top_p": 1.0, "top_k": 0, "min_p": 0.0}


def to_generation_config(config: GenerationConfig) -> EngineGenerationConfig:
    """The engine's GenerationConfig for one lmdeploy GenerationConfig (same names, same meaning)."""
    refuse_unsupported(config, _GENERATION_UNSUPPORTED)
    values = {name: getattr(config, name) for name in _SHARED_GENERATION_FIELDS}
    values["min_new_tokens"] = config.min_new_tokens or 0
    engine_config = validated(EngineGenerationConfig, values, "GenerationConfig", {})
    if not config.do_sample:  # lmdeploy decodes greedily then, whatever its sampling filters say
        engine_config = engine_config.model_copy(update=_SAMPLING_OFF)
    return engine_config


def chat_messages(prompt: str | list[dict[str, Any]], template: ChatTemplateConfig | None) -> list[dict[str, Any]]:
    """One prompt as the message list the chat template renders (a str is one user turn)."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if template is not None and template.meta_instruction is not None \
            and not any(m.get("role") == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": template.meta_instruction})
    return messages


def check_template(template: ChatTemplateConfig | None) -> None:
    if template is not None:
        refuse_unsupported(template, _TEMPLATE_UNSUPPORTED)
