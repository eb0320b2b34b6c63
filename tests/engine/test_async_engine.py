"""AsyncEngine: the step loop on its thread, asyncio streams, cancellation freeing pages."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import pytest

from engine import EngineConfig, GenerationConfig, Response
from engine.async_engine import AsyncEngine
from engine.errors import RequestError
from testing.tiny_checkpoint import DLLM_TEST_LOGIT_SCALE, write_tiny_checkpoint


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("sdar"), model_type="sdar",
                                 logit_scale=DLLM_TEST_LOGIT_SCALE)
    eng = AsyncEngine(str(path), EngineConfig(max_model_len=256, num_kv_blocks=128, kv_block_size=4))
    yield eng
    eng.shutdown()


async def _collect(eng: AsyncEngine, prompt, params) -> Response:
    return Response.from_chunks([c async for c in eng.generate(prompt, params)])


def test_concurrent_requests_equal_sequential_ones(engine):
    params = GenerationConfig(max_new_tokens=12, ignore_eos=True)
    prompts = [[5 + i, 9, 13 + 2 * i] * (i + 1) for i in range(6)]

    async def main():
        together = await asyncio.gather(*(_collect(engine, p, params) for p in prompts))
        alone = [await _collect(engine, p, params) for p in prompts]
        return together, alone

    together, alone = asyncio.run(main())
    assert [(r.token_ids, r.step_map) for r in together] == [(r.token_ids, r.step_map) for r in alone]


def test_callers_on_two_event_loops_each_get_their_requests_whole(engine):
    """One step's chunks go to every caller's loop at once; a caller that folds its chunks (unstreamed)
    gets two of them, with the streamed caller's tokens."""
    params = GenerationConfig(max_new_tokens=10, ignore_eos=True)
    prompts = [[3 + i, 8, 21 - i] for i in range(5)]
    got: dict[bool, list[list]] = {}

    def caller(streamed: bool) -> None:
        async def one(prompt):
            return [c async for c in engine.generate(prompt, params, streamed=streamed)]

        async def main():
            return await asyncio.gather(*(one(p) for p in prompts))

        got[streamed] = asyncio.run(main())

    threads = [threading.Thread(target=caller, args=(streamed,)) for streamed in (True, False)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    streamed, unstreamed = got[True], got[False]
    assert [Response.from_chunks(c).token_ids for c in unstreamed] == [Response.from_chunks(c).token_ids
                                                                       for c in streamed]
    assert all(len(c) == 2 for c in unstreamed) and all(len(c) > 2 for c in streamed)


def _read_first_then_the_rest_once_finished(engine: AsyncEngine, prompt, params, interval_s: float) -> list:
    """A caller that takes the first delta, then comes back only after the engine finished the request."""
    async def main():
        stream = engine.generate(prompt, params, batch_interval_s=interval_s)
        chunks = [await stream.__anext__()]
        while engine.stats().load.running + engine.stats().load.waiting:
            await asyncio.sleep(0.01)
        return chunks + [c async for c in stream]

    return asyncio.run(main())


def test_a_batching_stream_sends_what_came_within_its_interval_as_one_delta(engine):
    """With a batching interval, the chunks that waited for a caller go as one delta, which folds to the
    same result; the first delta goes alone. Without one, each chunk goes as the engine made it."""
    params = GenerationConfig(max_new_tokens=16, ignore_eos=True, return_step_trace=True, logprobs=1)
    plain = _read_first_then_the_rest_once_finished(engine, [4, 9, 2], params, 0.0)
    batched = _read_first_then_the_rest_once_finished(engine, [4, 9, 2], params, 0.05)
    assert len(plain) > 3 and len(batched) == 2 and batched[1].finished

    def output(chunk_or_response) -> dict:  # without what tells two copies of a request apart
        fields = dataclasses.asdict(chunk_or_response)
        return {k: v for k, v in fields.items() if k not in ("request_id", "queue_time_s")}

    assert output(batched[0]) == output(plain[0])
    assert output(Response.from_chunks(batched)) == output(Response.from_chunks(plain))
    assert batched[1].step_trace == [event for c in plain[1:] for event in c.step_trace]


def test_bad_request_raises_before_the_first_chunk_and_engine_keeps_serving(engine):
    async def main():
        with pytest.raises(RequestError) as err:
            await _collect(engine, [10**9], GenerationConfig(max_new_tokens=4))
        assert err.value.param == "input_ids"
        return await _collect(engine, [1, 2, 3], GenerationConfig(max_new_tokens=4, ignore_eos=True))

    assert len(asyncio.run(main()).token_ids) == 4


def test_cancelled_stream_frees_its_pages(engine):
    start = engine.stats().load.kv_pages_free

    async def main():
        stream = engine.generate([1, 2, 3, 4, 5], GenerationConfig(max_new_tokens=200, ignore_eos=True))
        got = 0
        async for chunk in stream:
            got += len(chunk.token_ids)
            if got >= 4:
                break
        await stream.aclose()
        for _ in range(100):
            stats = await engine.run(lambda e: (e.kv.num_free_pages, e.has_unfinished()))
            if stats == (start, False):
                return stats
            await asyncio.sleep(0.05)
        return stats

    assert asyncio.run(main()) == (start, False)
    engine.check_health()


def test_health_check_fails_when_the_loop_is_dead(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "q", model_type="qwen3")
    eng = AsyncEngine(str(path), EngineConfig(max_model_len=64, num_kv_blocks=32, kv_block_size=4))
    eng.check_health()
    eng.shutdown()
    with pytest.raises(RuntimeError):
        eng.check_health()
