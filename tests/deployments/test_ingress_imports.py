"""The ingress loads no model code: importing it (as each ingress replica does) leaves the engine's
model, worker, executor and core packages, the kernels and torch unimported."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.support.paths import ROOT

HEAVY = ("engine.model", "engine.worker", "engine.executor", "engine.core", "engine.async_engine", "ops", "torch")


def test_importing_the_ingress_loads_no_model_code():
    code = ("import json, sys; import deployments.ingress, deployments.llm.router, deployments.llm.forwarding; "
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('engine', 'ops', 'torch'))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert [m for m in loaded if m.startswith(HEAVY)] == []
