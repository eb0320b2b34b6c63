"""Every bench entry point run at toy size, so none can rot: `python -m bench --toy` as a user types it
(every part, `bench.memory` among them, its Ray Serve part on a cluster of its own), `bench.overhead`,
`bench.replica_overhead`, `bench.serve_streaming` (on a cluster of its own), `bench.moe`,
`bench.weight_sync`, `bench.prefix_routing`, `bench.load`, `bench.outputs`, `bench.fused_elementwise`,
`bench.diffusion_gemma`. bench.gpu_check's CPU-side parts are tests/bench/test_gpu_check.py's,
bench.trajectory_scoring's tests/engine/test_trajectory_scoring.py's. The figures of a toy run mean
nothing; what is checked is that each part runs to the end and that its
own cross-checks (outputs equal to the baselines') hold."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bench import load, prefix_routing, weight_sync
from bench.plan import plan
from tests.support.paths import ROOT

SMOKED_HERE = {"bench", "bench.memory", "bench.overhead", "bench.replica_overhead", "bench.serve_streaming",
               "bench.moe", "bench.weight_sync", "bench.prefix_routing",
               "bench.load", "bench.outputs", "bench.fused_elementwise", "bench.published_configs",
               "bench.diffusion_gemma", "bench.step_metadata", "bench.decisions",
               "bench.nemotron", "bench.detokenize", "bench.paired"}
SMOKED_ELSEWHERE = {"bench.gpu_check": "bench/test_gpu_check.py", "bench.gpu_check.collect": "bench/test_gpu_check.py",
                    "bench.trajectory_scoring": "engine/test_trajectory_scoring.py",
                    "bench.fast_dllm": "engine/families/test_fast_dllm.py", "bench.soak": "system/test_soak.py",
                    "bench.llada2": "testing/test_llada2_diffusers.py"}  # paths under tests/


def _run_module(*args: str) -> dict:
    """`python -m <args>` from the repository root; its stdout's JSON object."""
    proc = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)


def _run_module_here(capsys, monkeypatch, module: str, *args: str) -> dict:
    """`python -m <module> <args>` run the way `-m` runs it (as `__main__`, with that argv, from the
    repository root) but in this process: its stdout's JSON object. For an entry point that a fresh
    interpreter imports in another test already (`python -m bench --toy` imports bench.moe; the
    DiffusionGemma memory bench's children run bench.diffusion_gemma), so that a new interpreter (some
    seconds of imports on a loaded machine) is not started once more just to run it. The torch state a
    bench sets (the global RNG, the thread count) is put back; the deprecation warnings of what it imports
    stay out of the report, as they did on a child's stderr."""
    import runpy
    import warnings

    import torch

    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", [module, *args])
    threads = torch.get_num_threads()
    capsys.readouterr()
    try:
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    finally:
        torch.set_num_threads(threads)
    return json.loads(capsys.readouterr().out)


def bench_entry_points() -> set[str]:
    """Every `python -m` target under bench/: a package with a `__main__.py` (bench itself, and e.g.
    bench.gpu_check as a package), or a module with a `__main__` guard."""
    out = set()
    for f in (ROOT / "bench").rglob("*.py"):
        parts = f.relative_to(ROOT).with_suffix("").parts
        if f.stem == "__main__":
            out.add(".".join(parts[:-1]))
        elif 'if __name__ == "__main__":' in f.read_text():
            out.add(".".join(parts))
    return out


def test_every_bench_entry_point_has_a_smoke_test():
    """A new `python -m bench.X` joins SMOKED_HERE with a test below, or names the file that runs it."""
    entry_points = bench_entry_points()
    assert SMOKED_HERE <= entry_points <= SMOKED_HERE | set(SMOKED_ELSEWHERE)
    for module in entry_points - SMOKED_HERE:
        test_file = ROOT / "tests" / SMOKED_ELSEWHERE[module]
        assert module.split(".")[1] in test_file.read_text(), (module, test_file)


def test_step_metadata_bench():
    """The bench checks the gathered tables against the lists itself, and reports every figure at each
    context; the table grows with the context."""
    out = _run_module("bench.step_metadata", "--context", "256", "2048", "--repeats", "2")
    small, large = out["runs"]
    assert (small["context"], large["context"]) == (256, 2048)
    assert 0 < small["table_entries"] < large["table_entries"]
    assert all(run[k] >= 0 for run in out["runs"] for k in ("tables_ms", "baseline_lists_ms", "upload_step_ms",
                                                              "gemma_prepare_ms", "gemma_baseline_slot_by_slot_ms"))


