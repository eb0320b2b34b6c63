"""A new Ray cluster on this machine that nothing beyond it can reach, for the processes that start
their own (`blockserve serve`, a JetEngine-style `LLM(tensor_parallel_size=2)`, the tests, the benches).

Loopback: Ray's single-machine mode (`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`, Ray's default on macOS
and Windows) gives the node the IP 127.0.0.1, and every Ray process of the node then listens on it.
Naming 127.0.0.1 as the node IP (`ray start --node-ip-address`, `ray.init(_node_ip_address=...)`) is
not enough on Linux: Ray replaces a loopback node IP with the machine's address. A cluster in this
mode takes no other nodes. The variable is read when `ray` is imported, so it is set before that; a
process that imported Ray earlier gets an error from `start_local_ray` rather than a cluster open to
the network.
"""

from __future__ import annotations

import ipaddress
import os
from typing import Any

LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def use_loopback() -> None:
    """Make the Ray clusters this process starts listen on 127.0.0.1 only (before `import ray`)."""
    os.environ.update(LOOPBACK_ENV)


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def start_local_ray(**init_kwargs: Any) -> Any:
    """`ray.init` of a new cluster on this machine (never one a `ray start` left running), every port on
    loopback. Returns Ray's context; its address (`ctx.address_info["address"]`) is 127.0.0.1:PORT."""
    use_loopback()
    import ray

    ctx = ray.init(address="local", **init_kwargs)
    node_ip = ctx.address_info["node_ip_address"]
    if not is_loopback(node_ip):
        ray.shutdown()
        raise RuntimeError(f"the new Ray cluster would listen on {node_ip}, not on loopback: Ray was imported "
                           f"before {', '.join(LOOPBACK_ENV)} was set; set it in the environment")
    return ctx
