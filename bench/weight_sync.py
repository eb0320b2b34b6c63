"""Seconds to push a ~1 GB model into a tp=2 engine (Ray TP executor, gloo) by each weight update
path: `update_weights_from_disk`, `update_weights_from_tensor` (full tensors in the caller's memory)
and `update_weights_from_distributed` (a trainer Ray actor, rank 0 of a gloo group, broadcasting every
tensor). Each figure is the wall time of the AsyncEngine call: stage and validate on both ranks,
swap (on CPU: repack the oneDNN weights), flush the prefix cache. After each update the engine
answers like a fresh engine on those weights (a short greedy generation is compared).

    python -m bench.weight_sync [--layers 20] [--repeats 2] [--workdir DIR] [--toy]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path

from bench.local_cluster import _free_port
from configs import EngineConfig, GenerationConfig
from deployments.single_machine import start_local_ray
from engine.async_engine import AsyncEngine
from engine.carrier import Response
from engine.local_ray import use_loopback
from engine.model.checkpoint import iter_weights
from testing.tiny_checkpoint import write_tiny_checkpoint

use_loopback()  # Ray reads its single-machine switch when imported: this bench's cluster listens on loopback only
import ray  # noqa: E402
import torch  # noqa: E402

SHAPE = dict(hidden_size=1024, num_attention_heads=8, num_key_value_heads=4, head_dim=128, intermediate_size=3072)
TOY_SHAPE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128)
PROMPT = [5, 9, 13, 22, 7, 8]
GREEDY = GenerationConfig(max_new_tokens=8, ignore_eos=True)


@ray.remote(num_cpus=1)
class Trainer:
    """Rank 0 of the update group: holds the weights in memory and broadcasts them in order."""

    def __init__(self, path: str):
        self.tensors = [(name, w[...].contiguous()) for name, w in iter_weights(path)]
        self.group = None

    def metadata(self) -> tuple[list[str], list[str], list[list[int]]]:
        return ([n for n, _ in self.tensors], [str(t.dtype).removeprefix("torch.") for _, t in self.tensors],
                [list(t.shape) for _, t in self.tensors])

    def join(self, port: int, world_size: int, group_name: str) -> None:
        from engine.worker.update_group import init_custom_process_group

        self.group = init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", world_size, 0, group_name)

    def broadcast(self) -> None:
        for _, t in self.tensors:
            torch.distributed.broadcast(t, src=0, group=self.group)

    def leave(self) -> None:
        torch.distributed.destroy_process_group(self.group)


def checkpoint(root: Path, name: str, seed: int, layers: int, shape: dict[str, int]) -> Path:
    path = root / f"{name}-{layers}l-{shape['hidden_size']}h"
    if not (path / "model.safetensors").is_file():
        write_tiny_checkpoint(path, model_type="qwen3", seed=seed, num_hidden_layers=layers, **shape)
    return path


async def greedy(eng: AsyncEngine) -> list[int]:
    return Response.from_chunks([c async for c in eng.generate(PROMPT, GREEDY)]).token_ids


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def measure(root: Path, layers: int, repeats: int, shape: dict[str, int]) -> tuple[int, dict[str, list[float]]]:
    """(bytes of safetensors, seconds of each update path per repeat), on the Ray cluster this driver
    is connected to."""
    a, b = checkpoint(root, "a", 1, layers, shape), checkpoint(root, "b", 2, layers, shape)
    size = sum(f.stat().st_size for f in a.glob("*.safetensors"))
    from engine.executor.ray_tp import RayTPExecutor

    config = EngineConfig(tp=2, max_model_len=256, num_kv_blocks=64, kv_block_size=16)
    eng = AsyncEngine(str(a), config, RayTPExecutor)
    trainer = Trainer.remote(str(b))
    try:
        want = {"a": asyncio.run(greedy(eng))}
        in_memory = [(n, w[...]) for n, w in iter_weights(a)]
        names, dtypes, shapes = ray.get(trainer.metadata.remote())
        port, group = _free_port(), "bench"
        joining = trainer.join.remote(port, 3, group)
        asyncio.run(eng.init_weights_update_group("127.0.0.1", port, 1, 3, group, "gloo"))
        ray.get(joining)

        def broadcast() -> None:
            sending = trainer.broadcast.remote()
            asyncio.run(eng.update_weights_from_distributed(names, dtypes, shapes, group))
            ray.get(sending)

        paths = {"disk": (lambda: asyncio.run(eng.update_weights_from_disk(str(b))), "b"),
                 "tensor": (lambda: asyncio.run(eng.update_weights_from_tensor(in_memory)), "a"),
                 "broadcast": (broadcast, "b")}
        seconds: dict[str, list[float]] = {k: [] for k in paths}
        for _ in range(repeats):
            for name, (push, lands_on) in paths.items():
                seconds[name].append(timed(push))
                got = asyncio.run(greedy(eng))
                want.setdefault(lands_on, got)
                assert got == want[lands_on], f"{name}: {got} != {want[lands_on]}"
        assert want["a"] != want["b"]
        asyncio.run(eng.destroy_weights_update_group(group))
        ray.get(trainer.leave.remote())
    finally:
        eng.shutdown()
        ray.kill(trainer)
    return size, seconds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=20, help="decoder layers (20: ~1 GB of float32 weights)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--workdir", default=None, help="where the two checkpoints are written (kept for reruns)")
    parser.add_argument("--toy", action="store_true", help="a toy-width model (seconds; figures meaningless)")
    args = parser.parse_args(argv)
    root = Path(args.workdir or tempfile.mkdtemp(prefix="bench-weight-sync-"))
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    start_local_ray(num_cpus=4, include_dashboard=False, logging_level="warning", log_to_driver=False)
    try:
        size, seconds = measure(root, args.layers, args.repeats, TOY_SHAPE if args.toy else SHAPE)
    finally:
        ray.shutdown()
    print(f"model: {args.layers} layers, {size / 1e9:.2f} GB float32 safetensors; engine tp=2 (Ray TP executor, "
          f"gloo), {os.cpu_count()} cores")
    print("| path | seconds (each run) | best | GB/s (best) |")
    print("|---|---|---|---|")
    for name, runs in seconds.items():
        print(f"| {name} | {', '.join(f'{s:.2f}' for s in runs)} | {min(runs):.2f} | {size / 1e9 / min(runs):.2f} |")


if __name__ == "__main__":
    main()
