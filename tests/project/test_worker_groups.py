"""The suite's own scheduler (tests/support/worker_groups.py), driven the way xdist's controller drives it: the
two groups that start a Ray cluster go to two workers first, whatever their size, each whole on its
worker; then the groups the workers name next (those with a `system` test), whatever their size; every
group goes whole to one worker."""

from __future__ import annotations

from types import SimpleNamespace

from tests.support.worker_groups import CLUSTER_GROUPS, GROUPS_DIR, WorkerGroupScheduling, write_groups


class Config:
    """The options of `pytest -n 3` that a LoadScopeScheduling reads."""

    option = SimpleNamespace(tx=["3*popen"], loadscopereorder=True)

    def getvalue(self, name: str):
        return getattr(self.option, name)


class Worker:
    """The part of xdist's WorkerController a scheduler calls: it records the tests it is sent."""

    shutting_down = False

    def __init__(self, name: str):
        self.name, self.sent = name, []
        self.gateway = SimpleNamespace(id=name)

    def send_runtest_some(self, indexes: list[int]) -> None:
        self.sent += indexes

    def shutdown(self) -> None:
        self.shutting_down = True


def test_the_cluster_groups_then_the_system_groups_go_out_before_a_larger_module(tmp_path):
    pool, own_apps = CLUSTER_GROUPS
    groups = {f"tests/test_big.py::test_{i}": "tests/test_big.py" for i in range(50)}  # the largest group
    groups |= {f"tests/test_a.py::test_{i}": own_apps for i in range(5)}
    groups |= {f"tests/test_b.py::test_{i}": pool for i in range(4)}
    groups |= {f"tests/test_c.py::test_{i}": pool for i in range(4)}  # a second module using the pool
    groups |= {f"tests/test_small.py::test_{i}": "tests/test_small.py" for i in range(3)}
    groups |= {f"tests/test_system.py::test_{i}": "tests/test_system.py" for i in range(3)}  # starts servers
    write_groups({GROUPS_DIR: str(tmp_path), "workerid": "gw0"}, groups, [*CLUSTER_GROUPS, "tests/test_system.py"])
    scheduler = WorkerGroupScheduling(Config(), None, tmp_path)
    workers = [Worker(f"gw{i}") for i in range(3)]
    collection = list(groups)
    for worker in workers:
        scheduler.add_node(worker)
    for worker in workers:
        scheduler.add_node_collection(worker, collection)
    scheduler.schedule()

    sent = {w.name: sorted(collection[i] for i in w.sent) for w in workers}
    assert sent["gw0"] == sorted(t for t, g in groups.items() if g == pool)  # both pool modules, on one worker
    assert sent["gw1"] == sorted(t for t, g in groups.items() if g == own_apps)
    assert sent["gw2"] == sorted(t for t, g in groups.items() if g == "tests/test_system.py")  # before the larger
    assert list(scheduler.workqueue) == ["tests/test_big.py", "tests/test_small.py"]  # to the workers that run dry
