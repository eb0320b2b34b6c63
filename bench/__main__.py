"""`python -m bench [--quick]`: the engine against Hugging Face baselines, side by side in one run.

Prints one JSON object to stdout (progress goes to stderr) and appends a dated section to
docs/benchmarks.md. Workloads, baselines and figures are described in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from bench import hf_baselines as hf
from bench.measure import PeakRSS, mm_peak_gflops, rss_bytes, run_engine
from bench.models import TOY_SHAPE, BenchShape, mask_id_of, stop_ids_of, write_bench_models
from bench.moe import bench_moe
from bench.report import append_report
from bench.serving import bench_serving
from bench.workloads import Traffic, make_prompts, scoring_inputs
from engine import EngineConfig, GenerationConfig, pipeline

BLOCK = 4
PARTS = ["memory", "dllm", "ar", "scoring", "serve", "moe"]
STRATEGY = "low_confidence_dynamic"
THRESHOLD = 0.85


def log(*args) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}]", *args, file=sys.stderr, flush=True)


def plan(mode: str) -> dict:
    """Workload c serves `waves * c` requests with c in flight (c = 1: `sequential_requests` of them).
    `mode`: full | quick | toy (every part at toy size in seconds, for the test suite)."""
    if mode == "toy":
        return {
            "shape": TOY_SHAPE,
            "traffic": Traffic(8, (4, 12), (4, 8)),
            "concurrency": [1, 4],
            "waves": 1,
            "sequential_requests": 1,
            "hf_dllm_requests": 1,
            "fusion_off_at": [4],
            "serve_concurrency": 4,
            "scoring": (2, 64),
            "memory_tokens": 128,
        }
    if mode == "quick":
        return {
            "shape": BenchShape(num_hidden_layers=2),
            "traffic": Traffic(64, (16, 128), (16, 48)),
            "concurrency": [1, 8, 32],
            "waves": 2,
            "sequential_requests": 2,
            "hf_dllm_requests": 4,  # the SDAR loop is sequential: its tokens/s is measured on a sample
            "fusion_off_at": [32],
            "serve_concurrency": 32,
            "scoring": (4, 1024),
            "memory_tokens": 6000,
        }
    return {
        "shape": BenchShape(),
        "traffic": Traffic(64, (16, 256), (32, 128)),
        "concurrency": [1, 8, 32],
        "waves": 2,
        "sequential_requests": 4,
        "hf_dllm_requests": 8,
        "fusion_off_at": [1, 8, 32],
        "serve_concurrency": 32,
        "scoring": (16, 1024),
        "memory_tokens": 6000,
    }


def num_requests(p: dict, c: int) -> int:
    return p["sequential_requests"] if c == 1 else min(p["waves"] * c, p["traffic"].num_requests)


def _engine_config(**kw) -> EngineConfig:
    base = {"num_kv_blocks": 1024, "kv_block_size": 16, "max_batch_size": 64, "dllm_block_length": BLOCK,
            "dllm_unmasking_strategy": STRATEGY, "dllm_confidence_threshold": THRESHOLD}
    base.update(kw)
    return EngineConfig(**base)


def _warm_engine(pipe, shape) -> None:
    run_engine(pipe.engine, [[11, 12, 13, 14, 15, 16, 17]], [GenerationConfig(max_new_tokens=8)], shape, 1)


def _blocks(prompt_len: int, n_out: int) -> int:
    """DLLM blocks an output of n_out tokens spans (the first may be the prompt's partial block)."""
    return (prompt_len + max(n_out, 1) - 1) // BLOCK - prompt_len // BLOCK + 1


class Clock:
    """Wall and process-CPU seconds of a `with` block."""

    def __enter__(self) -> Clock:
        self.t, self.c = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        self.wall = time.perf_counter() - self.t
        self.cpu = time.process_time() - self.c


def _rates(tokens: int, wall: float, cpu: float) -> dict:
    return {"seconds": round(wall, 3), "cpu_seconds": round(cpu, 3), "tokens_per_s": round(tokens / wall, 3),
            "tokens_per_cpu_s": round(tokens / cpu, 3)}


def _ratios(engine: dict, base: dict) -> dict:
    return {"ratio_vs_baseline": round(engine["tokens_per_cpu_s"] / base["tokens_per_cpu_s"], 2),
            "ratio_vs_baseline_wall": round(engine["tokens_per_s"] / base["tokens_per_s"], 2)}


def _summary_engine(run, peak: float, prompts, dllm: bool) -> dict:
    tokens = run.output_tokens
    out = {
        "requests": len(run.outputs),
        "output_tokens": tokens,
        **_rates(tokens, run.seconds, run.cpu_seconds),
        "forwards": run.forwards,
        "forwards_per_token": round(run.forwards / max(tokens, 1), 4),
        "sequence_forwards_per_token": round(run.seq_forwards / max(tokens, 1), 4),
        "lm_head_rows_per_token": round(run.lm_head_rows / max(tokens, 1), 3),
        "ttfc_mean_s": round(statistics.fmean(run.ttfc), 3),
        "ttfc_p50_s": round(statistics.median(run.ttfc), 3),
        "ttfc_max_s": round(max(run.ttfc), 3),
        "engine_overhead": round(1 - run.forward_seconds / run.step_seconds, 4),
        "achieved_gflops": round(run.matmul_flops / run.forward_cpu_seconds / 1e9, 2),
        "share_of_mm_peak": round(run.matmul_flops / run.forward_cpu_seconds / 1e9 / peak, 3),
        "peak_rss_mb": round(run.peak_rss / 2**20),
        "finish_stop": sum(o.finish_reason == "stop" for o in run.outputs),
    }
    if dllm:
        blocks = sum(_blocks(len(p), len(o.token_ids)) for p, o in zip(prompts, run.outputs))
        out["blocks"] = blocks
        out["sequence_forwards"] = run.seq_forwards
        out["unmasking_steps"] = run.unmasking_steps
        out["sequence_forwards_per_block"] = round(run.seq_forwards / blocks, 3)
        out["denoising_steps_per_block"] = round(run.unmasking_steps / blocks, 3)
    return out


# ---- DLLM --------------------------------------------------------------------------------------
def bench_dllm(path: Path, p: dict, peak: float) -> dict:
    shape: BenchShape = p["shape"]
    stops = stop_ids_of(path)
    mask_id = mask_id_of(path)
    prompts, budgets = make_prompts(p["traffic"], shape.vocab_size, stops | {mask_id})
    params = [GenerationConfig(max_new_tokens=m) for m in budgets]
    result: dict = {"workloads": {}}
    engine_outputs: dict[int, list[int]] = {}
    for fusion in (True, False):
        todo = p["concurrency"] if fusion else p["fusion_off_at"]
        pipe = pipeline(str(path), _engine_config(dllm_commit_fusion=fusion))
        _warm_engine(pipe, shape)
        for c in todo:
            n = num_requests(p, c)
            log(f"dllm engine fusion={fusion} concurrency={c} requests={n}")
            run = run_engine(pipe.engine, prompts[:n], params[:n], shape, c)
            s = _summary_engine(run, peak, prompts[:n], dllm=True)
            if fusion:
                result["workloads"][str(c)] = {"engine": s}
                for i, o in enumerate(run.outputs):
                    engine_outputs.setdefault(i, o.token_ids)
            else:
                result["workloads"][str(c)]["engine_fusion_off"] = s
        pipe.close()
        del pipe
        gc.collect()

    # The SDAR loop serves one request at a time: measure it on the first `hf_dllm_requests` prompts.
    model = hf.load_hf(path)
    hf.sdar_generate(model, [11, 12, 13, 14, 15], block_length=BLOCK, mask_id=mask_id, max_new_tokens=4,
                     stop_ids=stops, strategy=STRATEGY, denoising_steps=BLOCK, threshold=THRESHOLD)
    per_request = []
    n_hf = min(p["hf_dllm_requests"], len(prompts))
    with PeakRSS() as mem:
        for i in range(n_hf):
            log(f"dllm HF SDAR loop request {i + 1}/{n_hf}")
            first: list[float] = []
            with Clock() as clock:
                out, forwards, rows = hf.sdar_generate(
                    model, prompts[i], block_length=BLOCK, mask_id=mask_id, max_new_tokens=budgets[i],
                    stop_ids=stops, strategy=STRATEGY, denoising_steps=BLOCK, threshold=THRESHOLD,
                    on_first_block=lambda first=first: first.append(time.perf_counter()))
            per_request.append({"tokens": len(out), "seconds": clock.wall, "cpu": clock.cpu, "forwards": forwards,
                                "rows": rows,
                                "first_block_s": (first[0] - clock.t) if first else clock.wall,
                                "blocks": _blocks(len(prompts[i]), len(out)),
                                "match": out == engine_outputs.get(i)})
    del model
    gc.collect()
    tokens = sum(r["tokens"] for r in per_request)
    wall = sum(r["seconds"] for r in per_request)
    forwards = sum(r["forwards"] for r in per_request)
    base = {
        "name": "SDAR generate loop on HF transformers (DynamicCache, one request at a time)",
        "requests_measured": n_hf,
        "output_tokens": tokens,
        **_rates(tokens, wall, sum(r["cpu"] for r in per_request)),
        "forwards_per_token": round(forwards / tokens, 4),
        "forwards_per_block": round(forwards / sum(r["blocks"] for r in per_request), 3),
        "lm_head_rows_per_token": round(sum(r["rows"] for r in per_request) / tokens, 3),
        "match_rate": round(sum(r["match"] for r in per_request) / n_hf, 3),
        "peak_rss_mb": round(mem.peak / 2**20),
    }
    result["baseline"] = base
    mean_req = wall / n_hf
    mean_first = statistics.fmean(r["first_block_s"] for r in per_request)
    for w in result["workloads"].values():
        e = w["engine"]
        w.update(_ratios(e, base))
        # a sequential server: request i waits for the i before it, then for its own first block
        w["baseline_ttfc_mean_s"] = round(mean_first + mean_req * (e["requests"] - 1) / 2, 3)
        if "engine_fusion_off" in w:
            off = w["engine_fusion_off"]
            w["fusion_speedup"] = round(e["tokens_per_cpu_s"] / off["tokens_per_cpu_s"], 3)
    return result


# ---- AR ----------------------------------------------------------------------------------------
def bench_ar(path: Path, p: dict, peak: float) -> dict:
    shape: BenchShape = p["shape"]
    stops = stop_ids_of(path)
    prompts, budgets = make_prompts(replace(p["traffic"], seed=p["traffic"].seed + 1), shape.vocab_size, stops)
    params = [GenerationConfig(max_new_tokens=m) for m in budgets]
    result: dict = {"workloads": {}}
    pipe = pipeline(str(path), _engine_config())
    _warm_engine(pipe, shape)
    engine_outputs = {}
    for c in p["concurrency"]:
        n = num_requests(p, c)
        log(f"ar engine concurrency={c} requests={n}")
        run = run_engine(pipe.engine, prompts[:n], params[:n], shape, c)
        result["workloads"][str(c)] = {"engine": _summary_engine(run, peak, prompts[:n], dllm=False)}
        engine_outputs[c] = [o.token_ids for o in run.outputs]
    pipe.close()
    del pipe
    gc.collect()
    model = hf.load_hf(path)
    pad = min(stops)
    hf.ar_generate(model, [[11, 12, 13]], [4], stops, pad)
    for c in p["concurrency"]:
        n = num_requests(p, c)
        log(f"ar HF generate batch={c} requests={n}")
        outs, first, wall, cpu, rows = [], [], 0.0, 0.0, 0
        with PeakRSS() as mem:
            for i in range(0, n, c):  # static batches of c, left padded
                with Clock() as clock:
                    batch_out, batch_rows = hf.ar_generate(model, prompts[i : i + c], budgets[i : i + c], stops, pad)
                outs += batch_out
                rows += batch_rows
                first += [wall + clock.wall] * len(prompts[i : i + c])  # no streaming: all at the end
                wall += clock.wall
                cpu += clock.cpu
        tokens = sum(len(o) for o in outs)
        w = result["workloads"][str(c)]
        w["baseline"] = {
            "name": "HF generate(), KV cache, static batches of c, left padded",
            "output_tokens": tokens,
            **_rates(tokens, wall, cpu),
            "ttfc_mean_s": round(statistics.fmean(first), 3),
            "lm_head_rows_per_token": round(rows / tokens, 3),
            "peak_rss_mb": round(mem.peak / 2**20),
            "match_rate": round(sum(a == b for a, b in zip(outs, engine_outputs[c])) / n, 3),
        }
        w.update(_ratios(w["engine"], w["baseline"]))
    del model
    gc.collect()
    return result


# ---- scoring -----------------------------------------------------------------------------------
def bench_scoring(path: Path, p: dict, peak: float, hf_budget_gb: float) -> dict:
    shape: BenchShape = p["shape"]
    num, length = p["scoring"]
    start = length // 2
    seqs = scoring_inputs(num, length, shape.vocab_size, set())
    rows = num * (length - start - 1)
    pipe = pipeline(str(path), _engine_config(logprobs_mode="raw_logprobs",
                                             num_kv_blocks=num * -(-length // 16) + 16))
    _warm_engine(pipe, shape)
    gen = GenerationConfig(max_new_tokens=0, logprob_start_len=start, logprobs=0)
    log(f"scoring engine {num} x {length}")
    run = run_engine(pipe.engine, seqs, [gen] * num, shape, num)
    engine_values = [[v for v, _ in o.input_token_logprobs] for o in run.outputs]
    pipe.close()
    del pipe
    gc.collect()
    model = hf.load_hf(path)
    # "as large as fits": the batch whose float32 logits + log_softmax rows fit the memory budget
    per_seq = (2 * length - start) * shape.vocab_size * 4
    batch = max(1, min(num, int(hf_budget_gb * 2**30 // per_seq)))
    hf.score(model, [seqs[0][:64]], 32, 1)
    log(f"scoring HF {num} x {length}, batch {batch}")
    with PeakRSS() as mem, Clock() as clock:
        hf_values = hf.score(model, seqs, start, batch)
    del model
    gc.collect()
    diff = max(abs(a - b) for x, y in zip(engine_values, hf_values) for a, b in zip(x, y))
    e = {**_summary_engine(run, peak, seqs, dllm=False), **_rates(rows, run.seconds, run.cpu_seconds),
         "extra_peak_rss_mb": round((run.peak_rss - run.rss_start) / 2**20)}
    for per_token in ("output_tokens", "forwards_per_token", "sequence_forwards_per_token", "lm_head_rows_per_token",
                      "finish_stop"):  # generation figures; scoring makes no tokens
        e.pop(per_token)
    b = {"name": "HF forward + log_softmax over the vocabulary", "batch_size": batch,
         **_rates(rows, clock.wall, clock.cpu),
         "peak_rss_mb": round(mem.peak / 2**20), "extra_peak_rss_mb": round((mem.peak - mem.start) / 2**20)}
    return {
        "sequences": num, "length": length, "logprob_start_len": start, "scored_rows": rows,
        "note": "tokens_per_s here counts scored rows",
        "engine": e, "baseline": b, **_ratios(e, b),
        "memory_ratio": round((run.peak_rss - run.rss_start) / max(mem.peak - mem.start, 1), 3),
        "max_abs_diff_vs_hf": diff,
    }


# ---- Ray Serve HTTP vs in-process -------------------------------------------------------------
def bench_serve(path: Path, p: dict, base_url: str | None = None) -> dict:
    """The DLLM workload at `serve_concurrency` through Ray Serve HTTP and in-process (wall clock);
    `base_url`: a running Serve instance to use instead of a throwaway local cluster."""
    c = p["serve_concurrency"]
    n = num_requests(p, c)
    avoid = stop_ids_of(path) | {mask_id_of(path)}
    prompts, budgets = make_prompts(p["traffic"], p["shape"].vocab_size, avoid)
    warm_prompts, warm_budgets = make_prompts(replace(p["traffic"], seed=p["traffic"].seed + 2), p["shape"].vocab_size,
                                              avoid)
    log(f"serve: dllm concurrency={c} requests={n}, in-process then over Ray Serve HTTP")
    return bench_serving(path, _engine_config(), p["shape"], prompts[:n], budgets[:n],
                         (warm_prompts[:c], warm_budgets[:c]), c, base_url)


def bench_memory(path: Path, tokens: int, threads: int) -> dict:
    """Memory: peak RSS of scoring one `tokens`-long sequence, engine vs HF, each in its own process."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    procs = {}
    for which in ("engine", "hf"):  # peak RSS is per process, so the two may run at once
        cmd = [sys.executable, "-m", "bench.memory", "--which", which, "--model", str(path),
               "--tokens", str(tokens), "--start", str(tokens // 2), "--threads", str(threads)]
        procs[which] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True)
    out = {}
    for which, proc in procs.items():
        stdout, _ = proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(f"bench.memory --which {which} failed with exit code {proc.returncode}")
        r = json.loads(stdout.strip().splitlines()[-1])
        out[which] = {"rss_after_load_mb": round(r["rss_after_load"] / 2**20),
                      "peak_rss_mb": round(r["peak_rss"] / 2**20),
                      "extra_peak_mb": round(r["extra_peak"] / 2**20), "rows": r["rows"], "sum": r["sum"],
                      "peak_reset": r["peak_reset"]}
    e, h = out["engine"], out["hf"]
    out["tokens"] = tokens
    out["logprob_start_len"] = tokens // 2
    out["extra_peak_ratio"] = round(e["extra_peak_mb"] / max(h["extra_peak_mb"], 1), 4)
    out["rows_agree"] = e["rows"] == h["rows"] and abs(e["sum"] - h["sum"]) <= 1e-3 * max(h["rows"], 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="smaller model and workloads (a few minutes)")
    size.add_argument("--toy", action="store_true",
                      help="toy model and workloads (seconds; checks that every part runs, figures meaningless)")
    ap.add_argument("--only", nargs="*", choices=PARTS, default=None)
    ap.add_argument("--docs", default=str(Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"),
                    help="markdown file to append the results to ('' = do not write)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads for engine and baselines alike (0 = torch's default); see docs")
    ap.add_argument("--hf-memory-budget-gb", type=float, default=6.0,
                    help="memory the HF scoring baseline may use for logits (sets its batch size)")
    ap.add_argument("--models", default=None, help="write the bench checkpoints here (default: a temp dir)")
    args = ap.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    mode = "toy" if args.toy else "quick" if args.quick else "full"
    p = plan(mode)
    only = set(args.only or PARTS)
    t_start = time.perf_counter()
    peak0 = mm_peak_gflops()
    log(f"torch.mm peak {peak0:.1f} GFLOP/s; threads {torch.get_num_threads()}")
    result: dict = {
        "date": time.strftime("%Y-%m-%d"),
        "mode": mode,
        "command": "python -m bench" + ("" if mode == "full" else f" --{mode}")
        + (f" --threads {args.threads}" if args.threads != 1 else ""),
        "machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "platform": platform.platform(), "torch": torch.__version__,
                    "load_avg_start": os.getloadavg()[0]},
        "model": {**asdict(p["shape"]), "dtype": "float32", "dllm_block_length": BLOCK,
                  "strategy": STRATEGY, "threshold": THRESHOLD},
        "traffic": {**asdict(p["traffic"]), "concurrency": p["concurrency"],
                    "requests": {str(c): num_requests(p, c) for c in p["concurrency"]}},
    }
    with tempfile.TemporaryDirectory(prefix="bench-models-") as tmp:
        root = Path(args.models or tmp)
        log(f"writing bench checkpoints under {root}")
        paths = write_bench_models(root, p["shape"])
        gc.collect()
        if "memory" in only:
            log(f"memory: scoring {p['memory_tokens']} tokens, engine and HF in child processes")
            result["memory"] = bench_memory(paths["qwen3"], p["memory_tokens"], args.threads)
        if "dllm" in only:
            result["dllm"] = bench_dllm(paths["sdar"], p, peak0)
        if "ar" in only:
            result["ar"] = bench_ar(paths["qwen3"], p, peak0)
        if "scoring" in only:
            result["scoring"] = bench_scoring(paths["qwen3"], p, peak0, args.hf_memory_budget_gb)
        if "serve" in only:
            result["serve"] = bench_serve(paths["sdar"], p)
        if "moe" in only:
            log("moe: SDAR-MoE block diffusion, engine vs the SDAR HF loop")
            result["moe"] = bench_moe(root / "moe", mode)
    peak1 = mm_peak_gflops()
    result["mm_peak_gflops"] = {"start": round(peak0, 1), "end": round(peak1, 1)}
    result["machine"]["load_avg_end"] = os.getloadavg()[0]
    result["rss_end_mb"] = round(rss_bytes() / 2**20)
    result["wall_seconds"] = round(time.perf_counter() - t_start, 1)
    result["targets"] = targets(result)
    print(json.dumps(result, indent=1))
    if args.docs:
        append_report(Path(args.docs), result)
        log(f"appended to {args.docs}")


def targets(r: dict) -> dict:
    """The performance targets at 32 concurrent requests (absent where the part was not run)."""
    out: dict = {}
    dllm = r.get("dllm", {}).get("workloads", {})
    if "32" in dllm:
        out["dllm_ratio_ge_8"] = dllm["32"]["ratio_vs_baseline"] >= 8
    if "1" in dllm:
        one = dllm["1"]["engine"]
        out["dllm_forwards_per_block_eq_denoising_steps"] = one["sequence_forwards"] == one["unmasking_steps"]
    ar = r.get("ar", {}).get("workloads", {})
    if "32" in ar:
        out["ar_ratio_ge_2"] = ar["32"]["ratio_vs_baseline"] >= 2
    if "scoring" in r:
        out["scoring_ratio_ge_1.5"] = r["scoring"]["ratio_vs_baseline"] >= 1.5
    if "memory" in r:
        out["scoring_memory_le_quarter"] = r["memory"]["extra_peak_ratio"] <= 0.25
    overheads = [w["engine"]["engine_overhead"] for part in ("dllm", "ar") for w in r.get(part, {}).get(
        "workloads", {}).values()]
    if overheads:
        out["engine_overhead_le_15pct"] = max(overheads) <= 0.15
    if "serve" in r:
        out["serve_http_ge_85pct_of_in_process"] = r["serve"]["ratio_http_vs_in_process"] >= 0.85
    return out


if __name__ == "__main__":
    main()
