"""The hostile checkpoint (tests/deployments/test_reliability_security.py, the pool's `secure` app): a
tiny checkpoint carrying everything a loader could be tricked into running. The fixture is loaded by
tests/conftest.py through `pytest_plugins`."""

from __future__ import annotations

from pathlib import Path

import pytest


def write_hostile_checkpoint(src: Path, dst: Path, marker_dir: Path) -> Path:
    """A copy of a tiny checkpoint that also carries everything a loader could be tricked into running:
    `modeling_sdar.py` / `configuration_sdar.py` / `tokenization_sdar.py` / `__init__.py` named by
    `auto_map` (+ `trust_remote_code`) in config.json and tokenizer_config.json, and pickled
    `pytorch_model.bin` / `training_args.bin` whose unpickling runs code. Each writes a file into
    `marker_dir` if executed."""
    import json
    import pickle
    import shutil

    shutil.copytree(src, dst)
    marker_dir.mkdir(parents=True, exist_ok=True)
    for name in ("modeling_sdar", "configuration_sdar", "tokenization_sdar", "__init__"):
        (dst / f"{name}.py").write_text(
            f"open({str(marker_dir / name)!r}, 'w').write('checkpoint code ran')\n"
            "class SDARForCausalLM: pass\nclass SDARConfig: pass\nclass SDARTokenizer: pass\n")

    class _Payload:
        def __init__(self, name: str):
            self.name = name

        def __reduce__(self):
            return (exec, (f"open({str(marker_dir / self.name)!r}, 'w').write('pickle ran')",))

    for name in ("pytorch_model.bin", "training_args.bin"):
        (dst / name).write_bytes(pickle.dumps(_Payload(name)))
    config = json.loads((dst / "config.json").read_text())
    config.update(trust_remote_code=True, auto_map={
        "AutoConfig": "configuration_sdar.SDARConfig", "AutoModel": "modeling_sdar.SDARForCausalLM",
        "AutoModelForCausalLM": "modeling_sdar.SDARForCausalLM"})
    (dst / "config.json").write_text(json.dumps(config))
    tok = json.loads((dst / "tokenizer_config.json").read_text())
    tok.update(auto_map={"AutoTokenizer": ["tokenization_sdar.SDARTokenizer", None]}, trust_remote_code=True)
    (dst / "tokenizer_config.json").write_text(json.dumps(tok))
    return dst


@pytest.fixture(scope="session")
def hostile_checkpoint(tiny_checkpoints, tmp_path_factory) -> tuple[Path, Path]:
    """(checkpoint dir, marker dir): see write_hostile_checkpoint."""
    root = tmp_path_factory.mktemp("hostile")
    marker = root / "markers"
    return write_hostile_checkpoint(tiny_checkpoints["sdar"], root / "sdar-hostile", marker), marker
