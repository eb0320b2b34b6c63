"""Part `dllm`: block diffusion, the engine (commit fusion on and off) against the SDAR HF loop."""

from __future__ import annotations

import gc
import statistics
import time
from pathlib import Path

from bench import hf_baselines as hf
from bench.measure import Clock, PeakRSS, run_engine, warm_up
from bench.models import mask_id_of, stop_ids_of
from bench.plan import BLOCK, STRATEGY, THRESHOLD, Plan, dllm_blocks, engine_config, num_requests
from bench.progress import log
from bench.summary import engine_summary, rates, ratios
from bench.workloads import make_prompts
from engine import GenerationConfig, pipeline


def bench_dllm(path: Path, p: Plan, peak: float) -> dict:
    """`path`: the SDAR checkpoint; `peak`: the torch.mm GFLOP/s."""
    stops = stop_ids_of(path)
    mask_id = mask_id_of(path)
    prompts, budgets = make_prompts(p.traffic, p.shape.vocab_size, stops | {mask_id})
    params = [GenerationConfig(max_new_tokens=m) for m in budgets]
    result: dict = {"workloads": {}}
    engine_outputs: dict[int, list[int]] = {}
    for fusion in (True, False):
        todo = p.concurrency if fusion else p.fusion_off_at
        pipe = pipeline(str(path), engine_config(dllm_commit_fusion=fusion))
        warm_up(pipe.engine, p.shape)
        for c in todo:
            n = num_requests(p, c)
            log(f"dllm engine fusion={fusion} concurrency={c} requests={n}")
            run = run_engine(pipe.engine, prompts[:n], params[:n], p.shape, c)
            s = engine_summary(run, peak, prompts[:n], dllm=True)
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
    n_hf = min(p.hf_dllm_requests, len(prompts))
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
                                "blocks": dllm_blocks(len(prompts[i]), len(out)),
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
        **rates(tokens, wall, sum(r["cpu"] for r in per_request)),
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
        w.update(ratios(e, base))
        # a sequential server: request i waits for the i before it, then for its own first block
        w["baseline_ttfc_mean_s"] = round(mean_first + mean_req * (e["requests"] - 1) / 2, 3)
        if "engine_fusion_off" in w:
            off = w["engine_fusion_off"]
            w["fusion_speedup"] = round(e["tokens_per_cpu_s"] / off["tokens_per_cpu_s"], 3)
    return result
