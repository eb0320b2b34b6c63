"""The carrier: OutputChunk / Response are plain picklable data; streamed deltas
concatenate exactly to the unary Response; None (not requested) and [] (requested, empty) never mix."""

from __future__ import annotations

import json
import pickle

import pytest
import torch

from engine import EngineConfig, GenerationConfig, OutputChunk, Response, pipeline

BUILTIN = (str, int, float, bool, type(None))


def assert_plain(value, where="value"):
    """Only built-in types all the way down (no tensors, no numpy): safe for Ray, pickle and JSON."""
    if isinstance(value, BUILTIN):
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            assert_plain(v, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for k, v in value.items():
            assert isinstance(k, (str, int)), f"{where} key {k!r}"
            assert_plain(v, f"{where}[{k!r}]")
        return
    raise AssertionError(f"{where} is a {type(value).__name__}, not plain data")


@pytest.fixture(scope="module")
def ar_pipe(ar_ckpt):
    with pipeline(ar_ckpt, EngineConfig(logprobs_mode="raw_logprobs", kv_block_size=4)) as pipe:
        yield pipe


@pytest.fixture(scope="module")
def dllm_pipe(dllm_ckpt):
    with pipeline(dllm_ckpt, EngineConfig(logprobs_mode="raw_logprobs", kv_block_size=4, dllm_block_length=4)) as pipe:
        yield pipe


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def without_id(r: Response) -> Response:
    r.request_id = None
    return r


def fields(obj) -> dict:
    d = obj.to_dict()
    d.pop("request_id", None)
    d.pop("queue_time_s", None)  # a measurement of this run, not part of the output
    return d


# ---- pickling ---------------------------------------------------------------------------------


def test_handmade_chunk_and_response_round_trip():
    chunk = OutputChunk(request_id="r1", text="hé", token_ids=[1, 2], step_map=[1, 1],
                        logprobs=[{1: -0.5, 7: -1.0}, {2: -0.1}], input_token_logprobs=[(-1.5, 3)],
                        input_top_logprobs=[[(-1.0, 4), (-1.5, 3)]],
                        step_trace=[{"step": 1, "positions": [0, 1], "token_ids": [1, 2]}],
                        finish_reason="stop", error=None, input_token_len=3, generate_token_len=2)
    again = pickle.loads(pickle.dumps(chunk))
    assert again == chunk and type(again) is OutputChunk
    resp = Response.from_chunks([chunk])
    assert pickle.loads(pickle.dumps(resp)) == resp
    assert_plain(chunk.to_dict())
    assert_plain(resp.to_dict())
    json.dumps(resp.to_dict())  # JSON-serialisable (int dict keys become strings)


def test_none_and_empty_are_preserved_when_folding():
    a = OutputChunk(request_id="r", logprobs=[], step_map=None)
    b = OutputChunk(request_id="r", logprobs=[], step_map=None, finish_reason="length")
    r = Response.from_chunks([a, b])
    assert r.logprobs == [] and r.step_map is None and r.input_token_logprobs is None
    r2 = Response.from_chunks([OutputChunk(request_id="r"), OutputChunk(request_id="r", finish_reason="stop")])
    assert r2.logprobs is None and r2.step_trace is None and r2.finish_reason == "stop"


@pytest.mark.parametrize("model", ["ar", "dllm"])
def test_real_outputs_pickle_round_trip(ar_pipe, dllm_pipe, model):
    pipe = ar_pipe if model == "ar" else dllm_pipe
    gen = GenerationConfig(max_new_tokens=7, ignore_eos=True, logprobs=2, return_step_trace=True)
    chunks = list(pipe.stream(prompt(6, 1), gen))
    for c in chunks:
        assert_plain(c.to_dict(), "chunk")
        assert pickle.loads(pickle.dumps(c)) == c
    resp = pipe(prompt(6, 1), gen)
    assert_plain(resp.to_dict(), "response")
    assert pickle.loads(pickle.dumps(resp)) == resp


# ---- streaming == unary -----------------------------------------------------------------------

CASES = {
    "plain": dict(max_new_tokens=9, ignore_eos=True),
    "logprobs": dict(max_new_tokens=9, ignore_eos=True, logprobs=3),
    "logprobs0": dict(max_new_tokens=6, ignore_eos=True, logprobs=0),
    "sampled": dict(max_new_tokens=9, ignore_eos=True, do_sample=True, random_seed=5, logprobs=1),
    "trace": dict(max_new_tokens=9, ignore_eos=True, return_step_trace=True),
    "input_rows": dict(max_new_tokens=4, ignore_eos=True, logprob_start_len=2, logprobs=2),
    "scoring": dict(max_new_tokens=0, logprob_start_len=1, logprobs=2),
}


AR_ONLY = ("input_rows", "scoring")  # input-token logprobs are AR only


@pytest.mark.parametrize(("model", "case"), [(m, c) for m in ("ar", "dllm") for c in CASES
                                             if m == "ar" or c not in AR_ONLY])
def test_stream_concatenates_to_unary(ar_pipe, dllm_pipe, model, case):
    pipe = ar_pipe if model == "ar" else dllm_pipe
    gen = GenerationConfig(**CASES[case])
    ids = prompt(11, 2)
    unary = pipe(ids, gen)
    chunks = list(pipe.stream(ids, gen))
    assert chunks, "a stream yields at least its final chunk"
    assert all(c.finish_reason is None for c in chunks[:-1]) and chunks[-1].finish_reason is not None
    assert len({c.request_id for c in chunks}) == 1
    streamed = Response.from_chunks(chunks)
    assert fields(streamed) == fields(unary)

    # None vs []: every chunk follows the rule of the whole response
    is_dllm = model == "dllm"
    want_logprobs = gen.logprobs is not None
    for c in chunks:
        assert (c.logprobs is not None) == want_logprobs
        assert (c.step_map is not None) == is_dllm
        assert (c.step_trace is not None) == (is_dllm and gen.return_step_trace)
        if c.logprobs is not None:
            assert len(c.logprobs) == len(c.token_ids)
        if c.step_map is not None:
            assert len(c.step_map) == len(c.token_ids)
    assert (unary.logprobs is None) == (not want_logprobs)
    assert (unary.step_map is None) == (not is_dllm)
    assert (unary.input_token_logprobs is None) == (gen.logprob_start_len < 0)
    if unary.logprobs is not None:
        assert len(unary.logprobs) == len(unary.token_ids)
    assert unary.generate_token_len == len(unary.token_ids)
    assert unary.input_token_len == len(ids)
    if case == "scoring":
        assert unary.logprobs == [] and unary.token_ids == [], "requested but empty stays []"
        assert len(unary.input_token_logprobs) == len(ids) - 2
    if gen.max_new_tokens >= 9 and case != "scoring":
        assert len(chunks) > 2, "tokens should be streamed as they are produced"


def test_dllm_step_trace_events(dllm_pipe):
    gen = GenerationConfig(max_new_tokens=10, ignore_eos=True, return_step_trace=True)
    ids = prompt(6, 3)
    chunks = list(dllm_pipe.stream(ids, gen))
    resp = Response.from_chunks(chunks)
    events = resp.step_trace
    assert events and [e["step"] for e in events] == sorted({e["step"] for e in events})
    revealed = {}
    for e in events:
        assert set(e) == {"step", "positions", "token_ids"}
        for p, t in zip(e["positions"], e["token_ids"], strict=True):
            assert p not in revealed, "a position is unmasked once"
            revealed[p] = (t, e["step"])
    assert sorted(revealed) == list(range(len(resp.token_ids)))
    assert [revealed[p][0] for p in range(len(resp.token_ids))] == resp.token_ids
    assert [revealed[p][1] for p in range(len(resp.token_ids))] == resp.step_map
    # each step's event travels in its own chunk, as soon as the step finishes (not at block end)
    with_events = [c for c in chunks if c.step_trace]
    assert all(len(c.step_trace) == 1 for c in with_events) and len(with_events) == len(events)


def test_stream_with_stop_word_text_matches_unary(ar_pipe):
    """Stop words may span chunks: text held back while it could still become a stop word."""
    ids = prompt(9, 4)
    ref = ar_pipe(ids, GenerationConfig(max_new_tokens=20, ignore_eos=True))
    tok = ar_pipe.tokenizer
    words = [tok.decode(ref.token_ids[j : j + 3]) for j in range(4, 15)]
    word = next((w for w in words if w.isprintable() and len(w) >= 3), None)
    if word is None:
        pytest.skip("no printable 3-token span in this output")
    for include in (False, True):
        gen = GenerationConfig(max_new_tokens=20, ignore_eos=True, stop_words=[word],
                               include_stop_str_in_output=include)
        unary = ar_pipe(ids, gen)
        chunks = list(ar_pipe.stream(ids, gen))
        assert fields(Response.from_chunks(chunks)) == fields(unary)
        assert unary.finish_reason == "stop"
        assert unary.text.endswith(word) == include
        assert "".join(c.text for c in chunks) == unary.text


def test_stream_with_stop_id_matches_unary(ar_pipe, dllm_pipe):
    for pipe in (ar_pipe, dllm_pipe):
        ids = prompt(7, 5)
        ref = pipe(ids, GenerationConfig(max_new_tokens=14, ignore_eos=True))
        i = next(i for i in range(3, 12) if ref.token_ids[i] not in ref.token_ids[:i])
        gen = GenerationConfig(max_new_tokens=14, ignore_eos=True, stop_token_ids=[ref.token_ids[i]], logprobs=1)
        unary = pipe(ids, gen)
        streamed = Response.from_chunks(list(pipe.stream(ids, gen)))
        assert fields(streamed) == fields(unary)
        assert unary.finish_reason == "stop" and len(unary.token_ids) == i + 1
