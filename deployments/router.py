"""Prefix-aware routing of requests to EngineServer replicas (Serve's custom request-router API).

A replica's prefix cache only helps the requests that reach it, so requests sharing a prefix (a
system prompt, a few-shot header, a conversation so far) should go to the replica that served
that prefix before, as long as that does not unbalance the load.

This follows the design of Ray Serve LLM's `PrefixCacheAffinityRouter` (match → the replica with
the longest cached prefix if load is balanced; little match → the replica holding the least; load
imbalanced → power of two choices) with two differences:

- it reads our `EngineRequest`s (and for `generate_batch` a list of them; a request dict made by
  hand is read too) instead of Ray Serve LLM's request types, and matches token-id prompts on their ids;
- its state lives in the router itself (one per calling ingress replica), not in a shared tree
  actor, because that router calls `ray.get` on the actor twice per request inside Serve's
  routing event loop, which serializes all routing behind actor round trips. The price: with
  several ingress replicas, each learns the placement of prefixes on its own.

Prefixes are recorded as a hash chain over fixed-size chunks of the key (like the engine's page
hashes): chunk i's hash covers chunks 0..i, so "replica r holds chunk hash h" means it saw that
whole prefix. Each replica's set is an LRU bounded by `max_chunks_per_replica`.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from ray.serve._private.common import ReplicaID
from ray.serve._private.replica_result import ReplicaResult
from ray.serve._private.request_router.common import PendingRequest
from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve._private.request_router.replica_wrapper import RunningReplica

from deployments.wire import EngineRequest


def request_key(request: Any) -> str | tuple[int, ...] | None:
    """What a request's prefix is matched on: its prompt text, or its token ids.

    The ingress sends `EngineRequest`s; a request dict made by hand (`{"prompt": str | list[int], ...}`)
    may also carry its ids as `input_ids`."""
    if isinstance(request, EngineRequest):
        prompt = request.prompt
    elif isinstance(request, dict):
        prompt = request.get("prompt")
        if prompt is None:
            prompt = request.get("input_ids")
    else:
        return None
    if isinstance(prompt, str):
        return prompt or None
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return tuple(prompt)
    return None


def request_keys(pending: PendingRequest | None) -> list[str | tuple[int, ...]]:
    """The keys of every request in a call: one for generate/generate_stream, one per entry of a
    generate_batch list; none for calls without a prompt (stats, health checks)."""
    if pending is None or not pending.args:
        return []
    arg = pending.args[0]
    keys = [request_key(r) for r in (arg if isinstance(arg, list) else [arg])]
    return [k for k in keys if k]


def chunk_hashes(key: str | tuple[int, ...], chunk_chars: int) -> list[int]:
    """Hash chain over the key's full chunks: entry i identifies the prefix key[: (i + 1) * chunk_chars]."""
    hashes, h = [], 0
    for i in range(len(key) // chunk_chars):
        h = hash((h, key[i * chunk_chars:(i + 1) * chunk_chars]))
        hashes.append(h)
    return hashes


class PrefixAffinityRouter(PowerOfTwoChoicesRequestRouter):
    """Route to the replica that holds the longest prefix of the request, load permitting."""

    def initialize_state(self, chunk_chars: int = 16, imbalanced_threshold: int = 8,
                         match_rate_threshold: float = 0.1, max_chunks_per_replica: int = 200_000) -> None:
        """chunk_chars: granularity of prefix matching (characters of a text prompt, or token ids);
        imbalanced_threshold: a replica this many requests busier than the least busy candidate
        is not preferred for its prefix; match_rate_threshold: below this share of the request's
        chunks matched, the request goes to the replica holding the fewest prefixes instead."""
        self.chunk_chars = chunk_chars
        self.imbalanced_threshold = imbalanced_threshold
        self.match_rate_threshold = match_rate_threshold
        self.max_chunks = max_chunks_per_replica
        self.held: dict[ReplicaID, OrderedDict[int, None]] = {}

    # ---- state -----------------------------------------------------------------------------
    def _matched(self, replica_id: ReplicaID, hashes: list[int]) -> int:
        held = self.held.get(replica_id)
        n = 0
        while held is not None and n < len(hashes) and hashes[n] in held:
            n += 1
        return n

    def _record(self, replica_id: ReplicaID, hashes: list[int]) -> None:
        held = self.held.setdefault(replica_id, OrderedDict())
        for h in hashes:
            held[h] = None
            held.move_to_end(h)
        while len(held) > self.max_chunks:
            held.popitem(last=False)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        alive = {r.replica_id for r in replicas}
        for rid in [rid for rid in self.held if rid not in alive]:
            del self.held[rid]

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.held.pop(replica_id, None)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: ReplicaResult) -> None:
        for key in request_keys(pending_request):
            self._record(replica_id, chunk_hashes(key, self.chunk_chars))

    # ---- choice ----------------------------------------------------------------------------
    def _queue_len(self, replica: RunningReplica) -> int:
        return self._replica_queue_len_cache.get(replica.replica_id) or 0

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        """Ranked groups: Serve tries the first group (the least loaded replica in it that has room),
        then the next. The last group is Serve's power-of-two choice."""
        # Serve's own power-of-two round first: FIFO order, locality rounds (same node, same zone,
        # then all) and the backoff between rounds come with it; it is also the fallback group.
        fallback = await super().choose_replicas(candidate_replicas, pending_request)
        if not fallback or not candidate_replicas:
            return fallback
        chains = [chunk_hashes(k, self.chunk_chars) for k in request_keys(pending_request)]
        total = sum(len(c) for c in chains)
        if total == 0:
            return fallback
        least = min(self._queue_len(r) for r in candidate_replicas)
        balanced = [r for r in candidate_replicas if self._queue_len(r) - least <= self.imbalanced_threshold]
        scores = {r.replica_id: sum(self._matched(r.replica_id, c) for c in chains) for r in balanced}
        best = max(scores.values(), default=0)
        if best > 0 and best / total >= self.match_rate_threshold:
            preferred = [r for r in balanced if scores[r.replica_id] == best]
        else:  # a new prefix: to the replica holding the fewest prefixes (spreads them evenly) ...
            fewest = min(len(self.held.get(r.replica_id, ())) for r in balanced)
            lightest = [r for r in balanced if len(self.held.get(r.replica_id, ())) == fewest]
            # ... the same one for every request of this prefix routed before the first is recorded
            first = next(c[0] for c in chains if c)
            preferred = [max(lightest, key=lambda r: hash((first, r.replica_id.unique_id)))]
        return [preferred, *fallback]
