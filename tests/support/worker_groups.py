"""How pytest-xdist shares the suite among its workers: the tests that reach a session's Ray cluster in
two groups (those using the pool of shared applications, and those deploying only their own), each
whole on one worker, whose cluster and applications stay in that process; any other test with the rest
of its module (a module-scoped fixture -- a scenario run once, an engine a module shares -- is built
once). tests/conftest.py's worker_group names each test's group.

xdist's own `--dist loadgroup` would do this from `xdist_group` marks, but it tags node ids through an
attribute pytest 9 no longer reads. So each worker writes the group of every test it collected to a file
(`write_groups`), and the controller's scheduler (`WorkerGroupScheduling`) reads it: the controller
never collects, and all it receives from the workers are node ids.

The order the groups are handed out in is the longest first, as far as it is known before anything has
run: the two cluster groups (each some ten minutes on 2 loaded cores), then the groups holding a `system`
test (each starts clusters or servers of its own, one to three minutes), then the rest by test count
(xdist's own order). Long groups handed out last would finish long after the other workers ran dry."""

from __future__ import annotations

import json
import os
from pathlib import Path

from xdist.scheduler import LoadScopeScheduling

GROUPS_DIR = "blockserve_worker_groups"  # the workerinput key: the folder the workers' group files go to
CLUSTER_GROUPS = ("serve_pool", "serve_cluster")  # the groups that start a cluster: handed out first


def write_groups(workerinput: dict, groups: dict[str, str], first: list[str]) -> None:
    """A worker's {node id: group} and the groups to hand out first, in that order (the rest follow by
    size), written whole before the worker reports its collection."""
    path = Path(workerinput[GROUPS_DIR]) / f"{workerinput['workerid']}.json"
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps({"groups": groups, "first": first}))
    os.replace(partial, path)


class WorkerGroupScheduling(LoadScopeScheduling):
    """LoadScopeScheduling whose scopes are the groups the workers wrote (all workers collect the same
    tests, which xdist checks, so any one worker's file is the whole map). The groups the file names
    `first` are handed out first, in its order -- the cluster groups one a worker, since two on one
    worker would run one after the other -- then the rest largest first."""

    def __init__(self, config, log, groups_dir: Path):
        super().__init__(config, log)
        self.groups_dir = groups_dir
        self._written: dict | None = None
        self._ordered = False

    def _assign_work_unit(self, node) -> None:
        if not self._ordered:
            for scope in reversed([s for s in self._read()["first"] if s in self.workqueue]):
                self.workqueue.move_to_end(scope, last=False)
            self._ordered = True
        super()._assign_work_unit(node)

    def _split_scope(self, nodeid: str) -> str:
        return self._read()["groups"][nodeid]

    def _read(self) -> dict:
        if self._written is None:
            self._written = json.loads(min(self.groups_dir.glob("*.json")).read_text())
        return self._written
