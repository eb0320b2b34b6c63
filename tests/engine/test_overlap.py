"""overlap_schedule: a step launches half of the requests' forward and applies the other half's, so
the host's work overlaps the device's (on the CPU the forward has finished by then; the schedule
and the bookkeeping are the same). Outputs must be those of the plain schedule -- tokens, step maps,
texts, finish reasons and logprob token ids exactly, logprob values to 1e-4 -- for greedy and seeded
sampling, block diffusion and AR, chunked prefills, stops, preemption under a small KV cache,
requests aborted while their forward is in flight, and retraction mid-run. And the schedule's own
rules: an abort returns the final chunk of a request that finished in the forward it applied; a
backlog keeps half the batch per forward; the newest request gives way first under page pressure."""

from __future__ import annotations

import pytest
import torch

from engine import EngineConfig, GenerationConfig, Response, pipeline

PAGE = 4
PROMPT_LENS = [9, 5, 30, 7, 3, 21, 12]


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(6, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def key(r: Response) -> tuple:
    """What must be identical: tokens, step_map, finish_reason, text, each logprob entry's token ids."""
    return r.token_ids, r.step_map, r.finish_reason, r.text, [list(e) for e in r.logprobs or []]


def logprob_values(r: Response) -> list[float]:
    return [v for e in r.logprobs or [] for v in e.values()]


def assert_same(got: list[Response], want: list[Response]) -> None:
    """Identical outputs; logprob values to 1e-4: the CPU forward's last bits depend on the other rows
    of its batch, and the two schedules batch the requests differently."""
    assert [key(r) for r in got] == [key(r) for r in want]
    for g, w in zip(got, want):
        assert logprob_values(g) == pytest.approx(logprob_values(w), abs=1e-4)


def run(engine, prompts: list[list[int]], params: list[GenerationConfig], before_step=None,
        max_steps: int = 500) -> dict[str, Response]:
    """Drive the engine by hand; `before_step(engine, step, rids, responses)` may act between steps.
    Checks that every request's chunks end with exactly one finished chunk."""
    rids = [engine.add_request(p, g) for p, g in zip(prompts, params)]
    responses = {rid: Response() for rid in rids}
    done: set[str] = set()

    def take(chunk) -> None:
        assert chunk.request_id not in done, f"a chunk after the final one of {chunk.request_id}"
        responses[chunk.request_id].add(chunk)
        if chunk.finished:
            done.add(chunk.request_id)

    for step in range(max_steps):
        if before_step is not None:
            for chunk in before_step(engine, step, rids, responses):
                take(chunk)
        for chunk in engine.step():
            take(chunk)
        if not engine.has_unfinished():
            break
    assert done == set(rids), "every request ends with one finished chunk"
    assert engine.kv.num_free_pages == engine.kv.num_pages
    return responses


def config(overlap: bool, dllm: bool, **extra) -> EngineConfig:
    base = dict(kv_block_size=PAGE, max_prefill_token_num=16, overlap_schedule=overlap)  # prompts of 21, 30: chunked
    if dllm:
        base["dllm_block_length"] = 4
    return EngineConfig(**(base | extra))


def both(ckpt: str, dllm: bool, prompts, params, before_step=None, **extra) -> tuple[list, list]:
    out = []
    for overlap in (False, True):
        with pipeline(ckpt, config(overlap, dllm, **extra)) as pipe:
            responses = run(pipe.engine, prompts, params, before_step)
            out.append(list(responses.values()))
    return out[0], out[1]


@pytest.fixture(params=["ar", "dllm"])
def model(request, ar_ckpt, dllm_ckpt) -> tuple[str, bool]:
    return (dllm_ckpt, True) if request.param == "dllm" else (ar_ckpt, False)


def test_greedy_outputs_identical_and_half_the_requests_per_forward(model):
    ckpt, dllm = model
    prompts = [prompt(n, i) for i, n in enumerate(PROMPT_LENS)]
    params = [GenerationConfig(max_new_tokens=11 + i, ignore_eos=True, logprobs=2) for i in range(len(prompts))]
    plain, overlapped = both(ckpt, dllm, prompts, params)
    assert_same(overlapped, plain)
    with pipeline(ckpt, config(True, dllm)) as pipe:
        sizes = []
        real = pipe.engine.executor.execute
        pipe.engine.executor.execute = lambda batch: sizes.append(len(batch.q_lens)) or real(batch)
        run(pipe.engine, prompts, params)
    assert max(sizes) <= (len(prompts) + 1) // 2


def test_seeded_sampling_identical(model):
    ckpt, dllm = model
    prompts = [prompt(n, 20 + i) for i, n in enumerate(PROMPT_LENS)]
    params = [GenerationConfig(max_new_tokens=12, ignore_eos=True, do_sample=True, temperature=0.9, top_p=0.9,
                               top_k=50, random_seed=100 + i, logprobs=1) for i in range(len(prompts))]
    plain, overlapped = both(ckpt, dllm, prompts, params)
    assert_same(overlapped, plain)


def test_stops_identical(model):
    """Stop ids (after min_new_tokens) end outputs at the same token with and without overlap."""
    ckpt, dllm = model
    prompts = [prompt(n, 40 + i) for i, n in enumerate(PROMPT_LENS)]
    free = [GenerationConfig(max_new_tokens=16, ignore_eos=True)] * len(prompts)
    with pipeline(ckpt, config(False, dllm)) as pipe:
        tokens = [r.token_ids for r in run(pipe.engine, prompts, free).values()]
    stops = sorted({t[5] for t in tokens} | {t[9] for t in tokens})[:4]
    params = [GenerationConfig(max_new_tokens=16, ignore_eos=True, stop_token_ids=stops, min_new_tokens=i % 3)
              for i in range(len(prompts))]
    plain, overlapped = both(ckpt, dllm, prompts, params)
    assert_same(overlapped, plain)
    assert any(r.finish_reason == "stop" for r in plain), "the stop ids must end some outputs"


def test_preemption_under_a_small_kv_cache_identical(model):
    ckpt, dllm = model
    prompts = [prompt(n, 60 + i) for i, n in enumerate([9, 5, 12, 7, 3, 10])]
    params = [GenerationConfig(max_new_tokens=12, ignore_eos=True)] * len(prompts)
    with pipeline(ckpt, config(False, dllm)) as pipe:
        want = list(run(pipe.engine, prompts, params).values())
    need = -(-(12 + 12) // 4) * 4 // PAGE  # the largest request's pages, block-rounded: 6
    with pipeline(ckpt, config(True, dllm, num_kv_blocks=need + 1)) as pipe:
        got = list(run(pipe.engine, prompts, params).values())
        assert pipe.engine.scheduler.num_preemptions > 0, "the page budget must force preemptions"
    assert_same(got, want)


def test_abort_in_flight_and_retract_mid_run(model):
    """A request aborted while its forward is in flight ends with what it had (a prefix of its full
    output) in one final chunk; retracting every request mid-run changes no output."""
    ckpt, dllm = model
    prompts = [prompt(n, 80 + i) for i, n in enumerate(PROMPT_LENS)]
    params = [GenerationConfig(max_new_tokens=14, ignore_eos=True)] * len(prompts)
    with pipeline(ckpt, config(False, dllm)) as pipe:
        want = list(run(pipe.engine, prompts, params).values())
    aborted: list[int] = []

    def act(engine, step, rids, responses):
        if step == 6:
            assert engine.retract_all() > 0
        if step in (4, 9):
            in_flight = [rid for fwd in engine.overlap.in_flight for rid in (it.seq.request_id for it in fwd.items)]
            assert in_flight, "a forward is in flight between steps"
            aborted.append(rids.index(in_flight[0]))
            return [engine.abort(in_flight[0])]
        return []

    with pipeline(ckpt, config(True, dllm)) as pipe:
        got = list(run(pipe.engine, prompts, params, act).values())
    assert len(set(aborted)) == 2
    for i, (g, w) in enumerate(zip(got, want)):
        if i in aborted:
            assert g.finish_reason == "abort" and g.token_ids == w.token_ids[: len(g.token_ids)]
            assert g.step_map == (w.step_map[: len(g.token_ids)] if dllm else None)
        else:
            assert_same([g], [w])


def test_aborting_everything_returns_a_final_chunk_for_requests_that_finished_meanwhile(ar_ckpt):
    """Aborting one request applies the forward in flight, in which another request may finish: the
    abort of that one (an abort-all walks every request) returns its final chunk, nothing is left
    for a later step (a paused engine runs none)."""
    lengths = [30, 30, 3, 3]
    with pipeline(ar_ckpt, config(True, False)) as pipe:
        engine = pipe.engine
        rids = [engine.add_request(prompt(5, 90 + i), GenerationConfig(max_new_tokens=n, ignore_eos=True))
                for i, n in enumerate(lengths)]
        finishing = []
        for _ in range(40):
            engine.step()
            finishing = [it.seq.request_id for fwd in engine.overlap.in_flight for it in fwd.items
                         if it.seq.params.max_new_tokens == 3 and it.seq.stop.num_consumed == 2]
            if finishing:
                break
        assert finishing, "a short request's last token must be in flight at some step"
        chunks = {rid: engine.abort(rid) for rid in list(engine.seqs)}
        assert engine.take_ready() == [] and not engine.has_unfinished()
    for rid in finishing:
        assert chunks[rid] is not None and chunks[rid].finish_reason == "length"
    assert set(chunks) == set(rids) and all(c is not None and c.finished for c in chunks.values()), chunks


def test_a_backlog_keeps_half_the_batch_per_forward(ar_ckpt):
    """With more requests waiting than the batch holds, each forward still takes half of the batch, so
    launching one half and applying the other keep alternating."""
    sizes = []
    with pipeline(ar_ckpt, config(True, False, max_batch_size=4)) as pipe:
        real = pipe.engine.executor.execute
        pipe.engine.executor.execute = lambda batch: sizes.append(len(batch.q_lens)) or real(batch)
        run(pipe.engine, [prompt(4, 100 + i) for i in range(12)],
            [GenerationConfig(max_new_tokens=8, ignore_eos=True)] * 12)
    assert max(sizes) == 2


def test_a_request_in_flight_gives_way_before_an_older_one_is_preempted(ar_ckpt):
    """Newest first, as without overlap: an older request short of pages waits for the newer one's
    forward to land instead of preempting itself."""
    preempted = []
    with pipeline(ar_ckpt, config(True, False, num_kv_blocks=14)) as pipe:
        scheduler = pipe.engine.scheduler
        real = scheduler._preempt

        def record(seq):
            preempted.append((seq.request_id, [s.request_id for s in scheduler.running if s.arrival > seq.arrival]))
            real(seq)

        scheduler._preempt = record
        run(pipe.engine, [prompt(4, 110 + i) for i in range(2)],
            [GenerationConfig(max_new_tokens=40, ignore_eos=True)] * 2)
    assert preempted and all(not newer for _, newer in preempted), preempted
