"""Scheduler: continuous batching, chunked prefill, preemption by recompute under a tiny page
budget (outputs identical to an unconstrained run), requests that can never fit."""

from __future__ import annotations

import pytest
import torch

from engine import EngineConfig, GenerationConfig, Response, pipeline

PAGE = 4


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def record_batches(pipe) -> list[tuple[list[int], list[int]]]:
    """(q_lens, kv_lens) of every forward (wraps the real executor)."""
    seen: list[tuple[list[int], list[int]]] = []
    real = pipe.engine.executor.execute

    def execute(batch):
        seen.append((list(batch.q_lens), list(batch.kv_lens)))
        return real(batch)

    pipe.engine.executor.execute = execute
    return seen


def generate_bounded(pipe, prompts, params: GenerationConfig, max_steps: int = 200) -> list[Response]:
    """Like `pipe(prompts, params)`, but fails instead of hanging when the engine stops progressing."""
    engine = pipe.engine
    rids = [engine.add_request(p, params) for p in prompts]
    responses = {rid: Response() for rid in rids}
    for _ in range(max_steps):
        for chunk in engine.step():
            responses[chunk.request_id].add(chunk)
        if not engine.has_unfinished():
            return [responses[rid] for rid in rids]
    sched = engine.core.scheduler
    pytest.fail(f"no completion after {max_steps} steps: running={[s.request_id for s in sched.running]}, "
                f"waiting={[(s.request_id, len(s.table.pages)) for s in sched.waiting]} (request, pages held), "
                f"free pages={engine.kv.num_free_pages}")


def key(r: Response):
    return (r.token_ids, r.step_map, r.finish_reason, r.text)


