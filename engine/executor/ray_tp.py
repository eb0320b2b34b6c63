"""Tensor-parallel executor on Ray: rank 0 runs in the EngineServer replica's process (so logits never
cross a process boundary); ranks 1..tp-1 are `TPWorker` actors placed in bundles 1..tp-1 of the
replica's placement group. The ranks join one torch.distributed group (gloo on CPU, nccl on CUDA)
through the TCP store rank 0 hosts, on a socket bound to the node's Ray address only: a store bound by
port alone listens on every interface, and whoever reaches it could join or disturb the group (on a
single machine served over loopback the store is reachable from this machine only).

Every rank must run the same forwards in the same order (the layers all-reduce / all-gather): each
`execute` sends the batch to the workers first (`.remote()`: an actor runs one caller's calls in
submission order), runs rank 0 locally, then waits for the workers with a timeout, so a failed or
dead worker becomes an error for the requests in flight rather than a hang. Such an error is *fatal*
(the process group is broken): the engine loop ends those requests and stops, the health check
fails, and Serve replaces the replica.

Control operations between forwards (weight updates, update groups, memory release) go to every
rank through `run_on_ranks`: the workers get the call first, rank 0 runs it, then every rank's
outcome is collected, so all ranks have finished before the caller sees the first rank's refusal
(a two-phase weight update discards on all of them only then).
"""

from __future__ import annotations

import datetime
import logging
import socket
import uuid
from typing import Any

import ray
import torch
import torch.distributed as dist
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from configs import EngineConfig
from engine.model.checkpoint import ModelSpec
from engine.model.layers.parallel import TPContext
from engine.worker.forward_batch import ForwardBatch, ForwardOutput
from engine.worker.runner import ModelRunner, resolve_device

log = logging.getLogger(__name__)


class TPExecutorError(RuntimeError):
    """A tensor-parallel forward failed; the group is unusable and the replica must restart."""

    fatal = True


def _store_socket(ip: str) -> socket.socket:
    """A listening socket for rank 0's TCP store on `ip` alone (a free port)."""
    sock = socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((ip, 0))
    sock.listen(128)
    return sock


def _join_group(backend: str, address: tuple[str, int], rank: int, size: int, timeout_s: float,
                listen_fd: int | None = None) -> None:
    """Join the group through the store at `address`; rank 0 hosts it on `listen_fd`."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(address[0], address[1], size, rank == 0, timeout, master_listen_fd=listen_fd)
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=size, timeout=timeout)


class TPShard:
    """One rank's model shard and KV cache (the body of a worker actor; rank 0 uses it in-process)."""

    def __init__(self, spec: ModelSpec, config: EngineConfig, rank: int, address: tuple[str, int], timeout_s: float,
                 listen_fd: int | None = None):
        device = resolve_device(config)
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(0)  # Ray exposes exactly this actor's GPU as cuda:0
        _join_group(backend, address, rank, config.tp, timeout_s, listen_fd)
        self.runner = ModelRunner(spec, config, TPContext(rank=rank, size=config.tp, group=None))

    @property
    def num_pages(self) -> int:
        return self.runner.num_pages

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


@ray.remote
class TPWorker:
    """Rank 1..tp-1: executes every batch rank 0 executes; returns nothing (rank 0 has the logits)."""

    def __init__(self, spec: ModelSpec, config: EngineConfig, rank: int, address: tuple[str, int], timeout_s: float):
        self.args = (spec, config, rank, address, timeout_s)
        self.shard: TPShard | None = None

    def setup(self) -> int:
        self.shard = TPShard(*self.args)
        return self.shard.num_pages

    def set_dllm_block_length(self, block_length: int | None) -> None:
        self.shard.runner.set_dllm_block_length(block_length)

    def execute(self, batch: ForwardBatch) -> None:
        self.shard.runner.execute(batch)

    def call(self, method: str, args: tuple) -> tuple[bool, Any]:
        """`ModelRunner.<method>(*args)` on this rank: (True, result) or (False, the exception)."""
        try:
            return True, getattr(self.shard.runner, method)(*args)
        except Exception as e:  # noqa: BLE001 - handed to rank 0, which raises it
            return False, e

    def shutdown(self) -> None:
        if self.shard is not None:
            self.shard.shutdown()


