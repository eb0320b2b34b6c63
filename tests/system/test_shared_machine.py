"""Safe by default on a shared machine: `blockserve serve` starts a Ray cluster that listens on loopback
only, refuses a taken HTTP port and a wrong model path before starting anything (one line naming it),
and a unary request whose client left is aborted in the engine (the batched path included)."""

from __future__ import annotations

import asyncio
import ipaddress
import os
import re
import select
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import psutil
import pytest

from engine.errors import CheckpointError
from engine.model.source import resolve_model_path
from tests.support.paths import BLOCKSERVE, ROOT
from tests.support.ports import free_port
from tests.support.processes import stop_process
from tests.support.serve import engine_totals, wait_idle


def _listening(proc: psutil.Process) -> list[tuple[str, str, int]]:
    """(process name, address, port) of every listening TCP socket of `proc` and its descendants."""
    found = []
    for p in [proc, *proc.children(recursive=True)]:
        try:
            name = " ".join(p.cmdline()[:1]) or p.name()
            found += [(name, c.laddr.ip, c.laddr.port) for c in p.net_connections(kind="inet")
                      if c.status == psutil.CONN_LISTEN]
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def _is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip)
    mapped = getattr(address, "ipv4_mapped", None)  # [::ffff:127.0.0.1]
    return (mapped or address).is_loopback


