"""`python -m bench.load`: N concurrent mixed requests against blockserve over HTTP.

The mix: block-diffusion generation on the DLLM app, each body sent twice -- once unary and once
streamed (SSE) -- with seeded sampling or greedy decoding, plus input-token scoring on the AR app
(unary and streamed). Every request is in flight at once. The run checks that none is lost or
duplicated and that each response belongs to its request (unique ids; a streamed response equals its
unary twin; scoring rows name exactly the request's tokens), and reports latency percentiles and
throughput.

    python -m bench.load                       # local: a Ray cluster with the tiny test checkpoints
    python -m bench.load --sdar-url http://127.0.0.1:8000 --qwen3-url http://127.0.0.1:8001  # running servers
    python -m bench.load -n 256 --json out.json

Prints one JSON object (figures + problems) to stdout; progress goes to stderr. Exit status 1 when
any check failed. `tests/deployments/test_reliability_load.py` runs the same functions against the test cluster.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.local_cluster import QUIET, local_serve

# the test cluster's engines (tests/support/ray_env.py SERVE_ENGINE): tiny checkpoints, 4-token pages
LOCAL_ENGINE = {"max_model_len": 512, "num_kv_blocks": 192, "kv_block_size": 4, "max_batch_size": 32,
                "dllm_block_length": 4}


@dataclass
class Job:
    index: int
    app: str  # "sdar" (DLLM generation) | "qwen3" (AR scoring)
    kind: str  # "unary" | "stream" | "score"
    body: dict[str, Any]
    pair: int | None = None  # generation: unary and streamed twins share a pair number


@dataclass
class Result:
    job: Job
    status: int = 0
    body: dict[str, Any] | None = None  # the unary JSON, or the merged stream
    latency_s: float = 0.0
    first_byte_s: float | None = None
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def make_jobs(n: int = 256, seed: int = 0, score_share: float = 0.25, max_tokens: int = 16,
              vocab: int = 300) -> list[Job]:
    """`n` jobs: pairs of DLLM generation bodies (unary + streamed) and AR scoring requests."""
    rng = random.Random(seed)
    n_score = int(n * score_share)
    n_pairs = (n - n_score) // 2
    n_score = n - 2 * n_pairs
    jobs: list[Job] = []
    for p in range(n_pairs):
        ids = [p % vocab + 1] + [rng.randrange(1, vocab) for _ in range(rng.randrange(3, 32))]  # unique per pair
        body: dict[str, Any] = {"input_ids": ids, "max_tokens": max_tokens, "ignore_eos": True}
        if p % 4 == 0:
            body["temperature"] = 0
        else:
            body.update(temperature=0.8, top_p=0.95, seed=rng.randrange(2**31))
        if p % 3 == 0:
            body.update(return_logprob=True, top_logprobs_num=2)
        jobs.append(Job(len(jobs), "sdar", "unary", body, p))
        jobs.append(Job(len(jobs), "sdar", "stream", {**body, "stream": True}, p))
    for _ in range(n_score):
        ids = [rng.randrange(1, vocab) for _ in range(rng.randrange(6, 48))]
        body = {"input_ids": ids, "max_tokens": 0, "return_logprob": True, "top_logprobs_num": 2,
                "logprob_start_len": rng.randrange(0, len(ids) - 1), "stream": rng.random() < 0.5}
        jobs.append(Job(len(jobs), "qwen3", "score", body))
    rng.shuffle(jobs)
    return jobs


def _merge(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """A /generate stream's cumulative chunks (SGLang's default) as the unary body."""
    from deployments.sglang.serving import fold_cumulative_chunks

    return fold_cumulative_chunks(chunks)


async def _one(client: httpx.AsyncClient, url: str, job: Job, t0: float) -> Result:
    res = Result(job)
    start = time.perf_counter()
    try:
        if not job.body.get("stream"):
            r = await client.post(url + "/generate", json=job.body)
            res.status = r.status_code
            res.first_byte_s = time.perf_counter() - start
            res.body = r.json()
        else:
            async with client.stream("POST", url + "/generate", json=job.body) as r:
                res.status = r.status_code
                deltas, done = [], 0
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if res.first_byte_s is None:
                        res.first_byte_s = time.perf_counter() - start
                    if line == "data: [DONE]":
                        done += 1
                    else:
                        deltas.append(json.loads(line[6:]))
                if r.status_code != 200:
                    res.body = deltas[0] if deltas else None
                else:
                    res.body = _merge(deltas)
                    res.extra = {"deltas": len(deltas), "done": done}
    except Exception as e:  # noqa: BLE001 - recorded as a lost request
        res.error = f"{type(e).__name__}: {e}"
    res.latency_s = time.perf_counter() - start
    res.extra["end_s"] = time.perf_counter() - t0
    return res


async def run_jobs(urls: dict[str, str], jobs: list[Job], timeout_s: float = 300.0,
                   headers: dict[str, str] | None = None) -> tuple[list[Result], float]:
    """Send every job at once; (results in job order, wall seconds)."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits, headers=headers) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(_one(client, urls[j.app], j, t0) for j in jobs))
        return list(results), time.perf_counter() - t0


