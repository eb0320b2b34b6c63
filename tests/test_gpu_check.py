"""bench/gpu_check.py's parts, run on the CPU in float32 with tiny shapes (the flash part through the
kernel substitutes of tests/test_flash_kernels.py), and its skip where CUDA is absent."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from test_flash_kernels import KERNELS

from bench import gpu_check
from bench.models import BenchShape
from bench.workloads import Traffic


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return gpu_check.write_tiny_pair(tmp_path_factory.mktemp("gpu_check"))


def test_skips_with_exit_0_without_cuda(capsys):
    assert not torch.cuda.is_available()
    assert gpu_check.main([]) == 0
    assert "no CUDA device" in json.loads(capsys.readouterr().out)["skipped"]


@pytest.mark.parametrize("kernel", KERNELS)
def test_flash_part_agrees_through_each_kernel_shape(kernel):
    out = gpu_check.compare_attention(KERNELS[kernel], torch.device("cpu"), torch.bfloat16, heads=4, kv_heads=2,
                                      head_dim=16)
    assert set(out) == {"ar", "dllm"}
    assert all(part["ok"] for part in out.values()), out


def test_greedy_part_finds_identical_outputs_for_identical_dtypes(tiny):
    out = gpu_check.compare_greedy(tiny, "cpu", ("float32", "float32"), requests=4)
    assert out == {name: {"dtypes": ["float32", "float32"], "requests": 4, "same_tokens": 1.0,
                          "same_step_map": 1.0, "divergence_gaps_nats": [], "max_gap_nats": None}
                   for name in ("dllm", "ar")}


def test_divergence_gap_is_read_from_the_second_run_at_the_first_differing_token():
    first = SimpleNamespace(token_ids=[5, 7, 9])
    second = SimpleNamespace(token_ids=[5, 8, 9], logprobs=[{5: -0.1}, {8: -0.50, 7: -0.52, 3: -2.0}, {9: -0.2}])
    assert gpu_check._first_divergence_gap(first, second) == pytest.approx(0.02)
    second.logprobs[1] = {8: -0.5, 3: -2.0}  # the first run's token is outside the second's top-k
    assert gpu_check._first_divergence_gap(first, second) is None
    assert gpu_check._first_divergence_gap(SimpleNamespace(token_ids=[5]), second) == 0.0


def test_seeded_sampling_part(tiny):
    assert gpu_check.check_seeded_sampling(tiny["dllm"], "cpu", "float32", requests=4)["ok"]


def test_throughput_part_against_the_sdar_loop(tmp_path):
    shape = BenchShape(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=16, intermediate_size=128, vocab_size=384)
    path = gpu_check.write_sdar(tmp_path, shape)
    out = gpu_check.throughput(path, shape, "cpu", "float32", [1, 4], Traffic(8, (8, 20), (8, 16)), hf_requests=2)
    assert set(out["engine"]) == {"1", "4"}
    assert all(e["output_tokens"] > 0 and e["tokens_per_s"] > 0 for e in out["engine"].values())
    assert out["hf_sdar_loop"]["same_as_engine"] == 1.0, "greedy float32: the engine's outputs are the loop's"
