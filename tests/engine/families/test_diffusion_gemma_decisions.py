"""Typed decisions on DiffusionGemma (renoising): a template (the first canvas's initial state, its
pins held every step and emitted), allowed sets (each restricted row, label masses, logprobs over the
set) and reads (k steps at most, no commit, finish reason `read`), against the reference loop
(`reference.renoise`: transformers' sampler, schedule and stop rule over transformers' passes, with
the same decisions) draw for draw under a seed: alone, among free requests, and at tp=2."""

from __future__ import annotations

import pickle
import socket

import pytest
import torch
import torch.multiprocessing as mp

from bench.diffusion_gemma import converging_checkpoint
from configs import EngineConfig, GenerationConfig
from engine.carrier import Response
from engine.core.llm_engine import LLMEngine
from engine.errors import RequestError
from testing.references.diffusion_gemma import (
    Drafts,
    Renoised,
    allowed_ids,
    load_reference,
    random_tokens,
    renoise,
    settle_steps,
)
from tests.support.gemma_decoding import CANVAS, KNOBS, PAGE, params, run
from tests.support.ranks import gloo_rank

pytest.importorskip("transformers.models.diffusion_gemma")
MAX_NEW = 40  # three canvases: the template lies in the first
REF_KNOBS = dict(max_denoising_steps=KNOBS.max_denoising_steps, t_min=KNOBS.t_min, t_max=KNOBS.t_max,
                 entropy_bound=KNOBS.entropy_bound, stability_threshold=KNOBS.stability_threshold,
                 confidence_threshold=KNOBS.stop_entropy)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    # two K/V heads on the full layers, so that the checkpoint also splits over tp=2
    return converging_checkpoint(tmp_path_factory.mktemp("dgd") / "tiny", CANVAS, num_global_key_value_heads=2)


def make_engine(ckpt, executor_factory=None, **config) -> LLMEngine:
    knobs = {f"dllm_{name}": value for name, value in vars(KNOBS).items()}
    return LLMEngine(str(ckpt), EngineConfig(**{"device": "cpu", "kv_block_size": PAGE, "num_kv_blocks": 1024,
                                                "max_batch_size": 16, "max_prefill_token_num": 256, **knobs,
                                                **config}), executor_factory)


@pytest.fixture(scope="module")
def engine(ckpt):
    return make_engine(ckpt)


@pytest.fixture(scope="module")
def model(ckpt):
    return load_reference(ckpt)


@pytest.fixture(scope="module")
def vocab(engine) -> int:
    return engine.spec.vocab_size


def cases(vocab: int) -> dict[str, tuple[int, dict]]:
    """Per case its seed and decisions: pins among slots; pins with a set per slot; one set for every
    position of every canvas (no template)."""
    pins = random_tokens(5, 7, vocab)
    template = [None, pins[0], pins[1], None, None, pins[2], None, pins[3], pins[4], None]
    slots = [g for g, t in enumerate(template) if t is None]
    per_slot = {g: random_tokens(2 + g % 4, 20 + g, vocab) for g in slots}
    return {"pins": (0, {"template": template}),
            "sets": (1, {"template": template, "allowed": per_slot}),
            "every": (2, {"allowed": random_tokens(6, 30, vocab)})}


def request(decisions: dict, seed: int, **kwargs) -> GenerationConfig:
    return params(random_seed=seed, dllm_template=decisions.get("template"),
                  dllm_allowed_token_ids=decisions.get("allowed"), **{"max_new_tokens": MAX_NEW, **kwargs})


def reference(model, prompt: list[int], seed: int, max_new: int = MAX_NEW, **decisions) -> Renoised:
    torch.manual_seed(seed)
    return renoise(model, prompt, max_new, **REF_KNOBS, **decisions)


@pytest.fixture(scope="module")
def prompt(vocab) -> list[int]:
    return random_tokens(9, 109, vocab)


@pytest.fixture(scope="module")
def refs(model, vocab, prompt) -> dict[str, Renoised]:
    out = {name: reference(model, prompt, seed, **decisions) for name, (seed, decisions) in cases(vocab).items()}
    out |= {f"free{seed}": reference(model, prompt, seed) for seed in range(3)}
    return out


