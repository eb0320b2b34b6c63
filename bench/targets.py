"""The performance targets, checked on a finished run's result."""

from __future__ import annotations


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
