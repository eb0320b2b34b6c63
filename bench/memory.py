"""Peak-memory probe for scoring, run in a child process so its peak RSS is its own.

`python -m bench.memory --which engine|hf --model PATH --tokens N --start S` loads the model, resets
the kernel's peak-RSS mark (`/proc/self/clear_refs`), scores one N-token sequence from S, and prints
one JSON line: the RSS after loading, the peak RSS while scoring, and their difference.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import resource
import time
from pathlib import Path


def _vm_hwm() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _reset_peak() -> bool:
    """Make the kernel's peak RSS mark equal the current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _settle() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--which", choices=["engine", "hf"], required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=6000)
    ap.add_argument("--start", type=int, default=3000)
    ap.add_argument("--chunk-rows", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0 = torch's default)")
    args = ap.parse_args()
    if args.threads > 0:
        import torch

        torch.set_num_threads(args.threads)

    from bench.measure import rss_bytes
    from bench.workloads import scoring_inputs

    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    seq = scoring_inputs(1, args.tokens, vocab, set(), seed=7)[0]
    if args.which == "engine":
        from engine import EngineConfig, GenerationConfig, pipeline

        cfg = EngineConfig(logprobs_mode="raw_logprobs", logprobs_chunk_rows=args.chunk_rows, max_batch_size=1,
                           max_model_len=args.tokens,
                           num_kv_blocks=-(-args.tokens // 16) + 4, kv_block_size=16)
        pipe = pipeline(args.model, cfg)
        gen = GenerationConfig(max_new_tokens=0, logprob_start_len=args.start, logprobs=0)

        def run():
            return [v for v, _ in pipe(seq, gen).input_token_logprobs]
    else:
        import torch

        from bench.hf_baselines import load_hf, score

        model = load_hf(args.model)

        def run():
            return score(model, [seq], args.start, 1)[0]

        torch.set_grad_enabled(False)
    _settle()
    base = rss_bytes()
    reset = _reset_peak()
    t = time.perf_counter()
    values = run()
    seconds = time.perf_counter() - t
    peak = _vm_hwm() if reset else None
    if peak is None:  # no clear_refs: fall back to the lifetime peak
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"which": args.which, "rss_after_load": base, "peak_rss": peak, "extra_peak": peak - base,
                      "seconds": seconds, "rows": len(values), "sum": float(sum(values)), "peak_reset": reset}))


if __name__ == "__main__":
    main()
