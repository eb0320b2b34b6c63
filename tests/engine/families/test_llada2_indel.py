"""LLaDA2.2's insert/delete editing rule `joint_threshold_indel` against SGLang's released
JointThresholdInDel (bench/sglang_indel.py loads the released file): step by step on the same logits,
random and constructed to force DELETE, SPLIT, cleanup and the anti-loop rule; whole requests over
the full-recompute LLaDA2 reference; the step trace replayed; refusals."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch

# the oracle is SGLang's released file: without sglang (`pip install --no-deps sglang==0.5.23`, docs/rl.md;
# .ci/run installs it) these tests skip, as the trainers' caller tests do, rather than fail the collection
pytest.importorskip("sglang", reason="needs sglang==0.5.23 (pip install --no-deps; docs/rl.md)")

from bench.sglang_indel import ForwardBatch as SGLangBatch
from bench.sglang_indel import SGLangInDel, algorithm, changed_writes, recording_rescans
from configs import EngineConfig
from deployments.cli import app_args, build_parser
from engine import GenerationConfig, pipeline
from engine.core.decoding.indel import InDelBlock, indel_step
from engine.core.decoding.unmasking import SpecialIds, UnmaskingSettings
from engine.errors import RequestError
from testing.references.llada2_moe import LLaDA2Reference
from testing.tiny_llada2 import write_tiny_llada2

RULE = "joint_threshold_indel"
B = 32
TOL = 1e-4
DELETE, SPLIT = 128, 287  # tokens the tiny model writes now and then (not its most likely ones): DELETE, SPLIT
LENGTHS = (1, 31, 32, 33, 70)


def prompt_of(length: int, seed: int) -> list[int]:
    """Random prompt ids. (The seeds are offset: with `Random(1)` the one-token prompt meets a routing
    near-tie in the tiny model, two experts 2.4e-7 apart, where the paged engine's float rounding and
    the reference's pick different experts; tokens agree there, logprobs not to 1e-4.)"""
    rng = random.Random(seed + 1000)
    return [rng.randrange(300) for _ in range(length)]


# ---- step level: the same logits into both ----------------------------------------------------

MASK, DEL, SPL, V = 9, 10, 11, 12  # a small vocabulary: ordinary tokens 0..8


def settings(t: float, e: float, m: int) -> UnmaskingSettings:
    return UnmaskingSettings(RULE, 0, t, 0.35, e, m)


class Pair:
    """One block decoded by the released rule and by `indel_step` side by side, step by step."""

    def __init__(self, block: list[int], offset: int, t: float, e: float, m: int):
        self.algo = algorithm(len(block), MASK, DEL, SPL, threshold=t, edit_threshold=e, max_post_edit_steps=m)
        self.rescans = recording_rescans(self.algo)
        self.batch = SGLangBatch(1, torch.tensor(block), torch.tensor([[i < offset for i in range(len(block))]]))
        self.states = self.algo.init_step_state(self.batch)
        self.offset, self.settings = offset, settings(t, e, m)
        self.ours = InDelBlock([True] * (len(block) - offset))
        self.finished, self.inputs = False, []

    def step(self, logits: torch.Tensor) -> None:
        """One step of both on `logits` [B, V]; asserts they agree."""
        before = self.batch.input_ids.tolist()
        repeated = before in self.inputs
        self.inputs.append(before)
        self.rescans.clear()
        done = self.algo.step(self.batch, logits, self.states)[0]
        after = self.batch.input_ids.tolist()
        state, o = self.states[0], self.offset
        outcome = indel_step(self.ours, before[o:], logits[o:], o, len(before), self.settings,
                             SpecialIds(MASK, DEL, SPL))
        written = self.rescans[0][1] if self.rescans else None
        if outcome is None:
            assert done and state["finished"] and after == before
        else:
            assert [it.token for it in outcome.items] == after[o:]
            assert {o + i: t for i, t in outcome.writes.items()} == changed_writes(before, written, after)
            assert outcome.rescanned == bool(self.rescans)
            assert state["finished"] == outcome.cleanup
            assert done == (outcome.cleanup and not outcome.changed)  # SGLang's extra forward persists a change
            self.changed = outcome.changed
        assert state["is_orig_mask"].tolist()[o:] == self.ours.orig_mask
        assert (state["post_edit_steps"], state["num_update_steps"]) == (self.ours.post_edit_steps,
                                                                         self.ours.num_update_steps)
        self.finished = state["finished"]
        self.repeats = getattr(self, "repeats", 0) + (repeated and outcome is not None and not outcome.cleanup
                                                      and outcome.changed)  # the anti-loop rule ran
        self.outcome = outcome


def model_logits(block: list[int], seed: int, boost: dict[int, float], scale: float) -> torch.Tensor:
    """A deterministic 'model': logits as a function of the block (so that blocks can repeat and the
    anti-loop rule runs), with the columns in `boost` raised."""
    gen = torch.Generator().manual_seed(hash((seed, *block)) % 2**31)
    logits = torch.randn(len(block), V, generator=gen) * scale
    for token, amount in boost.items():
        logits[:, token] += amount
    return logits


@pytest.mark.parametrize("m", [0, 1, 3, 16])
@pytest.mark.parametrize("b,offset", [(8, 0), (8, 5), (32, 0), (32, 17)])
def test_steps_equal_the_released_rule(b, offset, m):
    """Many blocks of random model-like logits, edit tokens frequent: every step's block, writes, edit
    flags of the masks, counters and end equal the released rule's."""
    rng = random.Random(b * 100 + offset * 10 + m)
    counts = {"rescans": 0, "cleanups": 0, "repeats": 0, "ends_without_writes": 0}
    for case in range(25):
        t, e = rng.choice([0.5, 0.9, 0.2]), rng.choice([0.0, 0.3, 0.8])
        boost = {DEL: rng.uniform(0, 3), SPL: rng.uniform(0, 3), MASK: rng.uniform(-1, 2)}
        scale = rng.choice([0.5, 2.0, 6.0])
        prompt = [rng.randrange(DEL + 2) for _ in range(offset)]  # literal MASK / DELETE / SPLIT included
        pair = Pair(prompt + [MASK] * (b - offset), offset, t, e, m)
        for _ in range(b + m + 2):
            pair.step(model_logits(pair.batch.input_ids.tolist(), case, boost, scale))
            counts["rescans"] += bool(pair.rescans)
            if pair.finished:
                counts["cleanups" if pair.outcome is not None else "ends_without_writes"] += 1
                break
        assert pair.finished, "the released rule ends every block within its steps"
        counts["repeats"] += pair.repeats
    assert counts["rescans"] and counts["cleanups"] and counts["repeats"], counts


def test_constructed_steps():
    """Logits built to hit each branch: an original mask predicting MASK (its best other token), too few
    confident masks (topk of 1 + introduced), DELETE and SPLIT (SPLIT at the last position truncates),
    a block that repeats (anti-loop), the cleanup step scrubbing MASK / DELETE / SPLIT."""
    def rows(*prefs: tuple[int, float]) -> torch.Tensor:
        logits = torch.zeros(len(prefs), V)
        for r, (token, strength) in enumerate(prefs):
            logits[r, token] = strength
        return logits

    pair = Pair([3, MASK, MASK, MASK, MASK], 1, 0.5, 0.0, 2)
    pair.step(rows((0, 0), (MASK, 9), (DEL, 9), (SPL, 9), (4, 1)))  # fallback at 1, DELETE at 2, SPLIT at 3
    assert pair.outcome.rescanned and pair.outcome.deleted
    for _ in range(6):  # the same logits: the block repeats, the anti-loop rule picks other tokens
        if pair.finished:
            break
        pair.step(rows((0, 0), (MASK, 9), (DEL, 9), (SPL, 9), (SPL, 9)))
    assert pair.finished and pair.repeats
    pair = Pair([MASK] * 4, 0, 0.5, 0.0, 1)
    pair.step(rows((1, 9), (2, 9), (3, 9), (4, 9)))  # every mask: the post-edit budget of 1 is next
    pair.step(rows((MASK, 9), (DEL, 9), (SPL, 9), (5, 9)))  # cleanup: no MASK / DELETE / SPLIT written
    assert pair.outcome.cleanup and not {MASK, DEL, SPL} & {it.token for it in pair.outcome.items}
    pair = Pair([MASK] * 4, 0, 0.5, 0.0, 0)
    pair.step(rows((SPL, 9), (1, 9), (2, 9), (SPL, 9)))  # m = 0: revealing the last originals is the cleanup
    assert pair.outcome.cleanup


# ---- whole requests ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    # LLaDA2.2: block routing, 4 of the 8 experts per 32-token routing block
    path = write_tiny_llada2(tmp_path_factory.mktemp("llada2"), use_qkv_bias=True, use_bias=True, seed=0,
                             expert_capacity=4)
    return path, LLaDA2Reference(path)


@pytest.fixture(scope="module")
def llada2(tiny):
    path, ref = tiny
    config = EngineConfig(logprobs_mode="raw_logprobs", max_model_len=512, dllm_delete_token_id=DELETE,
                          dllm_split_token_id=SPLIT)
    with pipeline(str(path), config) as pipe:
        yield ref, pipe


def check(out, want, prompt: list[int], mask_id: int, case, template: list[int | None] = ()) -> None:
    """Tokens and finish reason as the released rule's; the trace's writes are its changing writes,
    step by step; replaying the trace (writes, then deletes and moves) over the template's pins gives
    its blocks, and the output's tokens, step_map and logprobs."""
    assert out.token_ids == want.output, case
    assert out.finish_reason == want.finish_reason, case
    steps = [(k, s) for k, block in enumerate(want.blocks) for s in block if s.writes]
    assert len(out.step_trace) == len(steps), case
    first_block = len(prompt) // B
    state: dict[int, tuple[int, int, float]] = {g: (t, 0, 0.0) for g, t in enumerate(template) if t is not None}
    for event, (k, step) in zip(out.step_trace, steps, strict=True):
        start = (first_block + k) * B
        shift = len(prompt) - start  # block position of generated index g: g + shift
        raw = torch.log_softmax(step.logits.float(), -1)
        writes = {g + shift: t for g, t in zip(event["positions"], event["token_ids"], strict=True)}
        assert writes == {i: t for i, t in step.writes.items() if t not in (DELETE, SPLIT)}, case
        assert ("moves" in event) == any(t in (DELETE, SPLIT) for t in step.writes.values()), case
        for g, token in zip(event["positions"], event["token_ids"], strict=True):
            state[g] = (token, event["step"], float(raw[g + shift, token]))
            if token == mask_id:
                del state[g]
        if "moves" in event:
            for g in event["deleted"]:
                state.pop(g, None)
            moved = {a: state.pop(a) for a, _ in event["moves"]}
            for a, b in event["moves"]:
                state[b] = moved[a]
        for i, token in enumerate(step.after):  # the replayed block is the released rule's
            if i - shift >= 0:
                assert state.get(i - shift, (mask_id,))[0] == token, (case, event["step"], i)
    n = len(out.token_ids)
    assert [state[g][:2] for g in range(n)] == list(zip(out.token_ids, out.step_map, strict=True)), case
    got = [entry[t] for entry, t in zip(out.logprobs, out.token_ids, strict=True)]
    assert got == pytest.approx([state[g][2] for g in range(n)], abs=TOL), case
    assert not {DELETE, SPLIT} & set(out.token_ids), case  # edit tokens are never output


def literal(prompt: list[int], mask_id: int) -> list[int]:
    """The prompt with a literal mask, DELETE and SPLIT id in it (ordinary prompt tokens)."""
    out = list(prompt)
    for k, token in enumerate((mask_id, DELETE, SPLIT)):
        out[(k * 7) % len(out)] = token
    return out


@pytest.mark.parametrize(("m", "e"), [(0, 0.0), (1, 0.0), (16, 0.0), (0, 0.6), (16, 0.6)])
def test_whole_requests_equal_the_released_rule(llada2, m, e):
    """Prompts of 1, 31, 32, 33 and 70 tokens (and the same with literal mask / DELETE / SPLIT ids),
    5 and 80 new tokens, post-edit budgets 0, 1 and 16, edit thresholds 0 and 0.6, batched, and some
    alone: equal to the released rule and loop over the full-recompute reference network."""
    ref, pipe = llada2
    mask_id = pipe.engine.decoding.mask_id
    prompts = [prompt_of(n, n) for n in LENGTHS]
    prompts += [literal(p, mask_id) for p in prompts if len(p) >= 3] + [[mask_id], [DELETE]]
    cases = [(p, n) for n in (5, 80) for p in prompts]
    params = [GenerationConfig(max_new_tokens=n, logprobs=0, return_step_trace=True, dllm_unmasking_strategy=RULE,
                               dllm_max_post_edit_steps=m, dllm_edit_threshold=e) for _, n in cases]
    outs = pipe([p for p, _ in cases], params)
    alone = {i: pipe(cases[i][0], params[i]) for i in range(0, len(cases), 5)}
    oracle = SGLangInDel(ref.logits, B, mask_id, DELETE, SPLIT, set(pipe.engine.spec.eos_token_ids), threshold=0.5,
                         edit_threshold=e, max_post_edit_steps=m)
    wants = oracle.generate([p for p, _ in cases], [n for _, n in cases])
    for (prompt, n), out, want in zip(cases, outs, wants, strict=True):
        check(out, want, prompt, mask_id, (len(prompt), n, m, e))
    for i, out in alone.items():
        assert (out.token_ids, out.step_map, out.step_trace) == (outs[i].token_ids, outs[i].step_map,
                                                                  outs[i].step_trace)
    written = [t for want in wants for block in want.blocks for step in block for t in step.writes.values()]
    if e == 0.0:  # (at edit threshold 0.6 and m = 0 these weights write DELETE but no SPLIT)
        assert any("moves" in ev for out in outs for ev in out.step_trace), "the cases delete or split"
        assert DELETE in written and SPLIT in written, "the cases write both edit tokens"


def test_templates_keep_their_pins_in_place(llada2):
    """A template under the rule: its pinned positions are never written, deleted, split or moved
    (the rescan runs between them), every request equal to the released rule and loop with the pins
    in the block's prompt mask and the rescan kept between them (`PinnedInDel`), batched with free
    requests and alone; the cases delete and split around the pins."""
    ref, pipe = llada2
    mask_id = pipe.engine.decoding.mask_id
    rng = random.Random(7)

    def template(length: int) -> list[int | None]:
        return [rng.choice(ordinary) if rng.random() < 0.3 else None for _ in range(length)]

    prompts = [prompt_of(n, n) for n in (1, 31, 33, 70)]
    ordinary = [t for t in range(300) if t not in (mask_id, DELETE, SPLIT)]
    cases = [(p, n, template(t)) for n, t in ((40, 12), (80, 70)) for p in prompts]
    cases += [(prompts[0], 40, []), (prompts[2], 80, [])]  # free requests in the same batch
    params = [GenerationConfig(max_new_tokens=n, logprobs=0, return_step_trace=True, dllm_unmasking_strategy=RULE,
                               dllm_max_post_edit_steps=1, dllm_template=t or None) for _, n, t in cases]
    outs = pipe([p for p, _, _ in cases], params)
    oracle = SGLangInDel(ref.logits, B, mask_id, DELETE, SPLIT, set(pipe.engine.spec.eos_token_ids), threshold=0.5,
                         edit_threshold=0.0, max_post_edit_steps=1)
    wants = oracle.generate([p for p, _, _ in cases], [n for _, n, _ in cases], [t for _, _, t in cases])
    for (prompt, n, t), out, want in zip(cases, outs, wants, strict=True):
        check(out, want, prompt, mask_id, (len(prompt), n, t), t)
        for g, token in enumerate(t[: len(out.token_ids)]):
            if token is not None:
                assert (out.token_ids[g], out.step_map[g]) == (token, 0), (len(prompt), g)
    pinned_moves = [ev for (_, _, t), out in zip(cases, outs, strict=True) if t for ev in out.step_trace
                    if "moves" in ev]
    assert pinned_moves, "the templated cases delete or split"
    alone = pipe(cases[1][0], params[1])
    assert (alone.token_ids, alone.step_map, alone.step_trace) == (outs[1].token_ids, outs[1].step_map,
                                                                    outs[1].step_trace)


def test_sets_and_reads_are_refused_templates_served(llada2):
    _, pipe = llada2
    base = dict(max_new_tokens=8, dllm_unmasking_strategy=RULE, dllm_template=[None, 5, None])
    for extra, field in ((dict(dllm_allowed_token_ids=[1, 2]), "dllm_allowed_token_ids"),
                         (dict(dllm_read_only=True), "dllm_read_only")):
        with pytest.raises(RequestError, match="stay at its slot") as e:
            pipe([1, 2], GenerationConfig(**base, **extra))
        assert e.value.param == field
    with pytest.raises(RequestError, match="DELETE or SPLIT") as e:
        pipe([1, 2], GenerationConfig(**{**base, "dllm_template": [None, DELETE]}))
    assert e.value.param == "dllm_template"
    assert pipe([1, 2], GenerationConfig(**base)).token_ids[1] == 5


def test_replay_fields_and_samples(llada2):
    """`return_dllm_replay`: the last block as it ended; `n` greedy samples are equal."""
    _, pipe = llada2
    params = GenerationConfig(max_new_tokens=40, dllm_unmasking_strategy=RULE, return_dllm_replay=True,
                              return_block_step_map=True, n=2, random_seed=3)
    first, second = pipe(prompt_of(33, 2), params)
    assert (first.token_ids, first.step_map) == (second.token_ids, second.step_map)
    assert first.dllm_replay_token_ids[: first.dllm_stop_length] == first.token_ids[-first.dllm_stop_length:]
    assert first.dllm_replay_step_maps[: first.dllm_stop_length] == first.step_map[-first.dllm_stop_length:]


def test_ids_from_config_json(tiny, tmp_path):
    """config.json's delete_token_id / split_token_id name the edit tokens (EngineConfig's only fill in)."""
    path, _ = tiny
    ckpt = shutil.copytree(path, tmp_path / "ckpt")
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, "delete_token_id": DELETE, "split_token_id": SPLIT}))
    params = GenerationConfig(max_new_tokens=40, dllm_unmasking_strategy=RULE)
    with pipeline(str(ckpt), EngineConfig(max_model_len=256, dllm_delete_token_id=1, dllm_split_token_id=2)) as pipe:
        assert (pipe.engine.decoding.ids.delete_id, pipe.engine.decoding.ids.split_id) == (DELETE, SPLIT)
        from_json = pipe(prompt_of(31, 1), params)
    with pipeline(str(path), EngineConfig(max_model_len=256, dllm_delete_token_id=DELETE,
                                          dllm_split_token_id=SPLIT)) as pipe:
        assert pipe(prompt_of(31, 1), params).token_ids == from_json.token_ids


