"""Multi-node drills on one machine, run by tests/system/test_multinode.py in a process of its own
(`python -m tests.support.multinode_scenario` from the repository root), since the test session already
has a Ray cluster: a `ray.cluster_utils.Cluster` of a head and two worker nodes (a third joins during
the node loss), each with logical CPUs and custom resources that force where replicas go. Prints one
JSON object.

- spread: two EngineServer replicas pinned to nodes A and B (resource `spread`); the outputs of both
  must equal those of another application's replicas (the `loss` app's).
- tp: a tp=2 group whose bundles need resource `tp` (one unit on A, one on B): STRICT_PACK is refused
  at build time with the missing resources named; PACK places rank 0 and rank 1 on different nodes.
- loss: two replicas on nodes A and B (resource `loss`; node E joins with a spare unit); streams in
  flight on both, generation paused in place (so what the loss hits is known whenever it lands), then
  node A is removed without warning and generation continues. The ingress is where the app's default
  puts it, on the head node. Every request is answered (lost = 0);
  the ones A held end with an explicit error, all others complete; new requests succeed once Serve
  replaced the replica on E.
- unschedulable: an app whose engine replica needs a resource that exists (so it passes the build-time
  check) but that another actor holds: Serve cannot place the replica, and HTTP requests get 503 with
  Retry-After at once instead of waiting for it.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from tests.support.ports import free_port
from tests.support.ray_env import QUIET, SERVE_ENGINE, set_test_ray_environment

set_test_ray_environment()
ENGINE = SERVE_ENGINE
PROMPTS = ["Hello world", "Question: what is 7 * 8? Answer:", "Once upon a time", "def f(x):", "1, 2, 3,", "abc"]
# Fast node-failure detection: the GCS declares a silent node dead after ~3 s instead of ~30 s.
SYSTEM_CONFIG = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 1000,
                 "health_check_failure_threshold": 3}


def _deploy(url: str, apps: dict[str, dict[str, Any]]) -> dict[str, str]:
    """Deploy build_app(args) for each named application at route /name, all at once (their replicas
    start in parallel); name -> URL once all are running."""
    from ray import serve

    from deployments.app import build_app

    serve.run_many([serve.RunTarget(build_app(args), name=name, route_prefix=f"/{name}", logging_config=QUIET)
                    for name, args in apps.items()])
    return {name: f"{url}/{name}" for name in apps}


def _alive_actors() -> list[dict[str, Any]]:
    """The cluster's live actors from the GCS of the cluster this driver is connected to (the state
    API would go through a dashboard, which this cluster does not run)."""
    import ray

    return [a for a in ray._private.state.actors().values() if a["State"] == "ALIVE"]


def _replica_nodes(app: str, deployment: str = "EngineServer") -> dict[str, str]:
    """Replica id -> node id, for the live replicas of one of the app's deployments."""
    return {a["Name"].split("#")[-1]: a["Address"]["NodeID"] for a in _alive_actors()
            if a["ActorClassName"] == f"ServeReplica:{app}:{deployment}"}


def _generate(url: str, prompt: str) -> dict[str, Any]:
    return httpx.post(url + "/generate", json={"prompt": prompt, "max_tokens": 12, "temperature": 0},
                      timeout=120).json()


def apps(ckpt: str) -> dict[str, dict[str, Any]]:
    """The applications the spread, tp and loss parts measure, deployed together before them."""
    return {
        # spread: two replicas on A and B
        "spread": {"model": ckpt, "engine": ENGINE, "num_replicas": 2,
                   "ray_actor_options": {"num_cpus": 1, "resources": {"spread": 1}}},
        # tp: a tp=2 group whose bundles need `tp` (one unit on A, one on B): PACK spans the two
        "tp_pack": tp_args(ckpt) | {"placement_strategy": "PACK"},
        # loss: two replicas on A and B (once spread's and tp's applications are gone), the spread
        # part's reference meanwhile
        "loss": {"model": ckpt, "engine": ENGINE, "num_replicas": 2, "request_router": "power_of_two",
                 "ray_actor_options": {"num_cpus": 1, "resources": {"loss": 1}},
                 "health_check_period_s": 1.0, "health_check_timeout_s": 5.0},
    }


def tp_args(ckpt: str) -> dict[str, Any]:
    """A tp=2 group whose bundles need resource `tp`."""
    return {"model": ckpt, "engine": dict(ENGINE, tp=2), "ray_actor_options": {"num_cpus": 1, "resources": {"tp": 1}}}


def tp_strict(url: str, ckpt: str) -> str | None:
    """The STRICT_PACK group's build-time refusal (None: it deployed)."""
    from deployments.placement import PlacementError

    try:
        _deploy(url, {"tp_strict": tp_args(ckpt)})
    except PlacementError as e:
        return str(e)
    return None


