"""The suite's tiers and its xdist worker groups; the shared fixtures are tests/support's modules,
loaded below through `pytest_plugins` (the Ray/Serve fixtures start only when a test asks for them).

Tiers (pytest markers, assigned here, never by hand except `system`):
- `engine`: no Ray at all -- every test that reaches neither the session's cluster nor a `system` fixture;
- `serve`: Ray Serve applications on the session's cluster (every test that reaches `serve_cluster`);
- `system`: multi-node, browser, soak, CLI -- anything that starts a cluster or a server process of its
  own: marked `@pytest.mark.system` (or `pytestmark`), or reaching a fixture of SYSTEM_FIXTURES.
`pytest -m engine` is the fast tier; an engine-tier test that starts Ray fails, naming the marker it needs.
"""

from __future__ import annotations

import os

# The Triton attention kernel runs here under Triton's interpreter, which Triton reads when it is first
# imported: set before anything imports it (torch does lazily), and inherited by every process the
# suite starts. Nothing else in the suite runs Triton (inductor compiles C++ on the CPU).
os.environ.setdefault("TRITON_INTERPRET", "1")

import sys  # noqa: E402
from pathlib import Path

import pytest
import torch

from tests.support.ray_env import set_test_ray_environment
from tests.support.worker_groups import CLUSTER_GROUPS, GROUPS_DIR

set_test_ray_environment()
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # torch may have been imported before the variable was set

# The shared fixtures, one module per subject (pytest finds fixtures only in conftest files and plugins).
pytest_plugins = [
    "tests.support.threads",  # one_thread
    "tests.support.checkpoints",  # gemma_ckpt, gemma_reference, ar_ckpt, dllm_ckpt, tiny_checkpoints
    "tests.support.hostile",  # hostile_checkpoint
    "tests.support.serve",  # serve_cluster
    "tests.support.serve_pool",  # serve_pool, served_apps, reliability_apps
    "tests.support.processes",  # stop_later
]

TIERS = ("engine", "serve", "system")
SYSTEM_FIXTURES = {"browser", "blockserve_cli"}  # a browser, or `blockserve serve` in a process of its own


def tier_of(item: pytest.Item) -> str:
    """A test's tier: `system` when marked so or when it reaches a system fixture, `serve` when it
    reaches the session's cluster, else `engine`."""
    fixtures = set(getattr(item, "fixturenames", ()))
    if item.get_closest_marker("system") or fixtures & SYSTEM_FIXTURES:
        return "system"
    return "serve" if "serve_cluster" in fixtures else "engine"


def worker_group(item: pytest.Item) -> str:
    """The unit one xdist worker runs (tests/support/worker_groups.py): one of CLUSTER_GROUPS for a test that
    reaches the session's cluster, else its module.

    A cluster is per worker process, so whatever shares applications must share a worker: every test
    that uses the pool (`serve_pool`: the applications several modules share) runs on one worker, and
    the tests that reach the cluster only to deploy applications of their own run on another, with a
    cluster of its own. That splits the suite's longest chain in two without deploying anything
    twice; a `system` test that uses the cluster goes with its group too, not with its module."""
    fixtures = set(getattr(item, "fixturenames", ()))
    pool_group, own_apps_group = CLUSTER_GROUPS
    if "serve_pool" in fixtures:
        return pool_group
    if "serve_cluster" in fixtures:
        return own_apps_group
    return item.nodeid.split("::", 1)[0]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        marked = [t for t in TIERS if t != "system" and item.get_closest_marker(t)]
        if marked:
            raise pytest.UsageError(f"{item.nodeid}: the `{marked[0]}` tier is derived from the fixtures a "
                                    "test uses (tests/conftest.py); mark only `system` by hand")
        item.add_marker(tier_of(item))
    if hasattr(config, "workerinput"):  # an xdist worker: tell the controller's scheduler the groups
        from tests.support.worker_groups import write_groups

        groups = {item.nodeid: worker_group(item) for item in items}
        system = {groups[item.nodeid] for item in items if item.get_closest_marker("system")}
        write_groups(config.workerinput, groups, [*CLUSTER_GROUPS, *sorted(system - set(CLUSTER_GROUPS))])


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """On an xdist worker a cluster group runs whole and in a row (tests/support/worker_groups.py): after its last
    test the worker's cluster, with the applications on it, is stopped at once rather than when the
    session ends, so that its idle Serve processes take no CPU from the groups the worker runs next.
    (A later test asking for `serve_cluster` would start a new one.)"""
    group = worker_group(item)
    if (hasattr(item.config, "workerinput") and group in CLUSTER_GROUPS
            and (nextitem is None or worker_group(nextitem) != group)):
        for fixturedef in item.session._fixturemanager.getfixturedefs("serve_cluster", item) or ():
            fixturedef.finish(item._request)  # its dependents (the pool, module fixtures) first


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:
    """Each xdist worker learns where to write its groups: one folder per run, made by the controller."""
    node.workerinput[GROUPS_DIR] = str(_groups_dir(node.config))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    from tests.support.worker_groups import WorkerGroupScheduling

    return WorkerGroupScheduling(config, log, _groups_dir(config))


def _groups_dir(config: pytest.Config) -> Path:
    if not hasattr(config, "_blockserve_groups_dir"):
        import tempfile

        config._blockserve_groups_dir = Path(tempfile.mkdtemp(prefix="blockserve-worker-groups-"))
    return config._blockserve_groups_dir


@pytest.fixture(autouse=True)
def _engine_tier_starts_no_ray(request):
    """The engine tier runs without Ray: a test there that starts Ray belongs in another tier."""
    def ray_started() -> bool:
        ray = sys.modules.get("ray")
        return ray is not None and ray.is_initialized()

    before = ray_started()  # the session's cluster, started by an earlier serve test
    yield
    if request.node.get_closest_marker("engine") and not before and ray_started():
        pytest.fail("this test started Ray but is in the `engine` tier (no Ray): use the `serve_cluster` "
                    "fixture, or mark it `@pytest.mark.system` if it starts a cluster of its own")
