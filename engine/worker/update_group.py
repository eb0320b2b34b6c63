"""The process group a trainer broadcasts new weights over (SGLang's `init_custom_process_group`)."""

from __future__ import annotations

import datetime

from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

WEIGHT_OP_TIMEOUT_S = 1800.0  # staging by broadcast waits for the trainer: far longer than a forward


def init_custom_process_group(backend: str, init_method: str, world_size: int, rank: int, group_name: str,
                              timeout_s: float = WEIGHT_OP_TIMEOUT_S):
    """A process group of its own (its own TCP store, keys under `group_name`), beside any default
    group the process already has: the trainer (rank 0, hosting the store) and the engine ranks of
    other worlds meet here. Trainers create theirs the same way (SGLang's and verl's
    `init_custom_process_group`), so the store keys agree."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    group, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), PrefixStore(group_name, store),
                                         group_name=group_name, timeout=timeout)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group
