"""A second server on a port the first one holds: README's `serve run serve_config.yaml` serves; then
`blockserve serve` and `serve run` of docs/deploy.md's configs/multinode.yaml (which binds 0.0.0.0, not
the first one's 127.0.0.1) on the same port are each refused with the port named (`blockserve serve` in
one line), exit non-zero, and never listen there: every /health probe of the first answers 200 while
they try. What refuses the port is the controller settings every Serve config the repository ships
carries (`controller_options`); each config is checked to carry them, so a `serve run` of each one is
not needed (each would start a Ray cluster of its own)."""

from __future__ import annotations

import os
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
import yaml

from tests.support.paths import BIN, ROOT
from tests.support.ports import free_port
from tests.support.processes import stop_process, wait_healthy

MIN_PROBES = 100
# every Serve config the repository ships
SERVE_CONFIGS = sorted(str(p.relative_to(ROOT)) for p in [ROOT / "serve_config.yaml", *ROOT.glob("configs/*.yaml")]
                       if "applications" in yaml.safe_load(p.read_text()))
SECOND_CONFIG = "configs/multinode.yaml"  # served second: binds every address, so it overlaps 127.0.0.1


def _env(ray_tmp: str) -> dict[str, str]:
    """The environment of a shell that typed the docs' commands: none of the Serve settings this test
    session's own cluster put into os.environ, and no cluster to attach to. Without an address `serve
    run` joins the cluster marked as this machine's current one in Ray's temp directory (a `ray start`,
    or another test's `ray.cluster_utils.Cluster`), so its servers get a temp directory of their own."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_ADDRESS", "SERVE_SOCKET_REUSE_PORT_ENABLED", "RAY_SERVE_CONTROLLER_CALLBACK_IMPORT_PATH")}
    return {**env, "RAY_AUTH_MODE": "disabled", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_TMPDIR": ray_tmp}


def _on_port(config: str, port: int, tmp_path: Path) -> Path:
    """A copy of one of the repository's Serve configs with its HTTP port changed, nothing else."""
    data = yaml.safe_load((ROOT / config).read_text())
    data["http_options"]["port"] = port
    path = tmp_path / Path(config).name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _listening_pids(port: int) -> set[int | None]:
    return {c.pid for c in psutil.net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port}


class Prober(threading.Thread):
    """GET /health on the first server, over a new connection each time, until stopped and at least
    MIN_PROBES were sent; records every answer (or error) and every set of processes listening.
    The first MIN_PROBES go out 0.01 s apart, so that a second server refused within seconds is not
    waited on for ten; the rest 0.1 s apart, leaving the CPUs to a second server that takes longer.
    One client without keep-alive: a new TCP connection per probe, without building a client (and its
    TLS context) for each."""

    def __init__(self, url: str, port: int):
        super().__init__(daemon=True)
        self.url, self.port = url, port
        self.answers: list[int | str] = []
        self.listeners: set[frozenset[int | None]] = set()
        self.done = threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=30, limits=httpx.Limits(max_keepalive_connections=0)) as client:
            while not (self.done.is_set() and len(self.answers) >= MIN_PROBES):
                try:
                    self.answers.append(client.get(self.url + "/health").status_code)
                except httpx.HTTPError as e:
                    self.answers.append(type(e).__name__)
                self.listeners.add(frozenset(_listening_pids(self.port)))
                time.sleep(0.01 if len(self.answers) < MIN_PROBES else 0.1)


def _second(argv: list[str], env: dict[str, str], url: str, port: int,
            timeout: float = 300) -> tuple[subprocess.CompletedProcess, Prober]:
    """Run a second server on the first one's port to its end while probing the first."""
    prober = Prober(url, port)
    prober.start()
    try:
        done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    finally:
        prober.done.set()
        prober.join(timeout=300)
    return done, prober


