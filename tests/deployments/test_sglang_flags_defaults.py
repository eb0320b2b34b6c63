"""SGLang's block-diffusion flags on `blockserve serve` (`--dllm-algorithm`, `--dllm-algorithm-config`)
decode with SGLang's defaults for the algorithm they name, unless the YAML or an engine setting sets
others; and engine settings the model cannot take (a block size above all) end the command before a
Ray cluster starts, in one line. No test here starts Ray: the arg building and the preflight run in
process, and the one subprocess must end before its cluster would start."""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

import pytest

from configs import EngineConfig, GenerationConfig
from deployments.cli import app_args, build_parser, preflight
from engine import pipeline
from testing.tiny_checkpoint import write_tiny_checkpoint
from testing.tiny_fast_dllm import write_tiny_fast_dllm
from testing.tiny_llada2 import write_tiny_llada2
from tests.support.paths import BLOCKSERVE, ROOT
from tests.support.ports import free_port

DELETE, SPLIT = 128, 287  # the tiny LLaDA2.2's edit tokens (tests/engine/families/test_llada2_indel.py)
EDIT_IDS = ("--dllm-delete-token-id", str(DELETE), "--dllm-split-token-id", str(SPLIT))

# SGLang's own defaults (python/sglang/srt/dllm/algorithm/*.py: `algorithm_config.get(key, default)`)
SGLANG = {
    "LowConfidence": {"dllm_unmasking_strategy": "low_confidence_dynamic", "dllm_confidence_threshold": 0.95},
    "JointThreshold": {"dllm_unmasking_strategy": "joint_threshold", "dllm_confidence_threshold": 0.5,
                       "dllm_edit_threshold": 0.0, "dllm_max_post_edit_steps": 16, "dllm_penalty_lambda": 0.0},
    "JointThresholdInDel": {"dllm_unmasking_strategy": "joint_threshold_indel", "dllm_confidence_threshold": 0.5,
                            "dllm_edit_threshold": 0.0, "dllm_max_post_edit_steps": 16},
}


def args_of(model: str | Path, *argv: str) -> dict:
    return app_args(build_parser().parse_args(["serve", str(model), *argv]))


def yaml_file(tmp_path: Path, text: str, name: str = "algo.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    return {"llada2": write_tiny_llada2(root / "llada2", seed=0),
            # LLaDA2.2: block routing over 32-token blocks (4 of the 8 experts per block)
            "llada2.2": write_tiny_llada2(root / "llada2.2", use_qkv_bias=True, use_bias=True, seed=0,
                                          expert_capacity=4),
            "fast_dllm": write_tiny_fast_dllm(root / "fast_dllm"),
            "sdar": ROOT / "models" / "sdar-tiny", "qwen3": ROOT / "models" / "qwen3-tiny",
            "sdar_moe": write_tiny_checkpoint(root / "sdar_moe", model_type="sdar_moe")}


def settings(model: Path, engine: dict) -> dict:
    """The unmasking settings a default request of an engine built from these fields decodes with."""
    with pipeline(str(model), EngineConfig(**engine, max_model_len=256)) as pipe:
        s = pipe.engine.unmasking_settings(GenerationConfig())
    return {"dllm_unmasking_strategy": s.strategy, "dllm_confidence_threshold": s.confidence_threshold,
            "dllm_edit_threshold": s.edit_threshold, "dllm_max_post_edit_steps": s.max_post_edit_steps,
            "dllm_penalty_lambda": s.penalty_lambda}


@pytest.mark.parametrize(("algorithm", "model"), [("LowConfidence", "llada2"), ("LowConfidence", "sdar"),
                                                  ("JointThreshold", "llada2"), ("JointThresholdInDel", "llada2.2")])
def test_an_algorithm_named_without_a_config_decodes_with_sglangs_defaults(checkpoints, algorithm, model):
    """The family's defaults (LLaDA2: 0.95; SDAR: the table's 0.85) do not replace SGLang's."""
    ids = EDIT_IDS if algorithm == "JointThresholdInDel" else ()
    engine = args_of("ckpt", "--dllm-algorithm", algorithm, *ids)["engine"]
    got = settings(checkpoints[model], engine)
    assert {k: got[k] for k in SGLANG[algorithm]} == SGLANG[algorithm]


