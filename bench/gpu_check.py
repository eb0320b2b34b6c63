"""The GPU check: `python -m bench.gpu_check` prints each part's JSON line as it finishes, then the whole
report as one JSON object (a part that raises reports its error and the others still run; each model
part stops starting new runs once its time cap is spent, so the whole check fits in about ten minutes).

0. `machine`: what the machine offers -- torch and CUDA versions, the GPU, Triton, a C compiler (Triton
   builds its launcher with one), and which attention entry points exist (vllm's flash kernels,
   torch's paged `_flash_attention_forward`, `torch.nn.attention.varlen`, FlexAttention).
1. `flash`: each flash kernel found (vllm's, torch's own) and FlexAttention against the torch backend,
   bf16, on random page tables (AR and DLLM batches: prefill chunks, denoising steps, fused commit +
   next block, decode rows).
2. `greedy`: greedy DLLM and AR outputs (tokens, step_map) of tiny checkpoints in bf16 against the
   same engine in fp32 on the same GPU; the share of identical outputs, and at each first differing
   token the fp32 run's logprob gap between the two choices (bf16 flips near-ties; a bug flips clear calls).
3. `seeded_sampling`: sampled requests with seeds, served twice in different batch mixes: identical.
4. `throughput`: an SDAR-1.7B-shaped random-weight model (hidden 2048, 28 layers, 16 / 8 heads x 128,
   MLP 6144, vocabulary 151,936, block 4) served at 1, 32 and 128 concurrent requests, against the SDAR
   reference loop on HF transformers (bench/hf_baselines.py) on the same GPU, tokens/s and output match.
   Per concurrency also forwards, engine steps, tokens per forward, the forwards' device time (CUDA
   events) against the steps' wall time, and at the highest concurrency a profiler table of the top
   device kernels and host ops over a few steps.
5. `float32_reference`: part 4 at one request at a time in float32, where the engine's outputs must
   match the reference loop's exactly (bf16's rounding flips confidences at the unmasking threshold).
6. `sdar_4b`: the SDAR-4B shape (hidden 2560, 36 layers, 32 / 8 heads x 128, MLP 9728) at 128
   concurrent, bf16, weights drawn at random on the device (nothing written to disk), with the same
   breakdown as part 4.
7. `batch_invariance`: one greedy request served alone and inside a batch of 128 on the SDAR-1.7B
   shape in bf16 (weights drawn on the device): same tokens, same step_map, and the largest logprob
   difference over the tokens both runs share.

Where CUDA is absent it prints why and exits 0. Every part is a function of (device, dtype, ...) so
tests/test_gpu_check.py runs them on the CPU in float32 with tiny shapes.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from bench import hf_baselines as hf
from bench.measure import run_engine
from bench.models import DLLM_LOGIT_SCALE, BenchShape, mask_id_of, stop_ids_of
from bench.workloads import Traffic, make_prompts
from configs import EngineConfig, GenerationConfig
from engine.core.llm_engine import LLMEngine
from engine.model.checkpoint import ModelSpec
from engine.model.qwen3 import Qwen3ForCausalLM, TPContext
from engine.worker import runner as model_runner
from ops.attention import AttentionBackend, AttentionMetadata, FlashAttention, FlexAttention, TorchAttention, flex_unmet
from ops.flash_kernel import INSTALLED, TORCH_KERNEL
from tools.tiny_checkpoint import DLLM_TEST_LOGIT_SCALE, write_tiny_checkpoint

SDAR_1_7B = BenchShape(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, intermediate_size=6144)
@dataclass(frozen=True)
class EngineChoice:
    """The engine settings a GPU run varies for the model parts."""

    attention: str = "auto"
    kv_block_size: int = 16
    cuda_graphs: bool = True


SDAR_4B = BenchShape(hidden_size=2560, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, intermediate_size=9728)
BLOCK, STRATEGY, THRESHOLD = 4, "low_confidence_dynamic", 0.85
PAGE = 16
# (tokens already cached, tokens fed now) per sequence
ATTENTION_BATCHES = {
    "ar": ([(0, 300), (128, 64), (517, 1), (33, 1), (1000, 1)], None),
    "dllm": ([(0, 256), (96, 32), (508, 8), (300, 4), (64, 4)], BLOCK),
}


# ---- 0. the machine --------------------------------------------------------------------------------------------
def machine_report() -> dict:
    """Versions and what exists: the figures of every other part depend on these."""
    cuda = torch.cuda.is_available()
    triton = importlib.util.find_spec("triton")
    flash_op = getattr(torch.ops.aten, "_flash_attention_forward", None)
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "gpu": torch.cuda.get_device_name() if cuda else None,
        "gpu_capability": ".".join(map(str, torch.cuda.get_device_capability())) if cuda else None,
        "triton": importlib.import_module("triton").__version__ if triton is not None else None,
        "c_compiler": next((c for c in (shutil.which(n) for n in ("cc", "gcc", "clang")) if c), None),
        "attention": {
            "vllm_flash_kernel": None if INSTALLED is None else f"{INSTALLED.source} ({INSTALLED.key_lengths})",
            "torch_flash_paged": TORCH_KERNEL is not None,  # a CUDA build whose operator takes block_table
            "torch_flash_operator": flash_op is not None,
            "torch_varlen_module": importlib.util.find_spec("torch.nn.attention.varlen") is not None,
            "flex_attention": True,
            "flex_compiled_unmet": flex_unmet(torch.device("cuda" if cuda else "cpu")),
        },
    }


# ---- 1. each fast backend == torch --------------------------------------------------------------------------
def backends_to_compare() -> dict[str, AttentionBackend]:
    """Every fast backend this machine can run on CUDA: the flash kernels found and compiled FlexAttention."""
    out: dict[str, AttentionBackend] = {}
    for kernel in (INSTALLED, TORCH_KERNEL):
        if kernel is not None:
            out[f"flash:{kernel.source}"] = FlashAttention(kernel)
    if not flex_unmet(torch.device("cuda")):
        out["flex"] = FlexAttention(compiled=True, dynamic=True)
    return out


def compare_attention(backend: AttentionBackend, device: torch.device, dtype: torch.dtype, heads: int = 16,
                      kv_heads: int = 8, head_dim: int = 128, seed: int = 0, page: int = PAGE) -> dict:
    """Max |backend - torch| per batch: both backends on the same `dtype` inputs, the torch one in float32.
    Pages of `page` tokens (torch's own flash kernel wants 256)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, (shapes, block_length) in ATTENTION_BATCHES.items():
        pages_needed = [-(-(c + f) // page) for c, f in shapes]
        num_pages = sum(pages_needed) + 8
        perm = torch.randperm(num_pages, generator=g).tolist()
        tables, slots, positions = [], [], []
        for (cached, fed), n in zip(shapes, pages_needed):
            table = [perm.pop() for _ in range(n)]
            tables.append(table + [0] * (max(pages_needed) - n))
            positions += range(cached, cached + fed)
            slots += [table[p // page] * page + p % page for p in range(cached, cached + fed)]
        total = len(positions)
        q, k, v = (torch.randn(total, h, head_dim, generator=g).to(dtype) for h in (heads, kv_heads, kv_heads))
        cache = torch.randn(2, num_pages, page, kv_heads, head_dim, generator=g).to(dtype)

        def run(run_backend, run_dtype, shapes=shapes, block_length=block_length, tables=tables, slots=slots,
                positions=positions, q=q, k=k, v=v, cache=cache):
            meta = AttentionMetadata(
                q_lens=[f for _, f in shapes], kv_lens=[c + f for c, f in shapes],
                positions=torch.tensor(positions, device=device), slot_mapping=torch.tensor(slots, device=device),
                page_tables=torch.tensor(tables, device=device), page_size=page, dllm_block_length=block_length)
            k_cache, v_cache = (c.to(device=device, dtype=run_dtype) for c in cache)
            run_backend.prepare(meta)
            x = [t.to(device=device, dtype=run_dtype) for t in (q, k, v)]
            return run_backend.forward(*x, k_cache, v_cache, meta, head_dim**-0.5).float()

        err = (run(backend, dtype) - run(TorchAttention(), torch.float32)).abs().max().item()
        out[name] = {"max_abs_error": err, "ok": err < 2e-2}
    out["ran_as"] = backend.name  # e.g. compiled flex that failed to build and handed over to torch
    return out


# ---- 2. greedy bf16 vs fp32 ------------------------------------------------------------------------------------
def _serve(path: Path, config: EngineConfig, prompts: list[list[int]], params: list[GenerationConfig],
           concurrency: int) -> list:
    engine = LLMEngine(str(path), config)
    return run_engine(engine, prompts, params, BenchShape(), concurrency).outputs


def _tiny_prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 300, (int(length),), generator=g).tolist()
            for length in torch.randint(5, 40, (n,), generator=g)]


def compare_greedy(paths: dict[str, Path], device: str, dtypes: tuple[str, str] = ("bfloat16", "float32"),
                   requests: int = 16) -> dict:
    """Share of identical greedy outputs (tokens and, for DLLM, step_map) between two dtypes, and where they
    differ, how close a call it was: at the first differing token, the second dtype's logprob of its own token
    minus its logprob of the first dtype's token (`None` when that token is outside its top 5). Rounding
    flips near-ties (gaps of hundredths of a nat); a bug shows as large gaps."""
    prompts = _tiny_prompts(requests, seed=3)
    params = [GenerationConfig(max_new_tokens=24, logprobs=5)] * requests
    out = {}
    for name, path in paths.items():
        runs = [_serve(path, EngineConfig(device=device, dtype=dt, kv_block_size=PAGE, num_kv_blocks=256,
                                          dllm_block_length=BLOCK), prompts, params, 8) for dt in dtypes]
        tokens = sum(a.token_ids == b.token_ids for a, b in zip(*runs))
        step_maps = sum(a.step_map == b.step_map for a, b in zip(*runs))
        gaps = [_first_divergence_gap(a, b) for a, b in zip(*runs) if a.token_ids != b.token_ids]
        known = [g for g in gaps if g is not None]
        out[name] = {"dtypes": list(dtypes), "requests": requests, "same_tokens": tokens / requests,
                     "same_step_map": step_maps / requests, "divergence_gaps_nats": gaps,
                     "max_gap_nats": max(known, default=None)}
    return out


def _first_divergence_gap(first, second) -> float | None:
    """`second`'s logprob of its token minus its logprob of `first`'s token, at the first differing position."""
    n = min(len(first.token_ids), len(second.token_ids))
    i = next((i for i in range(n) if first.token_ids[i] != second.token_ids[i]), None)
    if i is None:
        return 0.0  # one output is a prefix of the other: a stop token's timing, not a different token
    row = second.logprobs[i]
    theirs = row.get(first.token_ids[i])
    return None if theirs is None else row[second.token_ids[i]] - theirs


# ---- 3. seeded sampling ----------------------------------------------------------------------------------------
def check_seeded_sampling(path: Path, device: str, dtype: str, requests: int = 12) -> dict:
    """The same seeded requests, once all together and once one at a time: identical outputs."""
    prompts = _tiny_prompts(requests, seed=4)
    params = [GenerationConfig(max_new_tokens=20, do_sample=True, temperature=0.9, top_p=0.95, random_seed=100 + i)
              for i in range(requests)]
    config = EngineConfig(device=device, dtype=dtype, kv_block_size=PAGE, num_kv_blocks=256, dllm_block_length=BLOCK)
    together = _serve(path, config, prompts, params, requests)
    alone = _serve(path, config, prompts, params, 1)
    same = sum(a.token_ids == b.token_ids and a.step_map == b.step_map for a, b in zip(together, alone))
    return {"requests": requests, "same_together_and_alone": same / requests, "ok": same == requests}


# ---- 4. throughput -----------------------------------------------------------------------------------------------
@contextmanager
def device_forward_timer(engine: LLMEngine) -> Iterator[list[float]]:
    """Device seconds of every forward (CUDA events around `executor.execute`, read after the run, so
    timing adds no synchronisation); an empty list off CUDA."""
    execute, pairs, seconds = engine.executor.execute, [], []

    def timed(batch):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = execute(batch)
        end.record()
        pairs.append((start, end))
        return out

    if torch.cuda.is_available():
        engine.executor.execute = timed
    try:
        yield seconds
    finally:
        engine.executor.execute = execute
        if pairs:
            torch.cuda.synchronize()
            seconds += [start.elapsed_time(end) / 1e3 for start, end in pairs]


def serve_and_break_down(engine: LLMEngine, prompts: list[list[int]], params: list[GenerationConfig],
                         shape: BenchShape, concurrency: int):
    """One engine run and where its time went: tokens per forward, forward device time against step
    wall time (the share the device spends in forwards; the rest is host work it waits for)."""
    runner = engine.executor.runner
    replays = runner.graphs.replays if runner.graphs is not None else 0
    with device_forward_timer(engine) as device_seconds:
        run = run_engine(engine, prompts, params, shape, concurrency)
    forward_device = sum(device_seconds) if device_seconds else None
    # graphs are switched off (None) when a capture fails
    graph_replays = runner.graphs.replays - replays if runner.graphs is not None else None
    return run, {
        "requests": len(prompts), "output_tokens": run.output_tokens, "seconds": run.seconds,
        "tokens_per_s": run.output_tokens / run.seconds, "forwards": run.forwards, "steps": run.steps,
        "tokens_per_forward": run.output_tokens / max(run.forwards, 1),
        "sequences_per_forward": run.seq_forwards / max(run.forwards, 1),
        "forward_host_seconds": run.forward_seconds, "forward_device_seconds": forward_device,
        "step_seconds": run.step_seconds,
        "forward_share_of_step_time": None if forward_device is None else forward_device / run.step_seconds,
        "cuda_graph_replays": graph_replays,
    }


def profile_steps(engine: LLMEngine, prompts: list[list[int]], params: list[GenerationConfig], steps: int,
                  rows: int = 15) -> dict:
    """A profiler table of `steps` engine steps once `prompts` are in flight and past their prefill: the
    top device kernels by device time and the top host ops by self CPU time. The requests are aborted
    afterwards."""
    ids = [engine.add_request(prompt, p) for prompt, p in zip(prompts, params)]
    for _ in range(sum(map(len, prompts)) // engine.config.max_prefill_token_num + 2):
        engine.step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    for rid in ids:  # leave the engine empty for whoever uses it next
        engine.abort(rid)
    events = prof.key_averages()

    def table(key: Callable, keep: Callable) -> list[dict]:
        chosen = sorted((e for e in events if keep(e)), key=key, reverse=True)[:rows]
        return [{"name": e.key[:80], "calls": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3,
                 "device_ms": e.device_time_total / 1e3} for e in chosen]

    return {"steps": steps,
            "top_device_kernels": table(lambda e: e.self_device_time_total,
                                        lambda e: e.self_device_time_total > 0),
            "top_host_ops": table(lambda e: e.self_cpu_time_total, lambda e: e.self_cpu_time_total > 0)}


def throughput(path: Path, shape: BenchShape, device: str, dtype: str, concurrency: list[int], traffic: Traffic,
               hf_requests: int, max_seconds: float = 240.0, profile_at_most: int = 8,
               choice: EngineChoice | None = None) -> dict:
    """Engine tokens/s at each concurrency with its breakdown, a profile at the highest one, and the SDAR HF
    loop's tokens/s (one request at a time) on the same prompts. A concurrency starts only while the part
    has spent less than `max_seconds`."""
    t0 = time.perf_counter()
    engine, prompts, params = _bench_engine(path, shape, device, dtype, concurrency, traffic, choice)
    result: dict = {"attention_backend": engine.executor.runner.backend.name, "engine": {}}
    first_outputs: list[list[int]] = []
    for c in concurrency:
        if time.perf_counter() - t0 > max_seconds:
            result["engine"][str(c)] = {"skipped": f"the part's {max_seconds:.0f} s cap was spent"}
            continue
        n = max(c, min(2 * c, traffic.num_requests)) if c > 1 else min(4, traffic.num_requests)
        run, result["engine"][str(c)] = serve_and_break_down(engine, prompts[:n], params[:n], shape, c)
        if not first_outputs:
            first_outputs = [o.token_ids for o in run.outputs]
    c = max(concurrency)
    result["profile"] = profile_steps(engine, prompts[:c], params[:c], steps=profile_at_most)
    del engine

    try:
        result["hf_sdar_loop"] = _hf_sdar_loop(path, device, dtype, prompts, budgets_of(params), stop_ids_of(path),
                                               mask_id_of(path), first_outputs, hf_requests)
    except Exception as exc:  # noqa: BLE001 -- the engine's figures above stand without the baseline
        result["hf_sdar_loop"] = {"error": f"{type(exc).__name__}: {exc}"}
        return result
    for e in result["engine"].values():
        if "tokens_per_s" in e:
            e["vs_hf_sdar_loop"] = e["tokens_per_s"] / result["hf_sdar_loop"]["tokens_per_s"]
    return result


def budgets_of(params: list[GenerationConfig]) -> list[int]:
    return [p.max_new_tokens for p in params]


def _bench_engine(path: Path, shape: BenchShape, device: str, dtype: str, concurrency: list[int], traffic: Traffic,
                  choice: EngineChoice | None = None) -> tuple[LLMEngine, list[list[int]], list[GenerationConfig]]:
    """The engine the model parts measure (block 4, `low_confidence_dynamic` 0.85), warmed up, and the
    traffic's prompts and greedy settings."""
    stops, mask_id = stop_ids_of(path), mask_id_of(path)
    prompts, budgets = make_prompts(traffic, shape.vocab_size, stops | {mask_id})
    params = [GenerationConfig(max_new_tokens=m) for m in budgets]
    choice = choice or EngineChoice()
    config = EngineConfig(device=device, dtype=dtype, kv_block_size=choice.kv_block_size,
                          num_kv_blocks=0.85 if device == "cuda"
                          else 4096, max_batch_size=max(concurrency), dllm_block_length=BLOCK,
                          dllm_unmasking_strategy=STRATEGY, dllm_confidence_threshold=THRESHOLD,
                          attention_backend=choice.attention, cuda_graphs=choice.cuda_graphs)
    engine = LLMEngine(str(path), config)
    run_engine(engine, prompts[:1], [GenerationConfig(max_new_tokens=8)], shape, 1)  # warm-up
    return engine, prompts, params


def _hf_sdar_loop(path: Path, device: str, dtype: str, prompts: list[list[int]], budgets: list[int], stops: set[int],
                  mask_id: int, engine_outputs: list[list[int]], requests: int) -> dict:
    """The SDAR reference loop on HF transformers, one request at a time: tokens/s and agreement with the engine."""
    model = hf.load_hf(path).to(device=device, dtype=getattr(torch, dtype))
    tokens, seconds, match = 0, 0.0, 0
    with torch.device(device):  # the loop builds its tensors with default devices
        for i in range(requests):
            t = time.perf_counter()
            out, _, _ = hf.sdar_generate(model, prompts[i], block_length=BLOCK, mask_id=mask_id,
                                         max_new_tokens=budgets[i], stop_ids=stops, strategy=STRATEGY,
                                         denoising_steps=BLOCK, threshold=THRESHOLD)
            if device == "cuda":
                torch.cuda.synchronize()
            seconds += time.perf_counter() - t
            tokens += len(out)
            match += out == engine_outputs[i]
    return {"requests": requests, "output_tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "same_as_engine": match / requests}


# ---- 6, 7. weights drawn on the device: the SDAR-4B shape, batch invariance ------------------------------------
TOKENIZER_IDS = 384  # the tiny checkpoints' vocabulary: the byte tokenizer's 324 tokens, rounded up


def write_config_only(root: Path, shape: BenchShape) -> Path:
    """An SDAR checkpoint directory of `shape` whose weights file is a tiny stand-in, for an engine that
    draws its weights on the device (`weights_on_device`): nothing large is written or read."""
    path = write_tiny_checkpoint(root / f"sdar-{shape.hidden_size}x{shape.num_hidden_layers}-config",
                                 model_type="sdar", block_size=BLOCK, seed=1, vocab_size=TOKENIZER_IDS)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update({k: v for k, v in asdict(shape).items() if k in cfg})
    (path / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return path


def fill_random(model: Qwen3ForCausalLM, spec: ModelSpec, seed: int, std: float = 0.1,
                logit_scale: float = DLLM_LOGIT_SCALE, tokenizer_ids: int = TOKENIZER_IDS) -> None:
    """Weights like `write_tiny_checkpoint`'s, drawn on the model's device: N(0, std) matrices, RMSNorm
    weights around 1, the final norm times `logit_scale`, and LM-head rows of zero for the mask token and
    the ids past the tokenizer (greedy never picks them)."""
    device = next(model.parameters()).device
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=g, device=device)
            param.copy_(1 + 0.2 * noise if name.endswith("norm.weight") else std * noise)
        model.model.norm.weight.mul_(logit_scale)
        never = [i for i in (spec.mask_token_id,) if i is not None]
        model.lm_head.weight[never] = 0
        model.lm_head.weight[tokenizer_ids:] = 0


@contextmanager
def weights_on_device(seed: int = 1) -> Iterator[None]:
    """Model runners built inside this block draw their weights on their device instead of loading them."""
    load = model_runner.build_model

    def build(spec: ModelSpec, device: torch.device, dtype: torch.dtype, tp: TPContext | None) -> Qwen3ForCausalLM:
        model = model_runner.allocate_model(spec, device, dtype, tp)
        fill_random(model, spec, seed)
        return model

    model_runner.build_model = build
    try:
        yield
    finally:
        model_runner.build_model = load


def shape_throughput(path: Path, shape: BenchShape, device: str, dtype: str, concurrency: int, traffic: Traffic,
                     profile_steps_at_most: int = 8, choice: EngineChoice | None = None) -> dict:
    """Tokens/s of one concurrency with its breakdown and profile, weights drawn on the device."""
    with weights_on_device():
        engine, prompts, params = _bench_engine(path, shape, device, dtype, [concurrency], traffic, choice)
    _, out = serve_and_break_down(engine, prompts[:concurrency], params[:concurrency], shape, concurrency)
    out["attention_backend"] = engine.executor.runner.backend.name
    out["profile"] = profile_steps(engine, prompts[:concurrency], params[:concurrency], steps=profile_steps_at_most)
    return out


def batch_invariance(path: Path, shape: BenchShape, device: str, dtype: str, batch: int, traffic: Traffic,
                     choice: EngineChoice | None = None) -> dict:
    """One greedy request alone, then the same request with `batch - 1` others in flight: whether its tokens
    and step_map are the same, and the largest logprob difference over the tokens both runs share."""
    with weights_on_device():
        engine, prompts, params = _bench_engine(path, shape, device, dtype, [batch], traffic, choice)
    params = [p.model_copy(update={"logprobs": 0}) for p in params]  # the chosen token's logprob alone
    alone = run_engine(engine, prompts[:1], params[:1], shape, 1).outputs[0]
    inside = run_engine(engine, prompts[:batch], params[:batch], shape, batch).outputs[0]
    shared = next((i for i, (a, b) in enumerate(zip(alone.token_ids, inside.token_ids)) if a != b),
                  min(len(alone.token_ids), len(inside.token_ids)))
    diffs = [abs(alone.logprobs[i][t] - inside.logprobs[i][t]) for i, t in enumerate(alone.token_ids[:shared])]
    return {"batch": batch, "dtype": dtype, "attention_backend": engine.executor.runner.backend.name,
            "tokens": len(alone.token_ids),
            "same_tokens": alone.token_ids == inside.token_ids, "same_step_map": alone.step_map == inside.step_map,
            "first_differing_token": None if alone.token_ids == inside.token_ids else shared,
            "max_logprob_diff": max(diffs, default=0.0),
            "mean_logprob_diff": sum(diffs) / len(diffs) if diffs else 0.0}


def write_tiny_pair(root: Path) -> dict[str, Path]:
    return {"dllm": write_tiny_checkpoint(root / "sdar", model_type="sdar", seed=5, logit_scale=DLLM_TEST_LOGIT_SCALE),
            "ar": write_tiny_checkpoint(root / "qwen3", model_type="qwen3", seed=4, logit_scale=2.0)}


def write_sdar(root: Path, shape: BenchShape) -> Path:
    return write_tiny_checkpoint(root / f"sdar-{shape.hidden_size}x{shape.num_hidden_layers}", model_type="sdar",
                                 block_size=BLOCK, logit_scale=DLLM_LOGIT_SCALE, seed=1, **asdict(shape))


PARTS = ("machine", "flash", "greedy", "seeded_sampling", "throughput", "float32_reference", "sdar_4b",
         "batch_invariance")
MODEL_PARTS = {"throughput", "float32_reference", "sdar_4b", "batch_invariance"}  # the large-model parts
TRAFFIC = Traffic(256, (64, 256), (64, 256))  # prompts and outputs of 64-256 tokens


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-throughput", action="store_true", help="leave out the large-model parts")
    parser.add_argument("--only", nargs="+", choices=PARTS, help="run these parts alone")
    parser.add_argument("--attention", default="auto", choices=["auto", "torch", "flash", "flex"],
                        help="the model parts' attention backend")
    parser.add_argument("--kv-block-size", type=int, default=PAGE,
                        help="the model parts' KV page size (torch's own flash kernel needs 256)")
    parser.add_argument("--no-cuda-graphs", action="store_true", help="the model parts without CUDA graphs")
    args = parser.parse_args(argv)
    choice = EngineChoice(args.attention, args.kv_block_size, not args.no_cuda_graphs)
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device: the GPU check runs only where torch.cuda.is_available()",
                          "machine": machine_report()}))
        return 0
    report: dict = {"engine_choice": asdict(choice)}
    selected = set(args.only or PARTS) - (MODEL_PARTS if args.skip_throughput else set())
    t0 = time.perf_counter()

    def part(name: str, check: Callable[[], dict]) -> None:
        """Run one part, print it at once (a later part's crash or timeout keeps the earlier ones), record it."""
        if name not in selected:
            return
        started = time.perf_counter()
        try:
            report[name] = check()
        except Exception as exc:  # noqa: BLE001 -- one failing part must not hide the others' results
            report[name] = {"error": f"{type(exc).__name__}: {exc}"}
        report[name]["part_seconds"] = time.perf_counter() - started
        print(json.dumps({name: report[name]}), flush=True)

    cuda = torch.device("cuda")
    part("machine", machine_report)
    part("flash", lambda: {name: compare_attention(backend, cuda, torch.bfloat16,
                                                   page=256 if name.startswith("flash:torch") else PAGE)
                           for name, backend in backends_to_compare().items()}
         or {"skipped": "no fast attention backend on this machine"})
    with tempfile.TemporaryDirectory() as tmp:
        tiny = write_tiny_pair(Path(tmp))
        part("greedy", lambda: compare_greedy(tiny, "cuda"))
        part("seeded_sampling", lambda: {name: check_seeded_sampling(path, "cuda", "bfloat16")
                                         for name, path in tiny.items()})
        if selected & {"throughput", "float32_reference"}:
            path = write_sdar(Path(tmp), SDAR_1_7B)
            part("throughput", lambda: throughput(path, SDAR_1_7B, "cuda", "bfloat16", [1, 32, 128], TRAFFIC,
                                                  hf_requests=4, choice=choice))
            part("float32_reference", lambda: throughput(path, SDAR_1_7B, "cuda", "float32", [1], TRAFFIC,
                                                         hf_requests=4, max_seconds=60, choice=choice))
        part("sdar_4b", lambda: shape_throughput(write_config_only(Path(tmp), SDAR_4B), SDAR_4B, "cuda", "bfloat16",
                                                 128, TRAFFIC, choice=choice))
        part("batch_invariance", lambda: batch_invariance(write_config_only(Path(tmp), SDAR_1_7B), SDAR_1_7B, "cuda",
                                                          "bfloat16", 128, TRAFFIC, choice=choice))
    report["seconds"] = time.perf_counter() - t0
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
