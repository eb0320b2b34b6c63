"""The soak's memory verdict on recorded-like samples (a run too short for the warm-up is inconclusive, never
a leak), and what the soak needs installed."""

from __future__ import annotations

import ast
import importlib.metadata
import math
import random
import re
import sys
from pathlib import Path

import tomllib

from bench.soak.record import SERIES, Recorder
from bench.soak.verdict import leaks
from tests.support.paths import ROOT


def _warming_up(iterations: int) -> list[float]:
    """The engine's anonymous memory as the soaks of docs/benchmarks.md recorded it: 338 MB at the start,
    441 MB at iteration 100, then a slow creep (+7 MB per 200 iterations), with the allocator's noise."""
    rng = random.Random(0)
    scale = 103 / (1 - math.exp(-100 / 60))
    return [338 + scale * (1 - math.exp(-i / 60)) + 0.035 * i + rng.gauss(0, 1.5) for i in range(iterations)]


def test_a_run_shorter_than_the_warm_up_is_inconclusive_not_a_leak():
    """97 iterations (a 2-minute run): the old verdict called this '+65 MB per 200 iterations after 21
    iterations of warm-up'; the series is still slowing down, so there is no verdict either way."""
    leak, t = leaks(_warming_up(97), 50.0)
    assert leak is None and t.settling
    assert leaks(_warming_up(700), 50.0)[0] is False  # past the warm-up: flat enough
    grows = [v + 0.5 * i for i, v in enumerate(_warming_up(700))]  # the same, leaking 100 MB per 200
    assert leaks(grows, 50.0)[0] is True


def test_the_summary_says_inconclusive_and_passes(tmp_path):
    recorder = Recorder(tmp_path, 50.0, None)
    for i, mb in enumerate(_warming_up(97)):
        recorder.records.append({"iteration": i, "requests": 16, "lost": 0, "version_problems": [], "unexpected": [],
                                 "problems": [], "faults": [], "pages": {}, "latency_s": {"p50": 0.2, "p99": 0.2},
                                 "procs": {"engine:1": {m: mb for m in SERIES}}})
    summary = recorder.summary()
    assert summary["verdict"] == "inconclusive: 97 iterations, warm-up not over" and summary["passed"]
    assert summary["leaks"] == [] and summary["warmup_not_over"] == ["rss_mb of engine:1", "anon_mb of engine:1"]


def test_the_soak_needs_only_the_base_dependencies_and_the_bench_extra():
    """What bench.soak imports (a module of this repository, the standard library, or a distribution)
    is installed by `pip install -e '.[bench]'`: the base dependencies or the `bench` extra."""
    root = ROOT
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    wanted = {re.split(r"[<>=\\[ ;]", r, maxsplit=1)[0].lower().replace("_", "-")
              for r in [*project["dependencies"], *project["optional-dependencies"]["bench"]]}
    dists = importlib.metadata.packages_distributions()
    ours = {p.name for p in root.iterdir() if (p / "__init__.py").exists()}
    for f in (root / "bench" / "soak").glob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for top in {n.split(".")[0] for n in names}:
                if top in ours or top in sys.stdlib_module_names or top == "matplotlib":  # PNGs: optional
                    continue
                assert {d.lower().replace("_", "-") for d in dists.get(top, [top])} & wanted, (f.name, top)


def test_the_soak_writes_outside_the_working_directory_unless_told(tmp_path, monkeypatch):
    """Run from a checkout, the soak leaves it clean: its files go to --out, else a new temporary folder."""
    from bench.soak.__main__ import out_dir, parse_args

    monkeypatch.chdir(tmp_path)
    default = out_dir(parse_args(["--iterations", "1"]))
    assert default.is_dir() and tmp_path not in default.parents and list(tmp_path.iterdir()) == []
    assert out_dir(parse_args(["--iterations", "1", "--out", "here"])) == Path("here")
