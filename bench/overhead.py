"""`python -m bench.overhead`: engine overhead per sequence-step, short vs long outputs or every paradigm.

Engine overhead = a step's wall time minus the time inside the model forward (scheduling, batch
building, sampling, unmasking, stop checks, detokenisation, output chunks). It must not grow with
output length: 32 concurrent requests with 64-token outputs vs 32 with 4,096-token outputs, block
diffusion and AR, on a small random-weight model (so the forward does not drown the figure).
Block-diffusion requests finish at different steps, so the figure is per sequence-step (a step's
overhead divided by the sequences it ran) over the steps that ran all 32 sequences: a step's fixed
costs spread over fewer sequences would otherwise count as growth. Prints one JSON object: per
paradigm and output length, the mean over the run and over its last 256 such steps, and the ratios
long / short.

Times are CPU time of the engine's thread (`time.thread_time`; torch runs on that one thread), so
other processes on a shared machine do not count as engine overhead. Two controls separate the
engine's own work from the machine's memory hierarchy: the Python
function calls per step (deterministic: constant work per step gives equal counts early and late
in a long run), and a short run whose forward also sweeps as much memory as the long run's KV cache
(a long-context forward evicts the CPU caches the engine's bookkeeping then runs on).
`--device cuda` runs the forward on the GPU, where it leaves the CPU caches to the engine.

`python -m bench.overhead --paradigms [--concurrency 128] [--tokens 128] [--only NAME[,NAME]]`: the
same figure at one shape for every decoding paradigm -- block diffusion (SDAR, block length 4) under
each of its unmasking rules, LLaDA2 token editing (`joint_threshold`), Fast-dLLM v2 sub-blocks,
DiffusionGemma canvases (seeded sampling; the tiny checkpoint's 16-position canvas and step count)
and AR (Qwen3) -- each on a tiny random-weight model with one layer (DiffusionGemma: two, one
sliding-window and one full-attention layer, the least its layer groups run with; the LLaDA2 layer is
a MoE one), every paradigm at the same output length, one torch thread, a warm-up run first. Prints
one JSON object; per paradigm: `overhead_us_per_seq_step` over the steps that ran the whole batch
(editing and canvas requests finish at different steps, so these can be few:
`overhead_us_per_seq_step_all_steps` is the same over every timed step;
`overhead_us_per_seq_step_median` the median of the full-batch steps, which a few steps slowed by
the rest of a shared machine move less than the mean), `python_calls_per_seq_step`
over `--profile-steps` steps (cProfile; not timed) in the middle of the run (where the warm-up run,
decoding the same requests, had its middle) and `engine_python_calls_per_seq_step`, the same without
the calls inside the forward (on the CPU its attention backend's bucketing; on a GPU a graph replay
makes none), `phase_us_per_seq_step_all_steps`, where the timed steps' overhead goes: the thread CPU time
of the scheduler's plan, the batch's layout, the sampler's launch and read-back and the applying of the
picks (with the strategy's own part and the output chunks within it), per sequence-step,
`engine_bytecodes_per_seq_step`, the Python bytecode instructions the engine runs per
sequence-step outside the forward, over as many steps right after the profiled ones (the finest of
the deterministic figures: it counts the work inside a function as well as the calls between them,
and like them it is the same on a busy machine as on a quiet one; `--bytecode-functions N` adds
`engine_bytecodes_by_function`, the N functions that ran the most of them, each per sequence-step:
a profile that noise cannot move either; but a count, not a cost: an instruction the interpreter has
specialised, an attribute read, costs a few nanoseconds and a call or a new object ten times that, so
fewer instructions need not mean less time -- compare times side by side, `python -m bench.paired`),
steps, full_batch_steps,
generated_tokens (the engine's count: editing and canvas steps count every token they write),
forward_cpu_ms_per_step and
`overhead_us_per_seq_step_per_forward_ms`, the median divided by it: on a shared machine whose speed
moves from run to run, the figure to compare between revisions (the forward is the same work on both
sides, and the overhead moves with it). `--only`
takes names or prefixes (`block_diffusion`: each of its rules). At the defaults the whole list takes
about 2.5 minutes on two shared CPU cores, DiffusionGemma's ~400 steps most of it. The mode uses only
engine interfaces that older checkouts also have, so the file can be copied into one to compare
revisions. `--unary` adds the requests as a caller that waits for the whole result does (an RL
rollout, a unary HTTP call: the engine then builds their first and last chunks only, not one a step);
it needs a checkout from 6909f75 on. `--no-stop-strings` leaves the stop string out (RL rollouts
usually stop on token ids only, and then nothing decides on the text while a request runs).
`--overlap` runs the engine under the overlap schedule: each step launches the forward of one half of
the requests and applies the other half's, so its figures are per sequence *applied* (a step's host work
is launching one half and landing the other). On a GPU that host work runs while the device computes;
on this CPU the forward runs in the thread, so the figure says what an overlapped step's host work costs
per sequence against a plain step's, not what it hides.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine import EngineConfig, GenerationConfig, pipeline
from engine.heap import freeze_startup_heap
from testing.tiny_checkpoint import DLLM_TEST_LOGIT_SCALE, write_tiny_checkpoint

PROMPT_LEN = 16
TAIL_STEPS = 256
CALLS_AT = 32  # profiled steps (early and late in a long run)
NEVER = ["\x00never\x00"]  # a stop string that never matches keeps the stop-string search on the hot path


def _pages(output_len: int, concurrency: int) -> int:
    return concurrency * (-(-(PROMPT_LEN + output_len + 8) // 16) + 1)


class BytecodeCounter:
    """Counts the Python bytecode instructions its thread runs while on (`sys.settrace` with opcode
    events on every frame entered). The same work gives the same count on any machine, busy or
    not, unlike its time; work done inside C (torch, a list copy) counts as the one instruction
    that called it. Tracing makes the code it counts some 50x slower."""

    def __init__(self, by_function: bool = False) -> None:
        self.count = 0
        self.on = False
        #: with `by_function`: the instructions each function ran itself (its code object's count)
        self.by_code: Counter | None = Counter() if by_function else None

    def _trace(self, frame, event: str, arg):
        if event == "opcode":
            self.count += 1
            if self.by_code is not None:
                self.by_code[frame.f_code] += 1
        else:
            frame.f_trace_opcodes = True
        return self._trace

    def top(self, n: int, per: int) -> dict[str, float]:
        """The `n` functions that ran the most instructions, each as `path:line name` -> its count / `per`
        (the constructors dataclasses generate share one name, `<string>:2 __init__`, and one count)."""
        root = str(Path(__file__).resolve().parent.parent) + "/"
        by_name: Counter = Counter()
        for code, count in (self.by_code or Counter()).items():
            by_name[f"{code.co_filename.removeprefix(root)}:{code.co_firstlineno} {code.co_name}"] += count
        return {name: round(count / per, 1) for name, count in by_name.most_common(n)}

    def start(self) -> None:
        self.on = True
        sys.settrace(self._trace)

    def stop(self) -> None:
        sys.settrace(None)
        self.on = False


class _ForwardClock:
    """Wraps the executor's forward: adds its thread CPU time to `seconds`, and optionally sweeps
    `sweep_bytes` of memory after it (counted as forward time). While `step_profile` (the step's
    profiler) is set, the forward's Python calls go to `forward_profile` instead, so that the step's
    profile holds the engine's calls only; while `bytecodes` counts, the forward's are left out."""

    def __init__(self, execute, device: str, sweep_bytes: int = 0, bytecodes_by_function: bool = False):
        self.execute = execute
        self.cuda = device == "cuda"
        self.buffer = torch.zeros(sweep_bytes // 4) if sweep_bytes else None
        self.seconds = 0.0
        self.step_profile: cProfile.Profile | None = None
        self.forward_profile = cProfile.Profile()
        self.bytecodes = BytecodeCounter(bytecodes_by_function)

    def __call__(self, batch):
        if self.bytecodes.on:
            self.bytecodes.stop()
            try:
                return self._timed(batch)
            finally:
                self.bytecodes.start()
        if self.step_profile is None:
            return self._timed(batch)
        self.step_profile.disable()
        self.forward_profile.enable()
        try:
            return self._timed(batch)
        finally:
            self.forward_profile.disable()
            self.step_profile.enable()

    def _timed(self, batch):
        t0 = time.thread_time()
        out = self.execute(batch)
        if self.cuda:  # the kernels run asynchronously: wait here, or the wait lands in the sampler's copy
            torch.cuda.synchronize()
        if self.buffer is not None:
            self.buffer.add_(1.0)
        self.seconds += time.thread_time() - t0
        return out


class _PhaseClock:
    """The thread CPU time of each phase of the engine's step over the steps it is `on` for: the
    scheduler's plan (`schedule`), the batch laid out (`build_batch`), the sampler queued (`pick`), its
    picks read back and cut per sequence (`read`) and the picks applied (`apply`, which holds the decoding
    strategy's own call, `strategy_apply`, and the output chunks made, `emit`). Each phase is one call a
    step, so timing them adds a few calls a step, none a sequence. A phase an older checkout lacks is left
    out."""

    #: (the engine's attribute holding the method, None: the engine itself; the method; the phase)
    WRAPPED = (("scheduler", "schedule", "schedule"), ("sampling", "pick", "pick"), ("sampling", "read", "read"),
               (None, "_apply", "apply"), ("decoding", "apply", "strategy_apply"), (None, "_emit", "emit"))
    ORDER = ("schedule", "build_batch", "pick", "read", "apply", "strategy_apply", "emit")

    def __init__(self, engine) -> None:
        import engine.core.llm_engine as llm_engine  # its step calls the module's `build_batch`

        self.on = False
        self.seconds: Counter = Counter()  # per phase timed (0 for one that never ran, e.g. `pick` where a
        # strategy samples its rows itself)
        for owner, method, phase in self.WRAPPED:
            target = engine if owner is None else getattr(engine, owner, None)
            if target is not None and hasattr(target, method):
                setattr(target, method, self._timed(getattr(target, method), phase))
                self.seconds[phase] = 0.0
        self._module, self._build_batch = llm_engine, llm_engine.build_batch
        llm_engine.build_batch = self._timed(llm_engine.build_batch, "build_batch")
        self.seconds["build_batch"] = 0.0

    def _timed(self, fn: Callable, phase: str) -> Callable:
        def timed(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            t0 = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[phase] += time.thread_time() - t0
        return timed

    def restore(self) -> None:
        """Put the module's `build_batch` back (the wrappers on the engine's objects end with the engine)."""
        self._module.build_batch = self._build_batch

    def per_seq_step(self, sequences: int) -> dict[str, float]:
        """µs per sequence-step of each phase timed."""
        return {phase: round(1e6 * self.seconds[phase] / sequences, 2) for phase in self.ORDER if phase in self.seconds}


def _calls_per_seq_step(engine, steps: int) -> float:
    """Python function calls per sequence per step over the next `steps` steps."""
    running = len(engine.scheduler.running)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(steps):
        engine.step()
    profile.disable()
    return pstats.Stats(profile).total_calls / steps / running


def measure(path: Path, output_len: int, concurrency: int, stop_words: list[str], sweep_bytes: int = 0,
            device: str = "cpu") -> dict:
    config = EngineConfig(device=device, num_kv_blocks=_pages(output_len, concurrency), kv_block_size=16,
                          max_batch_size=concurrency, dllm_block_length=4)
    with pipeline(str(path), config) as pipe:
        engine = pipe.engine
        freeze_startup_heap()  # as a Serve engine replica does
        clock = engine.executor.execute = _ForwardClock(engine.executor.execute, device, sweep_bytes)
        gen = GenerationConfig(max_new_tokens=output_len, ignore_eos=True, stop_words=stop_words)
        for i in range(concurrency):
            engine.add_request([(7 * i + 3 * k) % 200 + 10 for k in range(PROMPT_LEN)], gen)
        overheads = []  # per step: overhead seconds / sequences in the step
        calls = {}
        while engine.has_unfinished():
            if len(overheads) in (CALLS_AT, output_len // 2) and output_len > 4 * CALLS_AT:
                calls[len(overheads)] = round(_calls_per_seq_step(engine, CALLS_AT), 2)
                overheads += [float("nan")] * CALLS_AT
                continue
            forward0, t0 = clock.seconds, time.thread_time()
            running = len(engine.scheduler.running) + len(engine.scheduler.waiting)
            engine.step()
            seconds = (time.thread_time() - t0) - (clock.seconds - forward0)
            overheads.append(seconds / running if running == concurrency else float("nan"))
        timed = [o for o in overheads if o == o]  # steps that ran the whole batch
        return {
            "python_calls_per_seq_step_at_step": calls or None,
            "steps": len(overheads),
            "full_batch_steps": len(timed),
            "generated_tokens": engine.stats.generated_tokens,
            "overhead_us_per_seq_step": round(1e6 * statistics.fmean(timed), 2),
            "overhead_us_per_seq_step_last_256": round(1e6 * statistics.fmean(timed[-TAIL_STEPS:]), 2),
            "forward_cpu_ms_per_step": round(1e3 * clock.seconds / len(overheads), 4),
        }


def _prompt(i: int) -> list[int]:
    return [(7 * i + 3 * k) % 200 + 10 for k in range(PROMPT_LEN)]


def _sdar(path: Path, max_len: int) -> Path:
    return write_tiny_checkpoint(path, model_type="sdar", num_hidden_layers=1, logit_scale=DLLM_TEST_LOGIT_SCALE,
                                 max_position_embeddings=max_len)


def _qwen3(path: Path, max_len: int) -> Path:
    return write_tiny_checkpoint(path, model_type="qwen3", num_hidden_layers=1, max_position_embeddings=max_len)


def _llada2(path: Path, max_len: int) -> Path:
    from testing.tiny.llada2_moe import write_tiny_llada2

    # first_k_dense_replace=0: the one layer is a MoE layer, as all but the first of a release's
    return write_tiny_llada2(path, num_hidden_layers=1, first_k_dense_replace=0, max_position_embeddings=max_len)


def _fast_dllm(path: Path, max_len: int) -> Path:
    from testing.tiny.fast_dllm_qwen import FAST_DLLM_TEST_LOGIT_SCALE, write_tiny_fast_dllm

    return write_tiny_fast_dllm(path, num_hidden_layers=1, logit_scale=FAST_DLLM_TEST_LOGIT_SCALE,
                                max_position_embeddings=max_len)


def _diffusion_gemma(path: Path, max_len: int) -> Path:
    from testing.tiny.diffusion_gemma import FULL, SLIDING, write_tiny_diffusion_gemma

    # one layer of each type: transformers makes a last layer full-attention, and the engine's
    # sliding-window K/V group needs a sliding layer
    return write_tiny_diffusion_gemma(path, layer_types=(SLIDING, FULL), max_position_embeddings=max_len)


@dataclass(frozen=True)
class Paradigm:
    """One row of `--paradigms`: the checkpoint it decodes (`write(directory, max_position_embeddings)`),
    the unmasking rule its requests name (None: the family's own), the engine settings it needs, and
    whether its requests are seeded (the rule or the paradigm samples)."""

    family: str
    write: Callable[[Path, int], Path]
    rule: str | None = None
    engine: Mapping[str, Any] = field(default_factory=dict)
    seeded: bool = False


PARADIGMS: dict[str, Paradigm] = {
    **{f"block_diffusion/{rule}": Paradigm("sdar", _sdar, rule, {"dllm_block_length": 4}, seeded=rule == "random")
       for rule in ("low_confidence_dynamic", "low_confidence_static", "sequential", "entropy_bounded", "random")},
    "token_editing/joint_threshold": Paradigm("llada2_moe", _llada2, "joint_threshold"),
    "sub_block/low_confidence_dynamic": Paradigm("fast_dllm_qwen", _fast_dllm),
    "renoising/diffusion_gemma": Paradigm("diffusion_gemma", _diffusion_gemma, seeded=True),
    "ar": Paradigm("qwen3", _qwen3),
}


def select_paradigms(only: str | None) -> list[str]:
    """The names `--only` picks, in table order: each of its comma-separated items is a name or a
    prefix ending at a `/` (`block_diffusion` picks every block-diffusion rule)."""
    if not only:
        return list(PARADIGMS)
    items = [item.strip().rstrip("/") for item in only.split(",") if item.strip()]
    unknown = [item for item in items if not any(n == item or n.startswith(item + "/") for n in PARADIGMS)]
    if unknown:
        raise SystemExit(f"--only: unknown {', '.join(unknown)}; names: {', '.join(PARADIGMS)}")
    return [n for n in PARADIGMS if any(n == item or n.startswith(item + "/") for item in items)]


def engine_settings(paradigm: Paradigm, tokens: int, concurrency: int, device: str, overlap: bool = False
                    ) -> dict[str, Any]:
    """The EngineConfig fields of a run of `concurrency` requests of `tokens` output tokens: pages for them
    all (two blocks / canvases of slack each), all of them in one batch, the paradigm's own settings, and
    the overlap schedule when `overlap` (left out otherwise, as older checkouts may lack the field)."""
    pages = concurrency * (-(-(PROMPT_LEN + tokens + 64) // 16) + 2)
    return {"device": device, "num_kv_blocks": pages, "kv_block_size": 16, "max_batch_size": concurrency,
            **paradigm.engine, **({"overlap_schedule": True} if overlap else {})}


class _StepSequences:
    """The sequences a step's figures are divided by: those running, or under the overlap schedule those
    whose forward the step applied (a step launches one half of the requests and applies the other
    half's forward, so its work is per sequence applied, not per sequence running)."""

    def __init__(self, engine, overlap: bool) -> None:
        self.applied: int | None = None  # sequences applied since the last `take` (None: not counted)
        if overlap:
            self.applied = 0
            apply = engine._apply

            def counted(fwd):
                self.applied += len(fwd.items)
                return apply(fwd)

            engine._apply = counted

    def take(self, running: int) -> int:
        """The sequences of the step just taken, `running` of them when it began."""
        if self.applied is None:
            return running
        applied, self.applied = self.applied, 0
        return applied


def request_params(paradigm: Paradigm, tokens: int, i: int, stop_strings: bool = True) -> GenerationConfig:
    """The i-th request of a paradigm's run: `tokens` output tokens, the stop-string search on (unless
    not `stop_strings`), seeded where the paradigm samples, under the paradigm's rule."""
    rule = {"dllm_unmasking_strategy": paradigm.rule} if paradigm.rule else {}
    return GenerationConfig(max_new_tokens=tokens, ignore_eos=True, stop_words=NEVER if stop_strings else None,
                            random_seed=i if paradigm.seeded else None, **rule)


def measure_paradigm(path: Path, paradigm: Paradigm, tokens: int, concurrency: int, device: str,
                     profile_at: int | None, profile_steps: int, unary: bool = False, stop_strings: bool = True,
                     top_functions: int = 0, overlap: bool = False) -> dict:
    """One run of `concurrency` requests of `tokens` output tokens (`unary`: added as unary requests;
    `stop_strings`: with the never-matching stop string; `overlap`: under the overlap schedule, where a
    step's sequences are those it applied).
    The `profile_steps` steps from step `profile_at` run under cProfile (their calls counted per
    sequence-step), as many after them count the engine's bytecode instructions (`BytecodeCounter`;
    with `top_functions`, also the functions that ran the most of them), and both are left out of
    the timings; `profile_at=None` profiles none (the warm-up run)."""
    config = EngineConfig(**engine_settings(paradigm, tokens, concurrency, device, overlap))
    with pipeline(str(path), config) as pipe:
        engine = pipe.engine
        freeze_startup_heap()  # as a Serve engine replica does
        clock = engine.executor.execute = _ForwardClock(engine.executor.execute, device,
                                                        bytecodes_by_function=top_functions > 0)
        phases = _PhaseClock(engine)
        step_sequences = _StepSequences(engine, overlap)
        for i in range(concurrency):
            params = request_params(paradigm, tokens, i, stop_strings)
            if unary:
                engine.add_request(_prompt(i), params, streamed=False)
            else:
                engine.add_request(_prompt(i), params)
        full, seconds, sequences = [], 0.0, 0  # per full-batch step: overhead / sequences; all timed steps' sums
        profile, profiled_sequences, counted_sequences, steps = cProfile.Profile(), 0, 0, 0
        while engine.has_unfinished():
            running = len(engine.scheduler.running) + len(engine.scheduler.waiting)
            if profile_at is not None and profile_at <= steps < profile_at + profile_steps:
                clock.step_profile = profile
                profile.enable()
                engine.step()
                profile.disable()
                clock.step_profile = None
                profiled_sequences += step_sequences.take(running)
                steps += 1
                continue
            if profile_at is not None and profile_at + profile_steps <= steps < profile_at + 2 * profile_steps:
                clock.bytecodes.start()  # the steps after the profiled ones, as many
                engine.step()
                clock.bytecodes.stop()
                counted_sequences += step_sequences.take(running)
                steps += 1
                continue
            forward0, t0 = clock.seconds, time.thread_time()
            phases.on = True
            engine.step()
            phases.on = False
            overhead = (time.thread_time() - t0) - (clock.seconds - forward0)
            steps += 1
            stepped = step_sequences.take(running)
            seconds, sequences = seconds + overhead, sequences + stepped
            if running == concurrency and stepped:
                full.append(overhead / stepped)
        phases.restore()
        engine_calls = forward_calls = None
        forward_ms = 1e3 * clock.seconds / steps if steps else None
        if profiled_sequences:
            engine_calls = pstats.Stats(profile).total_calls / profiled_sequences
            forward_calls = pstats.Stats(clock.forward_profile).total_calls / profiled_sequences
        return {
            "tokens": tokens,
            "steps": steps,
            "full_batch_steps": len(full),
            "generated_tokens": engine.stats.generated_tokens,
            "overhead_us_per_seq_step": round(1e6 * statistics.fmean(full), 2) if full else None,
            "overhead_us_per_seq_step_median": round(1e6 * statistics.median(full), 2) if full else None,
            "overhead_us_per_seq_step_all_steps": round(1e6 * seconds / sequences, 2) if sequences else None,
            "phase_us_per_seq_step_all_steps": phases.per_seq_step(sequences) if sequences else None,
            "python_calls_per_seq_step": round(engine_calls + forward_calls, 2) if profiled_sequences else None,
            "engine_python_calls_per_seq_step": round(engine_calls, 2) if profiled_sequences else None,
            "engine_bytecodes_per_seq_step": round(clock.bytecodes.count / counted_sequences, 1)
            if counted_sequences else None,
            **({"engine_bytecodes_by_function": clock.bytecodes.top(top_functions, counted_sequences)}
               if top_functions and counted_sequences else {}),
            "profiled_steps": [profile_at, profile_at + profile_steps] if profile_at is not None else None,
            "forward_cpu_ms_per_step": round(forward_ms, 4) if forward_ms else None,
            # the same work on either side of an A/B, so it cancels the machine's speed of the moment
            "overhead_us_per_seq_step_per_forward_ms": round(1e6 * statistics.median(full) / forward_ms, 3)
            if full and forward_ms else None,
        }


def run_paradigms(names: list[str], tokens: int, concurrency: int, device: str, profile_steps: int,
                  unary: bool = False, stop_strings: bool = True, top_functions: int = 0, overlap: bool = False
                  ) -> dict:
    """`--paradigms`: each named paradigm once to warm up, then measured with its profiled steps in
    the middle of the warm-up run's step count. A paradigm's `rule` is null where its requests name
    none (the family's own: Fast-dLLM v2 low_confidence_dynamic, DiffusionGemma and AR have no rule)."""
    out: dict = {"mode": "paradigms", "device": device, "concurrency": concurrency, "tokens": tokens, "unary": unary,
                 "stop_strings": stop_strings, "overlap": overlap,
                 "prompt_len": PROMPT_LEN, "torch_threads": torch.get_num_threads(), "profile_steps": profile_steps,
                 "paradigms": {}}
    with tempfile.TemporaryDirectory() as tmp:
        written: dict[str, Path] = {}
        for name in names:
            paradigm = PARADIGMS[name]
            if paradigm.family not in written:
                written[paradigm.family] = paradigm.write(Path(tmp) / paradigm.family, PROMPT_LEN + tokens + 256)
            path = written[paradigm.family]
            config = json.loads((path / "config.json").read_text())
            layers = config.get("num_hidden_layers") or config["text_config"]["num_hidden_layers"]
            print(f"[overhead] {name}: warm-up", file=sys.stderr, flush=True)
            warm = measure_paradigm(path, paradigm, tokens, concurrency, device, None, profile_steps, unary,
                                    stop_strings, overlap=overlap)
            middle = max(0, (warm["steps"] - profile_steps) // 2)
            print(f"[overhead] {name}: {warm['steps']} steps, profiling {middle}..{middle + profile_steps}",
                  file=sys.stderr, flush=True)
            result = measure_paradigm(path, paradigm, tokens, concurrency, device, middle, profile_steps, unary,
                                      stop_strings, top_functions, overlap)
            out["paradigms"][name] = {"family": paradigm.family, "rule": paradigm.rule, "layers": layers, **result}
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 epilog="--paradigms: every paradigm at one shape (--concurrency, --tokens); "
                                        "otherwise block diffusion and AR at --short and --long outputs")
    ap.add_argument("--short", type=int, default=64, help="short output length (growth mode)")
    ap.add_argument("--long", type=int, default=4096, help="long output length (growth mode)")
    ap.add_argument("--concurrency", type=int, default=None,
                    help="concurrent requests (default 32; with --paradigms 128)")
    ap.add_argument("--paradigms", action="store_true",
                    help="measure every paradigm and unmasking rule at one shape instead of the growth runs")
    ap.add_argument("--tokens", type=int, default=128, help="--paradigms: output tokens per request (default 128)")
    ap.add_argument("--only", default=None, metavar="NAME[,NAME]",
                    help=f"--paradigms: run only these (or a prefix such as block_diffusion): {', '.join(PARADIGMS)}")
    ap.add_argument("--profile-steps", type=int, default=16,
                    help="--paradigms: steps profiled with cProfile in the middle of the run")
    ap.add_argument("--unary", action="store_true",
                    help="--paradigms: the requests wait for their whole result (no chunk a step), as RL rollouts do")
    ap.add_argument("--no-stop-strings", dest="stop_strings", action="store_false",
                    help="--paradigms: requests without stop strings (RL rollouts usually stop on ids only)")
    ap.add_argument("--overlap", action="store_true",
                    help="--paradigms: under the overlap schedule (a step launches one half of the requests and "
                         "applies the other half's forward); figures per sequence applied")
    ap.add_argument("--bytecode-functions", type=int, default=0, metavar="N",
                    help="--paradigms: also list the N functions that ran the most of the engine's bytecodes")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: the forward runs on the GPU (bf16) and leaves the CPU caches to the engine")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.paradigms:
        command = "python -m bench.overhead " + " ".join(sys.argv[1:] if argv is None else argv)
        result = run_paradigms(select_paradigms(args.only), args.tokens, args.concurrency or 128, args.device,
                               args.profile_steps, args.unary, args.stop_strings, args.bytecode_functions,
                               args.overlap)
        print(json.dumps({"command": command, **result}, indent=2))
        return
    if args.only or args.unary or not args.stop_strings or args.bytecode_functions or args.overlap:
        ap.error("--only, --unary, --no-stop-strings, --overlap and --bytecode-functions need --paradigms")
    args.concurrency = args.concurrency or 32
    out: dict = {"device": args.device, "concurrency": args.concurrency, "short": args.short, "long": args.long}
    with tempfile.TemporaryDirectory() as tmp:
        models = {"block_diffusion": _sdar(Path(tmp) / "sdar", args.long + 64),
                  "ar": _qwen3(Path(tmp) / "qwen3", args.long + 64)}
        for name, path in models.items():
            runs = {}
            # warm-up: first-use costs of kernels and allocator
            measure(path, args.short, args.concurrency, NEVER, device=args.device)
            for length in (args.short, args.long):
                print(f"[overhead] {name} {length}-token outputs", file=sys.stderr, flush=True)
                runs[str(length)] = measure(path, length, args.concurrency, NEVER, device=args.device)
            kv_bytes = _pages(args.long, args.concurrency) * 16 * 2 * 2 * 16 * 4  # pages x tokens x K,V x heads x dim
            print(f"[overhead] {name} {args.short}-token outputs + {kv_bytes >> 20} MiB sweep", file=sys.stderr)
            runs[f"{args.short}+sweep"] = measure(path, args.short, args.concurrency, NEVER, sweep_bytes=kv_bytes,
                                                  device=args.device)
            short, long = runs[str(args.short)], runs[str(args.long)]
            out[name] = {
                "runs": runs,
                "ratio_long_vs_short": round(long["overhead_us_per_seq_step"] / short["overhead_us_per_seq_step"], 3),
                "ratio_last_256_vs_short": round(long["overhead_us_per_seq_step_last_256"]
                                                 / short["overhead_us_per_seq_step"], 3),
                "ratio_long_vs_short_with_sweep": round(long["overhead_us_per_seq_step"]
                                                        / runs[f"{args.short}+sweep"]["overhead_us_per_seq_step"], 3),
            }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
