"""`build_app(args)`: the Serve application builder named in serve_config.yaml and used by the
`blockserve serve` CLI (docs/deploy.md).

    args = {
        "model": PATH,                       # checkpoint directory (relative: cwd, then the repo root) or a
                                             # Hugging Face model id (the local HF cache, else a download)
        "served_model_name": None,           # default: the last component of `model` as given
        "engine": {EngineConfig fields},     # tp > 1 -> one placement-group bundle per shard
        "num_replicas": 1,                   # data-parallel EngineServer replicas ...
        "autoscaling_config": None,          # ... or Serve autoscaling instead of a fixed count
        "ray_actor_options": None,           # EngineServer replica (rank 0) resources; default 1 CPU (+1 GPU)
        "max_ongoing_requests": 512,         # per EngineServer replica
        "tp_timeout_s": 60, "stall_timeout_s": 60,   # a TP forward / an engine loop stuck this long fails
        "health_check_period_s": 5, "health_check_timeout_s": 30,   # Serve's health check of EngineServer
        "debug_hooks": False,                # True: EngineServer.debug_stall (handle only; for fault drills)
        "ingress": {"max_batch_size": 16, "batch_wait_timeout_s": 0.005, "api_key": None,
                    "max_body_bytes": 8388608, "max_concurrent_requests": None, "retry_after_s": 1,
                    "max_ongoing_requests": 1024, "num_replicas": 1, "ray_actor_options": {"num_cpus": 0.5}},
    }
"""

from __future__ import annotations

from pathlib import PurePath
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from ray.serve import Application

from configs import EngineConfig
from deployments.engine_server import EngineServer
from deployments.ingress import DEFAULT_MAX_BODY_BYTES, RETRY_AFTER_S, Ingress
from engine.model_source import resolve_model_path


class IngressArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_batch_size: int = Field(16, ge=1)
    batch_wait_timeout_s: float = Field(0.005, ge=0.0)
    api_key: str | None = None
    max_body_bytes: int = Field(DEFAULT_MAX_BODY_BYTES, ge=1024)
    # Admission control per ingress replica: beyond this many generation requests in flight, answer
    # 429 with Retry-After instead of queueing without bound. None = no limit.
    max_concurrent_requests: int | None = Field(None, ge=1)
    retry_after_s: int = Field(RETRY_AFTER_S, ge=0)
    max_ongoing_requests: int = Field(1024, ge=1)  # Serve's own cap (raised above max_concurrent_requests)
    num_replicas: int = Field(1, ge=1)
    ray_actor_options: dict[str, Any] = Field(default_factory=lambda: {"num_cpus": 0.5})


class AppArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    served_model_name: str | None = None
    engine: dict[str, Any] = Field(default_factory=dict)
    num_replicas: int = Field(1, ge=1)
    autoscaling_config: dict[str, Any] | None = None
    ray_actor_options: dict[str, Any] | None = None
    max_ongoing_requests: int = Field(512, ge=1)
    tp_timeout_s: float = Field(60.0, gt=0.0)
    stall_timeout_s: float = Field(60.0, gt=0.0)
    health_check_period_s: float = Field(5.0, gt=0.0)
    health_check_timeout_s: float = Field(30.0, gt=0.0)
    debug_hooks: bool = False
    hold_timeout_s: float | None = Field(None, gt=0.0)  # paused/released: a request waits this long, then 503
    ingress: IngressArgs = Field(default_factory=IngressArgs)


def _wants_gpu(config: EngineConfig) -> bool:
    if config.device != "auto":
        return config.device == "cuda"
    try:
        import ray

        return ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0
    except Exception:  # noqa: BLE001 - no cluster to ask: assume CPU
        return False


def engine_server_options(args: AppArgs, config: EngineConfig) -> dict[str, Any]:
    """Serve options for EngineServer: replicas, and for tp > 1 a PACKed placement group with one
    bundle per shard (rank 0 = the replica itself in bundle 0, workers in bundles 1..tp-1)."""
    gpu = _wants_gpu(config)
    actor = {"num_cpus": 1, **({"num_gpus": 1} if gpu else {})}
    actor.update(args.ray_actor_options or {})
    options: dict[str, Any] = {"ray_actor_options": actor, "max_ongoing_requests": args.max_ongoing_requests,
                               "health_check_period_s": args.health_check_period_s,
                               "health_check_timeout_s": args.health_check_timeout_s}
    if args.autoscaling_config is not None:
        options["autoscaling_config"] = args.autoscaling_config
    else:
        options["num_replicas"] = args.num_replicas
    if config.tp > 1:
        bundle = {"CPU": actor.get("num_cpus", 1)}
        if actor.get("num_gpus"):
            bundle["GPU"] = actor["num_gpus"]
        options["placement_group_bundles"] = [dict(bundle) for _ in range(config.tp)]
        options["placement_group_strategy"] = "PACK"
    return options


def tp_worker_options(options: dict[str, Any]) -> dict[str, Any]:
    """Resources of one TP worker actor: exactly one bundle."""
    bundles = options.get("placement_group_bundles")
    if not bundles:
        return {}
    return {"num_cpus": bundles[0].get("CPU", 0), "num_gpus": bundles[0].get("GPU", 0)}


def build_app(args: dict[str, Any]) -> Application:
    try:
        parsed = AppArgs.model_validate(args)
        config = EngineConfig(**parsed.engine)
    except ValidationError as e:
        raise ValueError(f"invalid blockserve application args: {e}") from None
    model = resolve_model_path(parsed.model)
    options = engine_server_options(parsed, config)
    server = EngineServer.options(**options).bind(
        model, config.model_dump(), tp_timeout_s=parsed.tp_timeout_s, stall_timeout_s=parsed.stall_timeout_s,
        tp_worker_options=tp_worker_options(options), debug_hooks=parsed.debug_hooks,
        hold_timeout_s=parsed.hold_timeout_s)
    ing = parsed.ingress
    # Serve must hand the ingress every request, so that admission control (not Serve's queue) decides.
    ongoing = max(ing.max_ongoing_requests, (ing.max_concurrent_requests or 0) + 64)
    return Ingress.options(num_replicas=ing.num_replicas, ray_actor_options=ing.ray_actor_options,
                           max_ongoing_requests=ongoing).bind(
        server, model, served_model_name=parsed.served_model_name or PurePath(parsed.model).name,
        max_model_len=config.max_model_len,
        max_batch_size=ing.max_batch_size, batch_wait_timeout_s=ing.batch_wait_timeout_s, api_key=ing.api_key,
        max_body_bytes=ing.max_body_bytes, max_concurrent_requests=ing.max_concurrent_requests,
        retry_after_s=ing.retry_after_s)

