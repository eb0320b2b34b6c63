"""Part `memory`: peak RSS of scoring one long sequence, engine against HF, each side in a child process
running `python -m bench.memory` (peak RSS is per process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bench.progress import log

REPO_ROOT = Path(__file__).resolve().parents[2]


def bench_memory(path: Path, tokens: int, threads: int) -> dict:
    """Memory: peak RSS of scoring one `tokens`-long sequence, engine vs HF, each in its own process."""
    log(f"memory: scoring {tokens} tokens, engine and HF in child processes")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
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
