"""One iteration of the trainer's loop, and the drills inside it. Each request carries the endings
it may have (`allowed`); anything else is a problem, and a request that never ended is lost."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx

from bench.soak.calls import Outcome, bounded, stream, unary
from bench.soak.probe import app_processes
from bench.soak.settings import SoakSettings
from bench.soak.updates import Updater

PAUSE_MODES = ("abort", "retract", "in_place")
FINISHED = {"stop", "length"}
ENDED = FINISHED | {"abort"}
ANY_END = ENDED | {"error"}


@dataclass
class Iteration:
    index: int
    version: str
    update: str
    outcomes: list[tuple[Outcome, set[str]]] = field(default_factory=list)  # each with its allowed endings
    problems: list[str] = field(default_factory=list)
    faults: list[str] = field(default_factory=list)
    spanned: int = 0  # requests of an in_place drill that ran under two versions (and said so)

    def add(self, outcome: Outcome, allowed: set[str]) -> Outcome:
        self.outcomes.append((outcome, allowed))
        return outcome


class SoakLoop:
    """The trainer's loop against one application (its base URL), one iteration per `run(i)`."""

    def __init__(self, settings: SoakSettings, client: httpx.AsyncClient, url: str, updater: Updater,
                 is_dllm: bool, vocab: int, root: int | None):
        self.s, self.client, self.url, self.updater = settings, client, url, updater
        self.is_dllm, self.vocab = is_dllm, vocab
        self.root = root  # the process that started the Ray cluster, when known (see app_processes)

    def _prompts(self, i: int, count: int) -> list[list[int]]:
        return [[(7 * i + 31 * j + k * 13) % (self.vocab - 10) + 5 for k in range(6 + j % 3)] for j in range(count)]

    def _timeout(self, call: Awaitable[Outcome], kind: str) -> Awaitable[Outcome]:
        return bounded(kind, call, self.s.request_timeout_s)

    async def run(self, i: int) -> Iteration:
        it = Iteration(i, f"soak-{i}", self.updater.kinds[i % len(self.updater.kinds)])
        await self._update(it, it.update, it.version)
        await self._rollouts(it)
        await self._pause_drill(it, PAUSE_MODES[i % len(PAUSE_MODES)])
        await self._leavers(it)
        await self._faults(it)
        return it

    async def _update(self, it: Iteration, kind: str, version: str) -> None:
        """Update to `version`; while an engine replica is being replaced (after a kill drill) the
        update is refused, so it is retried until the application serves again."""
        deadline = time.monotonic() + self.s.request_timeout_s
        while True:
            try:
                answer = await self.updater.update(kind, version)
            except (httpx.HTTPError, RuntimeError) as e:
                answer = {"success": False, "message": f"{type(e).__name__}: {e}"}
            if answer.get("success") and answer.get("weight_version") == version:
                return
            if time.monotonic() > deadline:
                it.problems.append(f"update {kind} to {version!r} failed: {answer}")
                return
            if kind == "broadcast":  # the group may lack a replaced replica: build it again
                await self.updater.join()
            await asyncio.sleep(2.0)

    def _long_body(self, i: int) -> dict[str, Any]:
        """One sample that generates until its token budget (a drill's request)."""
        body = self._rollout_body(i, 1, self.s.drill_tokens)
        body["sampling_params"] |= {"n": 1, "ignore_eos": True}
        return body

    def _rollout_body(self, i: int, prompts: int, max_tokens: int) -> dict[str, Any]:
        body = {"input_ids": self._prompts(i, prompts), "return_logprob": True,
                "sampling_params": {"n": self.s.samples, "max_new_tokens": max_tokens, "temperature": 1.0,
                                    "sampling_seed": i}}
        if self.is_dllm:
            body["return_dllm_replay"] = True
        return body

    async def _rollouts(self, it: Iteration) -> None:
        """n samples per prompt, unary and streamed, then the unary ones scored as trajectories."""
        body = self._rollout_body(it.index, self.s.prompts, self.s.max_tokens)
        u, s = await asyncio.gather(self._timeout(unary(self.client, self.url, body, [it.version], "rollout"),
                                                  "rollout"),
                                    self._timeout(stream(self.client, self.url, body, [it.version], "rollout_stream"),
                                                  "rollout_stream"))
        it.add(u, FINISHED)
        it.add(s, FINISHED)
        if self.is_dllm and u.bodies:
            scoring = self._scoring_body(body["input_ids"], u.bodies)
            it.add(await self._timeout(unary(self.client, self.url, scoring, [it.version], "score"), "score"),
                   FINISHED)

    def _scoring_body(self, prompts: list[list[int]], bodies: list[dict[str, Any]]) -> dict[str, Any]:
        """Score each sample's trajectory (bodies are prompt-major: sample j of prompt i is i * n + j)."""
        trajectories = []
        for b in bodies:
            meta = b["meta_info"]
            trajectories.append({"output_ids": b["output_ids"], "step_map": meta["step_map"],
                                 "replay_token_ids": meta.get("dllm_replay_token_ids"),
                                 "replay_step_maps": meta.get("dllm_replay_step_maps"),
                                 "stop_length": meta.get("dllm_stop_length")})
        return {"input_ids": [prompts[k // self.s.samples] for k in range(len(bodies))],
                "sampling_params": {"max_new_tokens": 0}, "return_logprob": True, "dllm_trajectory": trajectories}

    async def _in_flight(self, it: Iteration, versions: list[str], kind: str, between, allowed: set[str]) -> None:
        """Two long streams and one unary request; once both streams are generating, `between()` runs
        (the pause, the fault); then every request must end with one of `allowed`."""
        body = self._long_body(it.index)
        firsts = [asyncio.Event(), asyncio.Event()]

        def first(e: asyncio.Event):
            async def fire() -> None:
                e.set()
            return fire

        streams = [asyncio.ensure_future(self._timeout(stream(self.client, self.url, body, versions,
                                                              f"{kind}_stream", on_first=first(e)), kind))
                   for e in firsts]
        for task, e in zip(streams, firsts):
            task.add_done_callback(lambda _, e=e: e.set())  # a stream refused or ended early: go on
        tasks = [*streams, asyncio.ensure_future(self._timeout(unary(self.client, self.url, body, versions,
                                                                     f"{kind}_unary"), kind))]
        await asyncio.gather(*(e.wait() for e in firsts))
        await between()
        for outcome in await asyncio.gather(*tasks):
            it.add(outcome, allowed)

    async def _control(self, name: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        return (await self.client.post(f"{self.url}/{name}", json=body or {})).json()

    async def _pause_drill(self, it: Iteration, mode: str) -> None:
        """pause(mode) with requests generating; in_place with an update between pause and continue,
        so its requests ran under two versions and must say so."""
        mid = f"{it.version}-mid"
        versions = [it.version, mid] if mode == "in_place" else [it.version]
        answers: dict[str, Any] = {}

        async def pause_and_continue() -> None:
            answers["pause"] = await self._control("pause_generation", {"mode": mode})
            if mode == "in_place":
                answers["update"] = await self._control("update_weights_from_disk", {
                    "model_path": self.updater.checkpoint, "weight_version": mid})
            answers["continue"] = await self._control("continue_generation")

        allowed = ENDED if mode == "abort" else FINISHED
        start = len(it.outcomes)
        await self._in_flight(it, versions, f"pause_{mode}", pause_and_continue, allowed)
        for name, answer in answers.items():
            if not answer.get("success"):
                it.problems.append(f"pause_{mode}: {name} failed: {answer}")
        if mode == "in_place":  # every request that ran on after the update was paused in place
            it.spanned = sum(mid in (b["meta_info"].get("weight_versions") or [])
                             for o, _ in it.outcomes[start:] for b in o.bodies)
            if answers["pause"].get("requests", 0) < it.spanned:
                it.problems.append(f"pause_in_place answered requests={answers['pause'].get('requests')} "
                                   f"while {it.spanned} requests were paused")
            it.version = mid  # what the engines serve now

    async def _leavers(self, it: Iteration) -> None:
        """A client that hangs up after the first chunk, and a request aborted by its rid."""
        body = self._long_body(it.index)
        await self._timeout(stream(self.client, self.url, body, [it.version], "hang_up", hang_up=True), "hang_up")
        rid = f"soak-{it.index}-rid"

        async def abort() -> None:
            await self._control("abort_request", {"rid": rid})

        it.add(await self._timeout(stream(self.client, self.url, {**body, "rid": rid}, [it.version], "abort_rid",
                                          on_first=abort), "abort_rid"), ENDED)

    async def _faults(self, it: Iteration) -> None:
        s, i = self.s, it.index + 1
        for every, role in ((s.kill_replica_every, "engine"), (s.kill_tp_worker_every, "tp_worker")):
            if every and i % every == 0:
                await self._kill_drill(it, role)
        if s.drop_client_every and i % s.drop_client_every == 0:
            it.faults.append("drop_client")
            await asyncio.to_thread(drop_mid_body, self.url)

    async def _kill_drill(self, it: Iteration, role: str) -> None:
        """Kill one process of `role` (SIGKILL) under requests in flight: they end (an explicit error
        is fine), nothing hangs; the application serves again once Serve replaced what died."""
        victims = [p for p in app_processes(self.s.app, self.root) if p.role == role]
        if not victims:
            it.problems.append(f"kill {role}: no such process of app {self.s.app!r} on this machine")
            return

        async def kill() -> None:
            os.kill(victims[0].pid, signal.SIGKILL)
            it.faults.append(f"killed {role} {victims[0].pid}")

        await self._in_flight(it, [it.version], f"kill_{role}", kill, ANY_END)
        await self._wait_serving(it)
        if self.updater.group is not None:
            await self.updater.join()  # the replacement is not in the broadcast group yet

    async def _wait_serving(self, it: Iteration) -> None:
        deadline = time.monotonic() + self.s.request_timeout_s
        body = {"input_ids": [5, 6, 7], "max_tokens": 2}
        while time.monotonic() < deadline:
            try:
                if (await self.client.post(self.url + "/generate", json=body)).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(1.0)
        it.problems.append("the application did not serve again after a fault")


def drop_mid_body(url: str) -> None:
    """A client that announces a body, sends part of it and disconnects."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port or 80), timeout=30) as sock:
        head = (f"POST {parts.path}/generate HTTP/1.1\r\nHost: {parts.hostname}\r\n"
                "Content-Type: application/json\r\nContent-Length: 4096\r\n\r\n")
        sock.sendall(head.encode() + b'{"input_ids": [5, 6, 7], "max_tok')
