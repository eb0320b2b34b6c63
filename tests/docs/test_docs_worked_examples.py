"""The docs' examples on the tiny checkpoints that the testing kit writes: every Python block that makes one
prints what its `# ` comment says, and every `python -c` line that makes one writes a checkpoint the
engine loads. (The paths under /tmp are this test's own.)"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import subprocess
import sys

import pytest

from engine import GenerationConfig, pipeline
from tests.support.paths import ROOT

DOCS = sorted((ROOT / "docs").glob("*.md"))


def _blocks(lang: str) -> list[tuple[str, str]]:
    pattern = re.compile(rf"^```{lang}\n(.*?)^```", re.M | re.S)
    return [(doc.name, m[1]) for doc in DOCS for m in pattern.finditer(doc.read_text()) if "testing.tiny_" in m[1]]


PYTHON = _blocks("python")
COMMANDS = [(name, line) for name, block in _blocks("bash") for line in block.splitlines() if "testing.tiny_" in line]


def test_the_new_families_examples_are_found():
    assert {"decoding.md", "models.md"} <= {name for name, _ in PYTHON + COMMANDS}
    assert any("tiny_llada2" in b for _, b in PYTHON) and any("tiny_fast_dllm" in b for _, b in PYTHON)


@pytest.mark.parametrize("block", [b for _, b in PYTHON], ids=[n for n, _ in PYTHON])
def test_python_example_prints_what_it_says(block, tmp_path):
    expected = [line.split("#", 1)[1].strip() for line in block.splitlines() if line.lstrip().startswith("print(")]
    assert expected, "an example names what it prints"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block.replace("/tmp/", f"{tmp_path}/"), "<docs example>", "exec"), {})
    assert out.getvalue().splitlines() == expected


@pytest.mark.system  # the documented commands as typed, each in a process of its own
@pytest.mark.parametrize("line", [c for _, c in COMMANDS], ids=[n for n, _ in COMMANDS])
def test_checkpoint_command_writes_a_model_the_engine_loads(line, tmp_path):
    argv = shlex.split(line.replace("/tmp/", f"{tmp_path}/"))
    assert argv[0] == ".venv/bin/python" and argv[1] == "-c", line
    subprocess.run([sys.executable, *argv[1:]], cwd=ROOT, check=True, capture_output=True, timeout=120)
    (path,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    with pipeline(str(path)) as pipe:
        assert len(pipe("23+58=", GenerationConfig(max_new_tokens=4)).token_ids) > 0
