"""Shared, session-scoped fixtures. The Ray/Serve ones start only when a test asks for them."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

QUIET = {"log_level": "WARNING", "enable_access_log": False}

# Small engines for tiny checkpoints (CONTRACT.md §2 names).
SERVE_ENGINE = {"max_model_len": 512, "num_kv_blocks": 192, "kv_block_size": 4, "max_batch_size": 32,
                "dllm_block_length": 4}


@dataclass
class ServeCluster:
    url: str  # http://127.0.0.1:PORT
    address: str  # the Ray cluster's GCS address, for other drivers


@dataclass
class ServedApp:
    name: str
    url: str  # base URL including the route prefix
    model: str  # checkpoint path
    engine: dict


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """One tiny SDAR (DLLM) and one tiny Qwen3 (AR) checkpoint on disk."""
    from engine.tiny_checkpoint import DLLM_TEST_LOGIT_SCALE, write_tiny_checkpoint

    root = tmp_path_factory.mktemp("ckpt")
    return {"sdar": write_tiny_checkpoint(root / "sdar", model_type="sdar", logit_scale=DLLM_TEST_LOGIT_SCALE),
            "qwen3": write_tiny_checkpoint(root / "qwen3", model_type="qwen3")}


@pytest.fixture(scope="session")
def serve_cluster():
    """A real local Ray cluster (logical CPUs, so tp=2 bundles and several replicas fit on 2 cores)
    with Serve's HTTP proxy on a free loopback port."""
    import ray
    from ray import serve

    ctx = ray.init(num_cpus=8, include_dashboard=False, configure_logging=True, logging_level="warning")
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port}, logging_config=QUIET)
    yield ServeCluster(url=f"http://127.0.0.1:{port}", address=ctx.address_info["address"])
    serve.shutdown()
    ray.shutdown()


def deploy(cluster: ServeCluster, name: str, model: Path, engine: dict, **args) -> ServedApp:
    """Deploy build_app(...) as application `name` at route /name and wait until it is RUNNING."""
    from ray import serve

    from deployments.app import build_app

    serve.run(build_app({"model": str(model), "engine": engine, **args}), name=name, route_prefix=f"/{name}",
              logging_config=QUIET)
    return ServedApp(name, f"{cluster.url}/{name}", str(model), engine)


@pytest.fixture(scope="session")
def served_apps(serve_cluster, tiny_checkpoints) -> dict[str, ServedApp]:
    """`sdar`: tiny SDAR, one replica, 1 MiB body limit. `qwen3`: tiny Qwen3 with raw_logprobs scoring, two
    replicas, unary requests batched over 0.1 s windows.
    Deployed together (their replicas start in parallel)."""
    from ray import serve

    from deployments.app import build_app

    specs = {
        "sdar": (tiny_checkpoints["sdar"], dict(SERVE_ENGINE), {"ingress": {"max_body_bytes": 1 << 20}}),
        "qwen3": (tiny_checkpoints["qwen3"], dict(SERVE_ENGINE, logprobs_mode="raw_logprobs"),
                  {"num_replicas": 2, "ingress": {"batch_wait_timeout_s": 0.1}}),
    }
    serve.run_many([serve.RunTarget(build_app({"model": str(m), "engine": e, **a}), name=n, route_prefix=f"/{n}",
                                    logging_config=QUIET) for n, (m, e, a) in specs.items()])
    return {n: ServedApp(n, f"{serve_cluster.url}/{n}", str(m), e) for n, (m, e, _) in specs.items()}


# ---- helpers for the serve tests (plain functions; import them from conftest) ----------------
def sse_events(lines) -> list:
    """Parse `data: ...` Server-Sent Events lines into JSON objects; "[DONE]" is kept as the string."""
    import json

    events = []
    for line in lines:
        if line.startswith("data: "):
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def without_ids(body: dict) -> dict:
    """A /generate body without its per-request id (two requests never share one)."""
    return {**body, "meta_info": {k: v for k, v in body["meta_info"].items() if k != "id"}}
