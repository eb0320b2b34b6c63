"""RL control across the engine replicas: every call is broadcast to every EngineServer replica, one
call at a time; a weight update is a two-phase commit (stage everywhere, then commit everywhere or
discard everywhere), so a refusal on any replica leaves all of them on the old weights."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from deployments.errors import ApiError, ControlError, parse, unavailable
from deployments.rl.protocol import (
    CONTROL_OPS,
    InitWeightsUpdateGroupRequest,
    UpdateWeightsFromTensorRequest,
    WeightUpdate,
)
from deployments.wire import ControlAnswer, ReplicaStats

# Call `method(*args)` on every running EngineServer replica: (method, *args, timeout_s=...,
# return_exceptions=...) -> each replica's answer.
Broadcast = Callable[..., Awaitable[list[Any]]]
# A control broadcast may wait for the trainer (a weight broadcast, a group rendezvous) as long as the
# engine does (EngineServer's `weight_op_timeout_s`), plus this margin.
CONTROL_MARGIN_S = 60.0


def _failed(answer: ControlAnswer | BaseException) -> ControlAnswer | None:
    """A replica's control answer if it failed (an exception from the broadcast counts), else None."""
    if isinstance(answer, BaseException):
        return ControlAnswer(False, f"{type(answer).__name__}: {answer}")
    return None if answer.success else answer


def _refusal_message(what: str, failed: list[ControlAnswer]) -> str:
    return f"{what}: " + "; ".join(f"replica {'?' if a.rank is None else a.rank}: {a.message}" for a in failed)


def _status(failed: list[ControlAnswer]) -> int:
    """400 when every failing replica refused the input, 500 when one of them failed."""
    return 400 if all(a.refused for a in failed) else 500


class ReplicaControl:
    """Runs SGLang's RL control calls on every engine replica of the application."""

    def __init__(self, broadcast: Broadcast, op_timeout_s: Callable[[], Awaitable[float]]):
        self._broadcast = broadcast
        self._op_timeout_s = op_timeout_s
        self._lock = asyncio.Lock()  # one RL control operation at a time (per ingress replica)

    async def _all(self, method: str, *args: Any) -> list[Any]:
        timeout_s = await self._op_timeout_s() + CONTROL_MARGIN_S
        return await self._broadcast(method, *args, timeout_s=timeout_s, return_exceptions=True)

    async def run(self, name: str, body: Any) -> dict[str, Any]:
        """Run one RL control call (SGLang's name and payload) on every engine replica, as its row of
        CONTROL_OPS says: its answer `{"success": true, "message", ...}`, or ControlError."""
        op = CONTROL_OPS[name]
        try:
            req = parse(op.request, {} if body is None else body)
            async with self._lock:
                if op.reach == "update":
                    return await self._update_weights(req)
                if op.reach == "join":
                    return await self._init_group(req)
                return await self._everywhere(name, req.model_dump())
        except ApiError as e:
            raise ControlError(e.message, e.param, e.status, e.type, e.retry_after_s) from None

    async def _everywhere(self, name: str, kwargs: dict[str, Any]) -> dict[str, Any]:
        answers = await self._all("control", name, kwargs)
        if not answers:
            raise unavailable()
        failed = [a for a in map(_failed, answers) if a is not None]
        if failed:
            raise ApiError(_refusal_message(f"{name} failed on {len(failed)} of {len(answers)} engine replicas",
                                            failed), None, _status(failed), "control_failed")
        out: dict[str, Any] = {"success": True, "message": f"{answers[0].message} ({len(answers)} replicas)",
                               "num_replicas": len(answers)}
        counts = [a.requests for a in answers if a.requests is not None]
        if counts:  # an operation on requests (pause_generation): how many it touched
            out["requests"] = sum(counts)
        return out

    async def _init_group(self, req: InitWeightsUpdateGroupRequest) -> dict[str, Any]:
        """Every replica joins the trainer's group; replica r's TP ranks at rank_offset + r * tp + tp_rank."""
        stats: list[ReplicaStats] = await self._broadcast("stats",
                                                          timeout_s=await self._op_timeout_s() + CONTROL_MARGIN_S)
        if not stats:
            raise unavailable()
        replicas, tp = len(stats), stats[0].tp
        if req.world_size != req.rank_offset + replicas * tp:
            raise ApiError(f"world_size={req.world_size}: {replicas} engine replicas of tp={tp} join at ranks "
                           f"{req.rank_offset}..{req.rank_offset + replicas * tp - 1}, so the group's world_size is "
                           f"rank_offset + replicas * tp = {req.rank_offset + replicas * tp}", "world_size")
        answers = await self._all("init_weights_update_group", req.master_address, req.master_port,
                                  req.rank_offset, req.world_size, req.group_name, req.backend, req.timeout_s)
        failed = [a for a in map(_failed, answers) if a is not None]
        if failed:
            raise ApiError(_refusal_message("init_weights_update_group failed", failed), None, _status(failed),
                           "control_failed")
        ranks = sorted(r for a in answers for r in a.ranks)
        return {"success": True, "message": f"joined weight update group {req.group_name!r} at ranks {ranks}",
                "ranks": ranks, "num_replicas": len(answers)}

    async def _update_weights(self, req: WeightUpdate) -> dict[str, Any]:
        """All or nothing across replicas: stage on every replica; commit on every replica only if all
        staged, else discard everywhere and answer 400 naming the refusal. A broadcast source is
        received by every replica either way (the trainer's collective completes)."""
        if isinstance(req, UpdateWeightsFromTensorRequest) and (req.serialized_named_tensors is not None
                                                                or req.named_tensors is None):
            raise ApiError("update_weights_from_tensor takes `named_tensors` ([[name, torch.Tensor], ...], or "
                           "ray.put() of that list so the tensors go straight to the engine replicas) through "
                           "the Serve handle: serve.get_app_handle(app).update_weights_from_tensor.remote({...}); "
                           "serialized (pickled) tensors over HTTP are not accepted", "named_tensors")
        update_id = uuid.uuid4().hex
        staged = await self._all("stage_weights", update_id, req)
        if not staged:
            raise unavailable()
        refused = [a for a in map(_failed, staged) if a is not None]
        if refused:
            await self._all("discard_weights", update_id)
            raise ApiError(_refusal_message(f"weight update refused ({len(refused)} of {len(staged)} engine "
                                            "replicas); every replica keeps its weights", refused), None, 400,
                           "weight_update_refused")
        committed = await self._all("commit_weights", update_id, req.weight_version, req.abort_all_requests)
        failed = [a for a in map(_failed, committed) if a is not None]
        if failed:  # past the point of no return: say exactly where the new weights are not
            raise ApiError(_refusal_message(f"weight update committed on {len(committed) - len(failed)} of "
                                            f"{len(committed)} engine replicas only", failed), None, 500,
                           "internal_error")
        versions = sorted({a.weight_version for a in committed})
        version = versions[0] if len(versions) == 1 else versions
        return {"success": True, "message": f"weights updated to version {version!r} on {len(committed)} replicas",
                "weight_version": version, "num_replicas": len(committed)}