def check(result: Response, ref: Renoised, decisions: dict) -> None:
    """The engine's output is the reference's; pins are emitted (step 0), slots hold their sets."""
    assert result.token_ids == ref.tokens
    assert result.step_map == ref.settle
    assert result.finish_reason == "length"
    assert [c["steps"] for c in result.dllm_replay_canvases] == ref.steps
    template, allowed = decisions.get("template") or [], decisions.get("allowed")
    for g, t in enumerate(template):
        if t is not None:
            assert (result.token_ids[g], result.step_map[g]) == (t, 0)
    for g, token in enumerate(result.token_ids):
        ids_g = allowed_ids(g, template, allowed)
        if ids_g is not None:
            assert token in ids_g
            assert result.label_mass[g] == pytest.approx(ref.label_mass[g], abs=1e-5)
        elif allowed is not None:
            assert result.label_mass[g] is None


def test_the_reference_without_decisions_is_transformers_generate(model, prompt):
    for seed in (0, 1):
        drafts = Drafts()
        torch.manual_seed(seed)
        tokens = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, streamer=drafts,
                                max_denoising_steps=KNOBS.max_denoising_steps, t_min=KNOBS.t_min, t_max=KNOBS.t_max,
                                stability_threshold=KNOBS.stability_threshold,
                                confidence_threshold=KNOBS.stop_entropy).sequences[0, len(prompt):].tolist()
        ref = reference(model, prompt, seed)
        assert ref.tokens == tokens[:MAX_NEW]
        assert ref.settle == settle_steps(drafts)[:MAX_NEW]
        assert ref.encodes == 3  # the prompt, then the commits of the first two canvases


def test_decisions_change_the_draws(refs):
    """The decisions matter: the same seed without them gives other tokens (so the equalities below
    can fail)."""
    for name, seed in (("pins", 0), ("sets", 1), ("every", 2)):
        assert refs[name].tokens != refs[f"free{seed}"].tokens


def test_decisions_among_free_requests_equal_the_reference(engine, vocab, prompt, refs):
    requests = {name: (prompt, request(decisions, seed)) for name, (seed, decisions) in cases(vocab).items()}
    requests |= {f"free{seed}": (prompt, params(max_new_tokens=MAX_NEW, random_seed=seed)) for seed in range(3)}
    results = run(engine, requests)
    for name, (_, decisions) in cases(vocab).items():
        check(results[name], refs[name], decisions)
    for seed in range(3):
        check(results[f"free{seed}"], refs[f"free{seed}"], {})


@pytest.mark.parametrize("name", ["pins", "sets", "every"])
def test_a_decisions_request_alone_equals_the_reference(engine, vocab, prompt, refs, name):
    seed, decisions = cases(vocab)[name]
    check(run(engine, {name: (prompt, request(decisions, seed))})[name], refs[name], decisions)


@pytest.mark.parametrize("raw", [False, True])
def test_logprobs_of_a_set_are_over_the_set(ckpt, engine, vocab, prompt, refs, raw):
    """processed: renormalised over the set (at the last step's temperature); raw: over the vocabulary.
    Either way the top entries are ids of the set."""
    seed, decisions = cases(vocab)["sets"]
    eng = make_engine(ckpt, logprobs_mode="raw_logprobs") if raw else engine
    result = run(eng, {"lp": (prompt, request(decisions, seed, logprobs=3))})["lp"]
    ref = refs["sets"]
    check(result, ref, decisions)
    temperature = KNOBS.temperature(KNOBS.max_denoising_steps - ref.steps[0] + 1)
    last = ref.last[0]
    for g, allowed in decisions["allowed"].items():
        row = last[g] if raw else restrict(last[g], allowed) / temperature
        expected = torch.log_softmax(row, dim=-1)
        entry = result.logprobs[g]
        assert set(entry) <= set(allowed) and len(entry) == min(3, len(allowed))
        for token, value in entry.items():
            assert value == pytest.approx(expected[token].item(), abs=1e-4)


def restrict(row: torch.Tensor, allowed: list[int]) -> torch.Tensor:
    return torch.full_like(row, float("-inf")).index_copy(0, torch.tensor(allowed), row[allowed])


def read_request(vocab: int) -> tuple[list[int | None], list[int]]:
    pins = random_tokens(3, 40, vocab)
    return [pins[0], None, pins[1], None, None, pins[2]], random_tokens(3, 41, vocab)


