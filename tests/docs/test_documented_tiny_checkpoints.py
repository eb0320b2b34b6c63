"""The one-line tiny-checkpoint writers docs/models.md shows, run as documented (the Python of each
`python -c` line, its /tmp directory moved under the test's own): every family has one (or ships in models/), LLaDA2.2's
writes the fields its rules read and serves `joint_threshold_indel` as written, the documented
`engine.trace` lines run on what they write, and the documented loose stop of DiffusionGemma's
converging checkpoint changes its canvases against the defaults."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from configs import EngineConfig, GenerationConfig
from engine.offline import pipeline
from engine.trace import main
from tests.support.paths import ROOT

MODELS_MD = ROOT / "docs" / "models.md"


def bash_lines() -> list[list[str]]:
    """The commands of docs/models.md's bash blocks, as argv lists."""
    text = MODELS_MD.read_text()
    blocks = re.findall(r"^```bash\n(.*?)^```", text, re.M | re.S)
    return [shlex.split(line) for block in blocks for line in block.splitlines() if line.strip()]


def writer_lines() -> list[str]:
    """The Python of every documented `python -c` tiny-checkpoint writer."""
    return [argv[2] for argv in bash_lines() if argv[0].endswith("python") and argv[1] == "-c"
            and re.search(r"write_tiny|converging_checkpoint", argv[2])]


def under(code: str, tmp: Path) -> str:
    return code.replace("'/tmp/", f"'{tmp}/")


def run_writer(code: str, tmp: Path) -> Path:
    """Run one documented writer's Python (from the repository root, as the docs run it); the
    directory it wrote."""
    exec(compile(under(code, tmp), "docs/models.md", "exec"), {"__name__": "__main__"})
    (path,) = re.findall(r"'/tmp/([^']+)'", code)
    return tmp / path


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> tuple[Path, dict[str, Path]]:
    """Every documented writer run once: (their directory, /tmp name -> the checkpoint)."""
    tmp = tmp_path_factory.mktemp("documented")
    return tmp, {re.findall(r"'/tmp/([^']+)'", code)[0]: run_writer(code, tmp) for code in writer_lines()}


def trace_line(model: str) -> list[str]:
    """The documented `engine.trace` invocation on /tmp/MODEL: its arguments after `-m engine.trace`."""
    (argv,) = [a for a in bash_lines() if "engine.trace" in a and f"/tmp/{model}" in a]
    return argv[argv.index("engine.trace") + 1:]


def test_every_family_has_a_documented_writer(written):
    """Each model_type of the registry is written by a documented line or ships in models/; LLaDA2.2 is
    one of the documented variants (block routing and edit tokens in its config.json)."""
    from engine.model.families import FAMILIES

    configs = [json.loads((path / "config.json").read_text()) for path in written[1].values()]
    shipped = {json.loads(p.read_text())["model_type"] for p in (ROOT / "models").glob("*/config.json")}
    assert sorted(set(FAMILIES) - {c["model_type"] for c in configs} - shipped) == []
    assert any({"expert_capacity", "delete_token_id", "split_token_id"} <= set(c) for c in configs)


def test_the_documented_llada22_writer_serves_joint_threshold_indel(written):
    """The documented LLaDA2.2 line writes block routing and both edit tokens (distinct tokens of the
    tokenizer), and an engine on it serves `joint_threshold_indel` greedily, engine-wide and per request,
    with no ids given."""
    (name,) = [re.findall(r"'/tmp/([^']+)'", c)[0] for c in writer_lines() if "variant='2.2'" in c]
    path = written[1][name]
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == "llada2_moe" and cfg["block_size"] == 32
    assert cfg["num_experts_per_tok"] <= cfg["expert_capacity"] <= cfg["num_experts"]
    vocab = json.loads((path / "tokenizer.json").read_text())["added_tokens"]
    ids = {t["id"] for t in vocab if t["special"]}
    assert {cfg["delete_token_id"], cfg["split_token_id"]} <= ids and cfg["delete_token_id"] != cfg["split_token_id"]

    gen = GenerationConfig(max_new_tokens=40, temperature=0, return_step_trace=True)
    with pipeline(str(path), EngineConfig(dllm_unmasking_strategy="joint_threshold_indel")) as pipe:
        engine_wide = pipe("23+58=", gen)
    with pipeline(str(path)) as pipe:
        per_request = pipe("23+58=", gen.model_copy(update={"dllm_unmasking_strategy": "joint_threshold_indel"}))
    for out in (engine_wide, per_request):
        assert out.finish_reason in ("length", "stop") and out.token_ids
        assert not {cfg["delete_token_id"], cfg["split_token_id"]} & set(out.token_ids)
    assert per_request.token_ids == engine_wide.token_ids


