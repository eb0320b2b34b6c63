"""Scoring: input-token logprobs from logprob_start_len, against Hugging
Face transformers' forward + log_softmax in float32."""

from __future__ import annotations

import pytest
import torch

from engine import EngineConfig, GenerationConfig, Response, pipeline
from engine.errors import RequestError
from testing.tiny_checkpoint import load_hf_reference, write_tiny_checkpoint
from tests.support.lm_head import record_lm_head_rows

TOL = 1e-4
L = 26
PAGE = 4


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("ar"), model_type="qwen3", seed=40, logit_scale=2.0)


@pytest.fixture(scope="module")
def hf(ckpt):
    model = load_hf_reference(ckpt)
    model.generation_config.eos_token_id = None
    return model


def ids_for(seed: int, n: int = L) -> list[int]:
    return torch.randint(0, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


_logits: dict = {}


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    key = tuple(ids)
    if key not in _logits:
        with torch.inference_mode():
            _logits[key] = hf(torch.tensor([ids])).logits[0].float()
    return _logits[key]


def expected_rows(hf, ids, n, mode):
    values = hf_logits(hf, ids)
    if mode == "raw_logprobs":
        values = values.log_softmax(-1)
    return values[n:-1]  # row j scores ids[n + 1 + j] given ids[: n + 1 + j]


def score(n: int, k: int | None = 5) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=0, logprob_start_len=n, logprobs=k)


def check_rows(resp: Response, hf, ids, n, mode, k):
    want = expected_rows(hf, ids, n, mode)
    rows = resp.input_token_logprobs
    assert rows is not None and len(rows) == len(ids) - n - 1, "one row per token of ids[N+1:]"
    assert [t for _, t in rows] == ids[n + 1 :], "row j scores ids[N+1+j]; the boundary token is not emitted"
    got = torch.tensor([v for v, _ in rows])
    torch.testing.assert_close(got, want.gather(1, torch.tensor(ids[n + 1 :])[:, None])[:, 0], atol=TOL, rtol=0)
    if k:
        assert resp.input_top_logprobs is not None and len(resp.input_top_logprobs) == len(rows)
        top_v, top_i = torch.topk(want, k, dim=-1)
        for j, row in enumerate(resp.input_top_logprobs):
            assert [t for _, t in row] == top_i[j].tolist(), f"row {j}"
            torch.testing.assert_close(torch.tensor([v for v, _ in row]), top_v[j], atol=TOL, rtol=0)
    else:
        assert resp.input_top_logprobs is None, "logprobs=0: no top-k was asked for"
    # a scoring request generates nothing
    assert resp.token_ids == [] and resp.text == "" and resp.generate_token_len == 0
    assert resp.logprobs == [], "logprobs were requested, nothing was generated: [] (not None)"
    assert resp.step_map is None
    assert resp.input_token_len == len(ids)
    assert resp.finish_reason not in (None, "abort", "error")