def spread(urls: dict[str, str], nodes: dict[str, str]) -> dict[str, Any]:
    from ray import serve

    expected = [_generate(urls["loss"], p)["output_ids"] for p in PROMPTS]
    got = [_generate(urls["spread"], p)["output_ids"] for p in PROMPTS]  # distinct prefixes: spread over both
    stats = serve.get_app_handle("spread").engine_stats.remote().result()
    placed = sorted(nodes[n] for n in _replica_nodes("spread").values())
    serve.delete("spread")
    return {"identical": got == expected, "replica_nodes": placed,
            "tokens_per_replica": sorted(s["generated_tokens"] for s in stats)}


def tp(urls: dict[str, str], nodes: dict[str, str], strict_error: str | None) -> dict[str, Any]:
    from ray import serve

    out = _generate(urls["tp_pack"], PROMPTS[1])
    (stats,) = serve.get_app_handle("tp_pack").engine_stats.remote().result()
    (worker,) = [a["Address"]["NodeID"] for a in _alive_actors() if a["Name"] == stats["tp_worker_names"][0]]
    rank_nodes = sorted(nodes[n] for n in [*_replica_nodes("tp_pack").values(), worker])
    serve.delete("tp_pack")
    return {"strict_error": strict_error, "pack_output_ids": out.get("output_ids"), "pack_rank_nodes": rank_nodes,
            "tp_workers": stats["tp_workers"]}


async def _stream(client: httpx.AsyncClient, url: str, prompt: str, ended: dict[int, float], i: int) -> str:
    """'ok', 'error' (an explicit error: status or error delta) or 'lost' (no answer, broken connection)."""
    body = {"prompt": prompt, "max_tokens": 400, "temperature": 1.0, "seed": i, "ignore_eos": True, "stream": True}
    try:
        async with client.stream("POST", url + "/generate", json=body) as r:
            lines = [line async for line in r.aiter_lines() if line]
    except Exception:  # noqa: BLE001 - a dropped connection or a timeout is a lost request
        return "lost"
    finally:
        ended[i] = time.monotonic()
    if r.status_code != 200:
        return "error" if r.status_code in (429, 500, 503) else "lost"
    events = [json.loads(x[6:]) for x in lines if x.startswith("data: ") and x != "data: [DONE]"]
    if not lines or lines[-1] != "data: [DONE]" or not events:
        return "lost"
    return "error" if events[-1]["meta_info"]["finish_reason"]["type"] == "error" else "ok"


def _held_once_all_admitted(handle, ended: dict[int, float], total: int) -> dict[str, int]:
    """With generation paused, wait until each of the `total` requests sent is inside an engine (or
    answered): replica id -> requests it holds. Nothing steps, so the count only grows."""
    deadline = time.monotonic() + 300  # a hang guard only: the count does not depend on speed
    while time.monotonic() < deadline:
        held = {s["replica"]: s["running"] + s["waiting"] for s in handle.engine_stats.remote().result()}
        if sum(held.values()) + len(ended) >= total:
            return held
        time.sleep(0.2)
    raise TimeoutError(f"only {held} of {total} requests reached an engine")


def loss(app: str, nodes: dict[str, str], cluster, victim) -> dict[str, Any]:
    """Replicas on A and B (running); node E joins with a spare `loss` unit for the replacement."""
    from ray import serve

    placed = {rid: nodes[n] for rid, n in _replica_nodes("loss").items()}
    ingress_nodes = sorted(nodes[n] for n in _replica_nodes("loss", "Ingress").values())  # the default placement
    nodes[cluster.add_node(num_cpus=3, resources={"loss": 1}).node_id] = "E"
    cluster.wait_for_nodes()
    handle = serve.get_app_handle("loss")

    async def drill() -> dict[str, Any]:
        ended: dict[int, float] = {}
        async with httpx.AsyncClient(timeout=300) as client:  # a hang guard: streams wait out the pause
            # Paused in place before anything is sent: no request finishes before the loss, whatever the
            # machine's speed, so what the loss hits is known exactly.
            paused = await asyncio.to_thread(lambda: handle.pause_generation.remote({"mode": "in_place"}).result())
            assert paused["success"], paused
            tasks: list[asyncio.Future] = []
            while True:
                first, count = len(tasks), 1 if tasks else 12
                tasks += [asyncio.ensure_future(_stream(client, app, PROMPTS[i % len(PROMPTS)], ended, i))
                          for i in range(first, first + count)]
                held = await asyncio.to_thread(_held_once_all_admitted, handle, ended, len(tasks))
                if len(held) == 2 and all(held.values()):
                    break  # both replicas hold requests (else the router put them all on one: send another)
            await asyncio.to_thread(cluster.remove_node, victim, False)
            killed_at = time.monotonic()
            # The live replica steps again; the dead one's part of the broadcast fails (an answer, not a raise).
            resumed = asyncio.ensure_future(asyncio.to_thread(lambda: handle.continue_generation.remote().result()))
            outcomes = await asyncio.gather(*tasks)
            await resumed
        after_kill = [ended[i] - killed_at for i, o in enumerate(outcomes) if o == "error"]
        return {"held_at_kill": {placed.get(r, "?"): n for r, n in held.items()}, "requests": len(outcomes),
                "ok": outcomes.count("ok"), "failed": outcomes.count("error"), "lost": outcomes.count("lost"),
                "max_error_s_after_kill": round(max(after_kill, default=0.0), 2)}

    result = asyncio.run(drill())
    deadline, recovered = time.monotonic() + 120, False
    while time.monotonic() < deadline:  # until Serve replaced A's replica (A's actor may still read ALIVE)
        r = httpx.post(app + "/generate", json={"prompt": "after", "max_tokens": 8}, timeout=60)
        after = [nodes.get(n, "?") for n in _replica_nodes("loss").values()]
        if r.status_code == 200 and len(after) == 2 and "A" not in after:
            recovered = all(_generate(app, p).get("output_ids") for p in PROMPTS)
            break
        time.sleep(1)
    result.update(replica_nodes_before=sorted(placed.values()), ingress_nodes=ingress_nodes, new_requests_ok=recovered,
                  replica_nodes_after=sorted(nodes.get(n, "?") for n in _replica_nodes("loss").values()))
    return result


