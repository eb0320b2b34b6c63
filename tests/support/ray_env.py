"""What the Ray clusters the tests start share: their environment and Serve settings. Used by
tests/conftest.py and by the multi-node scenario, which runs in a process of its own."""

from __future__ import annotations

import os

from engine.local_ray import LOOPBACK_ENV

QUIET = {"log_level": "WARNING", "enable_access_log": False}  # Serve's logging_config for test apps

# Small engines for tiny checkpoints (EngineConfig field names).
SERVE_ENGINE = {"max_model_len": 512, "num_kv_blocks": 192, "kv_block_size": 4, "max_batch_size": 32,
                "dllm_block_length": 4}


def set_test_ray_environment() -> None:
    """Settings the Ray processes read at start; call before starting a cluster. Values already in the
    environment win."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # One torch (OpenMP) thread per process: the suite runs several pytest workers, Ray replicas and
    # server processes on a machine of few cores, and OpenMP threads that spin while they wait for a core
    # burn it. On 2 cores beside a busy job, the engine tier took 618 s with two threads per process
    # and 274 s with one (2026-12-04).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for name, value in LOOPBACK_ENV.items():  # every port of the tests' clusters on 127.0.0.1 (read at `import ray`)
        os.environ.setdefault(name, value)
    # Ray starts its workers at nice 15, so any busy normal-priority process on a shared machine starves
    # the cluster under test; the tests' own cluster runs its workers at normal priority.
    os.environ.setdefault("RAY_worker_niceness", "0")
    # No Ray metrics: Ray's own exporters (every process's core metrics, Serve's gauges cached and flushed
    # every 100 ms in each replica) took a quarter of an idle cluster's CPU: 11.2 -> 8.5 CPU-s a minute
    # with four applications (2026-12-04), and the suite keeps its cluster up for the whole run. The
    # engine's /metrics (prometheus_client in the replicas) does not go through them.
    os.environ.setdefault("RAY_enable_metrics_collection", "0")
    os.environ.setdefault("RAY_SERVE_METRICS_EXPORT_INTERVAL_MS", "0")
    # Serve's controller reconciles every 0.1 s by default, the largest share of an idle cluster's CPU:
    # every 0.5 s, an idle cluster with seven applications took 11.1 CPU-s a minute instead of 13.3
    # (2026-12-05), and no test waits on a reconciliation to the tenth of a second.
    os.environ.setdefault("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", "0.5")
    # On a loaded machine Serve's HTTP proxy can take longer than Serve's default 5-10 s to start and
    # answer its health checks; the controller would then kill it and every Serve test would fail.
    for name in ("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S"):
        os.environ.setdefault(name, "60")
