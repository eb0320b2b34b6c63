"""bench/gpu_check's parts, run on the CPU in float32 with tiny shapes (the flash part through the
kernel substitutes of tests/ops/test_flash_kernels.py, the triton backend under Triton's interpreter, which
tests/conftest.py switches on), its part loop and `--out` files, its `--set` overrides, its skip where CUDA
is absent, and the prepared device script (device_run.sh) with its summary (collect)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tarfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from bench import gpu_check
from bench.gpu_check import agreement, attention, breakdown, cli, collect, random_weights, throughput
from bench.gpu_check.batch_invariance import batch_invariance
from bench.gpu_check.engine_choice import EngineChoice
from bench.gpu_check.trajectory import trajectory_scoring
from bench.models import TOY_SHAPE, BenchShape
from bench.trajectory_scoring import Rollouts
from bench.workloads import Traffic
from engine.model.checkpoint import load_model_spec
from engine.model.source import check_checkpoint
from engine.worker import runner
from ops.attention import FlashAttention, FlexAttention, TritonAttention, triton_unmet
from tests.support.flash_kernels import KERNELS
from tests.support.paths import ROOT

DEVICE_RUN = ROOT / "bench" / "gpu_check" / "device_run.sh"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return agreement.write_tiny_pair(tmp_path_factory.mktemp("gpu_check"))


def test_skips_with_exit_0_without_cuda_and_reports_the_machine(capsys):
    assert not torch.cuda.is_available()
    assert gpu_check.main([]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "no CUDA device" in out["skipped"]
    machine = out["machine"]
    assert machine["torch"] == torch.__version__ and machine["gpu"] is None
    assert machine["attention"]["torch_varlen_module"] and machine["attention"]["flex_attention"]
    assert any("device is cpu" in r for r in machine["attention"]["flex_compiled_unmet"])


@pytest.mark.parametrize("kernel", KERNELS)
def test_flash_part_agrees_through_each_kernel_shape(kernel):
    out = attention.compare_attention(FlashAttention(KERNELS[kernel]), torch.device("cpu"), torch.bfloat16, heads=4,
                                      kv_heads=2, head_dim=16)
    assert set(out) == {"ar", "dllm", "ran_as"} and out["ran_as"] == "flash"
    assert out["ar"]["ok"] and out["dllm"]["ok"], out


def test_flash_part_runs_flex_too():
    out = attention.compare_attention(FlexAttention(compiled=False), torch.device("cpu"), torch.bfloat16, heads=4,
                                      kv_heads=2, head_dim=16)
    assert out["ar"]["ok"] and out["dllm"]["ok"] and out["ran_as"] == "flex", out


def test_flash_part_runs_triton_on_both_head_mixes():
    """The part as a GPU runs it, at small heads: on the CPU only the triton kernel can (under Triton's
    interpreter), built for each batch's query group: 2 for the AR and DLLM batches, 4 for SDAR-4B's."""
    cpu = torch.device("cpu")
    assert not triton_unmet(cpu), "tests/conftest.py sets TRITON_INTERPRET=1"
    backends = attention.backends_to_compare(cpu)
    assert "triton" in backends and "flex" not in backends  # compiled flex needs CUDA
    assert backends["triton"].rows_per_tile == TritonAttention(query_group=16 // 8).rows_per_tile
    assert (attention.backends_to_compare(cpu, *attention.SDAR_4B_HEADS)["triton"].rows_per_tile
            == TritonAttention(query_group=32 // 8).rows_per_tile != backends["triton"].rows_per_tile)
    out = attention.flash_part(cpu, torch.bfloat16, head_dim=16, heads=(4, 2), sdar_4b_heads=(8, 2))["triton"]
    assert set(out) == {"ar", "dllm", "dllm_sdar_4b", "ran_as"} and out["ran_as"] == "triton"
    assert out["ar"]["ok"] and out["dllm"]["ok"] and out["dllm_sdar_4b"]["ok"], out


def test_greedy_part_finds_identical_outputs_for_identical_dtypes(tiny):
    out = agreement.compare_greedy(tiny, "cpu", ("float32", "float32"), requests=4)
    assert out == {name: {"dtypes": ["float32", "float32"], "requests": 4, "same_tokens": 1.0,
                          "same_step_map": 1.0, "divergence_gaps_nats": [], "max_gap_nats": None}
                   for name in ("dllm", "ar")}


def test_divergence_gap_is_read_from_the_second_run_at_the_first_differing_token():
    first = SimpleNamespace(token_ids=[5, 7, 9])
    second = SimpleNamespace(token_ids=[5, 8, 9], logprobs=[{5: -0.1}, {8: -0.50, 7: -0.52, 3: -2.0}, {9: -0.2}])
    assert agreement._first_divergence_gap(first, second) == pytest.approx(0.02)
    second.logprobs[1] = {8: -0.5, 3: -2.0}  # the first run's token is outside the second's top-k
    assert agreement._first_divergence_gap(first, second) is None
    assert agreement._first_divergence_gap(SimpleNamespace(token_ids=[5]), second) == 0.0


@pytest.mark.parametrize("attention", ["torch", "flex", "triton"])
def test_seeded_sampling_part(tiny, attention):
    result = agreement.check_seeded_sampling(tiny["dllm"], "cpu", "float32", requests=2, attention=attention)
    assert result["ok"] and result["attention_backend"] == attention


def test_seeded_sampling_part_skips_backends_that_cannot_run_and_reports_errors_beside_the_rest(tiny, monkeypatch):
    calls = []

    def check(path, device, dtype, requests, attention):
        calls.append((path, attention))
        if attention == "flex":
            raise RuntimeError("no kernel")
        return {"ok": True}

    monkeypatch.setattr(agreement, "check_seeded_sampling", check)
    monkeypatch.setattr(agreement, "triton_unmet", lambda device: ["Triton is not installed", "no CUDA"])
    out = agreement.seeded_sampling_part(tiny, "cpu", "float32")
    for name in ("dllm", "ar"):
        assert out[name] == {"torch": {"ok": True}, "flex": {"error": "RuntimeError: no kernel"},
                             "triton": {"skipped": "Triton is not installed; no CUDA"}}
    assert calls == [(tiny[name], backend) for name in ("dllm", "ar") for backend in ("torch", "flex")]


def test_throughput_part_against_the_sdar_loop(tmp_path):
    shape = BenchShape(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=16, intermediate_size=128, vocab_size=384)
    path = throughput.write_sdar(tmp_path, shape)
    out = throughput.throughput(path, shape, "cpu", "float32", [1, 4], Traffic(8, (8, 20), (8, 16)), hf_requests=2,
                               profile_at_most=2)
    assert set(out["engine"]) == {"1", "4"}
    for e in out["engine"].values():
        assert e["output_tokens"] > 0 and e["tokens_per_s"] > 0 and e["forwards"] > 0 and e["steps"] > 0
        assert e["tokens_per_forward"] == e["output_tokens"] / e["forwards"]
        assert e["forward_device_seconds"] is None and e["forward_share_of_step_time"] is None  # CPU: no events
        assert e["ms_per_forward_device"] is None
        assert e["ms_per_forward_wall"] == pytest.approx(1e3 * e["step_seconds"] / e["forwards"])
        assert 0 < e["steps_after_prefill"] < e["steps"]  # the first steps of a request prefill its prompt
        # no graphs on the CPU
        assert e["graph_replays"] is None and e["graph_captures"] is None and e["graph_failure"] is None
        assert 0 < e["forward_host_seconds"] <= e["step_seconds"] <= e["seconds"]
    profile = out["profile"]
    assert profile["steps"] == 2 and profile["top_host_ops"]
    assert profile["kernel_launches_per_step"] == 0 and profile["launch_calls"] == {}  # the CPU launches nothing
    assert out["engine"]["4"]["kernel_launches_per_step"] == 0 and "kernel_launches_per_step" not in out["engine"]["1"]
    assert out["hf_sdar_loop"]["same_as_engine"] == 1.0, "greedy float32: the engine's outputs are the loop's"


def test_launches_are_counted_per_step_from_the_profilers_host_events():
    events = [("cudaLaunchKernel", 30), ("cuLaunchKernelEx", 6), ("cudaGraphLaunch", 4), ("aten::mm", 99),
              ("cudaLaunchKernel", 10), ("cudaMemcpyAsync", 7)]
    counts = breakdown.launch_counts(events)
    assert counts == {"cudaLaunchKernel": 40, "cuLaunchKernelEx": 6, "cudaGraphLaunch": 4}
    assert breakdown.launches_per_step(counts, steps=4) == {"kernel_launches_per_step": 12.5,
                                                            "graph_launches_per_step": 1.0, "launch_calls": counts}


def test_graph_report_gives_deltas_and_none_where_graphs_are_off_or_uncounted():
    graphs = SimpleNamespace(replays=5, captures=2)
    runner_ = SimpleNamespace(graphs=graphs, graph_failure=None)
    before = breakdown.graph_counters(runner_)
    graphs.replays, graphs.captures = 12, 3
    assert breakdown.graph_report(runner_, before) == {"graph_replays": 7, "graph_captures": 1, "graph_failure": None}
    runner_.graphs, runner_.graph_failure = None, "capturing the graph of 64-token steps failed: OOM"
    assert breakdown.graph_report(runner_, before) == {"graph_replays": None, "graph_captures": None,
                                                       "graph_failure": runner_.graph_failure}
    older = SimpleNamespace(graphs=SimpleNamespace(replays=1))  # a runner without `captures` nor `graph_failure`
    assert breakdown.graph_report(older, breakdown.graph_counters(older)) == {
        "graph_replays": 0, "graph_captures": None, "graph_failure": None}


@pytest.mark.parametrize("q_lens, block_length, prefill", [
    ([1, 1, 1], None, False), ([1, 7], None, True), ([4, 8, 4], 4, False), ([4, 9], 4, True), ([], 4, False)])
def test_a_forward_feeds_prefill_when_a_sequence_feeds_more_than_a_decode_step(q_lens, block_length, prefill):
    assert breakdown.feeds_prefill(q_lens, block_length) is prefill


def test_throughput_part_stops_starting_runs_once_its_cap_is_spent(tmp_path):
    path = throughput.write_sdar(tmp_path, TOY_SHAPE)
    out = throughput.throughput(path, TOY_SHAPE, "cpu", "float32", [1, 4], Traffic(8, (8, 20), (8, 16)), hf_requests=1,
                               max_seconds=0.0, profile_at_most=1)
    assert out["engine"]["1"]["skipped"].startswith("the part's 0 s cap")


# ---- weights drawn on the device: the SDAR-4B part and batch invariance, at toy size ------------------------
def test_weights_on_device_are_seeded_and_never_pick_the_mask_or_padding(tmp_path):
    path = random_weights.write_config_only(tmp_path, TOY_SHAPE)
    spec = load_model_spec(str(path))
    assert (spec.hidden_size, spec.vocab_size) == (TOY_SHAPE.hidden_size, TOY_SHAPE.vocab_size)
    load, models = runner.build_model, []
    for _ in range(2):
        with random_weights.weights_on_device(seed=3):
            models.append(runner.build_model(spec, torch.device("cpu"), torch.float32, None))
    assert runner.build_model is load
    a, b = ({name: p.detach() for name, p in m.named_parameters()} for m in models)
    assert all(torch.equal(a[name], b[name]) for name in a)
    head = a["lm_head.weight"]
    assert not head[spec.mask_token_id].any() and not head[random_weights.TOKENIZER_IDS:].any()
    assert a["model.layers.0.mlp.up_proj.weight"].std() == pytest.approx(0.1, rel=0.2)


def test_shape_part_at_toy_size(tmp_path):
    path = random_weights.write_config_only(tmp_path, TOY_SHAPE)
    out = throughput.shape_throughput(path, TOY_SHAPE, "cpu", "float32", 4, Traffic(8, (8, 20), (8, 16)),
                                     profile_steps_at_most=1)
    assert out["requests"] == 4 and out["output_tokens"] > 0 and out["forwards"] > 0
    assert out["profile"]["top_host_ops"] and out["kernel_launches_per_step"] == 0
    assert out["graph_replays"] is None and out["steps_after_prefill"] > 0
    # the device script's run e: the same part under the overlap schedule (half the requests a forward)
    overlapped = EngineChoice(overrides={"overlap_schedule": True})
    halves = throughput.shape_throughput(path, TOY_SHAPE, "cpu", "float32", 4, Traffic(8, (8, 20), (8, 16)),
                                        profile_steps_at_most=1, choice=overlapped)
    assert halves["output_tokens"] == out["output_tokens"] and halves["forwards"] > out["forwards"], (halves, out)


def test_batch_invariance_part_at_toy_size(tmp_path):
    path = random_weights.write_config_only(tmp_path, TOY_SHAPE)
    out = batch_invariance(path, TOY_SHAPE, "cpu", "float32", 4, Traffic(8, (8, 20), (8, 16)))
    assert out["tokens"] > 0 and out["same_tokens"] and out["same_step_map"]
    assert out["first_differing_token"] is None and out["max_logprob_diff"] < 1e-4


def test_trajectory_part_at_toy_size(tmp_path):
    path = random_weights.write_config_only(tmp_path, TOY_SHAPE)
    out = trajectory_scoring(path, "cpu", "float32", Rollouts(trajectories=4, tokens=16, prompt_len=8))
    assert out["vocab_size"] == TOY_SHAPE.vocab_size and out["trajectories"] == 4 and out["output_tokens"] == 16
    assert out["speedup"] > 0 and out["generate_forwards"] > out["score_forwards"] > 0
    assert out["max_abs_diff_scored_vs_logged"] < 1e-4


def test_diffusion_gemma_part_at_toy_size(tmp_path):
    """The part on a tiny DiffusionGemma (weights drawn as the part draws them), each backend serving
    every request to the end; and the release config it writes loads as the release's shape."""
    pytest.importorskip("transformers.models.diffusion_gemma")
    from bench.gpu_check.diffusion_gemma import diffusion_gemma, write_release_config
    from testing.tiny.diffusion_gemma import write_tiny_diffusion_gemma

    release_dir = write_release_config(tmp_path)
    check_checkpoint(release_dir)  # what the engine checks before it draws the weights
    release = load_model_spec(release_dir)
    assert (release.vocab_size, release.num_hidden_layers, release.extra.canvas_length) == (262144, 30, 256)
    path = write_tiny_diffusion_gemma(tmp_path / "tiny")
    out = diffusion_gemma(path, "cpu", "float32", EngineChoice(overrides={"dllm_max_denoising_steps": 4}),
                          concurrency=(1, 3), max_new_tokens=20)
    for backend in ("torch", "flex"):
        assert out[backend]["ran_as"] == backend
        for n in (1, 3):
            run = out[backend][str(n)]
            assert run["finished"] == run["requests"] == n and run["tokens_per_s"] > 0
            assert run["steps_per_request"] == [8]  # two canvases of 16 for 20 tokens, 4 steps each
    assert out["same_tokens_on_every_backend"] == out["compared_requests"] == 3
    cut = diffusion_gemma(path, "cpu", "float32", concurrency=(2,), max_new_tokens=20, max_seconds=0)
    assert cut["torch"]["2"]["finished"] == 0 and cut["compared_requests"] == 0  # no token lists compared


