"""The ranks of a torch.distributed group that a test starts with `torch.multiprocessing.spawn`."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.queues import Queue

import torch.distributed as dist


@contextmanager
def gloo_rank(rank: int, port: int, world_size: int = 2, feeds: tuple[Queue, ...] = ()) -> Iterator[None]:
    """Run the body as `rank` of a gloo group over loopback `port`; the group is destroyed after it.

    A rank whose body succeeded ends its process right there (`os._exit(0)`): the interpreter's teardown
    after a gloo group now and then aborts in a C++ thread's destructor ("terminate called without an
    active exception", SIGABRT) once the rank's work is done, and `spawn` would report that rank as
    failed. `feeds`: the multiprocessing queues the rank puts to, flushed first (`os._exit` skips the
    flush of their feeder threads, and a reader would wait forever for what was still buffered). A body
    that raises still ends the process through `spawn`, which reports its traceback."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
    for queue in feeds:
        queue.close()
        queue.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