def _blockserve(args: list[str], env: dict[str, str], timeout: float = 120) -> tuple[subprocess.CompletedProcess,
                                                                                       float]:
    started = time.monotonic()
    out = subprocess.run([str(BLOCKSERVE), "serve", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=timeout)
    return out, time.monotonic() - started


def _ready_line(server: subprocess.Popen, timeout: float, stderr: Path) -> str:
    """The line `blockserve serve` prints once the application answers (bounded wait); a server that
    ends first fails the test with the end of what it wrote to `stderr`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if select.select([server.stdout], [], [], 1)[0]:
            line = server.stdout.readline()
            assert line, (f"blockserve serve ended (status {server.wait()}) without serving; its stderr ends:\n"
                          + "\n".join(stderr.read_text(errors="replace").splitlines()[-30:]))
            if "ready at" in line:
                return line
    raise AssertionError(f"blockserve serve did not answer within {timeout:g}s")


@pytest.mark.system  # `blockserve serve` starts a cluster of its own
def test_blockserve_serve_listens_on_loopback_only_and_refuses_a_taken_port(tmp_path, stop_later):
    """At tp=2, so the tensor-parallel group's TCP store and gloo pairs are among the sockets. (The server,
    and the cluster it started, stop while the module's next tests run.)"""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"RAY_AUTH_MODE": "disabled"}
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    stderr = tmp_path / "server.err"
    with stderr.open("w") as err:
        server = subprocess.Popen([str(BLOCKSERVE), "serve", "models/sdar-tiny", "--port", str(port), "--tp", "2",
                                   "--num-cpus", "0.5"],
                                  cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        ready = _ready_line(server, timeout=300, stderr=stderr)
        address = re.search(r"RAY_ADDRESS=(\S+) ", ready).group(1)
        assert address.startswith("127.0.0.1:"), ready
        assert httpx.get(url + "/health", timeout=30).status_code == 200

        sockets = _listening(psutil.Process(server.pid))
        names = " ".join(name for name, _, _ in sockets)
        assert "gcs_server" in names and "raylet" in names, sockets  # the cluster's processes were found
        assert int(address.rsplit(":", 1)[1]) in {p for _, _, p in sockets}  # the GCS, at the printed address
        exposed = [s for s in sockets if not _is_loopback(s[1])]
        assert not exposed, f"listening beyond loopback: {exposed}"
        print(f"{len(sockets)} listening sockets, all on loopback: {sorted(set(name for name, _, _ in sockets))}")

        # A second server on the same port: refused before Ray starts, naming the port.
        ray_dir = tmp_path / "second-ray"
        second, seconds = _blockserve(["models/sdar-tiny", "--port", str(port)], env | {"RAY_TMPDIR": str(ray_dir)})
        print(f"second start: status {second.returncode} after {seconds:.1f}s: {second.stderr.strip()}")
        assert second.returncode != 0 and f"port {port}" in second.stderr and "--port" in second.stderr
        assert len(second.stderr.strip().splitlines()) == 1 and not ray_dir.exists()  # one line; no Ray started
        models = [httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"] for _ in range(20)]
        assert models == ["sdar-tiny"] * 20 and server.poll() is None  # the first serves alone
    finally:
        stop_later(lambda: stop_process(server))


@pytest.mark.system  # the `blockserve serve` command as typed
@pytest.mark.parametrize("model, says", [
    ("models/nope", ["models/nope", "Hugging Face", "HF_HUB_OFFLINE"]),  # shaped like an HF id: both tries named
    ("/nonexistent/blockserve/ckpt", ["/nonexistent/blockserve/ckpt", "not a directory"]),
])
def test_a_wrong_model_path_exits_at_once_naming_it(model, says, tmp_path):
    ray_dir = tmp_path / "ray"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {
        "RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1", "RAY_TMPDIR": str(ray_dir)}
    out, seconds = _blockserve([model, "--port", str(free_port())], env)
    print(f"{model}: status {out.returncode} after {seconds:.1f}s: {out.stderr.strip()}")
    lines = out.stderr.strip().splitlines()
    assert out.returncode != 0 and len(lines) == 1, out.stderr
    assert all(s in out.stderr for s in says), out.stderr
    assert not ray_dir.exists()  # refused before any Ray process started


@pytest.mark.system  # the `blockserve serve` command as typed
def test_a_directory_that_is_not_a_checkpoint_is_refused_naming_what_it_lacks(tiny_checkpoints, tmp_path):
    path = tmp_path / "sdar"
    shutil.copytree(tiny_checkpoints["sdar"], path)
    (path / "tokenizer.json").unlink()
    for weights in path.glob("*.safetensors"):
        weights.unlink()
    with pytest.raises(CheckpointError, match=re.escape(f"model path '{path}' is not a checkpoint directory: it has "
                                                        "no weights (*.safetensors), no tokenizer.json")):
        resolve_model_path(str(path))
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="it has no config.json, no weights"):
        resolve_model_path(str(tmp_path / "empty"))


async def _leave_while_running(url: str, body: dict, app: str, stay: dict | None = None) -> tuple[dict, float,
                                                                                                   dict | None]:
    """Send `body` (and `stay`, in the same batching window); once the engine runs them, the client of
    `body` leaves. Returns the engine totals once idle (aborted, or everything generated: the
    token count tells which), the seconds that took, and `stay`'s answer."""
    async with httpx.AsyncClient(timeout=120) as client:
        leaving = asyncio.ensure_future(client.post(url + "/generate", json=body))
        staying = asyncio.ensure_future(client.post(url + "/generate", json=stay)) if stay else None
        deadline = time.monotonic() + 300  # a hang guard
        while (await asyncio.to_thread(engine_totals, app))["running"] < 1:
            assert time.monotonic() < deadline and not leaving.done(), "the request never ran"
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
        leaving.cancel()  # the client closes its connection
        left = time.monotonic()
        idle = await asyncio.to_thread(wait_idle, app, 300.0)  # a hang guard
        seconds = time.monotonic() - left
        return idle, seconds, (await staying).json() if staying else None


def test_a_unary_request_whose_client_left_is_aborted_in_the_engine(served_apps):
    """`qwen3` batches unary requests over 0.1 s windows (one generate_batch call per window). The
    leaving client sends 8 long prompts (SGLang's batch body): alone in their call, the call is
    cancelled whole; with a short request of another client in the same call, they are aborted by id
    and the other client gets its whole answer."""
    app = served_apps["qwen3"]
    long = {"text": ["count"] * 8, "sampling_params": {"max_new_tokens": 480, "temperature": 0, "ignore_eos": True}}
    everything = 8 * 480  # what the engine generates if nothing is aborted
    short = {"prompt": "count", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    for stay in (None, short):
        wait_idle("qwen3")
        before = engine_totals("qwen3")["generated_tokens"]
        idle, seconds, answer = asyncio.run(_leave_while_running(app.url, long, "qwen3", stay))
        generated = idle["generated_tokens"] - before
        print(f"{'with a batch mate' if stay else 'alone'}: engine idle {seconds:.2f}s after the client left, "
              f"{generated} of {everything} tokens generated")
        assert idle["running"] + idle["waiting"] == 0, idle
        assert generated < everything  # aborted, not finished
        if stay:
            assert answer["meta_info"]["completion_tokens"] == 24  # the batch mate answered in full
