"""Shared, session-scoped fixtures, and the suite's tiers. The Ray/Serve fixtures start only when a test
asks for them.

Tiers (pytest markers, assigned here, never by hand except `system`):
- `engine`: no Ray at all -- every test that reaches neither the session's cluster nor a `system` fixture;
- `serve`: Ray Serve applications on the session's cluster (every test that reaches `serve_cluster`);
- `system`: multi-node, browser, soak, CLI -- anything that starts a cluster or a server process of its
  own: marked `@pytest.mark.system` (or `pytestmark`), or reaching a fixture of SYSTEM_FIXTURES.
`pytest -m engine` is the fast tier; an engine-tier test that starts Ray fails, naming the marker it needs.
"""

from __future__ import annotations

import os

# The Triton attention kernel runs here under Triton's interpreter, which Triton reads when it is first
# imported: set before anything imports it (torch does lazily), and inherited by every process the
# suite starts. Nothing else in the suite runs Triton (inductor compiles C++ on the CPU).
os.environ.setdefault("TRITON_INTERPRET", "1")

import signal  # noqa: E402
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from ports import free_port
from ray_env import QUIET, SERVE_ENGINE, set_test_ray_environment
from worker_groups import CLUSTER_GROUPS, GROUPS_DIR

set_test_ray_environment()
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # torch may have been imported before the variable was set

TIERS = ("engine", "serve", "system")
SYSTEM_FIXTURES = {"browser", "blockserve_cli"}  # a browser, or `blockserve serve` in a process of its own


def tier_of(item: pytest.Item) -> str:
    """A test's tier: `system` when marked so or when it reaches a system fixture, `serve` when it
    reaches the session's cluster, else `engine`."""
    fixtures = set(getattr(item, "fixturenames", ()))
    if item.get_closest_marker("system") or fixtures & SYSTEM_FIXTURES:
        return "system"
    return "serve" if "serve_cluster" in fixtures else "engine"


def worker_group(item: pytest.Item) -> str:
    """The unit one xdist worker runs (tests/worker_groups.py): one of CLUSTER_GROUPS for a test that
    reaches the session's cluster, else its module.

    A cluster is per worker process, so whatever shares applications must share a worker: every test
    that uses the pool (`serve_pool`: the applications several modules share) runs on one worker, and
    the tests that reach the cluster only to deploy applications of their own run on another, with a
    cluster of its own. That splits the suite's longest chain in two without deploying anything
    twice; a `system` test that uses the cluster goes with its group too, not with its module."""
    fixtures = set(getattr(item, "fixturenames", ()))
    pool_group, own_apps_group = CLUSTER_GROUPS
    if "serve_pool" in fixtures:
        return pool_group
    if "serve_cluster" in fixtures:
        return own_apps_group
    return item.nodeid.split("::", 1)[0]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        marked = [t for t in TIERS if t != "system" and item.get_closest_marker(t)]
        if marked:
            raise pytest.UsageError(f"{item.nodeid}: the `{marked[0]}` tier is derived from the fixtures a "
                                    "test uses (tests/conftest.py); mark only `system` by hand")
        item.add_marker(tier_of(item))
    if hasattr(config, "workerinput"):  # an xdist worker: tell the controller's scheduler the groups
        from worker_groups import write_groups

        groups = {item.nodeid: worker_group(item) for item in items}
        system = {groups[item.nodeid] for item in items if item.get_closest_marker("system")}
        write_groups(config.workerinput, groups, [*CLUSTER_GROUPS, *sorted(system - set(CLUSTER_GROUPS))])


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """On an xdist worker a cluster group runs whole and in a row (tests/worker_groups.py): after its last
    test the worker's cluster, with the applications on it, is stopped at once rather than when the
    session ends, so that its idle Serve processes take no CPU from the groups the worker runs next.
    (A later test asking for `serve_cluster` would start a new one.)"""
    group = worker_group(item)
    if (hasattr(item.config, "workerinput") and group in CLUSTER_GROUPS
            and (nextitem is None or worker_group(nextitem) != group)):
        for fixturedef in item.session._fixturemanager.getfixturedefs("serve_cluster", item) or ():
            fixturedef.finish(item._request)  # its dependents (the pool, module fixtures) first


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:
    """Each xdist worker learns where to write its groups: one folder per run, made by the controller."""
    node.workerinput[GROUPS_DIR] = str(_groups_dir(node.config))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    from worker_groups import WorkerGroupScheduling

    return WorkerGroupScheduling(config, log, _groups_dir(config))


