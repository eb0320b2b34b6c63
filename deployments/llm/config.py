"""Ray Serve LLM's configuration shapes (`ray.serve.llm`'s LLMConfig, ModelLoadingConfig,
LLMServingArgs) and what each becomes here: one `deployments.app` application's arguments per model.

`engine_kwargs` take vLLM's names where they apply (`tensor_parallel_size`, `max_model_len`,
`block_size`, `max_num_seqs`, `max_num_batched_tokens`, `gpu_memory_utilization`,
`enable_prefix_caching`, `dtype`, `enforce_eager`, `trust_remote_code`) and EngineConfig's own names.
Fields for features this engine lacks (LoRA, custom server classes, ...) are refused when set.
"""

from __future__ import annotations

import os
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from configs import EngineConfig
from engine.upstream_fields import refuse_unsupported, validated

# vLLM's engine argument -> EngineConfig's field
VLLM_NAMES = {"tensor_parallel_size": "tp", "block_size": "kv_block_size", "max_num_seqs": "max_batch_size",
              "max_num_batched_tokens": "max_prefill_token_num", "gpu_memory_utilization": "num_kv_blocks"}
VLLM_DTYPES = {"half": "float16", "float": "float32"}
# Serve deployment options a model's deployment_config may set (they size the engine replicas)
DEPLOYMENT_OPTIONS = ("num_replicas", "autoscaling_config", "ray_actor_options", "max_ongoing_requests",
                      "max_queued_requests", "health_check_period_s", "health_check_timeout_s",
                      "graceful_shutdown_wait_loop_s", "graceful_shutdown_timeout_s")

# A model's own ingress only answers what the front ingress forwards: a small share of a CPU, anywhere
MODEL_INGRESS = {"ray_actor_options": {"num_cpus": 0.1}}


class ModelLoadingConfig(BaseModel):
    """`model_id`: the name clients send as OpenAI's `model`; `model_source`: the checkpoint (a local
    directory or a Hugging Face model id; default: `model_id`)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model_id: str
    model_source: str | None = None
    tokenizer_source: str | None = None

    @model_validator(mode="after")
    def _tokenizer_is_the_models(self) -> ModelLoadingConfig:
        if self.tokenizer_source not in (None, self.model_source, self.model_id):
            raise ValueError("tokenizer_source: the tokenizer is read from the checkpoint; leave tokenizer_source "
                             "unset (or equal to model_source)")
        return self


class LLMConfig(BaseModel):
    """One model of the application, in Ray Serve LLM's shape."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model_loading_config: ModelLoadingConfig
    engine_kwargs: dict[str, Any] = Field(default_factory=dict)
    deployment_config: dict[str, Any] = Field(default_factory=dict)
    accelerator_type: str | None = None
    runtime_env: dict[str, Any] | None = None
    llm_engine: str = "vLLM"
    log_engine_metrics: bool | None = True
    # Ray Serve LLM features this engine does not have: accepted only unset
    accelerator_config: dict[str, Any] | None = None
    placement_group_config: dict[str, Any] | None = None
    lora_config: dict[str, Any] | None = None
    server_cls: Any = None
    # of Ray Serve LLM's experimental settings, only `stream_batching_interval_ms` (the app argument)
    experimental_configs: dict[str, Any] = Field(default_factory=dict)
    callback_config: dict[str, Any] | None = None

    @field_validator("accelerator_config", mode="before")
    @classmethod
    def _no_accelerator_config(cls, value: Any) -> Any:
        return value or None  # ray.serve.llm's LLMConfig fills in an empty one

    @property
    def model_id(self) -> str:
        return self.model_loading_config.model_id

    @classmethod
    def from_file(cls, path: str) -> LLMConfig:
        with open(path) as f:
            return cls.model_validate(yaml.safe_load(f))


_UNSUPPORTED = {"accelerator_config": None, "placement_group_config": None, "lora_config": None, "server_cls": None,
                "callback_config": None}
_EXPERIMENTAL = ("stream_batching_interval_ms",)  # the `experimental_configs` keys taken (as app arguments)