# ---- knobs and refusals ------------------------------------------------------------------


def test_threshold_defaults_to_half_for_this_rule(tiny):
    path, _ = tiny
    ids = dict(dllm_delete_token_id=DELETE, dllm_split_token_id=SPLIT, max_model_len=256)
    indel = GenerationConfig(dllm_unmasking_strategy=RULE)
    with pipeline(str(path), EngineConfig(**ids)) as pipe:
        assert pipe.engine.unmasking_settings(indel).confidence_threshold == 0.5
        assert pipe.engine.unmasking_settings(GenerationConfig()).confidence_threshold == 0.95  # the family's
        assert pipe.engine.unmasking_settings(indel.model_copy(update={"dllm_confidence_threshold": 0.7})
                                              ).confidence_threshold == 0.7
    with pipeline(str(path), EngineConfig(dllm_confidence_threshold=0.8, **ids)) as pipe:
        assert pipe.engine.unmasking_settings(indel).confidence_threshold == 0.8  # the user's engine setting


def test_refusals(llada2, tiny):
    _, pipe = llada2
    base = dict(max_new_tokens=4, dllm_unmasking_strategy=RULE)
    # sampling is refused naming the temperature the user set (an unset one decodes greedily)
    for field, value, extra, param in (("do_sample", True, {"temperature": 0.7}, "temperature"),
                                       ("repetition_penalty", 1.2, {}, "repetition_penalty"),
                                       ("min_new_tokens", 2, {}, "min_new_tokens"),
                                       ("dllm_penalty_lambda", 1.0, {}, "dllm_penalty_lambda")):
        with pytest.raises(RequestError, match=param) as e:
            pipe([1, 2], GenerationConfig(**base, **extra, **{field: value}))
        assert e.value.param == param
    trajectory = GenerationConfig(max_new_tokens=0, logprobs=0, dllm_unmasking_strategy=RULE,
                                  dllm_trajectory={"output_ids": [5, 6], "step_map": [1, 2]})
    with pytest.raises(RequestError, match="dllm_trajectory"):
        pipe([1, 2, 3], trajectory)
    path, _ = tiny
    with pipeline(str(path), EngineConfig(max_model_len=256)) as plain:  # no edit tokens
        with pytest.raises(RequestError, match="delete_token_id") as e:
            plain([1, 2], GenerationConfig(**base))
        assert e.value.param == "dllm_unmasking_strategy"
    for bad in (dict(dllm_unmasking_strategy=RULE), dict(dllm_delete_token_id=10**6, dllm_split_token_id=SPLIT),
                dict(dllm_delete_token_id=DELETE, dllm_split_token_id=DELETE)):
        with pytest.raises(ValueError, match="dllm_"), pipeline(str(path), EngineConfig(max_model_len=256, **bad)):
            pass


def test_sglang_flags(tmp_path):
    algo = tmp_path / "algo.yaml"
    algo.write_text("threshold: 0.6\nedit_threshold: 0.1\nmax_post_edit_steps: 8\nblock_size: 32\n")
    argv = ["serve", "ckpt", "--dllm-algorithm", "JointThresholdInDel", "--dllm-algorithm-config", str(algo)]
    engine = app_args(build_parser().parse_args(argv))["engine"]
    assert EngineConfig(**engine).model_dump(include=set(engine)) == {
        "dllm_unmasking_strategy": RULE, "dllm_confidence_threshold": 0.6, "dllm_edit_threshold": 0.1,
        "dllm_max_post_edit_steps": 8, "dllm_block_length": 32}


def test_the_bench_runs_and_agrees_with_the_released_rule():
    """`python -m bench.llada2 --indel --toy`'s measuring part, at one block of new tokens (the
    whole-request tests above cover several): every request identical to the released rule's."""
    from bench.llada2 import run_indel

    result = run_indel(32, toy=True)
    for concurrent in (1, 8):
        part = result[f"indel/{concurrent}"]
        assert part["identical_requests"] == part["requests"] == concurrent, part
