"""`python -m bench.outputs`: the greedy bench workloads' outputs as JSON, to show that a change leaves
them identical.

    python -m bench.outputs --out after.json [--ckpt DIR]   # the quick workloads (checkpoints written to DIR once)
    python -m bench.outputs --compare before.json after.json

The workloads are `python -m bench --quick`'s traffic (64 requests, prompts 16-128, outputs 16-48
tokens) on its checkpoints, block diffusion under each unmasking strategy and AR, with raw logprobs.
To compare two revisions, run `--out` in a checkout of each with the same `--ckpt` (the checkpoint
is written by the first run and read by both), then `--compare`. The dump holds, per request,
token_ids, step_map, finish_reason, text and the logprob entries; `--compare` prints per workload how
many requests are identical and the largest logprob difference, and exits 1 when any differ.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.models import TOY_SHAPE, BenchShape, mask_id_of, stop_ids_of, write_bench_models
from bench.workloads import Traffic, make_prompts

WORKLOADS = (("sdar", "low_confidence_dynamic"), ("sdar", "low_confidence_static"), ("sdar", "sequential"),
             ("qwen3", None))


def dump(ckpt: Path, toy: bool) -> dict[str, list[dict]]:
    from engine import EngineConfig, GenerationConfig, pipeline

    shape = TOY_SHAPE if toy else BenchShape(num_hidden_layers=2)
    traffic = Traffic(8, (4, 12), (4, 8)) if toy else Traffic(64, (16, 128), (16, 48))
    if not (ckpt / "sdar" / "config.json").exists():
        write_bench_models(ckpt, shape)
    out = {}
    for model, strategy in WORKLOADS:
        path = ckpt / model
        avoid = stop_ids_of(path) | ({mask_id_of(ckpt / "sdar")} if model == "sdar" else set())
        prompts, budgets = make_prompts(traffic, shape.vocab_size, avoid)
        config = {"max_model_len": 512, "logprobs_mode": "raw_logprobs"}
        if strategy is not None:
            config["dllm_unmasking_strategy"] = strategy
        with pipeline(str(path), EngineConfig(**config)) as pipe:
            responses = pipe(prompts, [GenerationConfig(max_new_tokens=b, logprobs=0) for b in budgets])
        out[f"{model}/{strategy or 'ar'}"] = [
            {"token_ids": r.token_ids, "step_map": r.step_map, "finish_reason": r.finish_reason, "text": r.text,
             "logprobs": [sorted((int(t), v) for t, v in entry.items()) for entry in r.logprobs or []]}
            for r in responses]
        print(f"[outputs] {model} {strategy or 'ar'}: {len(responses)} requests", file=sys.stderr, flush=True)
    return out


def compare(before: dict[str, list[dict]], after: dict[str, list[dict]]) -> dict[str, dict]:
    report = {}
    for name, old in before.items():
        new = after.get(name, [])
        same, worst = 0, 0.0
        for a, b in zip(old, new):
            keys_equal = all(a[k] == b[k] for k in ("token_ids", "step_map", "finish_reason", "text"))
            ids_equal = [[t for t, _ in e] for e in a["logprobs"]] == [[t for t, _ in e] for e in b["logprobs"]]
            same += keys_equal and ids_equal
            for ea, eb in zip(a["logprobs"], b["logprobs"]):
                worst = max([worst] + [abs(va - vb) for (_, va), (_, vb) in zip(ea, eb)])
        report[name] = {"requests": len(old), "identical": same if len(new) == len(old) else 0,
                        "max_abs_logprob_diff": worst}
    return report


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="write this checkout's outputs here")
    ap.add_argument("--ckpt", type=Path, default=Path("/tmp/blockserve-bench-outputs"),
                    help="the checkpoints (written here once, then read)")
    ap.add_argument("--toy", action="store_true", help="toy model and traffic (seconds; for the test suite)")
    ap.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    args = ap.parse_args(argv)
    if args.compare:
        before, after = (json.loads(p.read_text()) for p in args.compare)
        report = compare(before, after)
        print(json.dumps(report, indent=2))
        sys.exit(0 if all(r["identical"] == r["requests"] and r["max_abs_logprob_diff"] == 0.0
                          for r in report.values()) else 1)
    if args.out is None:
        ap.error("--out or --compare")
    outputs = dump(args.ckpt, args.toy)
    args.out.write_text(json.dumps(outputs))
    print(json.dumps({name: len(rows) for name, rows in outputs.items()}))


if __name__ == "__main__":
    main()