def test_the_documented_trace_lines_run_on_the_documented_llada2_checkpoints(written, capsys):
    for model in ("llada2-tiny", "llada2.2-tiny"):
        args = [under(f"'{a}'", written[0])[1:-1] for a in trace_line(model)]
        assert main([*args, "--no-colour"]) == 0, model
        assert re.search(r"^\d+ tokens in \d+ steps", capsys.readouterr().out, re.M), model


def test_the_documented_loose_stop_changes_the_canvases(written, capsys):
    """docs/models.md's `engine.trace` line on the converging checkpoint (written by its documented
    line) names the loose stop the prose names; with it the canvases stop early ("stable"), and without
    those flags (the defaults) the same seeded request runs every canvas to its last step."""
    args = [under(f"'{a}'", written[0])[1:-1] for a in trace_line("diffusion-gemma-converging")]
    flags = dict(zip(args[2::2], args[3::2]))
    section = MODELS_MD.read_text().split("## DiffusionGemma")[1]
    assert f"`dllm_stop_entropy` {flags['--stop-entropy']}" in section
    assert f"`dllm_stability_threshold` {flags['--stability-threshold']}" in section

    def canvases(argv: list[str]) -> list[tuple[int, int, str]]:
        assert main([*argv, "--no-colour"]) == 0
        out = capsys.readouterr().out
        return [(int(a), int(b), stop) for a, b, stop in re.findall(r"^canvas \d+: .* steps (\d+)-(\d+) \((\w+)\)",
                                                                     out, re.M)]

    loose = canvases(args)
    defaults = [a for i, a in enumerate(args) if a not in ("--stop-entropy", "--stability-threshold")
                and args[i - 1] not in ("--stop-entropy", "--stability-threshold")]
    assert "--seed" in defaults
    default = canvases(defaults)
    assert default and all(stop == "max_steps" for _, _, stop in default)
    assert loose and all(stop == "stable" for _, _, stop in loose)
    assert loose[-1][1] < default[-1][1]


@pytest.mark.parametrize("variant", ["2.0", "2.1"])
def test_the_earlier_variants_write_no_llada22_fields(tmp_path, variant):
    """LLaDA2.0 / 2.1 checkpoints as before; LLaDA2.2's of the same seed has the same tensors but the LM
    head rows of its edit tokens (zero padding rows in the others)."""
    from safetensors.torch import load_file

    from testing.tiny_llada2 import write_tiny_llada2

    path = write_tiny_llada2(tmp_path / variant, variant=variant)
    cfg = json.loads((path / "config.json").read_text())
    assert not {"expert_capacity", "delete_token_id", "split_token_id"} & set(cfg) and cfg["rope_theta"] == 600000.0
    llada22 = write_tiny_llada2(tmp_path / "2.2", variant="2.2")
    edit = json.loads((llada22 / "config.json").read_text())
    ids = [edit["delete_token_id"], edit["split_token_id"]]
    ours, theirs = load_file(path / "model.safetensors"), load_file(llada22 / "model.safetensors")
    assert ours.keys() == theirs.keys()
    assert not ours["lm_head.weight"][ids].any() and theirs["lm_head.weight"][ids].any()
    theirs["lm_head.weight"][ids] = 0
    assert all(ours[k].equal(theirs[k]) for k in ours)
