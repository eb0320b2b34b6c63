"""`python -m bench [--quick]`: the engine against Hugging Face baselines, side by side in one run.

Prints one JSON object to stdout (progress goes to stderr); `--record` also appends a dated section to
docs/benchmarks.md (`--docs FILE`: to another file). Workloads, baselines and figures are described in
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

from bench.measure import mm_peak_gflops, rss_bytes
from bench.models import write_bench_models
from bench.moe import bench_moe
from bench.parts.ar import bench_ar
from bench.parts.dllm import bench_dllm
from bench.parts.memory import bench_memory
from bench.parts.scoring import bench_scoring
from bench.parts.serve import bench_serve
from bench.plan import BLOCK, STRATEGY, THRESHOLD, Plan, num_requests, plan
from bench.progress import log
from bench.report import append_report
from bench.targets import targets

PARTS = ["memory", "dllm", "ar", "scoring", "serve", "moe"]
DOCS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="smaller model and workloads (a few minutes)")
    size.add_argument("--toy", action="store_true",
                      help="toy model and workloads (seconds; checks that every part runs, figures meaningless)")
    ap.add_argument("--only", nargs="*", choices=PARTS, default=None)
    ap.add_argument("--record", action="store_true",
                    help="append the results to docs/benchmarks.md as a dated section (default: only print them)")
    ap.add_argument("--docs", type=Path, default=None,
                    help="append the results to this markdown file instead (implies --record)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads for engine and baselines alike (0 = torch's default); see docs")
    ap.add_argument("--hf-memory-budget-gb", type=float, default=6.0,
                    help="memory the HF scoring baseline may use for logits (sets its batch size)")
    ap.add_argument("--models", default=None, help="write the bench checkpoints here (default: a temp dir)")
    return ap.parse_args()


def run_header(mode: str, threads: int, p: Plan) -> dict:
    """What the run is: its command, machine, model and traffic (the result's first keys)."""
    return {
        "date": time.strftime("%Y-%m-%d"),
        "mode": mode,
        "command": "python -m bench" + ("" if mode == "full" else f" --{mode}")
        + (f" --threads {threads}" if threads != 1 else ""),
        "machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "platform": platform.platform(), "torch": torch.__version__,
                    "load_avg_start": os.getloadavg()[0]},
        "model": {**asdict(p.shape), "dtype": "float32", "dllm_block_length": BLOCK,
                  "strategy": STRATEGY, "threshold": THRESHOLD},
        "traffic": {**asdict(p.traffic), "concurrency": p.concurrency,
                    "requests": {str(c): num_requests(p, c) for c in p.concurrency}},
    }


def run_parts(args: argparse.Namespace, mode: str, p: Plan, peak: float) -> dict:
    """The selected parts' results by name, on checkpoints written for this run."""
    only = set(args.only or PARTS)
    result: dict = {}
    with tempfile.TemporaryDirectory(prefix="bench-models-") as tmp:
        root = Path(args.models or tmp)
        log(f"writing bench checkpoints under {root}")
        paths = write_bench_models(root, p.shape)
        gc.collect()
        if "memory" in only:
            result["memory"] = bench_memory(paths["qwen3"], p.memory_tokens, args.threads)
        if "dllm" in only:
            result["dllm"] = bench_dllm(paths["sdar"], p, peak)
        if "ar" in only:
            result["ar"] = bench_ar(paths["qwen3"], p, peak)
        if "scoring" in only:
            result["scoring"] = bench_scoring(paths["qwen3"], p, peak, args.hf_memory_budget_gb)
        if "serve" in only:
            result["serve"] = bench_serve(paths["sdar"], p)
        if "moe" in only:
            log("moe: SDAR-MoE block diffusion, engine vs the SDAR HF loop")
            result["moe"] = bench_moe(root / "moe", mode)
    return result


def main() -> None:
    args = parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    mode = "toy" if args.toy else "quick" if args.quick else "full"
    p = plan(mode)
    t_start = time.perf_counter()
    peak0 = mm_peak_gflops()
    log(f"torch.mm peak {peak0:.1f} GFLOP/s; threads {torch.get_num_threads()}")
    result = run_header(mode, args.threads, p)
    result.update(run_parts(args, mode, p, peak0))
    peak1 = mm_peak_gflops()
    result["mm_peak_gflops"] = {"start": round(peak0, 1), "end": round(peak1, 1)}
    result["machine"]["load_avg_end"] = os.getloadavg()[0]
    result["rss_end_mb"] = round(rss_bytes() / 2**20)
    result["wall_seconds"] = round(time.perf_counter() - t_start, 1)
    result["targets"] = targets(result)
    print(json.dumps(result, indent=1))
    if args.record or args.docs:
        docs = args.docs or DOCS
        append_report(docs, result)
        log(f"appended to {docs}")


if __name__ == "__main__":
    main()
