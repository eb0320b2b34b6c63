"""`build_app(args)`: the Serve application builder named in serve_config.yaml and used by the
`blockserve serve` CLI (docs/deploy.md, which also explains the placement, routing, overload and
autoscaling knobs below).

    args = {
        "model": PATH,                       # checkpoint directory (relative: cwd, then the repo root) or a
                                             # Hugging Face model id (the local HF cache, else a download)
        "served_model_name": None,           # default: the last component of `model` as given
        "engine": {EngineConfig fields},     # tp > 1 -> one placement-group bundle per rank
        "num_replicas": 1,                   # data-parallel EngineServer replicas ...
        "autoscaling_config": None,          # ... or Serve autoscaling instead of a fixed count
        "ray_actor_options": None,           # EngineServer replica (rank 0) resources; default 1 CPU (+1 GPU)
        "tp_worker_actor_options": None,     # each TP worker (rank 1..tp-1); default: as ray_actor_options
        "placement_strategy": "STRICT_PACK", # a TP group on one node; PACK: may span nodes
        "request_router": "prefix_aware",    # or "power_of_two" (Serve's default)
        "request_router_kwargs": {},         # deployments.router.PrefixAffinityRouter.initialize_state
        "max_ongoing_requests": 512,         # per EngineServer replica
        "max_queued_requests": -1,           # per caller, waiting for a replica; beyond: BackPressureError
        "graceful_shutdown_wait_loop_s": 2, "graceful_shutdown_timeout_s": 60,   # draining a removed replica
        "tp_timeout_s": 60, "stall_timeout_s": 60,   # a TP forward / an engine loop stuck this long fails
        "health_check_period_s": 5, "health_check_timeout_s": 30,   # Serve's health check of EngineServer
        "incremental_streaming_output": False,   # /generate streams deltas (SGLang's flag), not cumulative chunks
        "enable_memory_saver": False,        # SGLang's flag, reported in /server_info (release works either way)
        "ingress": {"max_batch_size": 16, "batch_wait_timeout_s": 0.005, "api_key": None,
                    "max_body_bytes": 8388608, "max_concurrent_requests": None, "max_queued_requests": None,
                    "retry_after_s": 1, "max_ongoing_requests": 1024, "num_replicas": 1,
                    "ray_actor_options": {"num_cpus": 0.5, "resources": {"node:__internal_head__": 0.001}}},
    }                                        # the ingress's default options pin it to the head node
"""

from __future__ import annotations

import copy
from pathlib import PurePath
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from ray.serve import Application, Deployment

from configs import EngineConfig
from deployments.engine_server import EngineServer
from deployments.http import DEFAULT_MAX_BODY_BYTES, RETRY_AFTER_S
from deployments.ingress import Ingress
from deployments.placement import (
    INGRESS_ACTOR_OPTIONS,
    Group,
    Strategy,
    actor_resources,
    bundle_of,
    check_fits,
    cluster_nodes,
)
from deployments.single_machine import check_serve_port_not_shared
from engine.model.source import resolve_model_path

ROUTERS = {"prefix_aware": "deployments.router:PrefixAffinityRouter",
           "power_of_two": "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter"}


class IngressArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_batch_size: int = Field(16, ge=1)
    batch_wait_timeout_s: float = Field(0.005, ge=0.0)
    api_key: str | None = None
    max_body_bytes: int = Field(DEFAULT_MAX_BODY_BYTES, ge=1024)
    # Generation requests in flight per ingress replica; beyond it 429 + Retry-After in the error JSON.
    # Counted by the ingress itself: Serve's own limits below count every route, and /health, /metrics
    # and the RL control routes must stay reachable while generation is full. None = no limit.
    max_concurrent_requests: int | None = Field(None, ge=1)
    # Serve's limits of the ingress deployment (all routes): requests one ingress replica handles at
    # once, and how many more wait in each proxy before it answers 429 + Retry-After (None: no bound).
    max_ongoing_requests: int = Field(1024, ge=1)
    max_queued_requests: int | None = Field(None, ge=1)
    retry_after_s: int = Field(RETRY_AFTER_S, ge=0)
    num_replicas: int = Field(1, ge=1)
    # default: on the head node (deployments.placement); options of your own place it as they say
    ray_actor_options: dict[str, Any] = Field(default_factory=lambda: copy.deepcopy(INGRESS_ACTOR_OPTIONS))


class AppArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    served_model_name: str | None = None
    engine: dict[str, Any] = Field(default_factory=dict)
    num_replicas: int = Field(1, ge=1)
    autoscaling_config: dict[str, Any] | None = None
    ray_actor_options: dict[str, Any] | None = None
    tp_worker_actor_options: dict[str, Any] | None = None
    placement_strategy: Strategy = "STRICT_PACK"
    request_router: Literal["prefix_aware", "power_of_two"] = "prefix_aware"
    request_router_kwargs: dict[str, Any] = Field(default_factory=dict)
    max_ongoing_requests: int = Field(512, ge=1)
    max_queued_requests: int = Field(-1, ge=-1)
    graceful_shutdown_wait_loop_s: float = Field(2.0, gt=0.0)
    graceful_shutdown_timeout_s: float = Field(60.0, gt=0.0)
    tp_timeout_s: float = Field(60.0, gt=0.0)
    stall_timeout_s: float = Field(60.0, gt=0.0)
    hold_timeout_s: float | None = Field(
        None, gt=0.0, description="a request waiting this long while generation is paused or memory released "
        "gets 503 + Retry-After (None: it waits)")
    health_check_period_s: float = Field(5.0, gt=0.0)
    health_check_timeout_s: float = Field(30.0, gt=0.0)
    # SGLang's --incremental-streaming-output: /generate streams deltas instead of cumulative chunks
    incremental_streaming_output: bool = False
    stream_batching_interval_ms: float = Field(
        0.0, ge=0.0, description="a stream's deltas that come within this many milliseconds of the previous one "
        "go as one delta, as Ray Serve LLM's stream batching (0: each delta as the engine makes it)")
    # SGLang's --enable-memory-saver as /server_info reports it: slime checks it against its --offload-rollout.
    # release_memory_occupation frees memory either way.
    enable_memory_saver: bool = False
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
    """Serve options for EngineServer: replicas, overload and draining limits, the request router, and
    for tp > 1 a placement group with one bundle per rank (rank 0 = the replica itself in bundle 0,
    workers in bundles 1..tp-1) placed with `placement_strategy`."""
    gpu = _wants_gpu(config)
    actor = {"num_cpus": 1, **({"num_gpus": 1} if gpu else {})}
    actor.update(args.ray_actor_options or {})
    options: dict[str, Any] = {
        "ray_actor_options": actor, "max_ongoing_requests": args.max_ongoing_requests,
        "max_queued_requests": args.max_queued_requests,
        "graceful_shutdown_wait_loop_s": args.graceful_shutdown_wait_loop_s,
        "graceful_shutdown_timeout_s": args.graceful_shutdown_timeout_s,
        "health_check_period_s": args.health_check_period_s, "health_check_timeout_s": args.health_check_timeout_s,
        "request_router_config": {"request_router_class": ROUTERS[args.request_router],
                                  "request_router_kwargs": args.request_router_kwargs}}
    if args.autoscaling_config is not None:
        options["autoscaling_config"] = args.autoscaling_config
    else:
        options["num_replicas"] = args.num_replicas
    if config.tp > 1:
        worker = {"num_cpus": 1, **({"num_gpus": 1} if gpu else {})}
        worker.update(args.tp_worker_actor_options or args.ray_actor_options or {})
        options["placement_group_bundles"] = [bundle_of(actor)] + [bundle_of(worker)] * (config.tp - 1)
        options["placement_group_strategy"] = args.placement_strategy
    return options