# ---- the part loop and the command line ------------------------------------------------------------------------
def test_part_loop_reports_errors_and_skips_a_part_whose_cap_no_longer_fits(capsys):
    part = cli.PartLoop({"ok", "fails", "capped"}, budget=30)
    part("ok", lambda: {"value": 1})
    part("fails", lambda: 1 / 0)
    part("not_selected", lambda: pytest.fail("an unselected part ran"))
    part("capped", lambda: pytest.fail("a part ran past the budget"), cap=60)
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [next(iter(line)) for line in lines] == ["ok", "fails", "capped"]
    assert part.report["ok"]["value"] == 1 and part.report["fails"]["error"].startswith("ZeroDivisionError")
    assert part.report["capped"]["skipped"].startswith("its 60 s cap exceeds the")


def test_part_loop_writes_each_part_as_it_finishes_and_the_report_at_the_end(tmp_path, capsys):
    out = tmp_path / "made" / "here"
    part = cli.PartLoop({"first", "fails"}, out_dir=out)
    part("first", lambda: {"value": 1})
    assert json.loads((out / "first.json").read_text())["value"] == 1 and not (out / "report.json").exists()
    part("fails", lambda: 1 / 0)
    part.report["card"] = "a card"
    report = part.finish()
    assert json.loads((out / "fails.json").read_text())["error"].startswith("ZeroDivisionError")
    assert json.loads((out / "report.json").read_text()) == report
    assert report["card"] == "a card" and report["first"]["value"] == 1 and report["seconds"] >= 0
    assert sorted(p.name for p in out.iterdir()) == ["fails.json", "first.json", "report.json"]
    assert json.loads(capsys.readouterr().out.split("\n", 2)[2]) == report  # two part lines, then the report