class Holder:
    """An actor that only holds the resources it was created with."""

    def ready(self) -> bool:
        return True


def unschedulable(url: str, ckpt: str) -> dict[str, Any]:
    import ray
    from ray import serve

    from deployments.app import build_app

    holder = ray.remote(resources={"busy": 1})(Holder).remote()
    ray.get(holder.ready.remote())
    args = {"model": ckpt, "engine": ENGINE, "ray_actor_options": {"num_cpus": 1, "resources": {"busy": 1}}}
    serve._run(build_app(args), _blocking=False, name="stuck", route_prefix="/stuck", logging_config=QUIET)
    answers: list[dict[str, Any]] = []
    deadline = time.monotonic() + 300  # a hang guard
    while time.monotonic() < deadline and len(answers) < 3:  # until the ingress itself is up
        started = time.monotonic()
        try:
            r = httpx.post(f"{url}/stuck/generate", json={"prompt": "hi", "max_tokens": 4}, timeout=30)
        except httpx.TimeoutException:
            answers.append({"status": "timeout", "seconds": round(time.monotonic() - started, 2)})
            continue
        if r.status_code != 404:  # 404: the proxy does not route /stuck yet
            answers.append({"status": r.status_code, "retry_after": r.headers.get("retry-after"),
                            "seconds": round(time.monotonic() - started, 2)})
        time.sleep(0.5)
    serve.delete("stuck", _blocking=False)
    ray.kill(holder)
    return {"answers": answers}


def main() -> int:
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from testing.tiny_checkpoint import DLLM_TEST_LOGIT_SCALE, write_tiny_checkpoint

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "_system_config": SYSTEM_CONFIG})
    # each of A and B holds a spread replica, a tp bundle and a loss replica at once (a CPU each), and A
    # the `busy` unit the unschedulable part's holder takes
    names = {"A": {"spread": 1, "tp": 1, "loss": 1, "busy": 1}, "B": {"spread": 1, "tp": 1, "loss": 1}}
    handles = {name: cluster.add_node(num_cpus=4, resources=res) for name, res in names.items()}
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level="warning", log_to_driver=False)
    nodes = {n["NodeID"]: "head" for n in ray.nodes()}
    for name, h in handles.items():
        nodes[h.node_id] = name
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port, "location": "HeadOnly"}, logging_config=QUIET)
    url = f"http://127.0.0.1:{port}"
    report: dict[str, Any] = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            ckpt = str(write_tiny_checkpoint(Path(tmp) / "sdar", model_type="sdar", logit_scale=DLLM_TEST_LOGIT_SCALE))
            started = time.monotonic()
            strict_error = tp_strict(url, ckpt)
            urls = _deploy(url, apps(ckpt))
            report["deploy_seconds"] = round(time.monotonic() - started, 1)
            for part, run in (("spread", lambda: spread(urls, nodes)), ("tp", lambda: tp(urls, nodes, strict_error)),
                              ("unschedulable", lambda: unschedulable(url, ckpt)),
                              ("loss", lambda: loss(urls["loss"], nodes, cluster, handles["A"]))):
                started = time.monotonic()
                report[part] = run()
                report[part]["seconds"] = round(time.monotonic() - started, 1)
    finally:
        print(json.dumps(report), flush=True)
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