@pytest.mark.parametrize("budget", [7, 2048], ids=["chunked", "whole"])
@pytest.mark.parametrize("mode", ["raw_logprobs", "raw_logits"])
def test_rows_equal_hf_cold_and_warm(ckpt, hf, mode, budget):
    cfg = EngineConfig(logprobs_mode=mode, kv_block_size=PAGE, max_prefill_token_num=budget)
    with pipeline(str(ckpt), cfg) as pipe:
        kv = pipe.engine.kv
        for n in (0, L // 2, L - 2):
            ids = ids_for(n)  # different ids per N: the first scoring is cold
            before = kv.prefix_hit_tokens
            cold = pipe(ids, score(n))
            assert kv.prefix_hit_tokens == before
            check_rows(cold, hf, ids, n, mode, 5)
            warm = pipe(ids, score(n))
            assert kv.prefix_hit_tokens - before == n // PAGE * PAGE, "reuse stops at the boundary N"
            check_rows(warm, hf, ids, n, mode, 5)
            assert [t for _, t in warm.input_token_logprobs] == [t for _, t in cold.input_token_logprobs]
        assert kv.num_free_pages == kv.num_pages


def test_top_k_zero_and_large(ckpt, hf):
    with pipeline(str(ckpt), EngineConfig(logprobs_mode="raw_logprobs")) as pipe:
        ids = ids_for(100, 12)
        check_rows(pipe(ids, score(3, k=0)), hf, ids, 3, "raw_logprobs", 0)
        check_rows(pipe(ids, score(3, k=20)), hf, ids, 3, "raw_logprobs", 20)


def test_warm_cache_from_generation_still_computes_every_row(ckpt, hf):
    ids = ids_for(200)
    with pipeline(str(ckpt), EngineConfig(logprobs_mode="raw_logprobs", kv_block_size=PAGE)) as pipe:
        pipe(ids, GenerationConfig(max_new_tokens=3, ignore_eos=True))  # caches every page of ids
        before = pipe.engine.kv.prefix_hit_tokens
        r = pipe(ids, score(5))
        assert pipe.engine.kv.prefix_hit_tokens - before == 4
        check_rows(r, hf, ids, 5, "raw_logprobs", 5)


def test_lm_head_sees_only_scored_rows_in_bounded_chunks(ckpt, hf):
    """Only rows >= N reach the LM head, `logprobs_chunk_rows` at a time (memory never grows with
    scored tokens x vocab beyond one chunk)."""
    ids = ids_for(300, 40)
    n = 9
    cfg = EngineConfig(logprobs_mode="raw_logprobs", logprobs_chunk_rows=3)
    with pipeline(str(ckpt), cfg) as pipe:
        sizes = record_lm_head_rows(pipe)
        r = pipe(ids, score(n))
    check_rows(r, hf, ids, n, "raw_logprobs", 5)
    projected = [s for s in sizes if s]
    assert max(projected) <= 3
    assert sum(projected) == len(ids) - n - 1


@pytest.mark.parametrize("chunk_rows", [1, 3])
def test_logprobs_chunk_rows_gives_same_rows(ckpt, hf, chunk_rows):
    ids = ids_for(400)
    with pipeline(str(ckpt), EngineConfig(logprobs_mode="raw_logits", logprobs_chunk_rows=chunk_rows,
                                          max_prefill_token_num=7)) as pipe:
        r = pipe(ids, score(4))
    check_rows(r, hf, ids, 4, "raw_logits", 5)


def run_mixed(pipe, requests):
    engine = pipe.engine
    rids = [engine.add_request(ids, gen) for ids, gen in requests]
    resp = {rid: Response() for rid in rids}
    widest = 0
    real = engine.executor.execute

    def execute(batch):
        nonlocal widest
        widest = max(widest, len(batch.q_lens))
        return real(batch)

    engine.executor.execute = execute
    for _ in range(500):
        for chunk in engine.step():
            resp[chunk.request_id].add(chunk)
        if not engine.has_unfinished():
            break
    engine.executor.execute = real
    assert not engine.has_unfinished(), "the engine stopped making progress"
    return [resp[r] for r in rids], widest


@pytest.mark.parametrize("budget", [6, 2048], ids=["chunked", "whole"])
def test_batched_scoring_with_generation_equals_alone(ckpt, hf, budget):
    requests = [
        (ids_for(500, 20), score(0)),
        (ids_for(501, 9), GenerationConfig(max_new_tokens=5, ignore_eos=True, logprobs=2)),
        (ids_for(502, 31), score(15, k=3)),
        (ids_for(503, 5), score(3, k=0)),
        (ids_for(500, 20), score(7)),  # same ids as the first, another boundary
    ]
    cfg = EngineConfig(logprobs_mode="raw_logprobs", kv_block_size=PAGE, max_prefill_token_num=budget)
    with pipeline(str(ckpt), cfg) as pipe:
        alone = [pipe(ids, gen) for ids, gen in requests]
    with pipeline(str(ckpt), cfg) as pipe:
        together, widest = run_mixed(pipe, requests)
        assert pipe.engine.kv.num_free_pages == pipe.engine.kv.num_pages
    if budget == 2048:
        assert widest == len(requests), "every request should be prefilled in the same forward"
    for (ids, gen), a, b in zip(requests, alone, together, strict=True):
        a.request_id = b.request_id = None
        assert a.token_ids == b.token_ids
        if gen.max_new_tokens == 0:
            check_rows(b, hf, ids, gen.logprob_start_len, "raw_logprobs", gen.logprobs)
            torch.testing.assert_close(torch.tensor([v for v, _ in a.input_token_logprobs]),
                                       torch.tensor([v for v, _ in b.input_token_logprobs]), atol=TOL, rtol=0)
        else:
            assert b.input_token_logprobs is None and b.input_top_logprobs is None
            assert [list(e) for e in a.logprobs] == [list(e) for e in b.logprobs]


def test_generation_with_input_rows(ckpt, hf):
    """logprob_start_len >= 0 with max_new_tokens > 0: input rows and output logprobs both."""
    ids = ids_for(600, 15)
    n, new = 6, 5
    with pipeline(str(ckpt), EngineConfig(logprobs_mode="raw_logprobs", max_prefill_token_num=4)) as pipe:
        r = pipe(ids, GenerationConfig(max_new_tokens=new, ignore_eos=True, logprob_start_len=n, logprobs=3))
    x = torch.tensor([ids])
    with torch.inference_mode():
        out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new, do_sample=False,
                          return_dict_in_generate=True, output_logits=True)
    assert r.token_ids == out.sequences[0, len(ids):].tolist()
    want_in = expected_rows(hf, ids, n, "raw_logprobs")
    assert [t for _, t in r.input_token_logprobs] == ids[n + 1 :]
    got = torch.tensor([v for v, _ in r.input_token_logprobs])
    torch.testing.assert_close(got, want_in.gather(1, torch.tensor(ids[n + 1 :])[:, None])[:, 0], atol=TOL, rtol=0)
    assert len(r.input_top_logprobs) == len(ids) - n - 1
    step_lp = torch.stack(out.logits, 1)[0].float().log_softmax(-1)
    assert len(r.logprobs) == new
    for s, (tok, entry) in enumerate(zip(r.token_ids, r.logprobs, strict=True)):
        top_v, top_i = torch.topk(step_lp[s], 3)
        assert list(entry) == top_i.tolist() and list(entry)[0] == tok
        torch.testing.assert_close(torch.tensor(list(entry.values())), top_v, atol=TOL, rtol=0)


