"""Multi-node placement, replica spread and node loss on a real multi-node Ray cluster on this machine.
The scenario (tests/support/multinode_scenario.py) starts its own `ray.cluster_utils.Cluster`, so it runs in
a subprocess: this session's own Ray cluster stays untouched. The subprocess gets a Ray temp directory
of its own: `Cluster` marks its head as this machine's current cluster (`ray_current_cluster` in
Ray's temp directory), and any `ray.init()` or `serve run` without an address joins the marked
cluster, so a `serve run` that another test started at the same time deployed into this one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest

from tests.support.paths import ROOT

pytestmark = pytest.mark.system  # a multi-node cluster of its own


@pytest.fixture(scope="module")
def report() -> dict:
    with tempfile.TemporaryDirectory(prefix="bs-multinode-", ignore_cleanup_errors=True) as ray_tmp:
        proc = subprocess.run([sys.executable, "-m", "tests.support.multinode_scenario"], cwd=ROOT,
                              env=os.environ | {"RAY_TMPDIR": ray_tmp}, capture_output=True, text=True, timeout=480)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1])


def test_replicas_on_different_nodes_serve_identical_outputs(report):
    spread = report["spread"]
    assert spread["replica_nodes"] == ["A", "B"]
    assert spread["identical"]
    assert min(spread["tokens_per_replica"]) > 0  # both replicas served some of the prompts


def test_tp_group_strict_pack_refused_with_missing_resources_pack_spans_nodes(report):
    tp = report["tp"]
    assert tp["strict_error"] is not None and "on one node" in tp["strict_error"]
    assert "tp: 1" in tp["strict_error"] and "PACK" in tp["strict_error"], tp["strict_error"]
    assert tp["pack_rank_nodes"] == ["A", "B"] and tp["tp_workers"] == 1
    assert tp["pack_output_ids"]


def test_node_loss_fails_its_requests_explicitly_and_the_rest_succeed(report):
    loss = report["loss"]
    print("node loss:", loss)
    assert loss["replica_nodes_before"] == ["A", "B"]
    assert loss["ingress_nodes"] == ["head"]  # by default: a lost worker node takes only engine replicas
    assert loss["lost"] == 0  # every request answered: a result or an explicit error
    held = loss["held_at_kill"]  # generation was paused in place: no request finished between count and kill
    assert held.get("A", 0) > 0 and held.get("B", 0) > 0, held
    assert loss["failed"] == held["A"]  # the lost node's requests: explicit errors, every one of them
    assert loss["ok"] == loss["requests"] - held["A"]  # all others complete: B's, and those done before the pause
    assert loss["new_requests_ok"] and loss["replica_nodes_after"] == ["B", "E"]


def test_unschedulable_replica_gets_503_at_once(report):
    answers = report["unschedulable"]["answers"]
    print("unschedulable:", answers)
    assert answers, "the ingress never answered"
    assert all(a["status"] == 503 and a["retry_after"] for a in answers), answers
