"""pause_generation / continue_generation with requests streaming: `abort` ends them with their
partial output, `retract` and `in_place` finish every request exactly once (paused and continued
they equal an uninterrupted run), a weight update while paused shows in the tokens generated after
it, and requests arriving while paused wait (or, with hold_timeout_s, end with EngineHeldError)."""

from __future__ import annotations

import asyncio

import pytest

from engine import EngineConfig, GenerationConfig, Response, pipeline
from engine.async_engine import AsyncEngine
from engine.errors import EngineHeldError
from testing.tiny_checkpoint import DLLM_TEST_LOGIT_SCALE, write_tiny_checkpoint

CONFIG = EngineConfig(max_model_len=512, num_kv_blocks=256, kv_block_size=4, logprobs_mode="raw_logprobs")
LONG = GenerationConfig(max_new_tokens=300, ignore_eos=True, logprobs=0)
PROMPTS = [[5, 9, 13, 22, 7], [77, 3, 120, 9, 41, 8], [200, 1, 2]]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("pause")
    return {
        "ar": str(write_tiny_checkpoint(root / "ar", model_type="qwen3", seed=1, logit_scale=2.0)),
        "ar_new": str(write_tiny_checkpoint(root / "ar_new", model_type="qwen3", seed=2, logit_scale=2.0)),
        "dllm": str(write_tiny_checkpoint(root / "dllm", model_type="sdar", seed=1, logit_scale=DLLM_TEST_LOGIT_SCALE)),
    }


@pytest.fixture(scope="module", params=["ar", "dllm"])
def served(request, ckpts):
    eng = AsyncEngine(ckpts[request.param], CONFIG)
    yield eng, uninterrupted(eng)
    eng.shutdown()


def uninterrupted(eng: AsyncEngine) -> list[Response]:
    async def main():
        return await asyncio.gather(*(collect(eng, p) for p in PROMPTS))

    return asyncio.run(main())


async def collect(eng: AsyncEngine, prompt, params: GenerationConfig = LONG) -> Response:
    return Response.from_chunks([c async for c in eng.generate(prompt, params)])


def streaming_then(eng: AsyncEngine, control) -> tuple[list[list], object]:
    """Stream every prompt; once each has sent a chunk, await `control()`; then wait for every stream."""
    async def main():
        chunks: list[list] = [[] for _ in PROMPTS]
        started = [asyncio.Event() for _ in PROMPTS]

        async def consume(i: int, prompt) -> None:
            async for chunk in eng.generate(prompt, LONG):
                chunks[i].append(chunk)
                started[i].set()

        tasks = [asyncio.ensure_future(consume(i, p)) for i, p in enumerate(PROMPTS)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
        result = await control()
        await asyncio.wait_for(asyncio.gather(*tasks), 300)
        return chunks, result

    return asyncio.run(main())


def assert_same(got: Response, want: Response) -> None:
    assert got.token_ids == want.token_ids
    assert got.step_map == want.step_map
    assert [v for e in got.logprobs for v in e.values()] == pytest.approx(
        [v for e in want.logprobs for v in e.values()], abs=1e-5)


def test_abort_ends_every_request_with_its_partial_output(served):
    eng, reference = served

    async def control():
        return await eng.pause_generation("abort")

    chunks, result = streaming_then(eng, control)
    assert result.requests == len(PROMPTS)
    for got, want in zip(chunks, reference):
        r = Response.from_chunks(got)
        assert r.finish_reason == "abort"
        assert 0 < len(r.token_ids) < LONG.max_new_tokens
        assert r.token_ids == want.token_ids[: len(r.token_ids)]  # the partial output, nothing lost
    assert asyncio.run(eng.run(lambda e: e.has_unfinished())) is False
    asyncio.run(eng.continue_generation())
    assert_same(asyncio.run(collect(eng, PROMPTS[0])), reference[0])


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_paused_and_continued_requests_equal_an_uninterrupted_run(served, mode):
    eng, reference = served

    async def control():
        paused = await eng.pause_generation(mode)
        state = eng.stats()
        await asyncio.sleep(0.3)  # nothing moves while paused
        assert eng.stats().generated_tokens == state.generated_tokens
        assert state.state == "paused"
        if mode == "retract":
            assert (state.load.running, state.load.waiting, state.load.kv_pages_free) == (0, len(PROMPTS), 256)
        await eng.continue_generation()
        return paused

    chunks, paused = streaming_then(eng, control)
    assert paused.requests == len(PROMPTS)  # retracted, or held where they stand
    for got, want in zip(chunks, reference):
        assert sum(c.finished for c in got) == 1 and got[-1].finished  # each ends once, last
        assert_same(Response.from_chunks(got), want)


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_an_update_while_paused_shows_in_the_tokens_after_it(ckpts, mode):
    eng = AsyncEngine(ckpts["ar"], CONFIG)
    try:
        async def control():
            await eng.pause_generation(mode)
            await eng.update_weights_from_disk(ckpts["ar_new"], weight_version="new")
            return await eng.continue_generation()

        chunks, _ = streaming_then(eng, control)
    finally:
        eng.shutdown()
    with pipeline(ckpts["ar_new"], CONFIG) as pipe:
        for prompt, got in zip(PROMPTS, chunks):
            versions = [c.weight_version for c in got]
            assert versions == sorted(versions, key=lambda v: v == "new") and versions[-1] == "new"
            before = Response.from_chunks([c for c in got if c.weight_version == "default"])
            after = Response.from_chunks([c for c in got if c.weight_version == "new"])
            assert len(before.token_ids) + len(after.token_ids) == LONG.max_new_tokens
            assert before.token_ids and after.token_ids
            if mode == "retract":  # K/V recomputed: exactly the new weights' continuation
                want = pipe(prompt + before.token_ids,
                            LONG.model_copy(update={"max_new_tokens": len(after.token_ids)}))
                assert after.token_ids == want.token_ids
                assert [v for e in after.logprobs for v in e.values()] == pytest.approx(
                    [v for e in want.logprobs for v in e.values()], abs=1e-5)


def test_requests_arriving_while_paused_wait_or_are_refused_after_hold_timeout(ckpts):
    eng = AsyncEngine(ckpts["ar"], CONFIG, hold_timeout_s=0.5)
    short = GenerationConfig(max_new_tokens=4, ignore_eos=True)
    try:
        async def main():
            await eng.pause_generation("in_place")
            with pytest.raises(EngineHeldError) as held:
                await collect(eng, PROMPTS[0], short)
            assert held.value.state == "paused" and held.value.retry_after_s == 0.5
            waiting = asyncio.ensure_future(collect(eng, PROMPTS[1], short))
            await asyncio.sleep(0.2)
            await eng.continue_generation()  # before its hold timeout: it is served
            return await waiting

        assert len(asyncio.run(main()).token_ids) == 4
        assert not asyncio.run(eng.run(lambda e: e.has_unfinished()))
        with pytest.raises(ValueError, match="pause_generation takes one of abort, retract, in_place"):
            asyncio.run(eng.pause_generation("stop"))
    finally:
        eng.shutdown()
