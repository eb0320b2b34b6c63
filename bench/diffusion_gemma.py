"""DiffusionGemma renoising decoding: the engine's canvas loop vs transformers' `generate()`.

`python -m bench.diffusion_gemma [--requests 8] [--max-new-tokens 256] [--canvas 128] [--steps 16]
[--vocab 16384] [--hidden 256] [--stop-entropy 0.1] [--norm-scale 4]`
writes a small random diffusion_gemma checkpoint whose canvases converge (`converging_checkpoint`:
at these defaults a canvas stops after 6 to 10 steps, varying by request and canvas), then decodes the
same seeded prompts on both sides, float32 on CPU:

- **transformers**: `generate()` one request at a time (`torch.manual_seed(seed)` before each) and
  once as its own static batch of all requests;
- **engine**: `LLMEngine`, one request at a time and all requests in flight together (one forward
  serves every request's pass).

The defaults make the LM head and the sampler over [canvas x vocabulary] a real part of a step, as
they are at the release's shape; `--vocab 384 --hidden 64 --canvas 32 --max-new-tokens 64
--stop-entropy 0.8 --norm-scale 12` is the toy shape, where per-step host work is all that costs.
After an untimed warm-up of both, it prints one JSON object: seconds and generated tokens per
second per side and mode, and how many seeded requests got tokens identical to transformers'
batch-1 output.

`python -m bench.diffusion_gemma --memory [--vocab 262144] [--levels 1,8,32] [--canvas 256] [--steps 4]
[--sides engine,transformers]`
measures memory instead: a checkpoint of the given vocabulary (hidden 64, the tiny few layers, so
the LM head and the sampler are what costs), one canvas per request, stability 0. Each side at each
concurrency level runs in a fresh interpreter (so each peak is that level's): its RSS once the
model (and the engine's KV, the same pools at every level) is in memory, then the kernel's resident
peak reset and N seeded requests run to completion cold (no warm-up), then the peak (VmHWM), its
growth over that baseline, seconds and tokens per second. transformers' batch `generate()` runs at a
level only when its predicted growth (at least one float32 [N, canvas, vocab] temporary;
extrapolated linearly from the levels measured before) stays under 18 GB and what is free; a child
that dies (returncode -9: the OOM killer) is reported as failed.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from configs import EngineConfig, GenerationConfig
from engine.core.decoding.renoising import RenoiseKnobs
from engine.core.llm_engine import LLMEngine
from testing.references.diffusion_gemma import load_reference
from testing.tiny.diffusion_gemma import write_tiny_diffusion_gemma


def converging_checkpoint(path: Path, canvas_length: int, norm_scale: float = 12.0,
                          self_conditioning_scale: float = 0.05, **text_kwargs) -> Path:
    """A tiny random checkpoint that behaves like a trained one under renoising: the final norm scaled
    up (peaked distributions, so the stop rule ends canvases after varying numbers of steps) and the
    self-conditioning output scaled down (a random network's self-conditioning amplifies float32
    rounding differences 2-4x per step; damped, two implementations keep drawing alike)."""
    path = write_tiny_diffusion_gemma(path, canvas_length=canvas_length, **text_kwargs)
    weights = load_file(path / "model.safetensors")
    weights["model.decoder.norm.weight"] *= norm_scale
    weights["model.decoder.self_conditioning.down_proj.weight"] *= self_conditioning_scale
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


def _timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def run(requests: int, max_new_tokens: int, canvas: int, steps: int, vocab: int, hidden: int, stop_entropy: float,
        norm_scale: float, prompt_len: int = 12) -> dict:
    """The speed comparison (the defaults are the command line's, `main`)."""
    knobs = RenoiseKnobs(max_denoising_steps=steps, stability_threshold=0, stop_entropy=stop_entropy)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = converging_checkpoint(Path(tmp) / "tiny", canvas, norm_scale=norm_scale, vocab_size=vocab,
                                     hidden_size=hidden)
        model = load_reference(ckpt)
        eng = LLMEngine(str(ckpt), EngineConfig(
            device="cpu", kv_block_size=16, num_kv_blocks=4096, max_batch_size=max(requests, 1),
            max_prefill_token_num=max(256, prompt_len),
            **{f"dllm_{name}": value for name, value in vars(knobs).items()}))
    vocab_size = eng.spec.vocab_size
    prompts = [torch.randint(0, vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(i)).tolist()
               for i in range(requests)]
    hf_kwargs = {"max_new_tokens": max_new_tokens, "max_denoising_steps": steps, "t_min": knobs.t_min,
                 "t_max": knobs.t_max, "stability_threshold": 0, "confidence_threshold": knobs.stop_entropy}

    def hf_one() -> list[list[int]]:
        out = []
        for seed, prompt in enumerate(prompts):
            torch.manual_seed(seed)
            out.append(model.generate(torch.tensor([prompt]), **hf_kwargs).sequences[0, prompt_len:]
                       [:max_new_tokens].tolist())
        return out

    def hf_batch() -> None:
        torch.manual_seed(0)
        model.generate(torch.tensor(prompts), **hf_kwargs)

    def engine(concurrent: int) -> list[list[int]]:
        done: dict[int, list[int]] = {}
        for first in range(0, requests, concurrent):
            for seed in range(first, min(first + concurrent, requests)):
                done[seed] = []
                eng.add_request(prompts[seed], GenerationConfig(max_new_tokens=max_new_tokens, random_seed=seed),
                                str(seed))
            while eng.has_unfinished():
                for chunk in eng.step():
                    done[int(chunk.request_id)] += chunk.token_ids
        return [done[i] for i in range(requests)]

    tokens = requests * max_new_tokens
    hf_batch(), engine(requests)  # warm-up, untimed
    hf_tokens, hf1 = _timed(hf_one)
    _, hfb = _timed(hf_batch)
    eng_tokens, e1 = _timed(lambda: engine(1))
    _, en = _timed(lambda: engine(requests))
    return {
        "requests": requests, "max_new_tokens": max_new_tokens, "canvas_length": canvas, "max_denoising_steps": steps,
        "vocab_size": vocab_size, "hidden_size": hidden, "stop_entropy": stop_entropy, "norm_scale": norm_scale,
        "transformers": {"batch_1_s": round(hf1, 3), "batch_1_tok_s": round(tokens / hf1, 1),
                         f"static_batch_{requests}_s": round(hfb, 3),
                         f"static_batch_{requests}_tok_s": round(tokens / hfb, 1)},
        "engine": {"concurrent_1_s": round(e1, 3), "concurrent_1_tok_s": round(tokens / e1, 1),
                   f"concurrent_{requests}_s": round(en, 3), f"concurrent_{requests}_tok_s": round(tokens / en, 1)},
        "identical_to_transformers": sum(a == b for a, b in zip(eng_tokens, hf_tokens, strict=True)),
    }


# ---- memory: peak RSS per concurrency level, each level in a fresh process ----------------------------------

GB = 1 << 30
HF_FIT_BYTES = 18 * GB  # the most transformers' batch may be predicted to need before it is skipped


def _status_kib(field: str) -> int:
    """A `/proc/self/status` field in KiB (VmRSS: resident now; VmHWM: the resident peak)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _reset_peak() -> bool:
    """Reset the kernel's resident peak (VmHWM) to the current RSS, so the peak a child reports is the
    workload's and not the checkpoint load's transient; False where the kernel refuses."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _gb(kib: int) -> float:
    return round(kib * 1024 / GB, 3)


def memory_child(side: str, ckpt: Path, n: int, steps: int, prompt_len: int, max_batch: int) -> dict:
    """One side at one concurrency level, in this (fresh) process: RSS once the model (and the engine's
    KV) is in memory, then `n` seeded requests of one canvas each to completion, then the peak."""
    knobs = RenoiseKnobs(max_denoising_steps=steps, stability_threshold=0)
    canvas = json.loads((ckpt / "config.json").read_text())["canvas_length"]
    vocab = json.loads((ckpt / "config.json").read_text())["text_config"]["vocab_size"]
    prompts = [torch.randint(0, vocab, (prompt_len,), generator=torch.Generator().manual_seed(i)).tolist()
               for i in range(n)]
    out: dict = {}
    if side == "engine":
        pages = max_batch * (-(-(prompt_len + canvas) // 16) + 2)
        eng = LLMEngine(str(ckpt), EngineConfig(
            device="cpu", kv_block_size=16, num_kv_blocks=pages, max_batch_size=max_batch,
            max_prefill_token_num=max(256, prompt_len),
            **{f"dllm_{name}": value for name, value in vars(knobs).items()}))
        caches = getattr(getattr(eng.executor, "runner", None), "kv_caches", [])
        out["kv_gb"] = round(sum(t.nbytes for layer in caches for t in layer) / GB, 4)

        def work() -> int:
            for seed, prompt in enumerate(prompts):
                eng.add_request(prompt, GenerationConfig(max_new_tokens=canvas, random_seed=seed), str(seed))
            tokens = 0
            while eng.has_unfinished():
                tokens += sum(len(chunk.token_ids) for chunk in eng.step())
            return tokens
    else:
        model = load_reference(ckpt)
        hf_kwargs = {"max_new_tokens": canvas, "max_denoising_steps": steps, "t_min": knobs.t_min,
                     "t_max": knobs.t_max, "stability_threshold": 0, "confidence_threshold": knobs.stop_entropy}

        def work() -> int:
            torch.manual_seed(0)
            with torch.no_grad():
                sequences = model.generate(torch.tensor(prompts), **hf_kwargs).sequences
            return sequences[:, prompt_len:prompt_len + canvas].numel()
    gc.collect()
    baseline = _status_kib("VmRSS")
    reset = _reset_peak()
    tokens, seconds = _timed(work)
    peak = _status_kib("VmHWM") if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {**out, "baseline_rss_gb": _gb(baseline), "peak_rss_gb": _gb(peak), "growth_gb": _gb(peak - baseline),
            "seconds": round(seconds, 2), "tokens": tokens, "tok_s": round(tokens / seconds, 1),
            **({} if reset else {"peak_includes_load": True})}


def _spawn(side: str, ckpt: Path, n: int, steps: int, prompt_len: int, max_batch: int, threads: int) -> dict:
    """`memory_child` in a fresh interpreter; a child that dies (the OOM killer: returncode -9) is reported."""
    cmd = [sys.executable, "-m", "bench.diffusion_gemma", "--threads", str(threads), "--memory-child", side,
           "--ckpt", str(ckpt), "--n", str(n), "--steps", str(steps), "--prompt-len", str(prompt_len),
           "--max-batch", str(max_batch)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=Path(__file__).resolve().parents[1])
    if proc.returncode != 0:
        return {"failed": f"returncode {proc.returncode}" + (" (killed: out of memory?)" if proc.returncode == -9
                                                               else ""), "stderr_tail": proc.stderr[-600:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 1 << 62


def _hf_prediction(n: int, canvas: int, vocab: int, measured: dict[int, dict]) -> float:
    """Bytes transformers' batch of `n` is predicted to add: at least one float32 [n, canvas, vocab]
    temporary; from one measured level, its growth scaled by the batch size; from two, their growth
    extrapolated linearly in the batch size (its logits, softmax and sampling temporaries all scale
    with it)."""
    one_temporary = n * canvas * vocab * 4
    done = sorted((k, v["growth_gb"] * GB) for k, v in measured.items() if "growth_gb" in v)
    if not done:
        return one_temporary
    if len(done) == 1:  # proportional to the batch size
        (n0, g0), = done
        return max(one_temporary, g0 * n / n0)
    (n0, g0), (n1, g1) = done[0], done[-1]
    return max(one_temporary, g1 + (g1 - g0) / (n1 - n0) * (n - n1))


def run_memory(levels: list[int], vocab: int, canvas: int, steps: int, threads: int, prompt_len: int = 12,
               sides: tuple[str, ...] = ("engine", "transformers")) -> dict:
    """Peak RSS growth of the engine at each concurrency level (the same engine config at each: the KV
    and batch sized for the largest level) and of transformers' batch `generate()` as far as it fits
    (`sides`: which of the two run)."""
    max_batch = max(levels)
    result: dict = {"vocab_size": vocab, "canvas_length": canvas, "max_new_tokens": canvas,
                    "max_denoising_steps": steps, "prompt_len": prompt_len, "hidden_size": 64,
                    "engine": {}, "transformers": {}}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = converging_checkpoint(Path(tmp) / "tiny", canvas, vocab_size=vocab)
        for n in levels if "engine" in sides else ():
            result["engine"][str(n)] = _spawn("engine", ckpt, n, steps, prompt_len, max_batch, threads)
        measured: dict[int, dict] = {}
        for n in levels if "transformers" in sides else ():
            need = _hf_prediction(n, canvas, vocab, measured)
            limit = min(HF_FIT_BYTES, _available_bytes() - 2 * GB)
            if need > limit:
                measured[n] = {"skipped": f"would need ~{need / GB:.1f} GB (limit {limit / GB:.1f} GB)"}
            else:
                measured[n] = _spawn("transformers", ckpt, n, steps, prompt_len, max_batch, threads)
            result["transformers"][str(n)] = measured[n]
    eng = result["engine"]
    lo, hi = str(min(levels)), str(max(levels))
    if "peak_rss_gb" in eng.get(lo, {}) and "peak_rss_gb" in eng.get(hi, {}):
        result[f"engine_peak_rss_growth_{lo}_to_{hi}_gb"] = round(eng[hi]["peak_rss_gb"] - eng[lo]["peak_rss_gb"], 3)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--canvas", type=int, default=None, help="canvas length (default 128; --memory: 256)")
    parser.add_argument("--steps", type=int, default=None, help="max denoising steps (default 16; --memory: 4)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (both sides)")
    parser.add_argument("--memory", action="store_true",
                        help="peak RSS per concurrency level instead of speed (each level a fresh process)")
    parser.add_argument("--vocab", type=int, default=None,
                        help="the checkpoint's vocabulary (default 16384; --memory: 262144)")
    parser.add_argument("--hidden", type=int, default=256, help="the checkpoint's hidden size (speed only)")
    parser.add_argument("--stop-entropy", type=float, default=0.1,
                        help="the stop rule's mean-entropy bound (speed only; stability 0)")
    parser.add_argument("--norm-scale", type=float, default=4.0,
                        help="the factor on the final norm that makes canvases converge (speed only)")
    parser.add_argument("--levels", default="1,8,32", help="--memory: concurrency levels, comma-separated")
    parser.add_argument("--sides", default="engine,transformers", help="--memory: which sides run, comma-separated")
    # one level of --memory, run by the parent in a fresh interpreter
    parser.add_argument("--memory-child", choices=("engine", "transformers"), help=argparse.SUPPRESS)
    parser.add_argument("--ckpt", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--prompt-len", type=int, default=12, help=argparse.SUPPRESS)
    parser.add_argument("--max-batch", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.memory_child:
        print(json.dumps(memory_child(args.memory_child, args.ckpt, args.n, args.steps, args.prompt_len,
                                      args.max_batch)))
    elif args.memory:
        levels = [int(x) for x in args.levels.split(",")]
        print(json.dumps({"memory": run_memory(levels, args.vocab or 262_144, args.canvas or 256, args.steps or 4,
                                               args.threads, sides=tuple(args.sides.split(",")))}, indent=2))
    else:
        print(json.dumps(run(args.requests, args.max_new_tokens, args.canvas or 128, args.steps or 16,
                             args.vocab or 16384, args.hidden, args.stop_entropy, args.norm_scale), indent=2))


if __name__ == "__main__":
    main()