def _groups_dir(config: pytest.Config) -> Path:
    if not hasattr(config, "_blockserve_groups_dir"):
        import tempfile

        config._blockserve_groups_dir = Path(tempfile.mkdtemp(prefix="blockserve-worker-groups-"))
    return config._blockserve_groups_dir


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module: tiny forwards run far faster on one thread than on two contended
    ones (a module asks for it with `pytestmark = pytest.mark.usefixtures("one_thread")`)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _engine_tier_starts_no_ray(request):
    """The engine tier runs without Ray: a test there that starts Ray belongs in another tier."""
    def ray_started() -> bool:
        ray = sys.modules.get("ray")
        return ray is not None and ray.is_initialized()

    before = ray_started()  # the session's cluster, started by an earlier serve test
    yield
    if request.node.get_closest_marker("engine") and not before and ray_started():
        pytest.fail("this test started Ray but is in the `engine` tier (no Ray): use the `serve_cluster` "
                    "fixture, or mark it `@pytest.mark.system` if it starts a cluster of its own")


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


def stop_process(proc: subprocess.Popen, timeout: float = 60) -> None:
    """Ctrl-C for a server process a test started (its Ray cleanup runs, `serve run` deletes its
    application), then kill if it lingers past `timeout` seconds. Its output pipes are read meanwhile:
    a process whose shutdown messages fill a pipe nobody reads blocks on the write and never exits."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


def wait_healthy(proc: subprocess.Popen, url: str, what: str, timeout: float = 300) -> None:
    """Poll `url`/health until it answers 200; fails with the process's stderr (it must have been
    started with stderr=PIPE) if it exits first, or naming `what` after `timeout` seconds."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, proc.stderr.read()[-4000:]
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"{what} never became healthy"
        time.sleep(1)


@pytest.fixture(scope="session")
def gemma_ckpt(tmp_path_factory) -> Path:
    """A tiny DiffusionGemma checkpoint written by transformers' own classes (both layer types, a
    sliding window of 8), read-only, shared by the network and runner tests."""
    pytest.importorskip("transformers.models.diffusion_gemma")
    from engine.model.families.diffusion_gemma.tiny import write_tiny_diffusion_gemma

    return write_tiny_diffusion_gemma(tmp_path_factory.mktemp("dg") / "tiny")


@pytest.fixture(scope="session")
def gemma_reference(gemma_ckpt):
    """transformers' DiffusionGemmaForBlockDiffusion on `gemma_ckpt`, driven as its generate() runs it."""
    from engine.model.families.diffusion_gemma.reference import load_reference

    return load_reference(gemma_ckpt)


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


@dataclass(frozen=True)
class AppSpec:
    """One application of the session's pool: a checkpoint (a key of ServePool's checkpoints), its engine
    and its other build_app args; `drills`: built with the fault-drill hooks (deployments.drills)."""

    checkpoint: str
    engine: dict
    args: dict = field(default_factory=dict)
    drills: bool = False


KEY = "reliability-secret-key"  # the `secure` app's API key
TP2_KEY = "tp2-secret-key"  # the `sdar_tp2` app's API key
QWEN3_KEY = "qwen3-secret-key"  # the `qwen3_keyed` app's API key
KV_ENGINE = dict(SERVE_ENGINE, num_kv_blocks=16)  # 16 pages x 4 tokens: far less than the work sent

# The applications tests of several modules share, each deployed once per session on first use.
APPS: dict[str, AppSpec] = {
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
        targets = []
        for name in missing:
            spec = APPS[name]
            args = {"model": str(self.checkpoints[spec.checkpoint]), "engine": spec.engine, **spec.args}
            targets.append(serve.RunTarget(app_builder(spec.drills)(args), name=name, route_prefix=f"/{name}",
                                           logging_config=QUIET))
        if targets:
            serve.run_many(targets)
        for name in missing:
            spec = APPS[name]
            self._running[name] = ServedApp(name, f"{self.cluster.url}/{name}",
                                            str(self.checkpoints[spec.checkpoint]), spec.engine)
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


def close_as_json(got: object, want: object, tol: float, where: str = "body") -> None:
    """Assert two JSON values equal, floats within `tol`. For the same request answered twice: a CPU
    forward's last bits depend on which rows share its batch, and two calls may be batched differently
    (under load, one call's sequences can land in separate steps)."""
    if isinstance(want, float) and isinstance(got, (int, float)) and not isinstance(got, bool):
        assert abs(got - want) <= tol, f"{where}: {got} vs {want}"
    elif isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), f"{where}: keys {got} vs {want}"
        for key in want:
            close_as_json(got[key], want[key], tol, f"{where}.{key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), f"{where}: {got} vs {want}"
        for i, (g, w) in enumerate(zip(got, want)):
            close_as_json(g, w, tol, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: {got!r} vs {want!r}"


# ---- the hostile checkpoint (tests/test_reliability_security.py) -----------------------------
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
