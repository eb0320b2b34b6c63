"""The docs' Python blocks as a reader pastes them into a script: each compiles as a module (an `await` outside
a function is a SyntaxError there, whatever an asyncio REPL accepts), and docs/rl.md's training step runs as
pasted, its placeholder paths pointed at a tiny checkpoint."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from testing.tiny_checkpoint import write_tiny_checkpoint
from tests.support.paths import ROOT

DOCS = [ROOT / "README.md", ROOT / "deployments" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def python_blocks(doc: Path) -> list[tuple[int, str]]:
    """(line, text) of each ```python block of `doc`."""
    text = doc.read_text()
    return [(text[:m.start()].count("\n") + 1, m[1])
            for m in re.finditer(r"^```python\n(.*?)^```", text, re.M | re.S)]


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_every_python_block_compiles_as_a_script(doc):
    for line, text in python_blocks(doc):
        try:
            compile(text, f"{doc.relative_to(ROOT)}:{line}", "exec")  # no top-level await
        except SyntaxError as e:
            pytest.fail(f"{doc.relative_to(ROOT)}, the block at line {line}, pasted into a script: {e}")


def test_the_rl_training_step_runs_as_pasted(tmp_path):
    (step,) = [text for _, text in python_blocks(ROOT / "docs" / "rl.md") if "update_weights_from_tensor" in text]
    ckpt = write_tiny_checkpoint(tmp_path / "sdar", model_type="sdar", seed=1)
    assert "path/to/checkpoint" in step and "path/to/trained/model.safetensors" in step
    script = (step.replace("path/to/checkpoint", str(ckpt))
              .replace("path/to/trained/model.safetensors", str(ckpt / "model.safetensors")))
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
