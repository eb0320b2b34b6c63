"""`build_openai_app`: Ray Serve LLM's application builder, serving this engine.

A Ray Serve LLM config serves here by changing its `import_path` to
`deployments.llm:build_openai_app`: each LLMConfig becomes one model (its engine replicas and its
ingress, built by `deployments.app` exactly as a single-model application), and one front ingress
routes requests to them by OpenAI's `model`.
"""

from __future__ import annotations

from typing import Any

from ray.serve import Application

from deployments.app import build_app_with
from deployments.llm.config import LLMConfig, LLMServingArgs, app_args
from deployments.llm.forwarding import ModelIngress
from deployments.llm.router import ModelRouter

# Serve options of the front ingress that `ingress_deployment_config` may set
INGRESS_OPTIONS = ("num_replicas", "autoscaling_config", "ray_actor_options", "max_ongoing_requests",
                   "max_queued_requests")


def build_openai_app(llm_serving_args: dict[str, Any] | LLMServingArgs) -> Application:
    """Ray Serve LLM's `build_openai_app`: `{"llm_configs": [...], "ingress_deployment_config": {...}}`
    (each config a dict, an LLMConfig, or a YAML file path) or an LLMServingArgs."""
    args = llm_serving_args if isinstance(llm_serving_args, LLMServingArgs) \
        else LLMServingArgs.model_validate(llm_serving_args)
    unknown = sorted(set(args.ingress_deployment_config) - set(INGRESS_OPTIONS))
    if unknown:
        raise ValueError(f"ingress_deployment_config: {unknown} are not supported; use {', '.join(INGRESS_OPTIONS)}")
    models = {config.model_id: _model_app(config) for config in args.llm_configs}
    return ModelRouter.options(**args.ingress_deployment_config).bind(models)


def _model_app(config: LLMConfig) -> Application:
    return build_app_with(app_args(config), ModelIngress)
