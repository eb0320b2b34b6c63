"""`python -m bench.soak`, short: the trainer's loop against a real application on the tiny SDAR
checkpoint (disk, tensor and flattened-broadcast updates, every pause mode, a client hanging up, an
abort by rid, a client dropping mid-body) loses nothing, keeps versions and pages straight; a leak
put in on purpose turns the verdict (exit status 1)."""

from __future__ import annotations

import asyncio
import json
import os

import pytest

from bench.soak.__main__ import main, soak
from bench.soak.settings import SoakSettings
from bench.soak.verdict import leaks, warmup_end
from tests.support.serve_pool import APPS

SHORT = dict(prompts=1, samples=2, max_tokens=8, drill_tokens=48)


@pytest.fixture(scope="module")
def soak_app(serve_pool):
    """The pool's `sdar_drills` (the leak test needs the drill hooks), deployed afresh for the soak (the
    fault tests before it stall and replace its replicas, and the soak counts its engine ranks from the
    app's processes), with no tensor-parallel application beside it: on one node the soak's process
    probe counts every TP worker as the soaked app's."""
    serve_pool.release("sdar_drills", *(name for name, spec in APPS.items() if spec.engine.get("tp", 1) > 1))
    return serve_pool["sdar_drills"]


@pytest.mark.system
def test_a_short_soak_keeps_every_promise(soak_app, tmp_path):
    s = SoakSettings(url=soak_app.url, app=soak_app.name, iterations=4, drop_client_every=2, out=str(tmp_path),
                     **SHORT)
    summary = asyncio.run(soak(s, soak_app.url, root=os.getpid()))  # this process started the cluster
    assert summary["iterations"] == 4 and summary["requests"] >= 4 * 10
    for verdict in ("version_problems", "unexpected_endings", "problems", "pages_not_back", "leaks"):
        assert summary[verdict] == [], (verdict, summary[verdict])
    assert summary["lost"] == 0 and summary["passed"]
    assert summary["faults"] == {"drop_client": 2}
    records = [json.loads(line) for line in (tmp_path / "soak.jsonl").read_text().splitlines()]
    assert [r["update"] for r in records] == ["disk", "tensor", "broadcast", "disk"]
    assert {k.split(":")[0] for k in records[-1]["procs"]} == {"engine", "ingress"}
    assert (tmp_path / "rss_mb.png").stat().st_size > 0 and (tmp_path / "summary.json").exists()


@pytest.mark.system
def test_a_leak_put_in_on_purpose_fails_the_soak(soak_app, tmp_path, capfd):
    argv = ["--url", soak_app.url, "--app", soak_app.name, "--iterations", "6", "--inject-leak-mb", "32",
            "--no-broadcast", "--out", str(tmp_path), *(f"--{k.replace('_', '-')}={v}" for k, v in SHORT.items())]
    assert main(argv) == 1
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert json.loads(capfd.readouterr().out) == summary, "the command's stdout is its JSON summary alone"
    assert summary["lost"] == 0 and summary["version_problems"] == []
    assert any(leak.startswith("rss_mb of engine:") for leak in summary["leaks"]), summary["leaks"]


def test_the_warm_up_is_found_where_growth_settles():
    warm = [100 + 40 * i for i in range(5)] + [260 + 0.1 * i for i in range(20)]
    assert warmup_end(warm) == 5 or warmup_end(warm) == 4
    assert leaks(warm, 50.0)[0] is False
    assert leaks([100 + 1.0 * i for i in range(25)], 50.0)[0] is True  # 200 MB per 200 iterations