def test_part_loop_without_out_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    part = cli.PartLoop({"first"})
    part("first", lambda: {"value": 1})
    part.finish()
    assert list(tmp_path.iterdir()) == []


def test_out_gets_the_report_without_cuda_too(tmp_path, capsys):
    assert gpu_check.main(["--out", str(tmp_path / "out")]) == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report == json.loads(capsys.readouterr().out) and "no CUDA device" in report["skipped"]


def test_parse_args_takes_the_triton_backend_and_an_out_folder():
    args = cli.parse_args(["--attention", "triton", "--out", "gpu-out/a"])
    assert args.attention == "triton" and args.out == Path("gpu-out/a") and cli.parse_args([]).out is None
    choice = EngineChoice(args.attention, args.kv_block_size, not args.no_cuda_graphs, dict(args.set))
    assert choice.config(device="cpu").attention_backend == "triton"


def test_set_overrides_every_model_part_engine_config_last():
    args = cli.parse_args(["--attention", "flash", "--set", "enable_torch_compile=true", "--set",
                           "attention_backend=flex", "--set", "max_prefill_token_num=4096"])
    choice = EngineChoice(args.attention, args.kv_block_size, not args.no_cuda_graphs, dict(args.set))
    config = choice.config(device="cpu", max_prefill_token_num=64)
    assert config.enable_torch_compile and config.attention_backend == "flex" and config.max_prefill_token_num == 4096
    assert config.device == "cpu" and cli.parse_args([]).set == []


