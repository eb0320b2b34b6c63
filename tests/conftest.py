"""Shared, session-scoped fixtures. The Ray/Serve ones start only when a test asks for them."""

from __future__ import annotations

import socket
from dataclasses import dataclass
from pathlib import Path

import pytest
from ray_env import QUIET, SERVE_ENGINE, set_test_ray_environment

set_test_ray_environment()


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
def ar_ckpt(tmp_path_factory) -> str:
    """A tiny Qwen3 (AR) checkpoint with mildly peaked logits, shared by the engine-level tests."""
    from tools.tiny_checkpoint import write_tiny_checkpoint

    return str(write_tiny_checkpoint(tmp_path_factory.mktemp("ar"), model_type="qwen3", seed=4, logit_scale=2.0))


@pytest.fixture(scope="session")
def dllm_ckpt(tmp_path_factory) -> str:
    """A tiny SDAR (DLLM) checkpoint whose confidences give dynamic unmasking something to do."""
    from tools.tiny_checkpoint import DLLM_TEST_LOGIT_SCALE, write_tiny_checkpoint

    return str(write_tiny_checkpoint(tmp_path_factory.mktemp("sdar"), model_type="sdar", seed=5,
                                     logit_scale=DLLM_TEST_LOGIT_SCALE))


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """One tiny SDAR (DLLM) and one tiny Qwen3 (AR) checkpoint on disk."""
    from tools.tiny_checkpoint import DLLM_TEST_LOGIT_SCALE, write_tiny_checkpoint

    root = tmp_path_factory.mktemp("ckpt")
    return {"sdar": write_tiny_checkpoint(root / "sdar", model_type="sdar", logit_scale=DLLM_TEST_LOGIT_SCALE),
            "qwen3": write_tiny_checkpoint(root / "qwen3", model_type="qwen3")}


@pytest.fixture(scope="session")
def serve_cluster():
    """A real local Ray cluster (logical CPUs, so tp=2 bundles and several replicas fit on 2 cores)
    with Serve's HTTP proxy on a free loopback port."""
    import ray
    from ray import serve

    from deployments.single_machine import start_local_ray

    # always a cluster of our own (never one another process started on this machine), on loopback
    ctx = start_local_ray(num_cpus=16, include_dashboard=False, configure_logging=True, logging_level="warning")
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


async def in_flight_then(url: str, body: dict, fault, headers: dict | None = None) -> tuple[float, list]:
    """Fault drill: two streams and two unary `body` requests in flight; once both streams have sent a
    first event (and 0.2 s more, so the unary ones are in the engine too), run the blocking `fault()` in
    a thread. Returns (seconds from the fault until every request ended, their endings): ("stream",
    events) or ("unary", (status, Retry-After, JSON body))."""
    import asyncio
    import time

    import httpx

    async with httpx.AsyncClient(timeout=120, headers=headers) as client:
        async def stream(first: asyncio.Event) -> tuple[str, object]:
            async with client.stream("POST", url + "/generate", json={**body, "stream": True}) as r:
                assert r.status_code == 200
                lines = []
                async for line in r.aiter_lines():
                    lines.append(line)
                    if line.startswith("data: "):
                        first.set()
            return "stream", sse_events(lines)

        async def unary() -> tuple[str, object]:
            r = await client.post(url + "/generate", json=body)
            return "unary", (r.status_code, r.headers.get("retry-after"), r.json())

        firsts = [asyncio.Event(), asyncio.Event()]
        tasks = [asyncio.ensure_future(stream(e)) for e in firsts] + [asyncio.ensure_future(unary()) for _ in range(2)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in firsts)), 60)
        await asyncio.sleep(0.2)
        await asyncio.to_thread(fault)
        started = time.monotonic()
        done = await asyncio.wait_for(asyncio.gather(*tasks), 60)
        return time.monotonic() - started, done


def record_lm_head_rows(pipe) -> list[int]:
    """Wrap the real model's `logits` (no mock) to record how many rows each call projects."""
    model = pipe.engine.executor.runner.model
    rows: list[int] = []
    real = model.logits

    def logits(hidden):
        rows.append(hidden.shape[0])
        return real(hidden)

    model.logits = logits
    return rows


def without_ids(body: dict) -> dict:
    """A /generate body without its per-request id (two requests never share one)."""
    return {**body, "meta_info": {k: v for k, v in body["meta_info"].items() if k != "id"}}