def test_the_controller_callback_refuses_a_port_held_outside_the_cluster(monkeypatch):
    """refuse_a_taken_http_port as Ray calls it (no arguments, from ServeController.__init__): a port a
    process outside the cluster listens on is refused, one only the cluster's own proxy holds (a restarted
    controller) is not, and outside a controller it does nothing; the CLI finds the message in Ray's text."""
    import socket

    from ray.serve.config import HTTPOptions

    from deployments import single_machine
    from deployments.single_machine import PortInUseError, refuse_a_taken_http_port

    class ServeController:
        def __init__(self, *, http_options):
            refuse_a_taken_http_port()

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        monkeypatch.setattr(single_machine, "_listeners_outside_this_cluster", lambda host, p: ["pid 7 (other)"])
        with pytest.raises(PortInUseError, match=f"port {port} on 127.0.0.1 is already in use by pid 7 "):
            ServeController(http_options=HTTPOptions(host="127.0.0.1", port=port))
        refuse_a_taken_http_port()  # not in a controller: nothing to check
        monkeypatch.setattr(single_machine, "_listeners_outside_this_cluster", lambda host, p: [])
        ServeController(http_options=HTTPOptions(host="127.0.0.1", port=port))  # its own proxy's port
    ServeController(http_options=HTTPOptions(host="127.0.0.1", port=port))  # a free port
    text = ("ray.exceptions.ActorDiedError: ...\ndeployments.single_machine.PortInUseError: port 8 on h is "
            "already in use by pid 7 (x); stop that one\n\nRuntimeError: The function f raised an exception: "
            "port 8 on h ...\n")
    assert PortInUseError.named_in(text) == "port 8 on h is already in use by pid 7 (x); stop that one"
    assert PortInUseError.named_in("ray.exceptions.ActorDiedError: out of memory") is None


@pytest.mark.parametrize("config", SERVE_CONFIGS)
def test_every_shipped_serve_config_sets_the_controller_that_refuses_a_taken_port(config):
    """The settings that make Serve's controller refuse a port another server holds (and its proxies bind
    the port alone) are `blockserve serve`'s own, word for word, in every config the repository ships."""
    from deployments.single_machine import CONTROLLER_OPTIONS

    assert SECOND_CONFIG in SERVE_CONFIGS and "serve_config.yaml" in SERVE_CONFIGS
    assert yaml.safe_load((ROOT / config).read_text())["controller_options"] == CONTROLLER_OPTIONS


@pytest.fixture
def ray_tmp():
    """A Ray temp directory for the servers this test starts, short enough for Ray's socket paths."""
    with tempfile.TemporaryDirectory(prefix="bs-ray-", ignore_cleanup_errors=True) as path:
        yield path


@pytest.mark.system  # servers of their own, two of them each starting its own Ray cluster
def test_a_second_server_on_a_taken_port_is_refused_and_takes_none_of_its_traffic(tmp_path, ray_tmp):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = _env(ray_tmp)
    first = subprocess.Popen([str(BIN / "serve"), "run", str(_on_port("serve_config.yaml", port, tmp_path))],
                             cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_healthy(first, url, "the first server")
        (proxy,) = _listening_pids(port)
        taken = f"port {port} on 127.0.0.1 is already in use"

        # blockserve serve: refused before it starts a cluster, in one line
        done, prober = _second([str(BIN / "blockserve"), "serve", "models/sdar-tiny", "--port", str(port)], env, url,
                               port)
        assert done.returncode != 0
        assert done.stderr.strip().splitlines() == [done.stderr.strip()] and done.stderr.startswith(
            f"blockserve serve: {taken}"), done.stderr[-4000:]
        assert set(prober.answers) == {200}, prober.answers
        assert prober.listeners == {frozenset({proxy})}

        # serve run of another config (Ray's own CLI): Serve's controller refuses the port before it starts
        # a proxy; the command's last line names the port and the host the config binds
        config = _on_port(SECOND_CONFIG, port, tmp_path)
        done, prober = _second([str(BIN / "serve"), "run", str(config)], env, url, port)
        assert done.returncode != 0
        last = done.stderr.strip().splitlines()[-1]
        assert f"port {port} on 0.0.0.0 is already in use" in last, done.stderr[-4000:]
        assert "stop that one, or choose another port" in last, done.stderr[-4000:]
        assert set(prober.answers) == {200}, prober.answers
        assert prober.listeners == {frozenset({proxy})}
        assert first.poll() is None and httpx.get(url + "/health", timeout=30).status_code == 200
    finally:
        stop_process(first, timeout=90)
