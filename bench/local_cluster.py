"""A throwaway local Ray cluster with Serve's HTTP proxy on a free loopback port, for the benches that
go through HTTP (`bench.load`, the `serve` part of `python -m bench`)."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator

QUIET = {"log_level": "WARNING", "enable_access_log": False}  # Serve's logging_config for bench apps


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def local_serve(num_cpus: int) -> Iterator[str]:
    """Start a new Ray cluster (`num_cpus` logical CPUs; never one a `ray start` left on this machine; every
    port on loopback) and Serve; yield the proxy's base URL; shut both down."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    from deployments.single_machine import start_local_ray

    start_local_ray(num_cpus=num_cpus, include_dashboard=False, logging_level="warning", log_to_driver=False)
    import ray
    from ray import serve

    try:
        port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port}, logging_config=QUIET)
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
