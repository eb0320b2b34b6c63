"""`python -m bench.soak` as a user runs it: stdout is the summary's JSON and nothing else (Ray's own lines go
to stderr); without the bench extra it says in one line what to install; a run whose every memory series is
still settling is inconclusive, not passed."""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import subprocess
import sys

from bench.soak import __main__ as cli
from bench.soak.record import SERIES, Recorder
from bench.soak.verdict import leaks
from tests.support.paths import ROOT


def _settling(iterations: int, seed: int) -> list[float]:
    """Memory that still grows more slowly as it goes (+20 MB, time constant 40 iterations): at 97 iterations its
    slope after the warm-up found is below the limit, but it is still slowing down."""
    rng = random.Random(seed)
    return [338 + 20 * (1 - math.exp(-i / 40)) + rng.gauss(0, 0.3) for i in range(iterations)]


def test_a_run_whose_every_series_still_settles_is_inconclusive(tmp_path):
    """A 2-minute run (97 iterations) whose series are all `settling` below the leak limit: the old verdict
    said `passed`; the warm-up is not over, so the memory verdict is inconclusive (and the run still passes)."""
    leak, t = leaks(_settling(97, 0), 50.0)
    assert t.settling and t.slope * 200 < 50.0 and leak is None
    recorder = Recorder(tmp_path, 50.0, None)
    series = {"engine:1": _settling(97, 1), "ingress:2": _settling(97, 2)}
    for i in range(97):
        recorder.records.append({"iteration": i, "requests": 16, "lost": 0, "version_problems": [], "unexpected": [],
                                 "problems": [], "faults": [], "pages": {}, "latency_s": {"p50": 0.2, "p99": 0.2},
                                 "procs": {p: dict.fromkeys(SERIES, ys[i]) for p, ys in series.items()}})
    summary = recorder.summary()
    assert all(trend["settling"] for trend in summary["trends"].values()), summary["trends"]
    assert summary["verdict"] == "inconclusive: 97 iterations, warm-up not over", summary["verdict"]
    assert summary["passed"] and summary["leaks"] == []
    assert sorted(summary["warmup_not_over"]) == sorted(f"{m} of {p}" for m in ("rss_mb", "anon_mb") for p in series)


def test_stdout_carries_only_the_summary_whatever_ray_prints(monkeypatch, capfd):
    """What the driver prints while the cluster runs (Ray prints `(raylet) ...` lines to stdout whatever
    `log_to_driver` says, and its processes share the file descriptor) goes to stderr."""
    @contextlib.contextmanager
    def noisy_app(s):
        print("(raylet) printed by Ray's driver")
        os.write(1, b"(raylet) written to the file descriptor\n")
        yield "http://127.0.0.1:1/app"
        print("(raylet) Task ServeController.listen_for_change failed.")

    async def summary(s, url, root):
        print("(pid=1) a worker's line")
        return {"passed": True, "verdict": "passed", "url": url}

    monkeypatch.setattr(cli, "started_app", noisy_app)
    monkeypatch.setattr(cli, "_until_interrupted", summary)
    assert cli.main(["--iterations", "1"]) == 0
    out, err = capfd.readouterr()
    assert json.loads(out) == {"passed": True, "verdict": "passed", "url": "http://127.0.0.1:1/app"}, out
    assert err.count("(raylet)") == 3 and "(pid=1)" in err and "[soak] passed" in err


def test_without_httpx_it_says_what_to_install():
    """Without the bench extra: one line naming the missing module and the install, no traceback."""
    code = ("import runpy, sys; sys.modules['httpx'] = None; sys.argv[1:] = ['--iterations', '1']; "
            "runpy.run_module('bench.soak', run_name='__main__', alter_sys=True)")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and run.stdout == "", (run.stdout, run.stderr)
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in run.stderr, run.stderr
    assert "httpx" in lines[0] and "pip install -e '.[bench]'" in lines[0], lines[0]