def test_the_config_and_the_engine_settings_win_over_sglangs_defaults(checkpoints, tmp_path):
    algo = yaml_file(tmp_path, "threshold: 0.7\nmax_post_edit_steps: 3\n")
    preset = yaml_file(tmp_path, "model: ckpt\nengine:\n  dllm_edit_threshold: 0.25\n", "preset.yaml")
    argv = ("--dllm-algorithm", "JointThreshold", "--dllm-algorithm-config", str(algo))
    got = settings(checkpoints["llada2"], args_of("ckpt", *argv, "--config", str(preset))["engine"])
    assert (got["dllm_confidence_threshold"], got["dllm_max_post_edit_steps"], got["dllm_edit_threshold"],
            got["dllm_penalty_lambda"]) == (0.7, 3, 0.25, 0.0)
    engine = args_of("ckpt", *argv, "--dllm-confidence-threshold", "0.8")["engine"]
    assert EngineConfig(**engine).dllm_confidence_threshold == 0.8
    # without --dllm-algorithm nothing of SGLang's applies: the family's defaults do
    assert settings(checkpoints["llada2"], {})["dllm_confidence_threshold"] == 0.95
    assert set(args_of("ckpt")) == {"model"}


def refusal(args: dict) -> str:
    """The line `blockserve serve` ends with for these args, before any cluster starts."""
    with pytest.raises(SystemExit) as e:
        preflight(args, "127.0.0.1", free_port())
    message = str(e.value.code)
    assert message.startswith("blockserve serve: ") and "\n" not in message, message
    return message


def test_a_block_size_the_model_cannot_take_is_refused_before_ray(checkpoints, tmp_path):
    indel = ("--dllm-algorithm", "JointThresholdInDel", *EDIT_IDS)
    block16 = yaml_file(tmp_path, "block_size: 16\n")
    message = refusal(args_of(checkpoints["llada2.2"], *indel, "--dllm-algorithm-config", str(block16)))
    assert "dllm_block_length=16" in message and "block_size=32" in message, message
    message = refusal(args_of(checkpoints["llada2.2"], "--dllm-block-length", "64"))
    assert "dllm_block_length=64" in message, message
    # Fast-dLLM v2 decodes a block in sub-blocks of 8, which must divide it
    message = refusal(args_of(checkpoints["fast_dllm"], "--dllm-algorithm", "LowConfidence",
                              "--dllm-algorithm-config", str(yaml_file(tmp_path, "block_size: 12\n", "b12.yaml"))))
    assert "divide the block length 12" in message, message
    # a value no model takes: EngineConfig's own bounds, in one line naming the field
    message = refusal(args_of(checkpoints["sdar"], "--dllm-algorithm-config",
                              str(yaml_file(tmp_path, "block_size: 0\n", "b0.yaml"))))
    assert "dllm_block_length" in message, message
    # the rest of what the engine would refuse as it starts: the rule's edit tokens, a rule of another paradigm
    message = refusal(args_of(checkpoints["llada2.2"], "--dllm-algorithm", "JointThresholdInDel"))
    assert "delete_token_id" in message, message
    message = refusal(args_of(checkpoints["fast_dllm"], "--dllm-algorithm", "JointThreshold"))
    assert "joint_threshold" in message, message


def test_block_sizes_the_model_takes_pass_the_preflight(checkpoints, tmp_path):
    block32 = yaml_file(tmp_path, "block_size: 32\n")
    for model, argv in (("llada2.2", ("--dllm-algorithm", "JointThresholdInDel", *EDIT_IDS,
                                      "--dllm-algorithm-config", str(block32))),
                        ("llada2", ("--dllm-algorithm", "JointThreshold", "--dllm-block-length", "16")),
                        ("sdar", ("--dllm-algorithm", "LowConfidence", "--dllm-block-length", "8")),
                        ("sdar_moe", ("--dllm-block-length", "8")),
                        ("fast_dllm", ("--dllm-block-length", "16")),
                        ("qwen3", ("--dllm-block-length", "8"))):  # an AR model ignores it (and logs so)
        preflight(args_of(checkpoints[model], *argv), "127.0.0.1", free_port())


def test_blockserve_serve_ends_with_one_line_before_its_cluster_starts(checkpoints, tmp_path):
    algo = yaml_file(tmp_path, "threshold: 0.9\nblock_size: 16\n")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    with tempfile.TemporaryDirectory(prefix="bs-ray-") as ray_tmp:
        done = subprocess.run([str(BLOCKSERVE), "serve", str(checkpoints["llada2.2"]), "--dllm-algorithm",
                               "JointThresholdInDel", "--dllm-algorithm-config", str(algo), *EDIT_IDS,
                               "--port", str(free_port())], cwd=ROOT, capture_output=True, text=True, timeout=300,
                              env={**env, "RAY_AUTH_MODE": "disabled", "RAY_TMPDIR": ray_tmp})
        assert not any(Path(ray_tmp).iterdir()), "a Ray cluster was started"
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("blockserve serve: "), done.stderr[-4000:]
    assert "dllm_block_length=16" in lines[0], lines[0]
