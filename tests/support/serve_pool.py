"""The applications tests of several modules share (APPS), each deployed once per session on first use
(the `serve_pool` fixture and its named groups, loaded by tests/conftest.py through `pytest_plugins`;
the tests that reach it run on one xdist worker, support/worker_groups.py)."""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.paths import ROOT
from tests.support.ray_env import QUIET, SERVE_ENGINE
from tests.support.serve import ServeCluster, ServedApp, app_builder


@dataclass(frozen=True)
class AppSpec:
    """One application of the session's pool: a checkpoint (a key of ServePool's checkpoints), its engine
    and its other build_app args; `drills`: built with the fault-drill hooks (deployments.drills)."""

    checkpoint: str
    engine: dict
    args: dict = field(default_factory=dict)
    drills: bool = False

    def build(self, checkpoints: dict[str, Path]) -> Any:
        return app_builder(self.drills)({"model": str(checkpoints[self.checkpoint]), "engine": self.engine,
                                         **self.args})

    def model(self, checkpoints: dict[str, Path]) -> str:
        return str(checkpoints[self.checkpoint])


@dataclass(frozen=True)
class ShippedApp:
    """The first application of a Serve config the repository ships (`config`, a path under the root),
    built from its import_path and args as `serve run` builds it; its models are the config's own."""

    config: str
    engine: dict = field(default_factory=dict)  # the config's engines: not restated here

    def build(self, checkpoints: dict[str, Path]) -> Any:
        from ray.serve._private.api import call_user_app_builder_with_args_if_necessary

        spec = yaml.safe_load((ROOT / self.config).read_text())["applications"][0]
        module, _, attr = spec["import_path"].partition(":")
        return call_user_app_builder_with_args_if_necessary(getattr(importlib.import_module(module), attr),
                                                            spec["args"])

    def model(self, checkpoints: dict[str, Path]) -> str:
        return str(ROOT / self.config)


KEY = "reliability-secret-key"  # the `secure` app's API key
TP2_KEY = "tp2-secret-key"  # the `sdar_tp2` app's API key
QWEN3_KEY = "qwen3-secret-key"  # the `qwen3_keyed` app's API key
KV_ENGINE = dict(SERVE_ENGINE, num_kv_blocks=16)  # 16 pages x 4 tokens: far less than the work sent
SHIPPED_LLM_CONFIG = "configs/ray-serve-llm.yaml"

# The applications tests of several modules share, each deployed once per session on first use.
APPS: dict[str, AppSpec | ShippedApp] = {
    # tiny SDAR, one replica, 1 MiB body limit
    "sdar": AppSpec("sdar", dict(SERVE_ENGINE), {"ingress": {"max_body_bytes": 1 << 20}}),
    # tiny Qwen3 with raw_logprobs scoring, two replicas, unary requests batched over 0.1 s windows
    "qwen3": AppSpec("qwen3", dict(SERVE_ENGINE, logprobs_mode="raw_logprobs"),
                     {"num_replicas": 2, "ingress": {"batch_wait_timeout_s": 0.1}}),
    # 16 KV pages (64 tokens): preemption under load, "can never fit" refusals
    "sdar_kv": AppSpec("sdar", dict(KV_ENGINE)),
    # fault drills, weight versions and the soak: the drill hooks, a stuck loop caught after 10 s (a
    # forward of the tiny model takes milliseconds; weight operations get their own allowance), a 1 s
    # health check
    "sdar_drills": AppSpec("sdar", dict(SERVE_ENGINE), {"stall_timeout_s": 10.0, "health_check_period_s": 1.0},
                           drills=True),
    # the hostile checkpoint, API key `KEY`, at most 2 generation requests in flight (the drill hooks: a
    # paused engine loop holds requests in flight for the 429 test)
    "secure": AppSpec("hostile", dict(SERVE_ENGINE), {"ingress": {"api_key": KEY, "max_concurrent_requests": 2,
                                                                  "retry_after_s": 2}}, drills=True),
    # tp=2 over Ray (rank 1 a TPWorker actor), raw_logprobs scoring, API key `TP2_KEY`
    "sdar_tp2": AppSpec("sdar", dict(SERVE_ENGINE, tp=2, logprobs_mode="raw_logprobs"),
                        {"ingress": {"api_key": TP2_KEY}}),
    # tiny Qwen3 behind API key `QWEN3_KEY`, a 4 KiB body limit, streaming deltas (incremental_streaming_output)
    "qwen3_keyed": AppSpec("qwen3", dict(SERVE_ENGINE), {"incremental_streaming_output": True,
                                                         "ingress": {"api_key": QWEN3_KEY, "max_body_bytes": 4096}}),
    # docs/migrate.md's Ray Serve LLM config: sdar-tiny and qwen3-tiny behind one OpenAI-style front
    # (the several-model application: routing by `model`, the viewer's model picker)
    "llm_yaml": ShippedApp(SHIPPED_LLM_CONFIG),
}


class ServePool(Mapping):
    """The session's shared applications (APPS) by name, each deployed on first use and kept for the
    session. `group(*names)` deploys those not yet running together (their replicas start in parallel)."""

    def __init__(self, cluster: ServeCluster, checkpoints: dict[str, Path]):
        self.cluster, self.checkpoints = cluster, checkpoints
        self._running: dict[str, ServedApp] = {}

    def group(self, *names: str) -> dict[str, ServedApp]:
        from ray import serve

        missing = [n for n in names if n not in self._running]
        targets = [serve.RunTarget(APPS[name].build(self.checkpoints), name=name, route_prefix=f"/{name}",
                                   logging_config=QUIET) for name in missing]
        if targets:
            serve.run_many(targets)
        for name in missing:
            spec = APPS[name]
            self._running[name] = ServedApp(name, f"{self.cluster.url}/{name}", spec.model(self.checkpoints),
                                            spec.engine)
        return {n: self._running[n] for n in names}

    def release(self, *names: str) -> None:
        """Delete these applications now (a later use deploys them again)."""
        from ray import serve

        for name in names:
            if self._running.pop(name, None) is not None:
                serve.delete(name)

    def __getitem__(self, name: str) -> ServedApp:
        if name not in APPS:
            raise KeyError(name)
        return self.group(name)[name]

    def __iter__(self) -> Iterator[str]:
        return iter(APPS)

    def __len__(self) -> int:
        return len(APPS)


@pytest.fixture(scope="session")
def serve_pool(serve_cluster, tiny_checkpoints, hostile_checkpoint) -> ServePool:
    return ServePool(serve_cluster, {**tiny_checkpoints, "hostile": hostile_checkpoint[0]})


@pytest.fixture(scope="session")
def served_apps(serve_pool) -> dict[str, ServedApp]:
    """The pool's `sdar` and `qwen3` (see APPS)."""
    return serve_pool.group("sdar", "qwen3")


@pytest.fixture(scope="session")
def reliability_apps(serve_pool) -> dict[str, ServedApp]:
    """The pool's `sdar_kv`, `sdar_drills` and `secure` (see APPS)."""
    return serve_pool.group("sdar_kv", "sdar_drills", "secure")
