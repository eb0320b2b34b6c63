"""Part `scoring`: prompt logprobs, the engine against one HF forward + log_softmax over the vocabulary."""

from __future__ import annotations

import gc
from pathlib import Path

from bench import hf_baselines as hf
from bench.measure import Clock, PeakRSS, run_engine, warm_up
from bench.plan import Plan, engine_config
from bench.progress import log
from bench.summary import engine_summary, rates, ratios
from bench.workloads import scoring_inputs
from engine import GenerationConfig, pipeline


def bench_scoring(path: Path, p: Plan, peak: float, hf_budget_gb: float) -> dict:
    """`path`: the Qwen3 checkpoint; `peak`: the torch.mm GFLOP/s; `hf_budget_gb`: the memory HF's logits
    may take, which sets its batch size."""
    num, length = p.scoring
    start = length // 2
    seqs = scoring_inputs(num, length, p.shape.vocab_size, set())
    rows = num * (length - start - 1)
    pipe = pipeline(str(path), engine_config(dllm=False, logprobs_mode="raw_logprobs",
                                             num_kv_blocks=num * -(-length // 16) + 16))
    warm_up(pipe.engine, p.shape)
    gen = GenerationConfig(max_new_tokens=0, logprob_start_len=start, logprobs=0)
    log(f"scoring engine {num} x {length}")
    run = run_engine(pipe.engine, seqs, [gen] * num, p.shape, num)
    engine_values = [[v for v, _ in o.input_token_logprobs] for o in run.outputs]
    pipe.close()
    del pipe
    gc.collect()
    model = hf.load_hf(path)
    # "as large as fits": the batch whose float32 logits + log_softmax rows fit the memory budget
    per_seq = (2 * length - start) * p.shape.vocab_size * 4
    batch = max(1, min(num, int(hf_budget_gb * 2**30 // per_seq)))
    hf.score(model, [seqs[0][:64]], 32, 1)
    log(f"scoring HF {num} x {length}, batch {batch}")
    with PeakRSS() as mem, Clock() as clock:
        hf_values = hf.score(model, seqs, start, batch)
    del model
    gc.collect()
    diff = max(abs(a - b) for x, y in zip(engine_values, hf_values) for a, b in zip(x, y))
    e = {**engine_summary(run, peak, seqs, dllm=False), **rates(rows, run.seconds, run.cpu_seconds),
         "extra_peak_rss_mb": round((run.peak_rss - run.rss_start) / 2**20)}
    for per_token in ("output_tokens", "forwards_per_token", "sequence_forwards_per_token", "lm_head_rows_per_token",
                      "finish_stop"):  # generation figures; scoring makes no tokens
        e.pop(per_token)
    b = {"name": "HF forward + log_softmax over the vocabulary", "batch_size": batch,
         **rates(rows, clock.wall, clock.cpu),
         "peak_rss_mb": round(mem.peak / 2**20), "extra_peak_rss_mb": round((mem.peak - mem.start) / 2**20)}
    return {
        "sequences": num, "length": length, "logprob_start_len": start, "scored_rows": rows,
        "note": "tokens_per_s here counts scored rows",
        "engine": e, "baseline": b, **ratios(e, b),
        "memory_ratio": round((run.peak_rss - run.rss_start) / max(mem.peak - mem.start, 1), 3),
        "max_abs_diff_vs_hf": diff,
    }
