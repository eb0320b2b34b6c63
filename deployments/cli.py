"""`blockserve serve MODEL [options]`, in the conventions of `vllm serve` and SGLang's launcher.

It builds the application serve_config.yaml describes (`deployments.app:build_app`, application
`blockserve` at route `/`) and runs it until Ctrl-C, like `serve run`. MODEL is a checkpoint directory
or a Hugging Face model id. `--config FILE` reads app args from YAML (the presets in configs/, or the
`args` of an application in a Serve config); flags override it. Every EngineConfig field is a flag in
kebab-case (`--max-model-len 1024`, `--logprobs-mode raw_logprobs`, `--no-enable-prefix-caching`).
The Ray cluster is the one RAY_ADDRESS names, else a new one on this machine whose every port listens on
127.0.0.1 only (`deployments.single_machine`). Before a new cluster starts, the HTTP port is checked and
MODEL resolved and checked (a directory with config.json, weights and tokenizer.json, or a Hugging Face
id), and the engine settings checked against the model as its engine would check them (a block size it
does not decode in, say): a port in use, a model not found or a setting it cannot take ends the command
at once with one line naming it. Once the application answers, it prints one line with its URL and the
Ray cluster's address (what RAY_ADDRESS must be for a Serve handle client); an application that cannot
be built or placed ends the command with the reason, exit status 1.
"""

from __future__ import annotations

import argparse
import os
import time
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from configs import EngineConfig
from deployments.sglang import dllm_algorithm
from deployments.single_machine import CONTROLLER_OPTIONS, PortInUseError, check_port_free, start_local_ray

APP_NAME = "blockserve"
NONE_WORDS = {"none", "null"}


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def _choices(annotation: Any) -> list[str] | None:
    """The values a Literal field (or an optional one: then also "none") allows."""
    for a in (annotation, *typing.get_args(annotation)):
        if typing.get_origin(a) is typing.Literal:
            optional = type(None) in typing.get_args(annotation)
            return [str(v) for v in typing.get_args(a)] + (["none"] if optional else [])
    return None


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field; values are validated by EngineConfig itself."""
    group = parser.add_argument_group("engine (EngineConfig fields; docs/config-reference.md)")
    for name, info in EngineConfig.model_fields.items():
        kw: dict[str, Any] = {"dest": f"engine.{name}", "default": argparse.SUPPRESS,
                              "help": info.description or f"default: {info.default!r}"}
        if info.annotation is bool:
            group.add_argument(_flag(name), action=argparse.BooleanOptionalAction, **kw)
        else:
            choices = _choices(info.annotation)  # argparse lists choices unless a metavar hides them
            group.add_argument(_flag(name), choices=choices, **({} if choices else {"metavar": name.upper()}), **kw)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="blockserve", description="blockserve: serve diffusion (SDAR, LLaDA2, "
                                     "Fast-dLLM v2, DiffusionGemma) and autoregressive (Qwen3, Qwen3-MoE) "
                                     "models on Ray Serve.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a model over HTTP (blocks until Ctrl-C)")
    serve.add_argument("model", nargs="?", help="checkpoint directory or Hugging Face model id (or in --config)")
    serve.add_argument("--config", type=Path, help="YAML app args, e.g. configs/qwen3-tiny.yaml")
    serve.add_argument("--host", default="127.0.0.1", help="HTTP host (default: loopback only)")
    serve.add_argument("--port", type=int, default=8000,
                       help="HTTP port (default: 8000); a port already taken is refused before anything starts")
    serve.add_argument("--served-model-name", dest="served_model_name", default=argparse.SUPPRESS)
    serve.add_argument("--num-replicas", dest="num_replicas", type=int, default=argparse.SUPPRESS,
                       help="data-parallel engine replicas")
    serve.add_argument("--api-key", dest="ingress.api_key", default=argparse.SUPPRESS,
                       help="require 'Authorization: Bearer KEY' on every route but /health")
    place = serve.add_argument_group("placement (docs/deploy.md)")
    place.add_argument("--num-cpus", dest="ray_actor_options.num_cpus", type=float, default=argparse.SUPPRESS,
                       help="CPUs each engine rank reserves (ray_actor_options.num_cpus; default 1)")
    place.add_argument("--num-gpus", dest="ray_actor_options.num_gpus", type=float, default=argparse.SUPPRESS,
                       help="GPUs each engine rank reserves (ray_actor_options.num_gpus; default 1 on a cluster "
                       "with GPUs, else 0)")
    place.add_argument("--placement-strategy", dest="placement_strategy", choices=["STRICT_PACK", "PACK"],
                       default=argparse.SUPPRESS,
                       help="tp > 1: STRICT_PACK (default) keeps a replica's ranks on one node, PACK may span nodes")
    _add_engine_flags(serve)
    dllm_algorithm.add_flags(serve)
    return parser


def _preset(path: Path) -> dict[str, Any]:
    """App args from YAML: a preset (the args themselves) or a Serve config (its `blockserve` app)."""
    data = yaml.safe_load(path.read_text()) or {}
    if "applications" in data:
        apps = {a.get("name"): a for a in data["applications"]}
        data = (apps.get(APP_NAME) or next(iter(apps.values())))["args"]
    return data


def app_args(ns: argparse.Namespace) -> dict[str, Any]:
    """The build_app args of a parsed command line: --config, then MODEL and the flags over it."""
    args = _preset(ns.config) if ns.config else {}
    if ns.model:
        args["model"] = ns.model
    if "model" not in args:
        raise SystemExit("blockserve serve: give MODEL (a checkpoint directory or a Hugging Face id) or --config")
    for key, value in vars(ns).items():
        section, _, name = key.partition(".")
        if section in ("engine", "ingress", "ray_actor_options"):
            if section == "engine" and isinstance(value, str) and value.lower() in NONE_WORDS:
                value = None
            args[section] = {**(args.get(section) or {}), name: value}
        elif key in ("served_model_name", "num_replicas", "placement_strategy"):
            args[key] = value
    dllm_algorithm.apply(ns, args)
    return args


def _one_line(e: ValidationError) -> str:
    """EngineConfig's refusal of the engine settings, each field with the value given and why."""
    return "; ".join(f"engine setting {'.'.join(map(str, err['loc']))}={err['input']}: "
                     f"{str(err['msg']).removeprefix('Value error, ')}" for err in e.errors())


