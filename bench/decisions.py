"""Typed reads against free generation: the same yes/no questions answered both ways.

`python -m bench.decisions [--toy] [--questions 64] [--family sdar|diffusion_gemma|both]` writes a
random-weight checkpoint of each family (SDAR: the bench shape of `bench.models` with the real
151,936-token vocabulary, or the toy shape; DiffusionGemma: `bench.diffusion_gemma`'s converging
tiny checkpoint), then answers `--questions` prompts of the form "question i ... answer:" in one batch
two ways:

- **read**: a template of one slot whose allowed set is the two label tokens, `dllm_read_only` (one
  step): the label is the slot's token and its probability comes with it;
- **free**: the model generates `--free-tokens` tokens (greedy for SDAR; DiffusionGemma's own
  sampler, seeded) and the answer is the first label token in them, if any (parsed).

It prints one JSON object per family: forwards, seconds and seconds per answer of each way, how
many free answers parsed to a label, and whether every read's label probabilities sum to 1.
Figures of random weights say what a read costs, not what a model answers.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.diffusion_gemma import converging_checkpoint
from bench.models import TOY_SHAPE, BenchShape, write_bench_models
from engine import EngineConfig, GenerationConfig
from engine.core.llm_engine import LLMEngine


def label_ids(engine: LLMEngine) -> tuple[int, int]:
    """The first token of "yes" and of "no" (distinct ids)."""
    yes = engine.tokenizer.encode("yes", add_special_tokens=False)[0]
    no = engine.tokenizer.encode("no", add_special_tokens=False)[0]
    return (yes, no) if yes != no else (yes, (yes + 1) % engine.spec.vocab_size)


def questions(n: int) -> list[str]:
    return [f"question {i}: is {7 * i % 13} more than {5 * i % 11}? answer:" for i in range(n)]


def run_batch(engine: LLMEngine, prompts: list[str], params: GenerationConfig | list[GenerationConfig]
              ) -> tuple[dict[str, Any], float, int]:
    """Every prompt in flight together: (request id -> its last chunk's fields, seconds, forwards)."""
    per = params if isinstance(params, list) else [params] * len(prompts)
    forwards, start = engine.stats.forwards, time.perf_counter()
    out: dict[str, dict] = {str(i): {"token_ids": [], "logprobs": []} for i in range(len(prompts))}
    for i, (prompt, p) in enumerate(zip(prompts, per, strict=True)):
        engine.add_request(prompt, p, str(i))
    while engine.has_unfinished():
        for chunk in engine.step():
            got = out[chunk.request_id]
            got["token_ids"] += chunk.token_ids
            got["logprobs"] += chunk.logprobs or []
            got["finish_reason"] = chunk.finish_reason or got.get("finish_reason")
    return out, time.perf_counter() - start, engine.stats.forwards - forwards


def compare(engine: LLMEngine, n: int, free_tokens: int, seeded: bool) -> dict[str, Any]:
    """The read and the free way over the same n questions (a warm-up round of each first)."""
    yes, no = label_ids(engine)
    prompts = questions(n)
    read = GenerationConfig(max_new_tokens=1, dllm_template=[-1], dllm_allowed_token_ids=[yes, no],
                            dllm_read_only=True)
    free = [GenerationConfig(max_new_tokens=free_tokens, ignore_eos=True, do_sample=seeded, random_seed=i)
            for i in range(n)]
    run_batch(engine, prompts[:2], read), run_batch(engine, prompts[:2], free[:2])  # warm-up
    reads, read_s, read_fwd = run_batch(engine, prompts, read)
    frees, free_s, free_fwd = run_batch(engine, prompts, free)
    sums = [sum(math.exp(v) for v in r["logprobs"][0].values()) for r in reads.values()]
    parsed = sum(any(t in (yes, no) for t in f["token_ids"]) for f in frees.values())
    return {
        "questions": n, "labels": [yes, no],
        "read": {"forwards": read_fwd, "seconds": round(read_s, 3), "seconds_per_answer": round(read_s / n, 5),
                 "answers": sum(r["finish_reason"] == "read" for r in reads.values()),
                 "label_probabilities_sum_to_1": all(abs(s - 1) < 1e-3 for s in sums)},
        "free": {"tokens": free_tokens, "forwards": free_fwd, "seconds": round(free_s, 3),
                 "seconds_per_answer": round(free_s / n, 5), "parsed_to_a_label": parsed},
        "read_speedup": round(free_s / read_s, 2) if read_s else None,
    }


def sdar_engine(root: Path, shape: BenchShape) -> LLMEngine:
    path = write_bench_models(root, shape)["sdar"]
    # processed logprobs: a read's rows are renormalised over its labels
    return LLMEngine(str(path), EngineConfig(max_model_len=512, num_kv_blocks=2048, kv_block_size=16,
                                             max_batch_size=256, logprobs_mode="processed_logprobs"))


def diffusion_gemma_engine(root: Path, toy: bool) -> LLMEngine:
    canvas = 16 if toy else 64
    shape = dict(vocab_size=384, hidden_size=64) if toy else dict(vocab_size=4096, hidden_size=256)
    path = converging_checkpoint(root / "dg", canvas_length=canvas, **shape)
    return LLMEngine(str(path), EngineConfig(max_model_len=512, num_kv_blocks=2048, kv_block_size=16,
                                             max_batch_size=256, logprobs_mode="processed_logprobs"))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--toy", action="store_true", help="seconds-long run on toy shapes (figures meaningless)")
    ap.add_argument("--questions", type=int, default=64)
    ap.add_argument("--free-tokens", type=int, default=16, help="tokens each free answer generates")
    ap.add_argument("--family", choices=("sdar", "diffusion_gemma", "both"), default="both")
    args = ap.parse_args(argv)
    report: dict[str, Any] = {"toy": args.toy}
    with tempfile.TemporaryDirectory() as tmp:
        if args.family in ("sdar", "both"):
            engine = sdar_engine(Path(tmp) / "sdar", TOY_SHAPE if args.toy else BenchShape())
            report["sdar"] = compare(engine, args.questions, args.free_tokens, seeded=False)
            engine.shutdown()
        if args.family in ("diffusion_gemma", "both"):
            engine = diffusion_gemma_engine(Path(tmp), args.toy)
            canvas = engine.decoding.canvas_length  # one whole canvas per free answer
            report["diffusion_gemma"] = compare(engine, args.questions, max(args.free_tokens, canvas), seeded=True)
            engine.shutdown()
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