@pytest.mark.parametrize("mode", ["full", "quick", "toy"])
def test_every_plan_fits_its_bench_model(mode):
    """The engine refuses a sequence longer than max_position_embeddings: no workload may need one."""
    p = plan(mode)
    longest = p.shape.max_position_embeddings
    assert p.memory_tokens <= longest
    assert p.scoring[1] <= longest
    assert p.traffic.prompt_len[1] + p.traffic.max_new_tokens[1] + 4 <= longest  # + a DLLM block


@pytest.mark.system  # the bench command as a user types it, in a process of its own
def test_outputs_dump_and_compare(tmp_path):
    """A dump compares identical with itself (exit 0); a changed token is caught (exit 1). (Two revisions'
    dumps on the same `--ckpt` are what the tool is for; the determinism of a checkout's outputs from
    process to process is the exactness tests'.)"""
    ckpt, a, b = tmp_path / "ckpt", tmp_path / "a.json", tmp_path / "b.json"
    counts = _run_module("bench.outputs", "--toy", "--ckpt", str(ckpt), "--out", str(a))
    assert counts and all(n == 8 for n in counts.values())
    b.write_text(a.read_text())
    report = _run_module("bench.outputs", "--compare", str(a), str(b))
    assert all(r["identical"] == r["requests"] == 8 and r["max_abs_logprob_diff"] == 0.0 for r in report.values())
    changed = json.loads(b.read_text())
    changed["sdar/sequential"][0]["token_ids"][0] += 1
    b.write_text(json.dumps(changed))
    proc = subprocess.run([sys.executable, "-m", "bench.outputs", "--compare", str(a), str(b)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and json.loads(proc.stdout)["sdar/sequential"]["identical"] == 7


@pytest.mark.system  # the bench command as a user types it, in a process of its own
def test_overhead():
    # 160 > 4 * CALLS_AT: the long run also takes its profiled call counts
    r = _run_module("bench.overhead", "--short", "8", "--long", "160", "--concurrency", "2")
    for paradigm in ("block_diffusion", "ar"):
        assert set(r[paradigm]["runs"]) == {"8", "160", "8+sweep"}
        assert r[paradigm]["runs"]["160"]["python_calls_per_seq_step_at_step"]
        assert r[paradigm]["ratio_long_vs_short"] > 0


PARADIGM_FIGURES = {"family", "rule", "layers", "tokens", "steps", "full_batch_steps", "generated_tokens",
                    "overhead_us_per_seq_step", "overhead_us_per_seq_step_all_steps",
                    "overhead_us_per_seq_step_median", "phase_us_per_seq_step_all_steps", "python_calls_per_seq_step",
                    "engine_python_calls_per_seq_step", "engine_bytecodes_per_seq_step", "profiled_steps",
                    "forward_cpu_ms_per_step",
                    "overhead_us_per_seq_step_per_forward_ms"}


@pytest.mark.system  # the bench command as a user types it, in a process of its own
def test_overhead_paradigms():
    """`--paradigms` at toy size: a prefix in `--only` picks every rule under it, and the whole list
    (every paradigm and rule, each family's tiny checkpoint) runs to the end with every figure."""
    from bench.overhead import PARADIGMS, select_paradigms

    assert select_paradigms("block_diffusion,ar") == [*(f"block_diffusion/{rule}" for rule in (
        "low_confidence_dynamic", "low_confidence_static", "sequential", "entropy_bounded", "random")), "ar"]
    r = _run_module("bench.overhead", "--paradigms", "--concurrency", "4", "--tokens", "16", "--profile-steps", "2")
    assert r["mode"] == "paradigms" and r["concurrency"] == 4 and r["tokens"] == 16
    assert list(r["paradigms"]) == list(PARADIGMS)
    assert {"token_editing/joint_threshold", "sub_block/low_confidence_dynamic", "renoising/diffusion_gemma",
            "ar"} <= set(r["paradigms"])
    for name, figures in r["paradigms"].items():
        assert set(figures) == PARADIGM_FIGURES, name
        assert figures["steps"] >= figures["full_batch_steps"] > 0, (name, figures)
        assert figures["generated_tokens"] >= 4 * 16, (name, figures)
        assert figures["python_calls_per_seq_step"] > 0 and figures["overhead_us_per_seq_step"] is not None, name
        # the forward's own calls (the CPU attention backend's) are counted apart from the engine's
        assert 0 < figures["engine_python_calls_per_seq_step"] < figures["python_calls_per_seq_step"], (name, figures)
        assert figures["engine_bytecodes_per_seq_step"] > figures["engine_python_calls_per_seq_step"], (name, figures)
        phases = figures["phase_us_per_seq_step_all_steps"]  # every phase of the step, timed
        assert list(phases) == ["schedule", "build_batch", "pick", "read", "apply", "strategy_apply", "emit"], name
        assert min(phases.values()) >= 0, (name, phases)
    # unary requests without stop strings (an RL rollout's): the same steps, without a chunk a step or
    # a text a step (fewer engine calls in the profiled ones)
    unary = _run_module("bench.overhead", "--paradigms", "--concurrency", "4", "--tokens", "16", "--profile-steps", "2",
                        "--only", "ar", "--unary", "--no-stop-strings", "--bytecode-functions", "3")
    assert unary["unary"] and not r["unary"] and list(unary["paradigms"]) == ["ar"]
    assert r["stop_strings"] and not unary["stop_strings"]
    streamed, once = r["paradigms"]["ar"], unary["paradigms"]["ar"]
    assert once["steps"] == streamed["steps"] and once["generated_tokens"] == streamed["generated_tokens"]
    assert once["engine_python_calls_per_seq_step"] < streamed["engine_python_calls_per_seq_step"], (once, streamed)
    assert once["engine_bytecodes_per_seq_step"] < streamed["engine_bytecodes_per_seq_step"], (once, streamed)
    top = once["engine_bytecodes_by_function"]  # the three functions that ran the most of them
    assert len(top) == 3 and 0 < sum(top.values()) <= once["engine_bytecodes_per_seq_step"], top
    assert "engine_bytecodes_by_function" not in streamed
    # under the overlap schedule: each step applies one half's forward, and the figures are per sequence applied
    halves = _run_module("bench.overhead", "--paradigms", "--concurrency", "4", "--tokens", "16",
                         "--profile-steps", "2", "--only", "ar", "--overlap")
    overlapped = halves["paradigms"]["ar"]
    assert halves["overlap"] and not r["overlap"] and set(overlapped) == PARADIGM_FIGURES
    assert overlapped["generated_tokens"] == streamed["generated_tokens"] and overlapped["steps"] > streamed["steps"]
    assert overlapped["full_batch_steps"] > 0 and overlapped["engine_python_calls_per_seq_step"] > 0, overlapped


@pytest.mark.system  # the bench command as a user types it, in a process of its own
def test_paired_runs_both_checkouts_side_by_side():
    """This checkout against itself as the baseline: every figure of both sides' output, per round, with
    its ratios; `--fields` keeps the figures named."""
    r = _run_module("bench.paired", "--base", str(ROOT), "--rounds", "2", "--fields", "english/engine", "--",
                    "detokenize", "--tokens", "60")
    assert r["rounds"] == 2 and r["figures"], r
    for path, figure in r["figures"].items():
        assert path.startswith("streams/english/engine/"), path
        assert len(figure["base"]) == len(figure["this"]) == len(figure["ratio"]) == 2
        assert figure["ratio_geometric_mean"] > 0 and figure["ratio_median"] > 0, figure


@pytest.mark.system  # the bench command as a user types it
def test_replica_overhead(capsys, monkeypatch):
    """Both ways at toy size: a unary call gets one result per request, a stream every chunk, and the
    engine thread's and the event loop's CPU time per sequence-step come back for each."""
    r = _run_module_here(capsys, monkeypatch, "bench.replica_overhead", "--concurrency", "3", "--tokens", "8",
                         "--repeats", "1", "--only", "block_diffusion/low_confidence_dynamic,ar")
    assert r["command"].startswith("python -m bench.replica_overhead") and r["concurrency"] == 3
    assert list(r["paradigms"]) == ["block_diffusion/low_confidence_dynamic", "ar"]
    for name, ways in r["paradigms"].items():
        assert ways["unary"]["received"] == 3 and ways["streamed"]["received"] > 3, (name, ways)
        for figures in ways.values():
            assert figures["sequence_steps"] >= 8 and figures["engine_us_per_seq_step"] > 0, (name, figures)
            assert figures["host_us_per_seq_step_runs"] == [figures["host_us_per_seq_step"]], (name, figures)


@pytest.mark.system  # the bench command as a user types it, in a process of its own (and a Ray cluster of its own)
def test_serve_streaming():
    """One application (20 ms batching; the bench deploys one per interval the same way), sent unary and
    streamed requests over HTTP: a unary request is one answer, a stream at least its first delta and its
    last, and the cluster's CPU time comes back for each."""
    r = _run_module("bench.serve_streaming", "--concurrency", "2", "--tokens", "8", "--repeats", "1",
                    "--intervals", "20")
    assert r["command"].startswith("python -m bench.serve_streaming") and r["concurrency"] == 2
    (rows,) = r["paradigms"].values()
    assert list(rows) == ["20"]
    for interval, ways in rows.items():
        assert ways["unary"]["events"] == 2 and ways["streamed"]["events"] >= 4, (interval, ways)
        for way in ways.values():  # how much CPU is the machine's business; that it adds up is the bench's
            by_process = way["cpu_s_by_process"]
            assert way["cpu_s"] >= 0 and all(s > 0 for s in by_process.values()), (interval, ways)
            assert abs(sum(by_process.values()) - way["cpu_s"]) <= 0.001 * (len(by_process) + 1), (interval, ways)


@pytest.mark.system  # the bench command as a user types it
def test_detokenize(capsys, monkeypatch):
    """Both sides time every stream over a first and a last window."""
    r = _run_module_here(capsys, monkeypatch, "bench.detokenize", "--tokens", "60")
    assert r["command"] == "python -m bench.detokenize --tokens 60" and r["window"] == 20
    assert set(r["streams"]) == {"english", "accented_emoji", "random_ids"}
    for name, row in r["streams"].items():
        for side in ("decode_stream_baseline", "engine"):
            assert row[side]["us_per_token_first"] > 0 and row[side]["us_per_token_last"] > 0, (name, row)


@pytest.mark.system  # the bench command as a user types it, in a process of its own
def test_fused_elementwise():
    r = _run_module("bench.fused_elementwise", "--toy")
    assert not r["fell_back_to_eager"] and set(r["tokens"]) == {"1", "16"}
    assert all(row["max_abs_diff"] < 1e-5 and row["speedup"] > 0 for row in r["tokens"].values()), r


@pytest.mark.system  # the bench command as a user types it
def test_moe(capsys, monkeypatch):
    """bench.moe's own command line; its bench (`bench_moe` at toy size) also runs, in a fresh interpreter, as
    the `moe` part of `python -m bench --toy` below."""
    r = _run_module_here(capsys, monkeypatch, "bench.moe", "--toy")
    assert r["command"] == "python -m bench.moe --toy" and r["outputs_identical_on_hf_sample"], r


def test_weight_sync(serve_cluster, tmp_path):
    """Every update path lands the weights it pushed (measure() compares greedy outputs after each)."""
    size, seconds = weight_sync.measure(tmp_path, layers=1, repeats=1, shape=weight_sync.TOY_SHAPE)
    assert size > 0 and set(seconds) == {"disk", "tensor", "broadcast"}
    assert all(len(runs) == 1 for runs in seconds.values())


def test_prefix_routing(serve_cluster, tmp_path):
    from testing.tiny_checkpoint import write_tiny_checkpoint

    ckpt = write_tiny_checkpoint(tmp_path / "qwen3", model_type="qwen3")
    jobs = prefix_routing.workload(prompts=2, per_prompt=4, system_tokens=32, seed=0)
    # the prefix-aware router (ours); Serve's own goes through the same function
    r = prefix_routing.run_router(serve_cluster.url, ckpt, "prefix_aware", jobs, concurrency=4, max_tokens=2,
                                  replicas=2)
    assert r["failed"] == 0 and r["requests"] == 8 and r["prefix_hit_tokens"] > 0, r


def test_load_against_running_apps(served_apps, capsys):
    argv = ["-n", "8", "--sdar-url", served_apps["sdar"].url, "--qwen3-url", served_apps["qwen3"].url]
    assert load.main(argv) == 0
    assert json.loads(capsys.readouterr().out)["ok"] == 8


def test_published_configs_loader(dllm_ckpt):
    """bench.published_configs' measuring part, on the tiny checkpoint (the releases take minutes)."""
    from bench.published_configs import load_once

    figures = load_once(dllm_ckpt, "bfloat16")
    assert figures["tokens"] == 8 and figures["load_s"] > 0 and figures["peak_rss_gb"] > 0


def _work_tree_state() -> tuple[list[str], bytes]:
    """Where a bench could write in the work tree (docs/, bench/, models/, the root): its `git status`, and
    docs/benchmarks.md itself (already modified or not)."""
    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all", "--", "docs", "bench", "models",
                             ":(glob)*"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.splitlines()
    return status, (ROOT / "docs" / "benchmarks.md").read_bytes()


@pytest.mark.system  # its own Ray Serve cluster, in a process of its own
def test_bench_toy_as_typed_from_the_repository_root_prints_and_leaves_the_tree_clean(tmp_path):
    """`python -m bench --toy` as a user types it from the repository root (every part, its own Ray Serve
    cluster on loopback included), with `--docs FILE`: exit 0, the JSON on stdout, the results appended
    to FILE, and not a file of the work tree changed (only `--record` writes docs/benchmarks.md)."""
    before = _work_tree_state()
    docs = tmp_path / "benchmarks.md"
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_ADDRESS")}
    proc = subprocess.run([sys.executable, "-m", "bench", "--toy", "--docs", str(docs)], cwd=ROOT,
                          capture_output=True, text=True, timeout=900, env={**env, "RAY_AUTH_MODE": "disabled"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(proc.stdout)
    assert r["mode"] == "toy" and {"memory", "dllm", "ar", "scoring", "serve", "moe"} <= set(r)
    assert r["memory"]["rows_agree"]
    assert r["dllm"]["baseline"]["match_rate"] == 1.0
    assert all(w["baseline"]["match_rate"] == 1.0 for w in r["ar"]["workloads"].values())
    assert r["scoring"]["max_abs_diff_vs_hf"] < 1e-4
    assert r["moe"]["outputs_identical_on_hf_sample"]
    assert r["serve"]["http"]["errors"] == 0 and r["serve"]["match_rate"] == 1.0, r["serve"]
    assert "`python -m bench --toy`" in docs.read_text()
    assert _work_tree_state() == before


def test_diffusion_gemma_bench_toy(capsys, monkeypatch):
    """The canvas loop against transformers' generate() at toy size: every seeded request identical."""
    pytest.importorskip("transformers.models.diffusion_gemma")
    r = _run_module_here(capsys, monkeypatch, "bench.diffusion_gemma", "--requests", "2", "--max-new-tokens", "8",
                         "--canvas", "8", "--steps", "4", "--vocab", "384", "--hidden", "64", "--stop-entropy", "0.8",
                         "--norm-scale", "12")
    assert r["identical_to_transformers"] == 2
    assert r["engine"]["concurrent_2_tok_s"] > 0 and r["transformers"]["static_batch_2_tok_s"] > 0


def test_diffusion_gemma_memory_bench_toy(capsys, monkeypatch):
    """`--memory` at toy size: each side in its own process (started by the bench, here) at one level of two
    concurrent canvases (each level runs the same way; every child starts an interpreter that imports torch
    and transformers, so one level keeps the test short), reported with its tokens."""
    pytest.importorskip("transformers.models.diffusion_gemma")
    r = _run_module_here(capsys, monkeypatch, "bench.diffusion_gemma", "--memory", "--vocab", "4096", "--levels", "2",
                         "--canvas", "16", "--steps", "2")["memory"]
    for side in ("engine", "transformers"):
        assert list(r[side]) == ["2"], r[side]
        assert r[side]["2"]["tokens"] == 2 * 16 and r[side]["2"]["peak_rss_gb"] > 0, r[side]["2"]


def test_decisions_bench_toy():
    """A read answers every question with one forward for the whole batch (one block), its label
    probabilities summing to 1; the free way takes a forward per denoising step."""
    r = _run_module("bench.decisions", "--toy", "--questions", "8", "--family", "sdar")["sdar"]
    assert r["read"]["answers"] == 8 and r["read"]["forwards"] == 1, r
    assert r["read"]["label_probabilities_sum_to_1"]
    assert r["free"]["forwards"] > r["read"]["forwards"]


def test_nemotron_bench_toy():
    """Every mode's greedy tokens are the release loop's; linear_spec reports its forwards and acceptance;
    on the (briefly) trained checkpoint linear_spec's greedy tokens are ar's."""
    report = _run_module("bench.nemotron", "--toy", "--requests", "3", "--tokens", "16")
    r = report["modes"]
    assert all(m["identical_to_release"] == m["checked"] == 2 for m in r.values()), r
    assert all(m["release_tok_s"] > 0 for m in r.values()), r
    assert r["linear_spec"]["mean_accepted"] >= 1 and r["linear_spec"]["nfe_per_token"] > 0
    d = report["drafting"]
    assert d["greedy_equal_to_ar"] == d["requests"] == 3 and d["predicted_speedup"] > 0, d
