"""`python -m bench.serve_streaming`: what a streamed request costs the Serve path, with and without batching.

A streamed request's every delta is a message from the engine replica to the ingress (a Serve
streaming call), formatted there as an SSE event and sent on to the HTTP proxy (another one). This
bench starts a throwaway local Ray cluster, deploys the application (`deployments.app.build_app`) on a
tiny random-weight model with one layer, once per `stream_batching_interval_ms` asked for, and sends
`--concurrency` requests of `--tokens` output tokens over loopback HTTP, unary and streamed (SSE),
alternating, `--repeats` times each. Per way it prints the wall seconds of the whole batch, the CPU
seconds the cluster's processes spent on it (the proxy, the ingress and engine replicas, Ray's
daemons: the processes the bench started, by `psutil`, summed per process name), and the SSE events
the client read. CPU time, not wall time, is the figure to compare on a shared machine; both are
medians of the repeats.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

from bench.local_cluster import QUIET, local_serve
from bench.overhead import PARADIGMS, PROMPT_LEN, _prompt, engine_settings, select_paradigms

DEFAULT_ONLY = "block_diffusion/low_confidence_dynamic"
WAYS = ("unary", "streamed")


def _cluster_cpu() -> dict[tuple[int, float], tuple[str, float]]:
    """CPU seconds so far of each process of the bench's own cluster -- the Ray processes this process
    started, its descendants, not another cluster's on a shared machine -- keyed by (pid, start time)
    so that a process that exits or a pid that is reused is not mistaken for another: (its name, e.g.
    `ray::ProxyActor`, its seconds)."""
    out: dict[tuple[int, float], tuple[str, float]] = {}
    for p in psutil.Process().children(recursive=True):
        try:
            t = p.cpu_times()
            out[(p.pid, p.create_time())] = (p.name(), t.user + t.system)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


async def _send(url: str, concurrency: int, tokens: int, streamed: bool) -> int:
    """Every request at once; the SSE events read (unary: one per request)."""
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        async def one(i: int) -> int:
            body = {"input_ids": _prompt(i), "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
            if not streamed:
                r = await client.post(url + "/generate", json=body)
                assert r.status_code == 200, r.text
                return 1
            events = 0
            async with client.stream("POST", url + "/generate", json={**body, "stream": True}) as r:
                assert r.status_code == 200, await r.aread()
                async for line in r.aiter_lines():
                    events += line.startswith("data:") and "[DONE]" not in line
            return events

        return sum(await asyncio.gather(*(one(i) for i in range(concurrency))))


def _measure(url: str, concurrency: int, tokens: int, streamed: bool) -> dict:
    before, t0 = _cluster_cpu(), time.perf_counter()
    events = asyncio.run(_send(url, concurrency, tokens, streamed))
    wall, after = time.perf_counter() - t0, _cluster_cpu()
    spent: dict[str, float] = {}  # by process name; a process that ended in between is not counted
    for key, (name, seconds) in after.items():
        spent[name] = spent.get(name, 0.0) + seconds - before.get(key, (name, 0.0))[1]
    return {"wall_s": wall, "cpu_s": sum(spent.values()), "events": events,
            # CPU times come in clock ticks, and a difference of two is not exact (0.00999...): keep every
            # process whose time rounds to something
            "cpu_s_by_process": {n: round(s, 3) for n, s in sorted(spent.items()) if round(s, 3) > 0}}


def _median(runs: list[dict]) -> dict:
    middle = sorted(runs, key=lambda r: r["cpu_s"])[len(runs) // 2]
    return {"cpu_s": round(statistics.median(r["cpu_s"] for r in runs), 3),
            "wall_s": round(statistics.median(r["wall_s"] for r in runs), 3),
            "events": middle["events"], "cpu_s_runs": [round(r["cpu_s"], 3) for r in runs],
            "cpu_s_by_process": middle["cpu_s_by_process"]}


def run(names: list[str], intervals: list[float], concurrency: int, tokens: int, repeats: int) -> dict:
    out: dict = {"concurrency": concurrency, "tokens": tokens, "prompt_len": PROMPT_LEN, "paradigms": {}}
    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(sys.stderr):  # Ray's messages
        with local_serve(num_cpus=4) as base:
            from ray import serve

            from deployments.app import build_app

            for name in names:
                paradigm = PARADIGMS[name]
                path = paradigm.write(Path(tmp) / paradigm.family, PROMPT_LEN + tokens + 256)
                engine = engine_settings(paradigm, tokens, concurrency, "cpu")
                actor = {"num_cpus": 1, "runtime_env": {"env_vars": {"OMP_NUM_THREADS": "1"}}}
                rows = out["paradigms"][name] = {}
                for interval in intervals:
                    print(f"[serve_streaming] {name}, stream_batching_interval_ms={interval:g}", flush=True)
                    serve.run(build_app({"model": str(path), "engine": engine, "ray_actor_options": actor,
                                         "stream_batching_interval_ms": interval}),
                              name="bench", route_prefix="/bench", logging_config=QUIET)
                    url = f"{base}/bench"
                    for way in WAYS:  # warm-up
                        _measure(url, concurrency, tokens, way == "streamed")
                    runs: dict[str, list[dict]] = {way: [] for way in WAYS}
                    for _ in range(repeats):
                        for way in WAYS:
                            runs[way].append(_measure(url, concurrency, tokens, way == "streamed"))
                    rows[f"{interval:g}"] = {way: _median(r) for way, r in runs.items()}
                    serve.delete("bench")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64, help="output tokens per request")
    ap.add_argument("--intervals", default="0,20", metavar="MS[,MS]",
                    help="the app's stream_batching_interval_ms values to deploy, one application each")
    ap.add_argument("--only", default=DEFAULT_ONLY, metavar="NAME[,NAME]",
                    help=f"paradigms (names or prefixes, as bench.overhead takes them): {', '.join(PARADIGMS)}")
    ap.add_argument("--repeats", type=int, default=3, help="measured runs of each way (medians are printed)")
    args = ap.parse_args(argv)
    intervals = [float(v) for v in args.intervals.split(",") if v.strip()]
    command = "python -m bench.serve_streaming " + " ".join(sys.argv[1:] if argv is None else argv)
    result = run(select_paradigms(args.only), intervals, args.concurrency, args.tokens, args.repeats)
    print(json.dumps({"command": command, **result}, indent=2))


if __name__ == "__main__":
    main()
