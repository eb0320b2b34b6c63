"""bench/gpu_check's parts, run on the CPU in float32 with tiny shapes (the flash part through the
kernel substitutes of tests/test_flash_kernels.py), its part loop, its `--set` overrides, and its skip
where CUDA is absent."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_flash_kernels import KERNELS

from bench import gpu_check
from bench.gpu_check import agreement, attention, cli, random_weights, throughput
from bench.gpu_check.batch_invariance import batch_invariance
from bench.gpu_check.engine_choice import EngineChoice
from bench.gpu_check.trajectory import trajectory_scoring
from bench.models import TOY_SHAPE, BenchShape
from bench.trajectory_scoring import Rollouts
from bench.workloads import Traffic
from engine.model.checkpoint import load_model_spec
from engine.model.source import check_checkpoint
from engine.worker import runner
from ops.attention import FlashAttention, FlexAttention


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


@pytest.mark.parametrize("attention", ["torch", "flex"])
def test_seeded_sampling_part(tiny, attention):
    result = agreement.check_seeded_sampling(tiny["dllm"], "cpu", "float32", requests=4, attention=attention)
    assert result["ok"] and result["attention_backend"] == attention


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
        assert e["cuda_graph_replays"] is None  # no graphs on the CPU
        assert 0 < e["forward_host_seconds"] <= e["step_seconds"] <= e["seconds"]
    assert out["profile"]["steps"] == 2 and out["profile"]["top_host_ops"]
    assert out["hf_sdar_loop"]["same_as_engine"] == 1.0, "greedy float32: the engine's outputs are the loop's"


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
    assert out["profile"]["top_host_ops"]


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
    from engine.model.families.diffusion_gemma.tiny import write_tiny_diffusion_gemma

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
                          cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "no CUDA device" in json.loads(proc.stdout)["skipped"]
