"""EngineServer's protocol in-process (no Ray): what the ingress relies on when requests are cancelled
at any moment (client disconnects)."""

from __future__ import annotations

import asyncio

import pytest

from configs import GenerationConfig
from deployments.engine_server import EngineServer
from deployments.wire import EngineRequest, Rejection
from engine.carrier import OutputChunk, Response
from tests.support.ray_env import SERVE_ENGINE


def request(i: int, **params) -> EngineRequest:
    return EngineRequest(prompt="Hello there", params=GenerationConfig(**params).model_dump(), request_id=f"r{i}")


def test_cancelling_at_any_point_never_kills_the_engine_or_leaks_pages(tiny_checkpoints):
    server = EngineServer.func_or_class(str(tiny_checkpoints["sdar"]), SERVE_ENGINE)
    try:
        async def main() -> None:
            free = server.stats().engine.load.kv_pages_free
            for i in range(48):  # cancel while the add is queued, while it runs, and mid-stream
                stream = server.generate_stream(request(i, max_new_tokens=200, ignore_eos=True))
                task = asyncio.ensure_future(stream.__anext__())
                if i % 3 == 2:
                    await asyncio.sleep(0.005 * (i % 5))
                else:
                    for _ in range(i % 3):
                        await asyncio.sleep(0)
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                await stream.aclose()
            for _ in range(200):
                s = server.stats().engine.load
                if s.running + s.waiting == 0:
                    break
                await asyncio.sleep(0.02)
            server.check_health()
            assert (s.running, s.waiting, s.kv_pages_free) == (0, 0, free)
            (out,) = await server.generate_batch([request(99, max_new_tokens=8)])
            assert isinstance(out, Response)
            assert out.finish_reason == "length" and len(out.token_ids) == len(out.step_map) == 8

        asyncio.run(main())
    finally:
        server.__del__()


def test_refusals_are_rejections_in_the_endpoint_names(tiny_checkpoints):
    server = EngineServer.func_or_class(str(tiny_checkpoints["qwen3"]), SERVE_ENGINE)
    try:
        async def main() -> None:
            too_long = EngineRequest(prompt="Hi", params=GenerationConfig(max_new_tokens=10**5).model_dump(),
                                     request_id="a", rename={"max_new_tokens": "max_tokens"})
            (item,) = await server.generate_batch([too_long])
            assert isinstance(item, Rejection) and item.status == 400 and item.param == "max_tokens"
            assert "max_tokens" in item.message and "max_new_tokens" not in item.message
            items = [i async for i in server.generate_stream(too_long)]
            assert items == [item]
            # a request made by hand (a dict of EngineRequest's fields) is answered the same
            assert [i async for i in server.generate_stream(too_long.model_dump())] == [item]

        asyncio.run(main())
    finally:
        server.__del__()


def test_a_caller_whose_event_loop_closed_mid_stream_does_not_kill_the_engine(tiny_checkpoints):
    server = EngineServer.func_or_class(str(tiny_checkpoints["qwen3"]), SERVE_ENGINE)
    try:
        async def first_delta(i: int) -> OutputChunk:
            stream = server.generate_stream(request(i, max_new_tokens=300, ignore_eos=True))
            return await stream.__anext__()  # left open: asyncio.run closes the loop under it

        for i in range(4):
            assert asyncio.run(first_delta(i)).finish_reason is None
        for _ in range(200):
            s = server.stats().engine.load
            if s.running + s.waiting == 0:
                break
            asyncio.run(asyncio.sleep(0.02))
        server.check_health()
        assert s.running + s.waiting == 0 and s.kv_pages_free == s.kv_pages_total
        (out,) = asyncio.run(server.generate_batch([request(9, max_new_tokens=4)]))
        assert len(out.token_ids) == 4
    finally:
        server.__del__()


