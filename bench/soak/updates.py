"""The soak's weight updates, as a trainer makes them: from disk (HTTP), tensors by reference (the
ingress handle, `ray.put` so they never pass through the ingress), and one flattened broadcast in a
process group where the soak is rank 0 (gloo). Every update pushes the served checkpoint's own
tensors (a subset for the tensor and broadcast kinds), so outputs stay those of the model and only
the version moves."""

from __future__ import annotations

import asyncio
import math
import socket
from pathlib import Path
from typing import Any

import httpx

BROADCAST_GROUP = "soak"
JOIN_TIMEOUT_S = 60.0  # the engines join at once or not at all (a replica still being replaced)


def _small_tensors(checkpoint: str, count: int = 2) -> dict[str, Any]:
    """The `count` smallest tensors of a safetensors checkpoint (what a partial update sends)."""
    from safetensors import safe_open

    files = sorted(Path(checkpoint).glob("*.safetensors"))
    sizes = {}
    for path in files:
        with safe_open(str(path), "pt") as f:
            sizes |= {(name, path): math.prod(f.get_slice(name).get_shape()) for name in f.keys()}
    smallest = sorted(sizes, key=lambda k: (sizes[k], k[0]))[:count]
    out = {}
    for name, path in smallest:
        with safe_open(str(path), "pt") as f:
            out[name] = f.get_tensor(name)
    return out


class Updater:
    """Makes each kind of update against one application; `kinds` are those this soak can make."""

    def __init__(self, client: httpx.AsyncClient, url: str, checkpoint: str, app: str | None,
                 engine_ranks: int | None, broadcast: bool):
        self.client, self.url, self.checkpoint, self.app = client, url, checkpoint, app
        self.tensors = _small_tensors(checkpoint)
        self.engine_ranks = engine_ranks  # replicas * tp: the group's members besides the soak
        self.group = None
        self.kinds = ["disk"] + (["tensor"] if app is not None else []) + (["broadcast"] if broadcast else [])

    async def update(self, kind: str, version: str) -> dict[str, Any]:
        """One update to `version`: the answer (`success` False when refused or failed)."""
        if kind == "disk":
            r = await self.client.post(self.url + "/update_weights_from_disk",
                                       json={"model_path": self.checkpoint, "weight_version": version})
            return r.json()
        if kind == "tensor":
            return await asyncio.to_thread(self._by_tensor, version)
        return await self._by_broadcast(version)

    def _by_tensor(self, version: str) -> dict[str, Any]:
        import ray
        from ray import serve

        named = ray.put([[n, t] for n, t in self.tensors.items()])
        return serve.get_app_handle(self.app).update_weights_from_tensor.remote(
            {"named_tensors": named, "weight_version": version}).result()

    async def join(self) -> dict[str, Any]:
        """(Re)build the broadcast group: every engine rank joins, the soak is rank 0."""
        from engine.worker.update_group import init_custom_process_group

        if self.group is not None:  # an engine replica was replaced: the old group lacks it
            await self.client.post(self.url + "/destroy_weights_update_group", json={"group_name": BROADCAST_GROUP})
            import torch.distributed as dist

            dist.destroy_process_group(self.group)
            self.group = None
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        world = 1 + (self.engine_ranks or 1)
        joined = asyncio.ensure_future(self.client.post(self.url + "/init_weights_update_group", json={
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": world,
            "group_name": BROADCAST_GROUP, "backend": "gloo"}))
        self.group = await asyncio.to_thread(init_custom_process_group, "gloo", f"tcp://127.0.0.1:{port}", world, 0,
                                             BROADCAST_GROUP, timeout_s=300, join_timeout_s=JOIN_TIMEOUT_S)
        return (await joined).json()

    async def _by_broadcast(self, version: str) -> dict[str, Any]:
        import torch
        import torch.distributed as dist

        if self.group is None:
            answer = await self.join()
            if not answer.get("success"):
                return answer
        names = list(self.tensors)
        flat = [self.tensors[n].float() for n in names]
        pushed = asyncio.ensure_future(self.client.post(self.url + "/update_weights_from_distributed", json={
            "names": names, "dtypes": ["float32"] * len(names), "shapes": [list(t.shape) for t in flat],
            "group_name": BROADCAST_GROUP, "load_format": "flattened_bucket", "weight_version": version}))
        bucket = torch.cat([t.flatten().view(torch.uint8) for t in flat])
        await asyncio.to_thread(dist.broadcast, bucket, 0, self.group)
        return (await pushed).json()
