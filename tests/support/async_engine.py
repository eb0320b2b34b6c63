"""Driving an AsyncEngine from a test, with ordering forced, never timed: a command that blocks the engine
loop holds it while the awaitables given are queued behind it in that order (commands run in arrival
order)."""

from __future__ import annotations

import asyncio
import threading

from engine import GenerationConfig, Response
from engine.async_engine import AsyncEngine


def run(coro):
    return asyncio.run(coro)


async def collect(eng: AsyncEngine, prompt: list[int], params: GenerationConfig) -> Response:
    return Response.from_chunks([c async for c in eng.generate(prompt, params)])


async def queue_in_order(eng: AsyncEngine, *steps):
    """Block the engine loop, queue each awaitable's command in the given order, then let the loop
    go; returns the results in order."""
    gate = threading.Event()
    blocker = asyncio.ensure_future(eng.run(lambda _: gate.wait()))
    tasks = []
    for step in steps:
        tasks.append(asyncio.ensure_future(step))
        await asyncio.sleep(0)  # the task runs up to its first wait: its command is queued
    gate.set()
    await blocker
    return await asyncio.gather(*tasks, return_exceptions=True)
