"""The process group a trainer broadcasts new weights over (SGLang's `init_custom_process_group`)."""

from __future__ import annotations

import datetime
import socket
import time
from urllib.parse import urlsplit

from torch.distributed.distributed_c10d import (
    Backend,
    PrefixStore,
    _new_process_group_helper,
    _set_pg_timeout,
    _world,
    rendezvous,
)

from engine.errors import WeightUpdateError

WEIGHT_OP_TIMEOUT_S = 1800.0  # staging by broadcast waits for the trainer: far longer than a forward
GROUP_JOIN_TIMEOUT_S = 120.0  # how long the members of a new update group have to meet
_JOINED_KEY = "blockserve/joined/"  # set by every non-trainer rank of ours once it reached the store
_PROBE_INTERVAL_S = 0.5


def _store_answers(init_method: str, timeout_s: float) -> bool:
    """Whether the TCP store at a `tcp://host:port` init method accepts a connection within `timeout_s`
    (True for other init methods: nothing to probe). Probed with a plain socket first because torch's
    own store client logs every failed try with a page of C++ stack."""
    url = urlsplit(init_method)
    if url.scheme != "tcp" or url.hostname is None or url.port is None:
        return True
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((url.hostname, url.port), timeout=max(0.1, min(2.0, timeout_s))):
                return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(_PROBE_INTERVAL_S)


def init_custom_process_group(backend: str, init_method: str, world_size: int, rank: int, group_name: str,
                              timeout_s: float = WEIGHT_OP_TIMEOUT_S, join_timeout_s: float | None = None):
    """A process group of its own (its own TCP store, keys under `group_name`), beside any default
    group the process already has: the trainer (rank 0, hosting the store) and the engine ranks of
    other worlds meet here. Trainers create theirs the same way (SGLang's and verl's
    `init_custom_process_group`), so the store keys agree.

    The members have `join_timeout_s` (default `timeout_s`) to meet; collectives on the group then
    get `timeout_s`. A group that does not form raises WeightUpdateError naming who did not join:
    rank 0 (the trainer) when its store never answered, else the ranks that never reached it."""
    join_s = timeout_s if join_timeout_s is None else join_timeout_s
    join = datetime.timedelta(seconds=join_s)
    where = f"{group_name!r} at {init_method} (world_size {world_size})"
    if rank != 0 and not _store_answers(init_method, join_s):
        raise WeightUpdateError(f"weight update group {where}: rank 0 (the trainer) never connected within "
                                f"{join_s:g}s (nothing accepts connections at {init_method})")
    try:
        store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=join))
    except RuntimeError as e:  # DistNetworkError / DistStoreError: nobody hosts the store there
        who = "rank 0 (the trainer)" if rank != 0 else "the other ranks"
        raise WeightUpdateError(f"weight update group {where}: {who} never connected within {join_s:g}s "
                                f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from e
    store.set_timeout(join)
    prefixed = PrefixStore(group_name, store)
    if rank != 0:
        prefixed.set(f"{_JOINED_KEY}{rank}", "1")
    try:
        group, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), prefixed,
                                             group_name=group_name, timeout=join)
    except RuntimeError as e:
        raise WeightUpdateError(f"weight update group {where} did not form within {join_s:g}s: "
                                f"{_who_is_missing(prefixed, world_size)}") from e
    op_timeout = datetime.timedelta(seconds=timeout_s)
    store.set_timeout(op_timeout)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    _set_pg_timeout(op_timeout, group)
    return group


def _who_is_missing(store: PrefixStore, world_size: int) -> str:
    """Which ranks never reached the group's store (each of ours leaves a key there on arrival; the
    trainer, rank 0, hosts the store, so it reached it)."""
    try:
        missing = [r for r in range(1, world_size) if not store.check([f"{_JOINED_KEY}{r}"])]
    except RuntimeError as e:  # the store went away with the trainer
        return f"the trainer's store stopped answering ({type(e).__name__})"
    if missing:
        return (f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} never joined "
                f"(ranks 1..{world_size - 1} are the engines'; check rank_offset and world_size)")
    return "every engine rank joined, but rank 0 (the trainer) did not complete its side of the group"