def tp_worker_options(options: dict[str, Any]) -> dict[str, Any]:
    """Resources of one TP worker actor: exactly its bundle."""
    bundles = options.get("placement_group_bundles")
    return actor_resources(bundles[1]) if bundles else {}


def _initial_replicas(options: dict[str, Any]) -> int:
    scaling = options.get("autoscaling_config")
    if scaling is None:
        return options["num_replicas"]
    return max(1, scaling.get("initial_replicas") or scaling.get("min_replicas", 1))


def placement_groups(options: dict[str, Any], ingress: IngressArgs) -> list[Group]:
    """What the application must place at once: the ingress replicas and the first engine replicas."""
    bundles = options.get("placement_group_bundles") or [bundle_of(options["ray_actor_options"])]
    together = options.get("placement_group_strategy", "STRICT_PACK") == "STRICT_PACK"
    tp = len(bundles)
    engines = [Group(f"EngineServer replica {i + 1} (tp={tp}, {options.get('placement_group_strategy', 'one actor')})",
                     tuple(bundles), together) for i in range(_initial_replicas(options))]
    ingresses = [Group(f"Ingress replica {i + 1}", (bundle_of(ingress.ray_actor_options),), True)
                 for i in range(ingress.num_replicas)]
    return engines + ingresses


def ingress_options(ing: IngressArgs) -> dict[str, Any]:
    """Serve options for the ingress: its own max_ongoing_requests / max_queued_requests (every route),
    beyond which Serve's proxy answers 429 + Retry-After."""
    return {"num_replicas": ing.num_replicas, "ray_actor_options": ing.ray_actor_options,
            "max_ongoing_requests": ing.max_ongoing_requests,
            "max_queued_requests": -1 if ing.max_queued_requests is None else ing.max_queued_requests,
            "backpressure_config": {"status_code": 429, "retry_after_s": ing.retry_after_s}}


def build_app(args: dict[str, Any]) -> Application:
    return build_app_with(args, Ingress)


def build_app_with(args: dict[str, Any], ingress: Deployment, server: Deployment = EngineServer) -> Application:
    """`build_app` with another ingress deployment taking Ingress's arguments (deployments.llm's
    per-model ingress, for several models in one application), or another engine replica deployment
    taking EngineServer's (deployments.drills, for fault drills)."""
    try:
        parsed = AppArgs.model_validate(args)
        config = EngineConfig(**parsed.engine)
    except ValidationError as e:
        raise ValueError(f"invalid blockserve application args: {e}") from None
    model = resolve_model_path(parsed.model)
    options = engine_server_options(parsed, config)
    nodes = cluster_nodes()
    if nodes is not None:  # not connected (a dry build): Serve checks nothing either
        check_fits(placement_groups(options, parsed.ingress), nodes)
        check_serve_port_not_shared()
    engines = server.options(**options).bind(
        # only the fields given: the engine applies the model family's decoding defaults to the others
        model, config.model_dump(exclude_unset=True), tp_timeout_s=parsed.tp_timeout_s,
        stall_timeout_s=parsed.stall_timeout_s,
        tp_worker_options=tp_worker_options(options), hold_timeout_s=parsed.hold_timeout_s,
        stream_batching_interval_ms=parsed.stream_batching_interval_ms)
    ing = parsed.ingress
    return ingress.options(**ingress_options(ing)).bind(
        engines, model, served_model_name=parsed.served_model_name or PurePath(parsed.model).name,
        max_batch_size=ing.max_batch_size, batch_wait_timeout_s=ing.batch_wait_timeout_s, api_key=ing.api_key,
        max_body_bytes=ing.max_body_bytes, max_concurrent_requests=ing.max_concurrent_requests,
        retry_after_s=ing.retry_after_s, incremental_streaming_output=parsed.incremental_streaming_output,
        enable_memory_saver=parsed.enable_memory_saver)
