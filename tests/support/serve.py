"""The session's Ray Serve cluster (the `serve_cluster` fixture, loaded by tests/conftest.py through
`pytest_plugins`; reaching it puts a test in the `serve` tier), deploying an application of a test's
own on it, and reading its engines' totals."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.ports import free_port
from tests.support.ray_env import QUIET


@dataclass
class ServeCluster:
    url: str  # http://127.0.0.1:PORT
    address: str  # the Ray cluster's GCS address, for other drivers


@dataclass
class ServedApp:
    name: str
    url: str  # base URL including the route prefix
    model: str  # checkpoint path (a shipped Serve config's path for an application built from one)
    engine: dict


@pytest.fixture(scope="session")
def serve_cluster():
    """A real local Ray cluster (logical CPUs, so tp=2 bundles and several replicas fit on 2 cores)
    with Serve's HTTP proxy on a free loopback port."""
    import ray
    from ray import serve

    from deployments.single_machine import start_local_ray

    # always a cluster of our own (never one another process started on this machine), on loopback
    ctx = start_local_ray(num_cpus=16, include_dashboard=False, configure_logging=True, logging_level="warning")
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port}, logging_config=QUIET)
    yield ServeCluster(url=f"http://127.0.0.1:{port}", address=ctx.address_info["address"])
    serve.shutdown()
    ray.shutdown()


def app_builder(drills: bool):
    """build_app, or the same application with the fault-drill hooks (deployments.drills)."""
    if drills:
        from deployments.drills import build_drill_app

        return build_drill_app
    from deployments.app import build_app

    return build_app


def deploy(cluster: ServeCluster, name: str, model: Path, engine: dict, drills: bool = False, **args) -> ServedApp:
    """Deploy build_app(...) (`drills`: with the fault-drill hooks) as application `name` at route /name
    and wait until it is RUNNING. For an application only one module needs; shared ones: APPS."""
    from ray import serve

    serve.run(app_builder(drills)({"model": str(model), "engine": engine, **args}), name=name,
              route_prefix=f"/{name}", logging_config=QUIET)
    return ServedApp(name, f"{cluster.url}/{name}", str(model), engine)


def engine_totals(app_name: str) -> dict[str, int]:
    """Engine stats summed over an application's EngineServer replicas."""
    from ray import serve

    stats = serve.get_app_handle(app_name).engine_stats.remote().result()
    keys = ("kv_pages_free", "kv_pages_total", "running", "waiting", "generated_tokens", "preemptions")
    return {k: sum(s[k] for s in stats) for k in keys} | {"replicas": len(stats)}


def wait_idle(app_name: str, timeout: float = 300.0) -> dict[str, int]:
    """Engine totals once no request is running or waiting. The timeout is a hang guard only: on a
    loaded machine an abort or a drain can take long, and tests judge by counts, never by time."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        t = engine_totals(app_name)
        if t["running"] + t["waiting"] == 0 or time.monotonic() > deadline:
            return t
        time.sleep(0.05)