def test_a_unary_request_folds_to_its_stream_and_still_times_its_first_token(tiny_checkpoints):
    """The engine sends a unary request's first tokens and its end only; the result is the stream's
    fold, and the replica's time-to-first-token histogram still sees it."""
    server = EngineServer.func_or_class(str(tiny_checkpoints["sdar"]), SERVE_ENGINE)

    def observed(name: str) -> float:
        return server.metrics.registry.get_sample_value(f"{name}_count") or 0.0

    try:
        params = {"max_new_tokens": 16, "ignore_eos": True, "return_step_trace": True, "logprobs": 1}

        async def main() -> tuple[Response, Response]:
            streamed = [c async for c in server.generate_stream(request(1, **params))]
            (unary,) = await server.generate_batch([request(2, **params)])
            return Response.from_chunks(streamed), unary

        timings = ("blockserve_time_to_first_token_seconds", "blockserve_time_per_output_token_seconds")
        before = [observed(name) for name in timings]
        streamed, unary = asyncio.run(main())
        assert isinstance(unary, Response) and unary.finish_reason == "length"
        assert (unary.text, unary.token_ids, unary.step_map, unary.logprobs, unary.step_trace) == \
            (streamed.text, streamed.token_ids, streamed.step_map, streamed.logprobs, streamed.step_trace)
        assert [observed(name) - b for name, b in zip(timings, before)] == [2, 2]
    finally:
        server.__del__()


def test_a_bug_while_a_request_runs_ends_that_request_alone_with_what_it_had(tiny_checkpoints):
    """An unexpected exception in the replica's code for one request, after its first delta: that request
    ends with a finish_reason "error" delta carrying its lengths so far (unary: a Response with the error),
    its batch mates finish normally, and the engine keeps serving."""
    server = EngineServer.func_or_class(str(tiny_checkpoints["sdar"]), SERVE_ENGINE)
    make_timer, made = server.metrics.timer, []

    class BrokenOnItsSecondChunk:
        def __init__(self):
            self.inner, self.seen = make_timer(), 0

        def chunk(self, *args):
            self.seen += 1
            if self.seen == 2:
                raise RuntimeError("a bug in the replica")
            self.inner.chunk(*args)

    def timer():  # the first request of each call below gets the broken timer
        made.append(1)
        return BrokenOnItsSecondChunk() if len(made) in (1, 2) else make_timer()

    server.metrics.timer = timer
    try:
        params = {"max_new_tokens": 16, "ignore_eos": True}

        async def main():
            streamed = [c async for c in server.generate_stream(request(1, **params))]
            unary = await server.generate_batch([request(2, **params), request(3, **params)])
            return streamed, unary

        streamed, (broken, fine) = asyncio.run(main())
        first, last = streamed
        assert first.finish_reason is None and first.token_ids
        assert (last.finish_reason, last.token_ids) == ("error", [])
        assert "RuntimeError: a bug in the replica" in last.error
        assert (last.input_token_len, last.generate_token_len) == (first.input_token_len, first.generate_token_len)
        assert isinstance(broken, Response) and broken.finish_reason == "error" and "a bug" in broken.error
        assert broken.token_ids and len(broken.token_ids) < 16  # its first tokens, then the error
        assert isinstance(fine, Response) and fine.finish_reason == "length" and len(fine.token_ids) == 16
        server.check_health()
    finally:
        server.__del__()


def test_stream_batching_gathers_the_deltas_that_waited_and_refuses_a_negative_interval(tiny_checkpoints):
    """`stream_batching_interval_ms`: a stream whose reader comes back only once the request finished gets
    the rest as one delta (the first went alone), folding to the unary result; a unary call is not
    batched; the app refuses a negative interval."""
    from pydantic import ValidationError

    from deployments.app import AppArgs

    with pytest.raises(ValidationError, match="stream_batching_interval_ms"):
        AppArgs(model="m", stream_batching_interval_ms=-1)
    server = EngineServer.func_or_class(str(tiny_checkpoints["sdar"]), SERVE_ENGINE, stream_batching_interval_ms=50)
    try:
        params = {"max_new_tokens": 16, "ignore_eos": True, "return_step_trace": True}

        async def main() -> tuple[list[OutputChunk], Response]:
            stream = server.generate_stream(request(1, **params))
            deltas = [await stream.__anext__()]
            while (load := server.stats().engine.load).running + load.waiting:
                await asyncio.sleep(0.01)
            deltas += [d async for d in stream]
            (unary,) = await server.generate_batch([request(2, **params)])
            return deltas, unary

        deltas, unary = asyncio.run(main())
        assert len(deltas) == 2 and deltas[1].finish_reason == "length"
        folded = Response.from_chunks(deltas)
        assert (folded.token_ids, folded.step_map, folded.step_trace, folded.text) == \
            (unary.token_ids, unary.step_map, unary.step_trace, unary.text)
    finally:
        server.__del__()
