"""Part `ar`: autoregressive decoding, the engine against HF `generate()` in static batches."""

from __future__ import annotations

import gc
import statistics
from dataclasses import replace
from pathlib import Path

from bench import hf_baselines as hf
from bench.measure import Clock, PeakRSS, run_engine, warm_up
from bench.models import stop_ids_of
from bench.plan import Plan, engine_config, num_requests
from bench.progress import log
from bench.summary import engine_summary, rates, ratios
from bench.workloads import make_prompts
from engine import GenerationConfig, pipeline


def bench_ar(path: Path, p: Plan, peak: float) -> dict:
    """`path`: the Qwen3 checkpoint; `peak`: the torch.mm GFLOP/s."""
    stops = stop_ids_of(path)
    prompts, budgets = make_prompts(replace(p.traffic, seed=p.traffic.seed + 1), p.shape.vocab_size, stops)
    params = [GenerationConfig(max_new_tokens=m) for m in budgets]
    result: dict = {"workloads": {}}
    pipe = pipeline(str(path), engine_config(dllm=False))
    warm_up(pipe.engine, p.shape)
    engine_outputs = {}
    for c in p.concurrency:
        n = num_requests(p, c)
        log(f"ar engine concurrency={c} requests={n}")
        run = run_engine(pipe.engine, prompts[:n], params[:n], p.shape, c)
        result["workloads"][str(c)] = {"engine": engine_summary(run, peak, prompts[:n], dllm=False)}
        engine_outputs[c] = [o.token_ids for o in run.outputs]
    pipe.close()
    del pipe
    gc.collect()
    model = hf.load_hf(path)
    pad = min(stops)
    hf.ar_generate(model, [[11, 12, 13]], [4], stops, pad)
    for c in p.concurrency:
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
            **rates(tokens, wall, cpu),
            "ttfc_mean_s": round(statistics.fmean(first), 3),
            "lm_head_rows_per_token": round(rows / tokens, 3),
            "peak_rss_mb": round(mem.peak / 2**20),
            "match_rate": round(sum(a == b for a, b in zip(outs, engine_outputs[c])) / n, 3),
        }
        w.update(ratios(w["engine"], w["baseline"]))
    del model
    gc.collect()
    return result
