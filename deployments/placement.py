"""Where an EngineServer replica goes: its resource requests (rank 0 and each tensor-parallel worker),
its placement-group bundles and strategy, and a check of all that against the cluster's nodes.

Serve never fails a replica whose resources no node can offer: it waits, the application stays
DEPLOYING and an HTTP request hangs. So the application builder checks first (`check_fits`) and
refuses with the resources that are missing.

The ingress replicas go on the head node by default (`INGRESS_ACTOR_OPTIONS`): the head holds the
cluster's GCS and a Serve proxy, so losing a worker node takes only engine replicas, whose requests
end with 503 + Retry-After or an error chunk, never an ingress with requests in flight (which Ray's
proxy would answer with a bare 500).

Strategies for a tensor-parallel group (one placement group per replica, one bundle per rank):
`STRICT_PACK` (the default) puts every rank on one node, as NCCL over NVLink wants; `PACK` lets
Ray spread the bundles over several nodes when one is not enough (gloo on CPU, or NCCL across
nodes over the network).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

Strategy = Literal["STRICT_PACK", "PACK"]

# Resource names Ray accounts for but that are not asked for by count here.
_IGNORED = ("memory", "object_store_memory")

# Ray's resource of the head node (1 unit there, none elsewhere); a sliver of it pins an actor there.
HEAD_NODE = {"node:__internal_head__": 0.001}
INGRESS_ACTOR_OPTIONS = {"num_cpus": 0.5, "resources": HEAD_NODE}


class PlacementError(ValueError):
    """No arrangement of the cluster's nodes can hold what the application asks for."""


def bundle_of(actor_options: Mapping[str, Any]) -> dict[str, float]:
    """The resources an actor with these `ray_actor_options` takes, as a placement-group bundle."""
    bundle = {"CPU": float(actor_options.get("num_cpus", 1))}
    if actor_options.get("num_gpus"):
        bundle["GPU"] = float(actor_options["num_gpus"])
    bundle.update({k: float(v) for k, v in (actor_options.get("resources") or {}).items()})
    return {k: v for k, v in bundle.items() if v > 0}


def actor_resources(bundle: Mapping[str, float]) -> dict[str, Any]:
    """The inverse of bundle_of: actor options that take exactly this bundle."""
    custom = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}
    options: dict[str, Any] = {"num_cpus": bundle.get("CPU", 0), "num_gpus": bundle.get("GPU", 0)}
    return options | ({"resources": custom} if custom else {})


@dataclass(frozen=True)
class Group:
    """What must be placed together: one bundle per rank, on one node (`together`) or not."""

    name: str
    bundles: tuple[dict[str, float], ...]
    together: bool

    def items(self) -> list[dict[str, float]]:
        """The pieces a node must hold at once."""
        return [_sum(self.bundles)] if self.together else list(self.bundles)


def _sum(bundles: Iterable[Mapping[str, float]]) -> dict[str, float]:
    total: dict[str, float] = {}
    for b in bundles:
        for k, v in b.items():
            total[k] = total.get(k, 0.0) + v
    return total


def _fmt(resources: Mapping[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(resources.items())) + "}"


def _fits(need: Mapping[str, float], free: Mapping[str, float]) -> bool:
    return all(free.get(k, 0.0) + 1e-9 >= v for k, v in need.items())


def check_fits(groups: list[Group], nodes: list[dict[str, float]]) -> None:
    """Raise PlacementError unless every group fits on `nodes` (each node's total resources) at once.

    First-fit decreasing: not an optimal packer, but exact for the usual cases (identical
    replicas, or one group too big for any node) and never too strict by more than a bundle."""
    free = [{k: v for k, v in n.items() if k not in _IGNORED} for n in nodes]
    pieces = [(g, p) for g in groups for p in g.items()]
    pieces.sort(key=lambda gp: -sum(gp[1].values()))
    for group, piece in pieces:
        for node in free:
            if _fits(piece, node):
                for k, v in piece.items():
                    node[k] = node.get(k, 0.0) - v
                break
        else:
            raise PlacementError(_explain(group, piece, free, nodes) + _overall(groups, nodes))


def _explain(group: Group, piece: Mapping[str, float], free: list[dict[str, float]],
             nodes: list[dict[str, float]]) -> str:
    where = "on one node" if group.together else "on some node"
    # The node that comes closest (fewest missing units) names what is missing.
    def missing(node: Mapping[str, float]) -> dict[str, float]:
        return {k: v - node.get(k, 0.0) for k, v in piece.items() if node.get(k, 0.0) + 1e-9 < v}

    best = min(free, key=lambda n: sum(missing(n).values())) if free else {}
    gap = missing(best)
    largest = max(nodes, key=lambda n: sum(n.get(k, 0.0) for k in piece), default={})
    hint = (" (placement_strategy: PACK, `blockserve serve --placement-strategy PACK`, lets a tensor-parallel "
            "group span nodes)" if group.together and len(group.bundles) > 1 else "")
    return (f"cannot place {group.name}: it needs {_fmt(piece)} {where}, and with the rest of the application "
            f"placed the best node is missing {_fmt(gap)}; the largest node has "
            f"{_fmt({k: largest.get(k, 0.0) for k in piece})} of those, the cluster has {len(nodes)} node(s)"
            f"{hint}. Lower ray_actor_options / tp_worker_actor_options (`blockserve serve --num-cpus N --num-gpus "
            f"N`: every rank), or add nodes with these resources.")


def _overall(groups: list[Group], nodes: list[dict[str, float]]) -> str:
    need = _sum(b for g in groups for b in g.bundles)
    have = _sum(nodes)
    return (f" The whole application ({', '.join(g.name for g in groups)}) needs {_fmt(need)}; the cluster has "
            f"{_fmt({k: have.get(k, 0.0) for k in need})}.")


def cluster_nodes() -> list[dict[str, float]] | None:
    """The alive nodes' total resources, or None when this process is not connected to Ray."""
    import ray

    if not ray.is_initialized():
        return None
    return [dict(n["Resources"]) for n in ray.nodes() if n.get("Alive")]