def _without_id(body: dict[str, Any]) -> dict[str, Any]:
    return {**body, "meta_info": {k: v for k, v in body["meta_info"].items() if k != "id"}}


LOGPROB_TOL = 1e-4


def _logprob_rows_close(a: Any, b: Any) -> bool:
    """[[value, id], ...] (or lists of them): the same ids, values within LOGPROB_TOL. Logprob values
    of one request depend in the last bits on which requests share its forwards (float reductions
    over a different batch); the tokens and everything else must be identical."""
    if a is None or b is None:
        return a is b
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x and isinstance(x[0], list):
            if not _logprob_rows_close(x, y):
                return False
        elif x[1] != y[1] or abs(x[0] - y[0]) > LOGPROB_TOL:
            return False
    return True


def same_result(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Two /generate bodies (ids removed) are the same result: exactly, up to logprob values."""
    lp = ("output_token_logprobs", "output_top_logprobs", "input_token_logprobs", "input_top_logprobs")
    ma, mb = a["meta_info"], b["meta_info"]
    if {k: v for k, v in a.items() if k != "meta_info"} != {k: v for k, v in b.items() if k != "meta_info"}:
        return False
    if {k: v for k, v in ma.items() if k not in lp} != {k: v for k, v in mb.items() if k not in lp}:
        return False
    return all(_logprob_rows_close(ma.get(k), mb.get(k)) for k in lp)


def check(results: list[Result]) -> list[str]:
    """Every problem found: lost (error / non-200 / unfinished), duplicated (an id seen twice),
    misdelivered (a body that does not belong to its request), streamed != unary."""
    problems: list[str] = []
    ids: dict[str, int] = {}
    pairs: dict[int, dict[str, dict]] = {}
    for r in results:
        j = r.job
        tag = f"job {j.index} ({j.app} {j.kind})"
        if r.error or r.status != 200 or not r.body or "meta_info" not in r.body:
            problems.append(f"{tag}: lost: status {r.status}, {r.error or str(r.body)[:300]}")
            continue
        mi = r.body["meta_info"]
        if mi["id"] in ids:
            problems.append(f"{tag}: duplicated id {mi['id']} (also job {ids[mi['id']]})")
        ids[mi["id"]] = j.index
        if j.body.get("stream") and r.extra.get("done") != 1:
            problems.append(f"{tag}: the stream ended {r.extra.get('done')} times with [DONE]")
        ids_in = j.body["input_ids"]
        if mi["prompt_tokens"] != len(ids_in):
            problems.append(f"{tag}: prompt_tokens {mi['prompt_tokens']} != {len(ids_in)}: not its response")
        if j.kind == "score":
            n = j.body["logprob_start_len"]
            rows = mi["input_token_logprobs"] or []
            if [row[1] for row in rows] != ids_in[n + 1:]:
                problems.append(f"{tag}: scoring rows do not name input_ids[{n + 1}:]: not its response")
            if r.body["output_ids"] or (mi["finish_reason"] or {}).get("type") != "length":
                problems.append(f"{tag}: scoring generated tokens or did not finish: {mi['finish_reason']}")
            continue
        if len(r.body["output_ids"]) != j.body["max_tokens"] or mi["finish_reason"]["type"] != "length":
            problems.append(f"{tag}: {len(r.body['output_ids'])} tokens, finish {mi['finish_reason']}")
        pairs.setdefault(j.pair, {})[j.kind] = _without_id(r.body)
    for p, twins in pairs.items():
        if len(twins) == 2 and not same_result(twins["unary"], twins["stream"]):
            u, s = twins["unary"], twins["stream"]
            diff = [k for k in u["meta_info"] if u["meta_info"][k] != s["meta_info"].get(k)]
            diff += [k for k in ("text", "output_ids") if u[k] != s[k]]
            problems.append(f"pair {p}: streamed != unary for the same body and seed: {diff}")
    return problems


def _pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    v = sorted(values)
    return v[max(0, math.ceil(q / 100 * len(v)) - 1)] if v else float("nan")


def summarize(results: list[Result], wall_s: float) -> dict[str, Any]:
    ok = [r for r in results if r.status == 200 and r.body and "meta_info" in r.body]

    def lat(rs: list[Result]) -> dict[str, float]:
        xs = [r.latency_s for r in rs]
        return {"n": len(xs), "p50_s": round(_pct(xs, 50), 3), "p99_s": round(_pct(xs, 99), 3),
                "max_s": round(max(xs), 3) if xs else float("nan")}

    by_kind = {k: lat([r for r in ok if r.job.kind == k]) for k in ("unary", "stream", "score")}
    ttft = [r.first_byte_s for r in ok if r.job.kind == "stream" and r.first_byte_s is not None]
    generated = sum(len(r.body["output_ids"]) for r in ok)
    scored = sum(len(r.body["meta_info"]["input_token_logprobs"] or []) for r in ok if r.job.kind == "score")
    return {
        "requests": len(results), "ok": len(ok), "wall_s": round(wall_s, 3),
        "throughput_req_s": round(len(ok) / wall_s, 2),
        "generated_tokens_s": round(generated / wall_s, 1), "scored_tokens_s": round(scored / wall_s, 1),
        "latency": {"all": lat(ok), **by_kind},
        "stream_first_delta": {"p50_s": round(_pct(ttft, 50), 3), "p99_s": round(_pct(ttft, 99), 3)},
        "mean_latency_s": round(statistics.fmean(r.latency_s for r in ok), 3) if ok else None,
    }


def run(urls: dict[str, str], n: int = 256, seed: int = 0, headers: dict[str, str] | None = None) -> dict[str, Any]:
    jobs = make_jobs(n, seed)
    results, wall = asyncio.run(run_jobs(urls, jobs, headers=headers))
    return {**summarize(results, wall), "problems": check(results)}


# ---- a local cluster like the test suite's (when no URLs are given) ----------------------------
def run_local(n: int, seed: int) -> dict[str, Any]:
    with contextlib.redirect_stdout(sys.stderr):  # Ray's own messages: stdout carries only the figures
        return _run_local(n, seed)


def _run_local(n: int, seed: int) -> dict[str, Any]:
    from engine.local_ray import use_loopback

    use_loopback()  # before `import ray`: local_serve's cluster listens on loopback only
    from ray import serve

    from deployments.app import build_app
    from testing.tiny_checkpoint import DLLM_TEST_LOGIT_SCALE, write_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp, local_serve(num_cpus=16) as base_url:
        sdar = write_tiny_checkpoint(Path(tmp) / "sdar", model_type="sdar", logit_scale=DLLM_TEST_LOGIT_SCALE)
        qwen3 = write_tiny_checkpoint(Path(tmp) / "qwen3", model_type="qwen3")
        specs = {"sdar": (sdar, dict(LOCAL_ENGINE), {}),
                 "qwen3": (qwen3, dict(LOCAL_ENGINE, logprobs_mode="raw_logprobs"), {"num_replicas": 2})}
        print("deploying the tiny sdar and qwen3 apps ...", file=sys.stderr)
        serve.run_many([serve.RunTarget(build_app({"model": str(m), "engine": e, **a}), name=name,
                                        route_prefix=f"/{name}", logging_config=QUIET)
                        for name, (m, e, a) in specs.items()])
        urls = {name: f"{base_url}/{name}" for name in specs}
        run(urls, n=min(n, 16), seed=seed + 1)  # warm-up
        return run(urls, n=n, seed=seed)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=256, help="concurrent requests (default 256)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sdar-url", help="base URL of a running DLLM app (else a local cluster is started)")
    ap.add_argument("--qwen3-url", help="base URL of a running AR app with logprobs_mode set")
    ap.add_argument("--api-key")
    ap.add_argument("--json", type=Path, help="also write the figures to this file")
    args = ap.parse_args(argv)
    if bool(args.sdar_url) != bool(args.qwen3_url):
        ap.error("give both --sdar-url and --qwen3-url, or neither")
    if args.sdar_url:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
        out = run({"sdar": args.sdar_url.rstrip("/"), "qwen3": args.qwen3_url.rstrip("/")}, args.n, args.seed,
                  headers)
    else:
        out = run_local(args.n, args.seed)
    text = json.dumps(out, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 1 if out["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
