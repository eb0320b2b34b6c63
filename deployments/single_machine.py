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

The HTTP port: Serve's proxies bind it with SO_REUSEPORT by default, so a second server on a taken port
would share it and take part of the first one's connections. A second server is refused before its
proxy starts: `check_port_free` before `blockserve serve` starts a cluster; `refuse_a_taken_http_port`
when Serve's controller starts (Ray's controller callback, set by CONTROLLER_OPTIONS: the Serve
configs' `controller_options`, `blockserve serve`), the one place of `serve run` / `serve deploy` of a
config where this project's code runs before the proxy; and `check_serve_port_not_shared` where the
application is built (configs without those options). The proxies of the clusters this project
starts bind the port without SO_REUSEPORT (SERVE_SOCKET_REUSE_PORT_ENABLED=0), so that no later
server, however started, can share it.
"""

from __future__ import annotations

import functools
import os
import re
import socket
import sys
from collections.abc import Callable
from typing import Any

from engine.local_ray import is_loopback
from engine.local_ray import start_local_ray as start_loopback_ray


class PortInUseError(ValueError):
    """The HTTP port the application would be served on is taken (a configuration to change)."""

    @classmethod
    def named_in(cls, text: str) -> str | None:
        """The message of the last PortInUseError a traceback's text names (one Serve's controller raised,
        as Ray reports it), else None."""
        found = re.findall(rf"{cls.__name__}: (.*)", text)
        return found[-1].strip() if found else None


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


# What every Serve instance this project starts runs its controller with (the Serve configs'
# `controller_options`, `blockserve serve`): the proxies it starts bind the HTTP port alone (they
# inherit the controller's env_vars), and before it starts any, the controller refuses an HTTP port
# another server holds (`refuse_a_taken_http_port`).
CONTROLLER_ENV_VARS = {
    "SERVE_SOCKET_REUSE_PORT_ENABLED": "0",
    "RAY_SERVE_CONTROLLER_CALLBACK_IMPORT_PATH": "deployments.single_machine:refuse_a_taken_http_port",
}
CONTROLLER_OPTIONS = {"runtime_env": {"env_vars": CONTROLLER_ENV_VARS}}


def _controller_http_options() -> Any:
    """The HTTPOptions of the Serve controller whose __init__ is calling us (Ray calls its controller
    callback without arguments, from ServeController.__init__, before any proxy starts); None elsewhere."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "__init__" and type(frame.f_locals.get("self")).__name__ == "ServeController":
            return frame.f_locals.get("http_options")
        frame = frame.f_back
    return None


def refuse_a_taken_http_port() -> None:
    """Ray's controller callback (RAY_SERVE_CONTROLLER_CALLBACK_IMPORT_PATH): raise PortInUseError when a
    process outside this Ray cluster listens on Serve's HTTP port on this machine, before the controller
    starts a proxy there. A controller restarted on a running Serve instance finds its own proxy there,
    inside the cluster, and goes on."""
    http = _controller_http_options()
    if http is None or not http.port or http.host is None:  # no HTTP proxy to start
        return
    try:
        check_port_free(http.host, http.port)
    except PortInUseError:
        others = _listeners_outside_this_cluster(http.host, http.port)
        if others != []:  # someone else's (None: the listener could not be told apart; refuse)
            who = f" by {', '.join(others)}" if others else ""
            raise PortInUseError(f"port {http.port} on {http.host} is already in use{who}, maybe by another "
                                 "blockserve server; stop that one, or choose another port "
                                 "(http_options.port, `--port N`)") from None


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


def _listeners_outside_this_cluster(host: str, port: int) -> list[str] | None:
    """"pid N (name)" of each process of this machine outside this Ray cluster listening on host:port; None
    when the operating system does not show them all (another user's), or no node of this cluster runs on
    this machine."""
    import psutil
    import ray

    try:
        raylet_ports = {n["NodeManagerPort"] for n in ray.nodes() if n.get("Alive")}
        raylets = {pid for _, pid in (s for p in raylet_ports for s in _listeners(p)) if pid is not None}
        if not raylets:
            return None
        others = []
        for address, pid in _listeners(port):
            if not _overlaps(address, host):
                continue
            if pid is None:
                return None
            process = psutil.Process(pid)
            if not raylets & {pid, *(p.pid for p in process.parents())}:
                others.append(f"pid {pid} ({process.name()})")
    except (psutil.Error, OSError):
        return None
    return others


def check_serve_port_not_shared() -> None:
    """Where the application is built on a running cluster (`serve run`, `serve deploy`): raise
    PortInUseError when a process of this machine outside this Ray cluster listens on Serve's HTTP
    port, i.e. when this cluster's proxy would share the port with another server. Nothing to check
    without Serve, or when the operating system does not show the listening sockets."""
    from ray import serve

    client = serve.context._get_global_client(raise_if_no_controller_running=False)
    if client is None:
        return
    http = client.http_config
    others = _listeners_outside_this_cluster(http.host, http.port)
    if others:
        raise PortInUseError(f"port {http.port} on {http.host} is already in use by {', '.join(others)}, outside this "
                             "Ray cluster, maybe another blockserve server; stop that one, or choose another port "
                             "(http_options.port, `--port N`)")