class RayTPExecutor:
    """An `engine.executor.base.Executor` over `config.tp` shards: rank 0 here, the others as actors."""

    def __init__(self, spec: ModelSpec, config: EngineConfig, timeout_s: float = 60.0,
                 worker_options: dict | None = None):
        self.timeout_s = timeout_s
        size = config.tp
        device = resolve_device(config)
        pg = get_current_placement_group()
        if pg is not None and len(pg.bundle_specs) < size:
            raise ValueError(f"tp={size} needs {size} placement-group bundles, the replica has {len(pg.bundle_specs)}")
        store_socket = _store_socket(ray.util.get_node_ip_address())
        address = store_socket.getsockname()[:2]
        resources = worker_options or ({"num_cpus": 1, "num_gpus": 1} if device.type == "cuda" else {"num_cpus": 1})
        group_id = uuid.uuid4().hex[:12]
        self.worker_names: list[str] = []
        self.workers = []
        for rank in range(1, size):
            options: dict = dict(resources)
            if pg is not None:
                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=rank)
            options["name"] = f"blockserve-tp-{group_id}-rank{rank}"  # findable for debugging / fault drills
            self.worker_names.append(options["name"])
            self.workers.append(TPWorker.options(**options).remote(spec, config, rank, address, timeout_s))
        setups = [w.setup.remote() for w in self.workers]
        try:
            self.shard = TPShard(spec, config, 0, address, timeout_s, store_socket.detach())
            pages = ray.get(setups, timeout=timeout_s + 600)
        except BaseException:
            store_socket.close()  # unless the store took it over
            self._kill_workers()
            raise
        # Shards of one model get the same page count unless memory differs (CUDA fractions): use
        # the smallest so every rank has every page the engine may address.
        self._num_pages = min([self.shard.num_pages, *pages])
        log.info("tensor-parallel group ready: tp=%d (store at %s:%d), %d KV pages", size, *address, self._num_pages)

    @property
    def num_pages(self) -> int:
        return self._num_pages

    @property
    def kv_groups(self) -> dict[str, tuple[int, int | None]] | None:
        return self.shard.runner.kv_groups  # every rank sizes its pools alike

    def describe(self) -> dict[str, Any]:
        return {"executor": "ray_tp", **self.shard.runner.describe(), "tp_workers": len(self.workers),
                "tp_worker_names": list(self.worker_names),
                "tp_namespace": ray.get_runtime_context().namespace,
                "tp_backend": dist.get_backend() if dist.is_initialized() else None}

    def set_dllm_block_length(self, block_length: int | None) -> None:
        self.shard.runner.set_dllm_block_length(block_length)
        ray.get([w.set_dllm_block_length.remote(block_length) for w in self.workers], timeout=self.timeout_s)

    def execute(self, batch: ForwardBatch) -> ForwardOutput:
        refs = [w.execute.remote(batch) for w in self.workers]
        try:
            out = self.shard.runner.execute(batch)
            ray.get(refs, timeout=self.timeout_s)
        except Exception as e:
            raise TPExecutorError(f"tensor-parallel forward failed ({type(e).__name__}): {e}") from e
        return out

    def run_on_ranks(self, method: str, *args: Any, timeout_s: float | None = None) -> list[Any]:
        """`ModelRunner.<method>(*args)` on every rank at once; the results in rank order. A rank's
        exception is raised (the lowest rank's) once every rank has finished; a worker that does not
        answer within the timeout is fatal, like a failed forward."""
        shipped = ray.put(args) if self.workers else None  # one copy in the object store for all workers
        refs = [w.call.remote(method, shipped) for w in self.workers]
        outcomes: list[tuple[bool, Any]] = []
        try:
            outcomes.append((True, getattr(self.shard.runner, method)(*args)))
        except Exception as e:  # noqa: BLE001 - raised below, after the workers finished
            outcomes.append((False, e))
        try:
            outcomes += ray.get(refs, timeout=timeout_s or self.timeout_s)
        except Exception as e:
            raise TPExecutorError(f"tensor-parallel {method} failed ({type(e).__name__}): {e}") from e
        for ok, value in outcomes:
            if not ok:
                raise value
        return [value for _, value in outcomes]

    def _kill_workers(self) -> None:
        for w in self.workers:
            try:
                ray.kill(w)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.workers = []

    def shutdown(self) -> None:
        self._kill_workers()
        shard = getattr(self, "shard", None)
        if shard is not None:
            shard.shutdown()
