"""A request whose caller waits for the whole result (`streamed=False`) gets two chunks -- the first
that carries tokens and the last -- and they fold to exactly what the step-by-step deltas fold to."""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import pytest

from engine import EngineConfig, GenerationConfig, Response
from engine.carrier import OutputChunk
from engine.core.llm_engine import LLMEngine

PROMPTS = [[5, 9, 13, 2], [7, 7, 3, 11, 4, 8, 1], [2, 30, 12], [9, 9, 4, 17]]
#: the last prompt's rule reveals a random position first, so its first steps may make no token final
RANDOM_FIRST = len(PROMPTS) - 1
#: fields that tell two copies of a request apart without being its output
NOT_OUTPUT = ("request_id", "queue_time_s")


def _params(is_dllm: bool, i: int) -> GenerationConfig:
    dllm = {"return_step_trace": True, "return_block_step_map": True, "return_dllm_replay": True} if is_dllm else {}
    if is_dllm and i == RANDOM_FIRST:
        dllm["dllm_unmasking_strategy"] = "random"
    return GenerationConfig(max_new_tokens=14 + 3 * i, ignore_eos=i != 1, logprobs=2, stop_words=[" zq", "ll"],
                            logprob_start_len=-1 if is_dllm else 0, random_seed=11 + i,
                            do_sample=i == 2, temperature=0.8 if i == 2 else 1.0, **dllm)


def _run(path: str, streamed: bool) -> tuple[list[list[OutputChunk]], bool]:
    """The prompts decoded together, every request streamed or none: each request's chunks. (Two runs
    with the same batches: a request's logprobs may differ in the last bits at another row of a batch.)"""
    engine = LLMEngine(path, EngineConfig(max_model_len=256, num_kv_blocks=128, kv_block_size=4,
                                          logprobs_mode="raw_logprobs"))
    try:
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(prompt, _params(engine.is_dllm, i), str(i), streamed)
        chunks: dict[str, list[OutputChunk]] = defaultdict(list)
        while engine.has_unfinished():
            for chunk in engine.step():
                chunks[chunk.request_id].append(chunk)
        return [chunks[str(i)] for i in range(len(PROMPTS))], engine.is_dllm
    finally:
        engine.shutdown()


def _output(chunks: list[OutputChunk]) -> dict:
    fields = dataclasses.asdict(Response.from_chunks(chunks))
    return {k: v for k, v in fields.items() if k not in NOT_OUTPUT}


@pytest.mark.parametrize("model", ["sdar", "qwen3"])
def test_unstreamed_requests_fold_to_the_streamed_result_from_two_chunks(tiny_checkpoints, model):
    (streamed_runs, is_dllm), (unstreamed_runs, _) = (_run(str(tiny_checkpoints[model]), s) for s in (True, False))
    for streamed, unstreamed in zip(streamed_runs, unstreamed_runs, strict=True):
        assert len(streamed) > 2, "the streamed copy must span several chunks for the comparison to mean anything"
        assert _output(unstreamed) == _output(streamed)
        assert len(unstreamed) == 2 and unstreamed[-1].finished and not unstreamed[0].finished
        # the first chunk is the one that brought the first tokens (time to first token stays visible)
        first_with_tokens = next(c for c in streamed if c.token_ids)
        assert unstreamed[0].token_ids == first_with_tokens.token_ids
        assert unstreamed[0].queue_time_s is not None
        if is_dllm:
            assert _output(streamed)["step_trace"], "the trace must have events for the comparison to mean anything"
    if is_dllm:  # a step that made no token final, whose trace event then waited for the first tokens
        assert not streamed_runs[RANDOM_FIRST][0].token_ids and streamed_runs[RANDOM_FIRST][0].step_trace
