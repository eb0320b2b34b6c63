"""The soak's HTTP requests and what each must show: every sample ends with a finish reason or an
explicit error, and names the weight versions it ran under, in order."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from deployments.sglang.serving import merge_generate_deltas


@dataclass
class Outcome:
    """One request (one or many samples): how each sample ended and what was wrong with it."""

    kind: str
    latency_s: float = 0.0
    endings: list[str] = field(default_factory=list)  # per sample: stop | length | abort | error | lost
    problems: list[str] = field(default_factory=list)  # version mismatches
    errors: list[str] = field(default_factory=list)  # what the explicit errors (and lost requests) said
    bodies: list[dict[str, Any]] = field(default_factory=list)  # final body per sample, index order


def _ending(meta: dict[str, Any] | None) -> str:
    reason = (meta or {}).get("finish_reason")
    return reason["type"] if isinstance(reason, dict) and reason.get("type") else "lost"


def check_versions(kind: str, chunks: list[dict[str, Any]], final: dict[str, Any],
                   versions: list[str]) -> list[str]:
    """A sample's chunks each name one of `versions` (the ones it may have run under, in order),
    never going back; its final body lists the versions it ran under, the last one as
    `weight_version`; a sample no update touched ran under exactly one."""
    meta = final["meta_info"]
    listed, last = meta.get("weight_versions"), meta.get("weight_version")
    if meta["finish_reason"] and meta["finish_reason"].get("type") == "error":
        return []  # a sample that failed says so; its versions are not a promise
    problems = []
    seen = [c["meta_info"].get("weight_version") for c in chunks]
    order = [versions.index(v) if v in versions else -1 for v in seen]
    if -1 in order or order != sorted(order):
        problems.append(f"{kind}: chunk versions {seen} outside or out of the order {versions}")
    if not listed or listed[-1] != last:
        problems.append(f"{kind}: weight_versions {listed} does not end with weight_version {last!r}")
    elif [v for v in versions if v in listed] != listed or not set(seen) <= set(listed):
        problems.append(f"{kind}: weight_versions {listed} vs chunks {seen} and possible {versions}")
    elif len(versions) == 1 and listed != versions:
        problems.append(f"{kind}: weight_versions {listed}, expected {versions}")
    return problems


def _final(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """The whole body of one sample's stream: the last chunk of a cumulative stream, the
    concatenation of an incremental one."""
    last = chunks[-1]
    cumulative = len(chunks) == 1 or last["meta_info"].get("completion_tokens") == len(last["output_ids"])
    return last if cumulative else merge_generate_deltas(chunks)


async def unary(client: httpx.AsyncClient, url: str, body: dict[str, Any], versions: list[str],
                kind: str = "unary") -> Outcome:
    out = Outcome(kind)
    start = time.monotonic()
    r = await client.post(url + "/generate", json=body)
    out.latency_s = time.monotonic() - start
    if r.status_code != 200:
        out.endings.append("error")
        out.errors.append(f"{kind}: HTTP {r.status_code}: {r.text[:200]}")
        return out
    answer = r.json()
    out.bodies = answer if isinstance(answer, list) else [answer]
    for b in out.bodies:
        out.endings.append(_ending(b["meta_info"]))
        out.problems += check_versions(kind, [b], b, versions)
    return out


async def stream(client: httpx.AsyncClient, url: str, body: dict[str, Any], versions: list[str], kind: str = "stream",
                 on_first: Callable[[], Awaitable[None]] | None = None, hang_up: bool = False) -> Outcome:
    """Stream `body`; `on_first` runs once the first chunk is in; `hang_up` closes the connection then
    (a client leaving mid-stream: nothing to check but that the server frees the request)."""
    out = Outcome(kind)
    start = time.monotonic()
    chunks: dict[int, list[dict[str, Any]]] = {}
    done = False
    async with client.stream("POST", url + "/generate", json={**body, "stream": True}) as r:
        if r.status_code != 200:
            out.endings.append("error")
            out.errors.append(f"{kind}: HTTP {r.status_code}: {(await r.aread())[:200]!r}")
            return out
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            payload = line[len("data: "):]
            if payload == "[DONE]":
                done = True
                continue
            event = json.loads(payload)
            first = not chunks
            chunks.setdefault(event.get("index", 0), []).append(event)
            if first and on_first is not None:
                await on_first()
            if first and hang_up:
                out.latency_s = time.monotonic() - start
                return out
    out.latency_s = time.monotonic() - start
    for index in sorted(chunks):
        final = _final(chunks[index])
        out.bodies.append(final)
        out.endings.append(_ending(final["meta_info"]) if done else "lost")
        out.problems += check_versions(f"{kind}[{index}]", chunks[index], final, versions)
    if not chunks:
        out.endings.append("lost")
    return out


async def bounded(kind: str, call: Awaitable[Outcome], timeout_s: float) -> Outcome:
    """A request that has not ended within `timeout_s` has hung: it counts as lost. A connection the
    server broke counts as lost too (the ingress answers every request it accepted)."""
    try:
        return await asyncio.wait_for(call, timeout_s)
    except (asyncio.TimeoutError, httpx.HTTPError) as e:
        return Outcome(kind, endings=["lost"], errors=[f"{kind}: {type(e).__name__}: {e}"])