PROMPT_LENS = [9, 5, 12, 7, 3, 10]


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_ar_preemption_gives_identical_outputs(ar_ckpt, prefix_caching):
    prompts = [prompt(n, i) for i, n in enumerate(PROMPT_LENS)]
    params = GenerationConfig(max_new_tokens=10, ignore_eos=True)
    with pipeline(ar_ckpt, EngineConfig(kv_block_size=PAGE)) as free_pipe:
        want = [key(r) for r in free_pipe(prompts, params)]
    need = -(-(max(PROMPT_LENS) + 10) // PAGE)  # pages of the largest request: 6
    cfg = EngineConfig(kv_block_size=PAGE, num_kv_blocks=need + 1, enable_prefix_caching=prefix_caching)
    with pipeline(ar_ckpt, cfg) as pipe:
        got = [key(r) for r in generate_bounded(pipe, prompts, params)]
        assert pipe.engine.scheduler.num_preemptions > 0, "the page budget must force preemptions"
        assert pipe.engine.kv.num_free_pages == need + 1
        assert not pipe.engine.has_unfinished()
    assert got == want


@pytest.mark.parametrize("strategy", ["low_confidence_dynamic"])
def test_dllm_preemption_gives_identical_outputs(dllm_ckpt, strategy):
    prompts = [prompt(n, 10 + i) for i, n in enumerate(PROMPT_LENS)]
    params = GenerationConfig(max_new_tokens=12, ignore_eos=True)
    base = dict(kv_block_size=PAGE, dllm_block_length=4, dllm_unmasking_strategy=strategy)
    with pipeline(dllm_ckpt, EngineConfig(**base)) as free_pipe:
        want = [key(r) for r in free_pipe(prompts, params)]
    need = -(-(max(PROMPT_LENS) + 12) // 4) * 4 // PAGE  # block-rounded: 6 pages
    with pipeline(dllm_ckpt, EngineConfig(num_kv_blocks=need + 1, **base)) as pipe:
        got = [key(r) for r in generate_bounded(pipe, prompts, params)]
        assert pipe.engine.scheduler.num_preemptions > 0
        assert pipe.engine.kv.num_free_pages == need + 1
    assert got == want
    assert all(len(k[1]) == len(k[0]) == 12 for k in got)


def test_request_that_can_never_fit_is_refused(ar_ckpt, dllm_ckpt):
    with pipeline(ar_ckpt, EngineConfig(kv_block_size=PAGE, max_model_len=32, num_kv_blocks=6)) as pipe:
        with pytest.raises(ValueError, match="max_model_len") as e:
            pipe(prompt(20, 1), GenerationConfig(max_new_tokens=13))
        assert e.value.param == "max_new_tokens"
        with pytest.raises(ValueError, match=r"KV pages.*num_kv_blocks"):
            pipe(prompt(20, 1), GenerationConfig(max_new_tokens=8))  # 28 tokens = 7 pages > 6
        # exactly at the limits is fine
        assert len(pipe(prompt(20, 1), GenerationConfig(max_new_tokens=4, ignore_eos=True)).token_ids) == 4
        # a refused request inside a batch leaves nothing behind
        with pytest.raises(ValueError):
            pipe([prompt(4, 2), prompt(30, 3)], GenerationConfig(max_new_tokens=8))
        assert not pipe.engine.has_unfinished() and pipe.engine.kv.num_free_pages == 6
    # DLLM: the page need is rounded up to whole DLLM blocks (19 + 2 = 21 tokens -> 24 = 6 pages of 4)
    with pipeline(dllm_ckpt, EngineConfig(kv_block_size=PAGE, num_kv_blocks=5, dllm_block_length=4)) as pipe:
        with pytest.raises(ValueError, match="num_kv_blocks"):
            pipe(prompt(19, 4), GenerationConfig(max_new_tokens=2))
        pipe(prompt(18, 4), GenerationConfig(max_new_tokens=2, ignore_eos=True))  # 20 tokens: 5 pages


def run_continuous(pipe, schedule: list[tuple[int, list[int], GenerationConfig]]) -> dict[int, Response]:
    """Drive the engine by hand: request i is added just before step `schedule[i][0]`."""
    engine = pipe.engine
    responses: dict[str, Response] = {}
    names: dict[str, int] = {}
    step = 0
    pending = sorted(range(len(schedule)), key=lambda i: schedule[i][0])
    while pending or engine.has_unfinished():
        while pending and schedule[pending[0]][0] <= step:
            i = pending.pop(0)
            rid = engine.add_request(schedule[i][1], schedule[i][2])
            names[rid] = i
            responses[rid] = Response()
        for chunk in engine.step():
            responses[chunk.request_id].add(chunk)
        step += 1
        assert step < 500
    return {names[rid]: r for rid, r in responses.items()}


@pytest.mark.parametrize("model", ["ar", "dllm"])
def test_requests_added_mid_flight_match_alone(ar_ckpt, dllm_ckpt, model):
    path = ar_ckpt if model == "ar" else dllm_ckpt
    cfg = EngineConfig(kv_block_size=PAGE, max_prefill_token_num=8, dllm_block_length=4)
    schedule = [
        (0, prompt(6, 20), GenerationConfig(max_new_tokens=8, ignore_eos=True)),
        (2, prompt(21, 21), GenerationConfig(max_new_tokens=5, ignore_eos=True)),  # chunked prefill
        (3, prompt(2, 22), GenerationConfig(max_new_tokens=7, ignore_eos=True)),
        (6, prompt(13, 23), GenerationConfig(max_new_tokens=4, ignore_eos=True)),
        (6, prompt(8, 24), GenerationConfig(max_new_tokens=6, ignore_eos=True)),
    ]
    with pipeline(path, cfg) as pipe:
        alone = [key(pipe(p, g)) for _, p, g in schedule]
        batches = record_batches(pipe)
        got = run_continuous(pipe, schedule)
        assert pipe.engine.kv.num_free_pages == pipe.engine.kv.num_pages
    assert [key(got[i]) for i in range(len(schedule))] == alone
    assert max(len(q) for q, _ in batches) >= 2, "requests must share forwards"
    mixed = [q for q, kv in batches if any(ql < kvl for ql, kvl in zip(q, kv, strict=True)) and max(q) > 1]
    assert mixed, "a prefill chunk should run in the same forward as running sequences"


def test_max_batch_size_limits_running_sequences(ar_ckpt):
    prompts = [prompt(n, 30 + i) for i, n in enumerate([4, 9, 2, 6, 11])]
    params = GenerationConfig(max_new_tokens=6, ignore_eos=True)
    with pipeline(ar_ckpt, EngineConfig(kv_block_size=PAGE)) as pipe:
        want = [key(r) for r in pipe(prompts, params)]
    with pipeline(ar_ckpt, EngineConfig(kv_block_size=PAGE, max_batch_size=2)) as pipe:
        batches = record_batches(pipe)
        got = [key(r) for r in pipe(prompts, params)]
    assert got == want
    assert max(len(q) for q, _ in batches) == 2


def test_chunked_prefill_respects_budget(ar_ckpt):
    with pipeline(ar_ckpt, EngineConfig(kv_block_size=PAGE, max_prefill_token_num=5)) as pipe:
        batches = record_batches(pipe)
        long = pipe(prompt(23, 40), GenerationConfig(max_new_tokens=3, ignore_eos=True))
    assert [q for q, _ in batches] == [[5], [5], [5], [5], [3], [1], [1]]
    assert [kv for _, kv in batches] == [[5], [10], [15], [20], [23], [24], [25]]
    assert len(long.token_ids) == 3


@pytest.mark.parametrize("model", ["ar", "dllm"])
def test_prefill_budget_does_not_cap_running_sequences(ar_ckpt, dllm_ckpt, model):
    """`max_prefill_token_num` bounds the prompt tokens fed per step (chunked-prefill
    budget); once prefilled, every running sequence (AR decode row / DLLM block) joins each forward."""
    path = ar_ckpt if model == "ar" else dllm_ckpt
    budget = 2 if model == "ar" else 4  # DLLM: one block of 4 is the smallest chunk
    cfg = EngineConfig(kv_block_size=PAGE, max_prefill_token_num=budget, dllm_block_length=4)
    prompts = [prompt(4, 60 + i) for i in range(4)]
    with pipeline(path, cfg) as pipe:
        batches = record_batches(pipe)
        pipe(prompts, GenerationConfig(max_new_tokens=6, ignore_eos=True))
    widest = max(len(q) for q, _ in batches)
    assert widest == 4, f"all 4 sequences should decode together; widest forward had {widest} (q_lens: {batches})"


def test_a_sequence_is_itself():
    """Two sequences whose fields are all equal are still two requests: finishing one takes that one
    out of the running list (membership is identity, which also keeps a finish from comparing every
    field of every running sequence)."""
    from engine.core.sequence import Sequence

    params = GenerationConfig(max_new_tokens=4)
    a, b = (Sequence("r", [1, 2], params, frozenset(), None, 0, 0) for _ in range(2))
    b.added_at = a.added_at
    running = [a, b]
    running.remove(b)
    assert running[0] is a and a != b