@pytest.mark.parametrize("setting, message", [
    ("no_such_field=1", "unknown EngineConfig field 'no_such_field'"),
    ("max_batch_size=many", "max_batch_size='many'"),
    ("overlap_schedule", "expected FIELD=VALUE"),
])
def test_set_refuses_unknown_fields_and_bad_values(setting, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.parse_args(["--set", setting])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_module_runs_and_skips_without_cuda():
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--set", "overlap_schedule=true"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "no CUDA device" in json.loads(proc.stdout)["skipped"]


# ---- the prepared device script and its summary ----------------------------------------------------------------
def device_runs() -> list[tuple[str, int, list[str]]]:
    """device_run.sh's runs, as its `each_run` lists them: (name, cap in seconds, the flags before the `--out`
    it adds)."""
    return [(name, int(cap), shlex.split(flags))
            for name, cap, flags in re.findall(r'^ +"\$1" (\w+) (\d+) (.*)$', DEVICE_RUN.read_text(), re.M)]


def test_device_script_parses_and_runs_every_part_with_flags_the_check_takes():
    assert os.access(DEVICE_RUN, os.X_OK)
    subprocess.run(["bash", "-n", str(DEVICE_RUN)], check=True)
    runs = device_runs()
    assert [(name, cap) for name, cap, _ in runs] == [("a", 90), ("b", 200), ("c", 200), ("d", 60), ("e", 150)]
    parsed = {name: cli.parse_args([*flags, "--out", f"gpu-out/{name}"]) for name, _, flags in runs}
    assert [parsed[n].only for n in "abcde"] == [["machine", "flash"], ["sdar_4b"], ["throughput"],
                                                 ["seeded_sampling"], ["sdar_4b"]]
    assert parsed["b"].attention == parsed["c"].attention == parsed["e"].attention == "triton"
    assert parsed["c"].throughput_seconds == 120
    # e is b under the overlap schedule
    assert dict(parsed["e"].set) == {"overlap_schedule": True} and not parsed["b"].set
    assert all(set(args.only) <= set(cli.PARTS) for args in parsed.values())


def run_device_script(tmp_path: Path, python: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "OUT"} | {"PYTHON": python, **env}
    return subprocess.run([str(DEVICE_RUN), str(tmp_path / "out")], cwd=tmp_path, env=environ, capture_output=True,
                          text=True, timeout=600)


def test_device_script_keeps_going_past_a_failed_run_and_leaves_a_summary_and_an_archive(tmp_path):
    """Every run through the real check (which skips without CUDA) but the second, which fails."""
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\ncase "$*" in *sdar_4b*) echo boom >&2; exit 3;; esac\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    proc = run_device_script(tmp_path, str(python))
    assert proc.returncode == 1, proc.stderr[-4000:]
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["exit_codes.txt", "runs.tar.gz", "summary.json"]
    codes = [line.split()[:2] for line in (out / "exit_codes.txt").read_text().splitlines()]
    assert codes == [["a", "0"], ["b", "3"], ["c", "0"], ["d", "0"], ["e", "3"]]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["b"]["exit_code"] == 3 and not summary["b"]["finished"] and summary["b"]["stderr_tail"] == ["boom"]
    for name in "acd":
        assert summary[name]["finished"] and "no CUDA device" in summary[name]["report"]["skipped"]
        assert summary[name]["cap_s"] == dict((n, c) for n, c, _ in device_runs())[name]
    with tarfile.open(out / "runs.tar.gz") as archive:
        names = set(archive.getnames())
    assert {"a/report.json", "a/stdout.log", "b/stderr.log", "d/report.json"} <= names


