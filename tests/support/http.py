"""What the serve tests send and read over HTTP: Server-Sent Events, requests in flight around a fault,
bodies compared as JSON."""

from __future__ import annotations


def sse_events(lines) -> list:
    """Parse `data: ...` Server-Sent Events lines into JSON objects; "[DONE]" is kept as the string."""
    import json

    events = []
    for line in lines:
        if line.startswith("data: "):
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


async def in_flight_then(url: str, body: dict, fault, headers: dict | None = None) -> tuple[float, list]:
    """Fault drill: two streams and two unary `body` requests in flight; once both streams have sent a
    first event (and 0.2 s more, so the unary ones are in the engine too), run the blocking `fault()` in
    a thread. Returns (seconds from the fault until every request ended, their endings): ("stream",
    events) or ("unary", (status, Retry-After, JSON body))."""
    import asyncio
    import time

    import httpx

    async with httpx.AsyncClient(timeout=120, headers=headers) as client:
        async def stream(first: asyncio.Event) -> tuple[str, object]:
            async with client.stream("POST", url + "/generate", json={**body, "stream": True}) as r:
                assert r.status_code == 200
                lines = []
                async for line in r.aiter_lines():
                    lines.append(line)
                    if line.startswith("data: "):
                        first.set()
            return "stream", sse_events(lines)

        async def unary() -> tuple[str, object]:
            r = await client.post(url + "/generate", json=body)
            return "unary", (r.status_code, r.headers.get("retry-after"), r.json())

        firsts = [asyncio.Event(), asyncio.Event()]
        tasks = [asyncio.ensure_future(stream(e)) for e in firsts] + [asyncio.ensure_future(unary()) for _ in range(2)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in firsts)), 60)
        await asyncio.sleep(0.2)
        await asyncio.to_thread(fault)
        started = time.monotonic()
        done = await asyncio.wait_for(asyncio.gather(*tasks), 60)
        return time.monotonic() - started, done


def without_ids(body: dict) -> dict:
    """A /generate body without its per-request id (two requests never share one)."""
    return {**body, "meta_info": {k: v for k, v in body["meta_info"].items() if k != "id"}}


def close_as_json(got: object, want: object, tol: float, where: str = "body") -> None:
    """Assert two JSON values equal, floats within `tol`. For the same request answered twice: a CPU
    forward's last bits depend on which rows share its batch, and two calls may be batched differently
    (under load, one call's sequences can land in separate steps)."""
    if isinstance(want, float) and isinstance(got, (int, float)) and not isinstance(got, bool):
        assert abs(got - want) <= tol, f"{where}: {got} vs {want}"
    elif isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), f"{where}: keys {got} vs {want}"
        for key in want:
            close_as_json(got[key], want[key], tol, f"{where}.{key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), f"{where}: {got} vs {want}"
        for i, (g, w) in enumerate(zip(got, want)):
            close_as_json(g, w, tol, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: {got!r} vs {want!r}"
