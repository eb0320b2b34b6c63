"""DiffusionGemma served on the `triton` attention backend (the project's kernel in its passes mode,
under Triton's interpreter) against transformers' `generate()`: the seeded requests of test_diffusion_gemma_decoding.py
(tests/support/gemma_decoding.py) -- one seed for each prompt length of 1, 9 and 40 tokens (40 crosses
the tiny sliding window), 40 new tokens -- in one batch of 3, and another alone: the same tokens,
settle-step maps and steps per canvas. A module of its own so that the suite's workers
run it beside the torch backend's tests (the interpreter is slow)."""

from __future__ import annotations

import pytest

from bench.diffusion_gemma import converging_checkpoint
from tests.support.gemma_decoding import (
    CANVAS,
    PROBE,
    PROMPT_LENGTHS,
    SEEDS,
    check_response,
    make_engine,
    params,
    probe_among_others,
    run,
    transformers_oracle,
)

pytest.importorskip("transformers.models.diffusion_gemma")


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    engine = make_engine(converging_checkpoint(tmp_path_factory.mktemp("dg") / "tiny", CANVAS),
                     attention_backend="triton", num_kv_blocks=1024)
    assert engine.executor.runner.backend.name == "triton"
    return engine


# every prompt length, each with its own seed: (0, 1), (1, 9), (2, 40); the interpreter is slow, and the
# torch backend's tests run all fifteen pairs of seed and length, alone and among others
BATCH = [(seed, PROMPT_LENGTHS[seed]) for seed in SEEDS[:3]]


@pytest.fixture(scope="module")
def oracle(engine):
    return transformers_oracle(engine.spec.path, engine.spec.vocab_size, pairs=[*BATCH, PROBE])


def test_three_seeded_requests_in_one_batch_give_transformers_tokens(engine, oracle):
    results = run(engine, {f"{seed}-{length}": (oracle[seed, length]["prompt"],
                                                params(max_new_tokens=40, random_seed=seed))
                           for seed, length in BATCH})
    for seed, length in BATCH:
        check_response(results[f"{seed}-{length}"], oracle[seed, length], 40)


def test_a_request_alone(engine, oracle):
    check_response(run(engine, probe_among_others(oracle, 1))["probe"], oracle[PROBE], 40)