def test_scoring_streams_one_terminal_chunk(ckpt, hf):
    ids = ids_for(700)
    with pipeline(str(ckpt), EngineConfig(logprobs_mode="raw_logprobs", max_prefill_token_num=5)) as pipe:
        chunks = list(pipe.stream(ids, score(2)))
    assert len(chunks) == 1 and chunks[0].finished
    check_rows(Response.from_chunks(chunks), hf, ids, 2, "raw_logprobs", 5)


def test_no_input_rows_unless_asked(ckpt):
    with pipeline(str(ckpt), EngineConfig(logprobs_mode="raw_logprobs")) as pipe:
        r = pipe(ids_for(800, 8), GenerationConfig(max_new_tokens=3, ignore_eos=True))
        assert r.input_token_logprobs is None and r.input_top_logprobs is None and r.logprobs is None
        r = pipe(ids_for(800, 8), GenerationConfig(max_new_tokens=3, ignore_eos=True, logprobs=2))
        assert r.input_token_logprobs is None and r.input_top_logprobs is None and len(r.logprobs) == 3


# ---- rejections ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def scorer(ckpt):
    with pipeline(str(ckpt), EngineConfig(logprobs_mode="raw_logprobs")) as pipe:
        yield pipe


REJECTIONS = [
    # (prompt, config, param, text the message must contain)
    (ids_for(1, 10), score(9), "logprob_start_len", "logprob_start_len"),  # N + 1 == len
    (ids_for(1, 10), score(8), None, None),  # N = len - 2: one row, fine
    (ids_for(1, 10), score(30), "logprob_start_len", "logprob_start_len"),
    (ids_for(1, 1), score(0), "logprob_start_len", "logprob_start_len"),
    ("Hello world, score me", score(0), "input_ids", "input_ids"),
    (ids_for(1, 10), GenerationConfig(max_new_tokens=0, logprobs=2), "max_new_tokens", "logprob_start_len"),
    (ids_for(1, 10), GenerationConfig(max_new_tokens=0, logprob_start_len=2), "logprobs", "logprobs"),
]


@pytest.mark.parametrize("prompt, gen, param, text", REJECTIONS)
def test_rejections(scorer, prompt, gen, param, text):
    if param is None:
        r = scorer(prompt, gen)
        assert len(r.input_token_logprobs) == 1
        return
    with pytest.raises(ValueError, match=text) as e:
        scorer(prompt, gen)
    assert isinstance(e.value, RequestError) and e.value.param == param
    assert not scorer.engine.has_unfinished()


def test_rejected_without_logprobs_mode(ckpt):
    with pipeline(str(ckpt)) as pipe:
        with pytest.raises(ValueError, match="logprobs_mode") as e:
            pipe(ids_for(2, 10), score(2))
        assert e.value.param == "logprobs_mode"
        with pytest.raises(ValueError, match="logprobs_mode"):
            pipe(ids_for(2, 10), GenerationConfig(max_new_tokens=2, logprob_start_len=2, logprobs=0))


def test_rejected_for_dllm(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "sdar", model_type="sdar", seed=41)
    with pipeline(str(path), EngineConfig(logprobs_mode="raw_logprobs")) as pipe:
        with pytest.raises(ValueError, match="AR") as e:
            pipe(ids_for(3, 10), score(2))
        assert "not autoregressive" in str(e.value) and "block diffusion" in str(e.value)
        with pytest.raises(ValueError, match="AR"):
            pipe(ids_for(3, 10), GenerationConfig(max_new_tokens=4, logprob_start_len=2, logprobs=0))


def test_scoring_rows_survive_preemption(ckpt, hf):
    """Chunked scoring prefills preempted by a tiny page budget: every row once, in order, correct."""
    requests = [(ids_for(900 + i, 14 + i), score(i, k=2)) for i in range(4)]
    requests += [(ids_for(950 + i, 6), GenerationConfig(max_new_tokens=10, ignore_eos=True)) for i in range(3)]
    cfg = EngineConfig(logprobs_mode="raw_logprobs", kv_block_size=PAGE, num_kv_blocks=6, max_prefill_token_num=5)
    with pipeline(str(ckpt), cfg) as pipe:
        out, _ = run_mixed(pipe, requests)
        assert pipe.engine.scheduler.num_preemptions > 0
    for (ids, gen), r in zip(requests, out, strict=True):
        if gen.max_new_tokens == 0:
            check_rows(r, hf, ids, gen.logprob_start_len, "raw_logprobs", 2)
        else:
            assert len(r.token_ids) == 10
