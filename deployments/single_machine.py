"""The single-machine Ray clusters this project starts (`blockserve serve`, the test fixtures, the
benches): reachable from this machine only, and refused before they start when their HTTP port is
taken.

Loopback: Ray's single-machine mode (engine.local_ray) gives the node the IP 127.0.0.1, and
every Ray process of the node then listens on it: the GCS, the raylet and its object manager, the
workers, the dashboard and metrics agents, Serve's proxy and controller. A cluster in this mode takes
no other nodes (`ray start --address` refuses), so a multi-node cluster is started by hand
(docs/deploy.md).

One listener ignores the node IP: every Serve replica opens a gRPC server for calls between
deployments on all interfaces (`[::]:0`), unauthenticated when Ray's token auth is off.
`keep_replica_grpc_on_loopback` (run when the deployments' modules load in a replica) binds it to
127.0.0.1 instead on a node whose IP is loopback, and leaves it alone on any other node.

The HTTP port: `check_port_free` before a new cluster starts (`blockserve serve`), and
`check_serve_port_not_shared` where the application is built on a running cluster (`serve run`,
`serve deploy`), since Serve's proxies share a taken port (SO_REUSEPORT) rather than fail.
"""

from __future__ import annotations

import functools
import os
import socket
import sys
from collections.abc import Callable
from typing import Any

from engine.local_ray import is_loopback
from engine.local_ray import start_local_ray as start_loopback_ray


class PortInUseError(ValueError):
    """The HTTP port the application would be served on is taken (a configuration to change)."""


def start_local_ray(**init_kwargs: Any) -> Any:
    """A new Ray cluster on this machine, every port on loopback (engine.local_ray), whose Serve
    proxy binds its HTTP port alone: a later server on that port fails to start instead of sharing it
    (SO_REUSEPORT) and taking part of this one's traffic. Returns Ray's context."""
    os.environ["SERVE_SOCKET_REUSE_PORT_ENABLED"] = "0"
    return start_loopback_ray(**init_kwargs)


def check_port_free(host: str, port: int) -> None:
    """Raise PortInUseError unless an HTTP server could listen on host:port, as the only one there.
    (Serve's proxies share a port with SO_REUSEPORT; a second server on a taken port would silently
    take part of the first one's traffic.)"""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        if os.name == "posix":  # connections in TIME_WAIT do not count; a listening socket does
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise PortInUseError(f"port {port} on {host} is already in use ({e.strerror}), maybe by another "
                                 "blockserve server; stop that one, or choose another port (`--port N`, "
                                 "http_options.port)") from None


def _on_loopback_node(add_port: Callable[[Any, str], int], server: Any, address: str) -> int:
    import ray

    host, _, port = address.rpartition(":")
    if host in ("[::]", "0.0.0.0") and is_loopback(ray.util.get_node_ip_address()):
        address = f"127.0.0.1:{port}"
    return add_port(server, address)


def keep_replica_grpc_on_loopback() -> None:
    """In a Serve replica process (Serve's replica module loaded), make its gRPC server for calls between
    deployments listen on 127.0.0.1 when the node's IP is loopback. Elsewhere: nothing."""
    replica = sys.modules.get("ray.serve._private.replica")
    add_port = getattr(replica, "add_port_to_grpc_server", None)
    if add_port is None or isinstance(add_port, functools.partial):  # not a replica, or done already
        return
    replica.add_port_to_grpc_server = functools.partial(_on_loopback_node, add_port)


def _listeners(port: int) -> list[tuple[str, int | None]]:
    """(address, pid) of the TCP sockets on this machine listening on `port` (pid None: not ours to see)."""
    import psutil

    return [(c.laddr.ip, c.pid) for c in psutil.net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port]


def _overlaps(a: str, b: str) -> bool:
    wildcard = ("0.0.0.0", "::")
    return a == b or a in wildcard or b in wildcard


def check_serve_port_not_shared() -> None:
    """Where the application is built on a running cluster (`serve run`, `serve deploy`): raise
    PortInUseError when a process of this machine outside this Ray cluster listens on Serve's HTTP
    port, i.e. when this cluster's proxy would share the port with another server. Nothing to check
    without Serve, or when the operating system does not show the listening sockets."""
    import psutil
    import ray
    from ray import serve

    client = serve.context._get_global_client(raise_if_no_controller_running=False)
    if client is None:
        return
    http = client.http_config
    try:
        raylet_ports = {n["NodeManagerPort"] for n in ray.nodes() if n.get("Alive")}
        raylets = {pid for _, pid in (s for p in raylet_ports for s in _listeners(p)) if pid is not None}
        if not raylets:  # no node of this cluster on this machine: its proxies' ports are elsewhere
            return
        others = []
        for address, pid in _listeners(http.port):
            if pid is None or not _overlaps(address, http.host):
                continue
            process = psutil.Process(pid)
            if not raylets & {pid, *(p.pid for p in process.parents())}:
                others.append(f"pid {pid} ({process.name()})")
    except (psutil.Error, OSError):
        return
    if others:
        raise PortInUseError(f"port {http.port} on {http.host} is already in use by {', '.join(others)}, outside this "
                             "Ray cluster, maybe another blockserve server; stop that one, or choose another port "
                             "(http_options.port, `--port N`)")