@pytest.mark.parametrize(("steps", "seed", "with_labels"), [(1, 5, True), (3, 0, False)])
def test_a_read_stops_after_its_steps_without_a_commit(engine, model, vocab, prompt, steps, seed, with_labels):
    """The read's canvas would take more steps (the seeds are chosen so); it stops after k, emits its
    argmax with temperature-1 logprobs (over the labels when given) and ends without a commit."""
    template, labels = read_request(vocab)
    labels = labels if with_labels else None
    config = GenerationConfig(dllm_template=template, dllm_allowed_token_ids=labels, dllm_read_only=True,
                              dllm_max_steps=steps, random_seed=seed, logprobs=3, max_new_tokens=CANVAS)
    forwards = engine.stats.forwards
    first = run(engine, {"read": (prompt, config)})["read"]
    assert engine.stats.forwards - forwards == 1 + steps  # the prompt, then canvas passes only
    ref = reference(model, prompt, seed, len(template), template=template, allowed=labels, read_steps=steps)
    uncapped = reference(model, prompt, seed, len(template), template=template, allowed=labels)
    assert ref.encodes == 1 and ref.steps == [steps] < uncapped.steps
    assert (first.finish_reason, first.num_steps) == ("read", steps)
    assert first.token_ids == ref.tokens and first.step_map == ref.settle
    assert [first.token_ids[g] for g in (0, 2, 5)] == [template[g] for g in (0, 2, 5)]
    last = ref.last[0][: len(template)]
    expected = torch.log_softmax(torch.stack([restrict(row, labels) for row in last]) if labels else last, -1)
    for g in (1, 3, 4):  # temperature 1, renormalised over the labels
        entry = first.logprobs[g]
        assert labels is None or (first.token_ids[g] in labels and set(entry) == set(labels))
        for token, value in entry.items():
            assert value == pytest.approx(expected[g, token].item(), abs=1e-4)
        if labels:
            assert first.label_mass[g] == pytest.approx(ref.label_mass[g], abs=1e-5)
    again = run(engine, {"again": (prompt, config)})["again"]  # a seeded read is reproducible
    assert again.token_ids == first.token_ids
    for a, b in zip(again.logprobs, first.logprobs, strict=True):
        assert a == pytest.approx(b, abs=1e-5)  # the same ids (the forward's float32 sums may differ in order)


def test_a_one_step_read_is_one_canvas_pass(engine, vocab, prompt):
    template, labels = read_request(vocab)
    config = GenerationConfig(dllm_template=template, dllm_allowed_token_ids=labels, dllm_read_only=True,
                              random_seed=3, max_new_tokens=CANVAS)
    forwards = engine.stats.forwards
    result = run(engine, {"read": (prompt, config)})["read"]
    assert (result.finish_reason, result.num_steps, engine.stats.forwards - forwards) == ("read", 1, 2)


def test_a_template_longer_than_the_canvas_is_refused(engine):
    with pytest.raises(RequestError, match="canvas") as refused:
        engine.add_request([1, 2, 3], GenerationConfig(max_new_tokens=64, dllm_template=[-1] * (CANVAS + 1)))
    assert refused.value.param == "dllm_template"
    with pytest.raises(RequestError, match="canvas") as refused:  # a read without a template reads its output
        engine.add_request([1, 2, 3], GenerationConfig(max_new_tokens=CANVAS + 1, dllm_read_only=True))
    assert refused.value.param == "max_new_tokens"
    assert not engine.has_unfinished()


NARROW = 6  # a request's canvas narrower than the model's (vLLM's diffusion_canvas_length)