def preflight(args: dict[str, Any], host: str, port: int) -> None:
    """What can be checked before Ray starts: the HTTP port (for a new local cluster; one that RAY_ADDRESS
    names has its own proxies), the model, and the engine settings against it -- what the engine would
    refuse as it starts, before loading a weight (`engine.core.model_settings.check_engine_config`: a
    block size the model does not decode in, a knob its decoding does not read, a rule's missing
    tokens, ...). Exits with one line naming the problem."""
    from engine.core.model_settings import check_engine_config
    from engine.model.source import resolve_model_path

    try:
        if not os.environ.get("RAY_ADDRESS"):
            check_port_free(host, port)
        model = resolve_model_path(str(args["model"]))
        try:
            config = EngineConfig(**(args.get("engine") or {}))
        except ValidationError as e:
            raise SystemExit(f"blockserve serve: {_one_line(e)}") from None
        check_engine_config(model, config)
    except (OSError, ValueError) as e:  # PortInUseError, a model not found, CheckpointError, a setting refused
        raise SystemExit(f"blockserve serve: {' '.join(str(e).split())}") from None


def serve(args: dict[str, Any], host: str, port: int) -> None:
    """Run the app on the cluster RAY_ADDRESS names (else a new local one, on loopback) until Ctrl-C. An
    app that cannot be built (bad args, a model not found, resources no node offers) exits with the
    reason."""
    if not os.environ.get("RAY_ADDRESS"):
        start_local_ray()  # before `import ray`: a new cluster on loopback, never one a `ray start` left
    import ray
    from ray import serve as ray_serve

    from deployments.app import build_app

    if not ray.is_initialized():
        ray.init()  # the cluster RAY_ADDRESS names
    try:
        app = build_app(args)
    except (ValueError, FileNotFoundError) as e:  # PlacementError is a ValueError
        raise SystemExit(f"blockserve serve: {e}") from None
    try:
        ray_serve.start(http_options={"host": host, "port": port}, controller_options=CONTROLLER_OPTIONS)
    except ray.exceptions.RayActorError as e:  # Serve's controller refused the port (a cluster RAY_ADDRESS names)
        refusal = PortInUseError.named_in(str(e))
        if refusal is None:
            raise
        raise SystemExit(f"blockserve serve: {refusal}") from None
    try:
        ray_serve.run(app, name=APP_NAME, route_prefix="/")
        # A Serve instance already running on the cluster keeps its own host and port: ask it.
        http = ray_serve.context._get_global_client().http_config
        address = ray.get_runtime_context().gcs_address
        print(f"blockserve: application {APP_NAME!r} ready at http://{http.host}:{http.port} on the Ray cluster at "
              f"{address} (RAY_ADDRESS={address} for Serve handles). Ctrl-C stops it.", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        ray_serve.delete(APP_NAME)


def main(argv: list[str] | None = None) -> None:
    ns = build_parser().parse_args(argv)
    args = app_args(ns)
    preflight(args, ns.host, ns.port)
    serve(args, ns.host, ns.port)


if __name__ == "__main__":
    main()
