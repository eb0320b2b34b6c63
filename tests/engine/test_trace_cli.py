"""`python -m engine.trace` beyond the totals: a flag for every knob (LLaDA2's edit token ids, the renoising
knobs, `--seed`), refusals as one line without a traceback, and what `--json` records: only the knobs
the model's paradigm reads (as the engine resolved them), and a renoising model's positions in canvases
(that follow the prompt wherever it ends), labelled by canvas."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from configs import GenerationConfig
from configs.knobs import KNOBS, RENOISING_KNOBS
from engine.offline import pipeline
from engine.trace import main
from testing.tiny_llada2 import write_tiny_llada2
from tests.support.paths import ROOT

PROMPT = "23+58="
DELETE, SPLIT = 128, 287  # ordinary tokens of the tiny vocabulary the tiny LLaDA2 model writes now and then


@pytest.fixture(scope="module")
def llada20(tmp_path_factory) -> Path:
    """A LLaDA2.0-style checkpoint: no edit tokens in its config.json."""
    return write_tiny_llada2(tmp_path_factory.mktemp("llada20"), use_qkv_bias=True, use_bias=True)


@pytest.fixture(scope="module")
def llada22(tmp_path_factory) -> Path:
    return write_tiny_llada2(tmp_path_factory.mktemp("llada22"), variant="2.2", use_qkv_bias=True, use_bias=True)


def saved(path: Path) -> dict:
    return json.loads(path.read_text())


# ---- LLaDA2's edit tokens, and errors --------------------------------------------------------


def test_the_edit_token_ids_are_flags(llada20, tmp_path, capsys):
    """On a checkpoint without edit tokens `joint_threshold_indel` runs once the ids are flags."""
    out = tmp_path / "t.json"
    argv = [str(llada20), PROMPT, "--strategy", "joint_threshold_indel", "--delete-token-id", str(DELETE),
            "--split-token-id", str(SPLIT), "--no-colour", "--json", str(out)]
    assert main(argv) == 0
    assert re.search(r"^\d+ tokens in \d+ steps", capsys.readouterr().out, re.M)
    settings = saved(out)["trace"]["settings"]
    assert (settings["dllm_delete_token_id"], settings["dllm_split_token_id"]) == (DELETE, SPLIT)


def test_a_checkpoint_without_edit_tokens_is_one_line_naming_the_flags(llada20):
    proc = subprocess.run([sys.executable, "-m", "engine.trace", str(llada20), PROMPT, "--strategy",
                           "joint_threshold_indel"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("python -m engine.trace: error: ")
    assert "delete_token_id" in lines[0] and "--delete-token-id" in lines[0] and "--split-token-id" in lines[0]


@pytest.mark.parametrize("flags,status,named", [
    (["--threshold", "0.9"], 1, "--threshold"),  # a knob renoising does not read
    (["--strategy", "sequential"], 1, "--strategy"),
    (["--t-min", "0.9"], 1, "dllm_t_min"),  # above the checkpoint's t_max
    (["--t-min", "-1"], 2, "--t-min"),  # out of the knob's bounds
    (["--t-min", "abc"], 2, "--t-min"),
    (["--strategy", "fastest"], 2, "--strategy"),
])
def test_refusals_are_one_line(gemma_ckpt, capsys, flags, status, named):
    """Exit status 1 for what the model refuses, 2 for a flag's bad value (argparse's), one line each."""
    try:
        code = main([str(gemma_ckpt), PROMPT, *flags])
    except SystemExit as e:
        code = e.code
    assert code == status
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and named in err[0], err


def test_a_missing_model_is_one_line(tmp_path, capsys):
    assert main([str(tmp_path / "none"), PROMPT]) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "none" in line


# ---- what --json records -----------------------------------------------------------------------


def test_a_renoising_trace_records_only_the_knobs_its_paradigm_reads(gemma_ckpt, tmp_path, capsys):
    """DiffusionGemma: the renoising knobs (given ones as given, the rest as the engine resolved them),
    max_new_tokens and the seed; no unmasking rule, confidence threshold or temperature. Sent back as a
    request, those settings are accepted and give the traced tokens."""
    out = tmp_path / "dg.json"
    assert main([str(gemma_ckpt), PROMPT, "--max-new-tokens", "24", "--seed", "7", "--t-max", "0.9",
                 "--max-denoising-steps", "6", "--no-colour", "--json", str(out)]) == 0
    capsys.readouterr()
    body = saved(out)
    settings = body["trace"]["settings"]
    assert set(settings) == {*RENOISING_KNOBS, "max_new_tokens", "seed"}
    assert all("renoising" in KNOBS[k].used_by for k in settings if k.startswith("dllm_"))
    assert (settings["dllm_t_max"], settings["dllm_max_denoising_steps"], settings["seed"]) == (0.9, 6, 7)
    request = {k: v for k, v in settings.items() if k != "seed"}
    with pipeline(str(gemma_ckpt)) as pipe:
        again = pipe(PROMPT, GenerationConfig(**request, random_seed=settings["seed"]))
    assert again.token_ids == body["output_ids"]


def test_block_traces_record_the_rules_own_knobs(llada22, tmp_path, capsys):
    """LLaDA2.2 under joint_threshold_indel: its threshold is the rule's 0.5 (not the engine-wide 0.85),
    no step quota (the rule reads none), greedy."""
    out = tmp_path / "indel.json"
    assert main([str(llada22), PROMPT, "--strategy", "joint_threshold_indel", "--no-colour", "--json", str(out)]) == 0
    capsys.readouterr()
    settings = saved(out)["trace"]["settings"]
    assert settings["dllm_unmasking_strategy"] == "joint_threshold_indel"
    assert settings["dllm_confidence_threshold"] == 0.5 and settings["temperature"] == 0
    assert "dllm_denoising_steps" not in settings and not set(RENOISING_KNOBS) & set(settings)


def test_renoising_positions_are_grouped_and_labelled_by_canvas(gemma_ckpt, tmp_path, capsys):
    """Canvases follow the prompt (here of a length that is no multiple of the canvas): the saved body
    names the paradigm and its canvases (no block length to group by), each token's step within its
    canvas tells the canvases apart as the viewer groups them, and the step lines come under a line per
    canvas (1, 2, ..., as the viewer numbers them) that names its positions and steps."""
    out = tmp_path / "dg.json"
    assert main([str(gemma_ckpt), PROMPT, "--max-new-tokens", "24", "--seed", "3", "--max-denoising-steps", "5",
                 "--no-colour", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    body = saved(out)
    trace, meta = body["trace"], body["meta_info"]
    length = trace["canvas_length"]
    assert trace["paradigm"] == "renoising" and trace["block_length"] is None and length == 16
    assert meta["prompt_tokens"] % length != 0
    spans = [c["positions"] for c in trace["canvases"]]
    assert [c["canvas"] for c in trace["canvases"]] == [1, 2] and spans == [[0, 16], [16, 24]]
    starts = [s - b for s, b in zip(meta["step_map"], meta["block_step_map"], strict=True)]  # the viewer's key
    groups = [[p for p in range(len(starts)) if starts[p] == key] for key in dict.fromkeys(starts)]
    assert [[g[0], g[-1] + 1] for g in groups] == spans
    steps = [c["steps"] for c in trace["canvases"]]
    assert steps[0][0] == 1 and steps[1][0] == steps[0][1] + 1 and steps[1][1] == meta["dllm_num_steps"]
    heads = re.findall(r"^canvas (\d+): positions (\d+)-(\d+), steps (\d+)-(\d+) \((\w+)\)$", printed, re.M)
    assert [(int(k), int(a), int(b) + 1) for k, a, b, *_ in heads] == [(1, 0, 16), (2, 16, 24)]
    assert [[int(a), int(b)] for *_, a, b, _ in heads] == steps


def test_a_narrower_canvas_is_traced_on_its_own_width(gemma_ckpt, tmp_path, capsys):
    """`--canvas-length 6`: the request decodes on canvases of 6, which the saved trace and the printed
    canvas lines name, and its recorded settings repeat it."""
    out = tmp_path / "narrow.json"
    assert main([str(gemma_ckpt), PROMPT, "--max-new-tokens", "14", "--seed", "2", "--max-denoising-steps", "4",
                 "--canvas-length", "6", "--no-colour", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    body = saved(out)
    trace = body["trace"]
    assert trace["canvas_length"] == 6 and trace["settings"]["dllm_canvas_length"] == 6
    assert [c["positions"] for c in trace["canvases"]] == [[0, 6], [6, 12], [12, 14]]
    assert "3 canvases of 6" in printed
    request = {k: v for k, v in trace["settings"].items() if k != "seed"}
    with pipeline(str(gemma_ckpt)) as pipe:
        again = pipe(PROMPT, GenerationConfig(**request, random_seed=trace["settings"]["seed"]))
    assert again.token_ids == body["output_ids"]


def test_an_unseeded_renoising_trace_prints_the_seed_that_repeats_it(gemma_ckpt, tmp_path, capsys):
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    argv = [str(gemma_ckpt), PROMPT, "--max-new-tokens", "16", "--max-denoising-steps", "4", "--no-colour"]
    assert main([*argv, "--json", str(first)]) == 0
    seed = int(re.search(r"seed (\d+)", capsys.readouterr().out)[1])
    assert saved(first)["trace"]["settings"]["seed"] == seed
    assert main([*argv, "--seed", str(seed), "--json", str(second)]) == 0
    assert saved(second)["output_ids"] == saved(first)["output_ids"]