def test_device_script_skips_the_runs_no_time_is_left_for(tmp_path):
    proc = run_device_script(tmp_path, sys.executable, GPU_CHECK_TOTAL_S="0", GPU_CHECK_KEEP_FOLDERS="1")
    assert proc.returncode == 1 and proc.stderr.count("skipped") == 5, proc.stderr[-4000:]
    out = tmp_path / "out"
    assert [line.split()[:2] for line in (out / "exit_codes.txt").read_text().splitlines()] == [
        [name, "skipped"] for name in "abcde"]
    assert (out / "a").is_dir() and not (out / "runs.tar.gz").exists()
    skipped = json.loads((out / "summary.json").read_text())["d"]
    assert skipped["exit_code"] == "skipped" and not skipped["finished"] and skipped["report"] == {}


def test_device_script_makes_only_the_runs_named(tmp_path):
    proc = run_device_script(tmp_path, sys.executable, GPU_CHECK_RUNS="b e", GPU_CHECK_TOTAL_S="0")
    out = tmp_path / "out"
    assert [line.split()[0] for line in (out / "exit_codes.txt").read_text().splitlines()] == ["b", "e"], proc.stderr
    with tarfile.open(out / "runs.tar.gz") as archive:
        assert {name.split("/")[0] for name in archive.getnames()} == {"b", "e"}
    wrong = run_device_script(tmp_path, sys.executable, GPU_CHECK_RUNS="b f")
    assert wrong.returncode == 2 and "no run named 'f'" in wrong.stderr


def test_collect_reads_what_a_run_cut_short_left(tmp_path):
    run = tmp_path / "c"
    run.mkdir()
    (run / "machine.json").write_text(json.dumps({"gpu": "H100"}))
    (run / "throughput.json").write_text('{"engine": {"1"')  # cut short mid-write
    (run / "stderr.log").write_text("loading\rloaded\n" + "".join(f"line {i}\n" for i in range(60)))
    (tmp_path / "exit_codes.txt").write_text("c 124 200 200\n")
    summary = collect.collect(tmp_path)
    c = summary["c"]
    assert c["exit_code"] == 124 and c["seconds"] == 200 and not c["finished"]
    assert c["report"]["machine"] == {"gpu": "H100"} and "unreadable" in c["report"]["throughput"]
    assert len(c["stderr_tail"]) == collect.STDERR_TAIL_LINES and c["stderr_tail"][-1] == "line 59"