# ---- the reliability suite's extra applications (tests/test_reliability_*.py) ----------------
KEY = "reliability-secret-key"  # the `secure` app's API key
KV_ENGINE = dict(SERVE_ENGINE, num_kv_blocks=16)  # 16 pages x 4 tokens: far less than the work sent


def write_hostile_checkpoint(src: Path, dst: Path, marker_dir: Path) -> Path:
    """A copy of a tiny checkpoint that also carries everything a loader could be tricked into running:
    `modeling_sdar.py` / `configuration_sdar.py` / `tokenization_sdar.py` / `__init__.py` named by
    `auto_map` (+ `trust_remote_code`) in config.json and tokenizer_config.json, and pickled
    `pytorch_model.bin` / `training_args.bin` whose unpickling runs code. Each writes a file into
    `marker_dir` if executed."""
    import json
    import pickle
    import shutil

    shutil.copytree(src, dst)
    marker_dir.mkdir(parents=True, exist_ok=True)
    for name in ("modeling_sdar", "configuration_sdar", "tokenization_sdar", "__init__"):
        (dst / f"{name}.py").write_text(
            f"open({str(marker_dir / name)!r}, 'w').write('checkpoint code ran')\n"
            "class SDARForCausalLM: pass\nclass SDARConfig: pass\nclass SDARTokenizer: pass\n")

    class _Payload:
        def __init__(self, name: str):
            self.name = name

        def __reduce__(self):
            return (exec, (f"open({str(marker_dir / self.name)!r}, 'w').write('pickle ran')",))

    for name in ("pytorch_model.bin", "training_args.bin"):
        (dst / name).write_bytes(pickle.dumps(_Payload(name)))
    config = json.loads((dst / "config.json").read_text())
    config.update(trust_remote_code=True, auto_map={
        "AutoConfig": "configuration_sdar.SDARConfig", "AutoModel": "modeling_sdar.SDARForCausalLM",
        "AutoModelForCausalLM": "modeling_sdar.SDARForCausalLM"})
    (dst / "config.json").write_text(json.dumps(config))
    tok = json.loads((dst / "tokenizer_config.json").read_text())
    tok.update(auto_map={"AutoTokenizer": ["tokenization_sdar.SDARTokenizer", None]}, trust_remote_code=True)
    (dst / "tokenizer_config.json").write_text(json.dumps(tok))
    return dst


@pytest.fixture(scope="session")
def hostile_checkpoint(tiny_checkpoints, tmp_path_factory) -> tuple[Path, Path]:
    """(checkpoint dir, marker dir): see write_hostile_checkpoint."""
    root = tmp_path_factory.mktemp("hostile")
    marker = root / "markers"
    return write_hostile_checkpoint(tiny_checkpoints["sdar"], root / "sdar-hostile", marker), marker


@pytest.fixture(scope="session")
def reliability_apps(serve_cluster, tiny_checkpoints, hostile_checkpoint) -> dict[str, ServedApp]:
    """Deployed together on first use (replicas start in parallel):
    `sdar_kv`: tiny SDAR with 16 KV pages (64 tokens) -- preemption under load, "can never fit" refusals;
    `sdar_stall`: tiny SDAR with debug_hooks, stall_timeout_s=2 and a 1 s health check -- fault drills;
    `secure`: the hostile checkpoint, API key `KEY`, at most 2 generation requests in flight (debug_hooks:
    a paused engine loop holds requests in flight for the 429 test)."""
    from ray import serve

    from deployments.app import build_app

    specs = {
        "sdar_kv": (tiny_checkpoints["sdar"], dict(KV_ENGINE), {}),
        "sdar_stall": (tiny_checkpoints["sdar"], dict(SERVE_ENGINE),
                       {"debug_hooks": True, "stall_timeout_s": 2.0, "health_check_period_s": 1.0,
                        "health_check_timeout_s": 5.0}),
        "secure": (hostile_checkpoint[0], dict(SERVE_ENGINE),
                   {"debug_hooks": True, "ingress": {"api_key": KEY, "max_concurrent_requests": 2,
                                                     "retry_after_s": 2}}),
    }
    serve.run_many([serve.RunTarget(build_app({"model": str(m), "engine": e, **a}), name=n, route_prefix=f"/{n}",
                                    logging_config=QUIET) for n, (m, e, a) in specs.items()])
    yield {n: ServedApp(n, f"{serve_cluster.url}/{n}", str(m), e) for n, (m, e, _) in specs.items()}
    for name in specs:
        serve.delete(name, _blocking=False)


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