def test_narrow_canvases_among_full_ones_equal_the_reference(engine, model, vocab, prompt, refs):
    """`dllm_canvas_length` narrows a request's canvases: equal to the reference loop on canvases of that
    many positions, draw for draw, with a template and without, beside full-width requests."""
    template = [None, random_tokens(1, 5, vocab)[0], None, None]
    requests = {"narrow": (prompt, request({}, 4, dllm_canvas_length=NARROW)),
                "narrow_pins": (prompt, request({"template": template}, 5, dllm_canvas_length=NARROW)),
                "free0": (prompt, params(max_new_tokens=MAX_NEW, random_seed=0))}
    results = run(engine, requests)
    narrow = reference(model, prompt, 4, canvas_length=NARROW)
    pinned = reference(model, prompt, 5, canvas_length=NARROW, template=template)
    check(results["narrow"], narrow, {})
    check(results["narrow_pins"], pinned, {"template": template})
    check(results["free0"], refs["free0"], {})
    assert len(results["narrow"].dllm_replay_canvases) == -(-MAX_NEW // NARROW)
    assert narrow.tokens != reference(model, prompt, 4, canvas_length=NARROW + 1).tokens  # the width matters


def test_a_canvas_wider_than_the_models_is_refused(engine):
    with pytest.raises(RequestError, match="wider than this model's canvas") as refused:
        engine.add_request([1, 2, 3], GenerationConfig(max_new_tokens=8, dllm_canvas_length=CANVAS + 1))
    assert refused.value.param == "dllm_canvas_length"
    with pytest.raises(RequestError, match="canvas holds 3") as refused:
        engine.add_request([1, 2, 3], GenerationConfig(max_new_tokens=8, dllm_canvas_length=3,
                                                       dllm_template=[-1, -1, -1, -1]))
    assert refused.value.param == "dllm_template"
    assert not engine.has_unfinished()


# ---- tp=2: rank 0 runs the engine, rank 1 every forward it makes -----------------------------------
class RankZero:
    """The executor of an engine at tp=2: rank 0's runner in this process, each call first handed to
    rank 1 (`rank_one`, a sibling process) through `calls`, so both run the same forwards in order."""

    def __init__(self, spec, config, calls):
        from engine.model.layers.parallel import TPContext
        from engine.worker.runner import ModelRunner

        self.calls = calls
        calls.put(pickle.dumps((spec, config)))
        self.runner = ModelRunner(spec, config, TPContext(rank=0, size=2))
        self.num_pages, self.kv_groups = self.runner.num_pages, self.runner.kv_groups

    def _on_ranks(self, method: str, *args):
        self.calls.put(pickle.dumps((method, args)))
        return getattr(self.runner, method)(*args)

    def set_dllm_block_length(self, block_length):
        self._on_ranks("set_dllm_block_length", block_length)

    def execute(self, batch):
        return self._on_ranks("execute", batch)

    def run_on_ranks(self, method, *args, timeout_s=None):
        return [self._on_ranks(method, *args)]

    def describe(self):
        return {"executor": "test_rank_zero", **self.runner.describe()}

    def shutdown(self):
        self.calls.put(None)


def rank_one(calls) -> None:
    from engine.model.layers.parallel import TPContext
    from engine.worker.runner import ModelRunner

    spec, config = pickle.loads(calls.get())
    runner = ModelRunner(spec, config, TPContext(rank=1, size=2))
    while (call := calls.get()) is not None:
        method, args = pickle.loads(call)
        getattr(runner, method)(*args)


def _tp_rank(rank: int, path: str, port: int, calls, out: str, requests: dict) -> None:
    torch.set_num_threads(1)
    with gloo_rank(rank, port, feeds=(calls,)):
        if rank == 1:
            rank_one(calls)
            return
        eng = make_engine(path, lambda spec, config: RankZero(spec, config, calls), tp=2)
        try:
            results = run(eng, requests)
        finally:
            eng.shutdown()
        results = {rid: (r.token_ids, r.step_map, r.label_mass) for rid, r in results.items()}
        torch.save({"tp": eng.executor.runner.tp.size, "results": results}, out)


def test_tp2_equals_tp1_on_a_template_request(ckpt, engine, vocab, prompt, tmp_path):
    seed, decisions = cases(vocab)["sets"]
    requests = {"sets": (prompt, request(decisions, seed)),
                "free": (prompt, params(max_new_tokens=MAX_NEW, random_seed=4))}
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    calls = mp.get_context("spawn").Queue()
    out = str(tmp_path / "tp2.pt")
    mp.spawn(_tp_rank, args=(str(ckpt), port, calls, out, requests), nprocs=2, join=True)
    saved = torch.load(out)
    assert saved["tp"] == 2
    tp2 = saved["results"]
    tp1 = run(engine, requests)
    for rid, result in tp1.items():
        tokens, step_map, mass = tp2[rid]
        assert (tokens, step_map) == (result.token_ids, result.step_map)
        assert (mass is None) == (result.label_mass is None)
        for a, b in zip(mass or [], result.label_mass or [], strict=True):
            assert (a is None and b is None) or a == pytest.approx(b, abs=1e-5)
