"""Append one run's results to docs/benchmarks.md as a dated section."""

from __future__ import annotations

import json
from pathlib import Path

HEADER = """# Benchmarks

How to read this file: docs/benchmarks.md starts with the method; every run of `python -m bench`
appends a dated section below it (newest last). See the method section for what each column means.
"""


def _fmt(v, suffix: str = "") -> str:
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.3g}{suffix}" if abs(v) < 100 else f"{v:.0f}{suffix}"
    return f"{v}{suffix}"


def _gen_rows(part: str, r: dict) -> list[str]:
    rows = []
    base = r.get("baseline", {})
    for c, w in r["workloads"].items():
        e = w["engine"]
        b = w.get("baseline", base)
        off = w.get("engine_fusion_off")
        fpb = "–"
        if "sequence_forwards_per_block" in e:
            fpb = f"{_fmt(e['sequence_forwards_per_block'])} / {_fmt(base.get('forwards_per_block'))}"
        rows.append(
            f"| {part} | {c} | {e['requests']} | {e['output_tokens']} | {_fmt(e['tokens_per_cpu_s'])} "
            f"| {_fmt(b['tokens_per_cpu_s'])} | **{_fmt(w['ratio_vs_baseline'])}×** "
            f"| {_fmt(w['ratio_vs_baseline_wall'])}× "
            f"| {_fmt(e['sequence_forwards_per_token'])} / {_fmt(b.get('forwards_per_token'))} | {fpb} "
            f"| {_fmt(e['lm_head_rows_per_token'])} / {_fmt(b.get('lm_head_rows_per_token'))} "
            f"| {_fmt(w.get('fusion_speedup'), '×') if off else '–'} "
            f"| {_fmt(e['ttfc_mean_s'])} / {_fmt(w.get('baseline_ttfc_mean_s', b.get('ttfc_mean_s')))} "
            f"| {e['engine_overhead'] * 100:.1f}% | {_fmt(e['achieved_gflops'])} ({e['share_of_mm_peak'] * 100:.0f}%) "
            f"| {e['peak_rss_mb']} / {_fmt(b.get('peak_rss_mb'))} | {_fmt(b.get('match_rate'))} |")
    return rows


def render(r: dict) -> str:
    m = r["machine"]
    shape = r["model"]
    lines = [
        f"## {r['date']} — `{r['command']}`",
        "",
        f"Machine: {m['cpus']} CPU cores, torch {m['torch']} ({m['torch_threads']} threads), {m['platform']}; "
        f"load average {m['load_avg_start']:.1f} at start, {m['load_avg_end']:.1f} at end (a shared machine). "
        f"`torch.mm` peak {r['mm_peak_gflops']['start']} GFLOP/s at start, {r['mm_peak_gflops']['end']} at end. "
        f"Wall time {r['wall_seconds']} s.",
        "",
        f"Model: hidden {shape['hidden_size']}, {shape['num_hidden_layers']} layers, "
        f"{shape['num_attention_heads']}/{shape['num_key_value_heads']} heads × {shape['head_dim']}, "
        f"MLP {shape['intermediate_size']}, vocabulary {shape['vocab_size']:,}, float32; DLLM block "
        f"{shape['dllm_block_length']}, `{shape['strategy']}`, threshold {shape['threshold']}. "
        f"Traffic: prompts {r['traffic']['prompt_len'][0]}–{r['traffic']['prompt_len'][1]} tokens, "
        f"max_new_tokens {r['traffic']['max_new_tokens'][0]}–{r['traffic']['max_new_tokens'][1]}, "
        "checkpoint stop ids.",
        "",
    ]
    if "dllm" in r or "ar" in r:
        lines += [
            "| part | concurrent | requests | tokens | engine tok/CPU-s | baseline tok/CPU-s | ratio | ratio (wall) "
            "| fwd/token engine / base | fwd/block engine / base | LM-head rows/token engine / base | fusion on/off "
            "| TTFC mean s engine / base | overhead | GFLOP/s (% mm peak) | peak RSS MB engine / base | match |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        if "dllm" in r:
            lines += _gen_rows("DLLM", r["dllm"])
        if "ar" in r:
            lines += _gen_rows("AR", r["ar"])
        lines.append("")
        if "dllm" in r:
            b = r["dllm"]["baseline"]
            lines.append(f"DLLM baseline measured on {b['requests_measured']} requests "
                         f"({b['output_tokens']} tokens, {b['seconds']} s); it serves one request at a time, so "
                         "its tokens/s is the same at every concurrency.")
            lines.append("")
    s = r.get("scoring")
    if s:
        e, b = s["engine"], s["baseline"]
        lines += [
            f"Scoring {s['sequences']} × {s['length']} tokens from logprob_start_len {s['logprob_start_len']} "
            f"({s['scored_rows']} rows): engine {e['tokens_per_cpu_s']} rows/CPU-s vs HF {b['tokens_per_cpu_s']} "
            f"rows/CPU-s (batch {b['batch_size']}) = **{s['ratio_vs_baseline']}×** (wall: "
            f"{s['ratio_vs_baseline_wall']}×); extra peak RSS engine "
            f"{e['extra_peak_rss_mb']} MB vs HF {b['extra_peak_rss_mb']} MB (ratio {s['memory_ratio']}); "
            f"engine overhead {e['engine_overhead'] * 100:.1f}%; max |engine − HF| = {s['max_abs_diff_vs_hf']:.2e}.",
            "",
        ]
    mem = r.get("memory")
    if mem:
        e, h = mem["engine"], mem["hf"]
        lines += [
            f"Memory: scoring {mem['tokens']:,} tokens from {mem['logprob_start_len']:,}, vocabulary "
            "151,936, each side in its own process: peak RSS above the loaded model engine "
            f"**{e['extra_peak_mb']} MB** "
            f"vs HF forward + log_softmax **{h['extra_peak_mb']} MB** (ratio {mem['extra_peak_ratio']}); "
            f"total peak {e['peak_rss_mb']} MB vs {h['peak_rss_mb']} MB; rows agree: {_fmt(mem['rows_agree'])}.",
            "",
        ]
    sv = r.get("serve")
    if sv:
        lo, hp = sv["in_process"], sv["http"]
        lines += [
            f"Ray Serve HTTP path: the DLLM workload, {sv['requests']} requests at {sv['concurrency']} concurrent, "
            f"`POST /generate` over loopback through the proxy, ingress and EngineServer replica: "
            f"{hp['tokens_per_s']} tokens/s vs in-process {lo['tokens_per_s']} tokens/s (wall clock) = "
            f"**{sv['ratio_http_vs_in_process'] * 100:.0f}%**; HTTP errors {hp['errors']}; outputs identical: "
            f"{_fmt(sv['match_rate'])}.",
            "",
        ]
    t = r.get("targets", {})
    if t:
        lines.append("Targets: " + ", ".join(f"{k} {_fmt(v)}" for k, v in t.items()) + ".")
        lines.append("")
    lines += ["<details><summary>raw JSON</summary>", "", "```json", json.dumps(r, indent=1), "```", "",
              "</details>", ""]
    return "\n".join(lines)


def append_report(path: Path, r: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        path.write_text(HEADER + "\n")
    with path.open("a") as f:
        f.write("\n" + render(r))