def _as_llm_config(value: Any) -> LLMConfig:
    """An LLMConfig from a dict, a YAML file path, or an LLMConfig (this module's or ray.serve.llm's)."""
    if isinstance(value, LLMConfig):
        return value
    if isinstance(value, str):
        if not os.path.exists(value):
            raise ValueError(f"llm_configs: {value!r} is not a file (a YAML file of one LLMConfig)")
        return LLMConfig.from_file(value)
    if isinstance(value, BaseModel):  # ray.serve.llm.LLMConfig: the same fields
        return LLMConfig.model_validate(value.model_dump(exclude_defaults=True))
    return LLMConfig.model_validate(value)


class LLMServingArgs(BaseModel):
    """`build_openai_app`'s argument: the models, and the Serve options of the HTTP ingress in front."""

    model_config = ConfigDict(extra="forbid")

    llm_configs: list[LLMConfig]
    ingress_deployment_config: dict[str, Any] = Field(default_factory=dict)
    ingress_cls_config: dict[str, Any] | None = None

    @field_validator("llm_configs", mode="before")
    @classmethod
    def _configs(cls, value: Any) -> list[LLMConfig]:
        return [_as_llm_config(v) for v in value]

    @model_validator(mode="after")
    def _check(self) -> LLMServingArgs:
        if not self.llm_configs:
            raise ValueError("llm_configs is empty: list at least one model")
        ids = [c.model_id for c in self.llm_configs]
        duplicates = sorted({i for i in ids if ids.count(i) > 1})
        if duplicates:
            raise ValueError(f"llm_configs: model ids must be unique; {duplicates} appear more than once")
        if self.ingress_cls_config:
            raise ValueError("ingress_cls_config: this application's ingress cannot be replaced; leave it unset")
        return self


def engine_args(kwargs: dict[str, Any]) -> dict[str, Any]:
    """EngineConfig's fields for vLLM-style `engine_kwargs` (checked; errors name the caller's key)."""
    engine = {VLLM_NAMES.get(k, k): v for k, v in kwargs.items() if k not in ("enforce_eager", "trust_remote_code")}
    if "enforce_eager" in kwargs:
        engine["cuda_graphs"] = not kwargs["enforce_eager"]
    if "dtype" in engine:
        engine["dtype"] = VLLM_DTYPES.get(engine["dtype"], engine["dtype"])
    if "gpu_memory_utilization" in kwargs:
        engine["num_kv_blocks"] = float(kwargs["gpu_memory_utilization"])
    names = {ours: theirs for theirs, ours in VLLM_NAMES.items()} | {"cuda_graphs": "enforce_eager"}
    validated(EngineConfig, engine, "engine_kwargs", names)
    return engine


def app_args(config: LLMConfig) -> dict[str, Any]:
    """`deployments.app` arguments serving one LLMConfig's model under its `model_id`."""
    refuse_unsupported(config, _UNSUPPORTED)
    unknown = sorted(set(config.deployment_config) - set(DEPLOYMENT_OPTIONS))
    if unknown:
        raise ValueError(f"deployment_config: {unknown} are not supported here; use {', '.join(DEPLOYMENT_OPTIONS)}")
    loading = config.model_loading_config
    args: dict[str, Any] = {"model": loading.model_source or loading.model_id, "served_model_name": loading.model_id,
                            "engine": engine_args(config.engine_kwargs), "ingress": MODEL_INGRESS,
                            **config.deployment_config}
    actor = dict(args.get("ray_actor_options") or {})
    if config.accelerator_type is not None:
        actor["accelerator_type"] = config.accelerator_type
    if config.runtime_env is not None:
        actor["runtime_env"] = config.runtime_env
    if actor:
        args["ray_actor_options"] = actor
    unknown = sorted(set(config.experimental_configs) - set(_EXPERIMENTAL))
    if unknown:
        raise ValueError(f"LLMConfig.experimental_configs: {unknown} are not supported by this engine; it takes "
                         f"{', '.join(_EXPERIMENTAL)}")
    args.update(config.experimental_configs)
    return args
