"""Sampler: seeded sampling reproducible across runs and batch compositions (AR and DLLM), top-k=1
equals greedy, repetition penalty against HF, stop ids / stop words / min_new_tokens / ignore_eos."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from engine import EngineConfig, GenerationConfig, Response, pipeline
from testing.tiny_checkpoint import DLLM_TEST_LOGIT_SCALE, load_hf_reference, write_tiny_checkpoint


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def ar_spread(tmp_path_factory):
    """logit_scale 1: near-uniform distributions, so sampling really is random."""
    return str(write_tiny_checkpoint(tmp_path_factory.mktemp("ar_spread"), model_type="qwen3", seed=11))


@pytest.fixture(scope="module")
def ar_sharp(tmp_path_factory):
    """logit_scale 2: greedy choices are not near-ties."""
    return str(write_tiny_checkpoint(tmp_path_factory.mktemp("ar_sharp"), model_type="qwen3", seed=12,
                                     logit_scale=2.0))


@pytest.fixture(scope="module")
def dllm(tmp_path_factory):
    return str(write_tiny_checkpoint(tmp_path_factory.mktemp("sdar"), model_type="sdar", seed=13,
                                     logit_scale=DLLM_TEST_LOGIT_SCALE))


SAMPLED = GenerationConfig(max_new_tokens=8, ignore_eos=True, do_sample=True, temperature=0.9, top_k=60,
                           top_p=0.9, min_p=0.05, random_seed=1234)


def others() -> list[tuple[list[int], GenerationConfig]]:
    """Five unrelated requests: greedy, sampled with other seeds / settings, unseeded."""
    base = dict(max_new_tokens=6, ignore_eos=True)
    return [
        (prompt(7, 1), GenerationConfig(**base)),
        (prompt(15, 2), GenerationConfig(do_sample=True, random_seed=1, **base)),
        (prompt(3, 3), GenerationConfig(do_sample=True, temperature=1.5, top_p=0.5, random_seed=99, **base)),
        (prompt(11, 4), GenerationConfig(do_sample=True, **base)),  # no seed
        (prompt(9, 5), GenerationConfig(do_sample=True, top_k=5, min_p=0.1, random_seed=7, **base)),
    ]


def outputs(r):
    return (r.token_ids, r.step_map, r.text)


@pytest.mark.parametrize("model", ["ar", "dllm"])
def test_seeded_sampling_reproducible_across_batch_compositions(ar_spread, dllm, model):
    path = ar_spread if model == "ar" else dllm
    target = prompt(12, 100)
    cfg = EngineConfig(kv_block_size=4, dllm_block_length=4)
    with pipeline(path, cfg) as pipe:
        alone = outputs(pipe(target, SAMPLED))
        assert outputs(pipe(target, SAMPLED)) == alone, "same seed, same engine: same output"
        rest = others()
        orders = [
            [(target, SAMPLED)] + rest,
            list(reversed(rest[:2])) + [(target, SAMPLED)] + rest[2:],
        ]
        if model == "ar":  # cheaper per step: one more order
            orders.append(list(reversed(rest)) + [(target, SAMPLED)])
        for order in orders:
            ps, gs = [p for p, _ in order], [g for _, g in order]
            rids = [pipe.engine.add_request(p, g) for p, g in zip(ps, gs, strict=True)]
            resp = {rid: Response() for rid in rids}
            while pipe.engine.has_unfinished():
                for chunk in pipe.engine.step():
                    resp[chunk.request_id].add(chunk)
            got = outputs(resp[rids[ps.index(target)]])
            assert got == alone, "a seeded request must not depend on what else is in the batch"
        other_seed = outputs(pipe(target, SAMPLED.model_copy(update={"random_seed": 4321})))
    with pipeline(path, cfg) as fresh:  # a new engine instance
        assert outputs(fresh(target, SAMPLED)) == alone
    assert other_seed != alone, "a different seed should give a different sample"


def test_seeded_sampling_survives_preemption(ar_spread):
    prompts = [prompt(n, 200 + i) for i, n in enumerate([9, 5, 12, 7, 3, 10])]
    gens = [SAMPLED.model_copy(update={"random_seed": 10 + i}) for i in range(6)]

    def run(pipe):
        rids = [pipe.engine.add_request(p, g) for p, g in zip(prompts, gens, strict=True)]
        resp = {rid: Response() for rid in rids}
        for _ in range(300):
            for chunk in pipe.engine.step():
                resp[chunk.request_id].add(chunk)
            if not pipe.engine.has_unfinished():
                break
        assert not pipe.engine.has_unfinished(), "engine made no progress"
        return [resp[r].token_ids for r in rids]

    with pipeline(ar_spread, EngineConfig(kv_block_size=4)) as pipe:
        want = run(pipe)
    with pipeline(ar_spread, EngineConfig(kv_block_size=4, num_kv_blocks=7, enable_prefix_caching=False)) as pipe:
        got = run(pipe)
        assert pipe.engine.scheduler.num_preemptions > 0
    assert got == want


@pytest.mark.parametrize("model", ["ar", "dllm"])
def test_top_k_1_equals_greedy(ar_sharp, dllm, model):
    """top_k=1 picks the argmax. For DLLM the candidates are the same, but the confidence of a sampled
    candidate is its probability under the filtered distribution, 1.0 here: so the
    comparison uses `sequential`, whose choice of positions ignores confidence."""
    path = ar_sharp if model == "ar" else dllm
    target = prompt(10, 300)
    with pipeline(path, EngineConfig(dllm_block_length=4, dllm_unmasking_strategy="sequential")) as pipe:
        greedy = pipe(target, GenerationConfig(max_new_tokens=8, ignore_eos=True))
        sampled = pipe(target, GenerationConfig(max_new_tokens=8, ignore_eos=True, do_sample=True, top_k=1,
                                                temperature=0.7, random_seed=3))
        assert outputs(sampled) == outputs(greedy)
        zero_temp = pipe(target, GenerationConfig(max_new_tokens=8, ignore_eos=True, do_sample=True,
                                                  temperature=0.0))
        assert outputs(zero_temp) == outputs(greedy), "temperature 0 means greedy"


def test_dllm_sampled_confidence_is_filtered_probability(dllm):
    """top_k=1: every candidate has confidence 1.0 >= threshold, so low_confidence_dynamic reveals each
    whole block in one step."""
    target = prompt(8, 301)  # block-aligned prompt: every block has 4 masked positions
    with pipeline(dllm, EngineConfig(dllm_block_length=4)) as pipe:
        r = pipe(target, GenerationConfig(max_new_tokens=12, ignore_eos=True, do_sample=True, top_k=1))
    assert r.step_map == [1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3]


FILTERS = {
    "top_k": dict(top_k=3),
    "top_p": dict(top_p=0.2),
    "min_p": dict(min_p=0.6),
}


@pytest.mark.parametrize("name", list(FILTERS))
def test_sampling_filters_keep_only_allowed_tokens(ar_spread, name):
    """Every sampled token lies inside the filtered set computed from HF's logits for that step, and
    the reported logprobs stay the raw model's (logprobs_mode raw_logprobs), not the filtered ones."""
    target = prompt(5, 350)
    n = 12
    gen = GenerationConfig(max_new_tokens=n, ignore_eos=True, do_sample=True, random_seed=8, logprobs=0,
                           temperature=0.8, **FILTERS[name])
    with pipeline(ar_spread, EngineConfig(logprobs_mode="raw_logprobs")) as pipe:
        r = pipe(target, gen)
    hf = load_hf_reference(ar_spread)
    with torch.inference_mode():
        logits = hf(torch.tensor([target + r.token_ids])).logits[0, len(target) - 1 : -1].float()
    logprobs = logits.log_softmax(-1)
    probs = (logits / 0.8).softmax(-1)
    for step, (tok, entry) in enumerate(zip(r.token_ids, r.logprobs, strict=True)):
        p = probs[step]
        if name == "top_k":
            assert tok in torch.topk(p, 3).indices.tolist()
        elif name == "top_p":
            order = p.argsort(descending=True)
            before = p[order].cumsum(0) - p[order]
            nucleus = order[before < 0.2].tolist()  # the smallest prefix reaching 0.2
            assert tok in nucleus
        else:
            assert p[tok] >= 0.6 * p.max()
        assert abs(entry[tok] - float(logprobs[step, tok])) < 1e-4
    assert len(set(r.token_ids)) > 1


def test_repetition_penalty_matches_hf(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "rep", model_type="qwen3", seed=14, logit_scale=10.0)
    hf = load_hf_reference(path)
    hf.generation_config.eos_token_id = None
    target = prompt(8, 400)
    n = 16
    ids = torch.tensor([target])
    with torch.inference_mode():
        want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                           repetition_penalty=1.3)[0, len(target):].tolist()
        plain_hf = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                               do_sample=False)[0, len(target):].tolist()
    with pipeline(str(path)) as pipe:
        plain = pipe(target, GenerationConfig(max_new_tokens=n, ignore_eos=True)).token_ids
        penalized = pipe(target, GenerationConfig(max_new_tokens=n, ignore_eos=True, repetition_penalty=1.3))
    assert plain == plain_hf
    assert penalized.token_ids == want
    assert penalized.token_ids != plain, "the penalty should change this (repetitive) greedy output"


# ---- stopping -------------------------------------------------------------------------------

N = 24


@pytest.fixture(scope="module")
def ar_pipe(ar_sharp):
    """One engine on `ar_sharp` (default config) for this module's stopping tests: each request stands alone."""
    with pipeline(ar_sharp) as pipe:
        yield pipe


@pytest.fixture(scope="module")
def reference(ar_pipe):
    """A prompt, its greedy continuation without any stop, and a token that first appears at i >= 4."""
    target = prompt(6, 500)
    ref = ar_pipe(target, GenerationConfig(max_new_tokens=N, ignore_eos=True)).token_ids
    i = next(i for i in range(4, N - 4) if ref[i] not in ref[:i])
    return target, ref, i


def test_stop_token_ids(ar_pipe, reference):
    target, ref, i = reference
    stop = ref[i]
    tok = ar_pipe.tokenizer
    r = ar_pipe(target, GenerationConfig(max_new_tokens=N, stop_token_ids=[stop]))
    assert r.token_ids == ref[: i + 1], "cut at the first stop id, which is kept in token_ids"
    assert r.finish_reason == "stop"
    assert r.text == tok.decode(ref[:i], skip_special_tokens=True), "the stop id is dropped from text"
    assert r.generate_token_len == i + 1
    r2 = ar_pipe(target, GenerationConfig(max_new_tokens=N, stop_token_ids=[stop], include_stop_str_in_output=True))
    assert r2.token_ids == ref[: i + 1] and r2.finish_reason == "stop"
    assert r2.text == tok.decode(ref[: i + 1], skip_special_tokens=True)
    # ignore_eos does not disable explicit stop ids
    r3 = ar_pipe(target, GenerationConfig(max_new_tokens=N, stop_token_ids=[stop], ignore_eos=True))
    assert r3.token_ids == ref[: i + 1] and r3.finish_reason == "stop"
    # max_new_tokens before the stop: "length"
    r4 = ar_pipe(target, GenerationConfig(max_new_tokens=i, stop_token_ids=[stop]))
    assert r4.token_ids == ref[:i] and r4.finish_reason == "length"


def test_min_new_tokens_suppresses_stop_ids(ar_pipe, reference):
    target, ref, i = reference
    stop = ref[i]
    m = i + 3
    r = ar_pipe(target, GenerationConfig(max_new_tokens=N, stop_token_ids=[stop], min_new_tokens=m))
    assert len(r.token_ids) >= m
    assert stop not in r.token_ids[:m], "a stop id must not be produced before min_new_tokens"
    assert r.token_ids[:i] == ref[:i]
    if stop in r.token_ids:
        assert r.finish_reason == "stop" and r.token_ids.index(stop) == len(r.token_ids) - 1
    else:
        assert r.finish_reason == "length" and len(r.token_ids) == N


def first_with(ids: list[int], decode, word: str) -> int:
    """Smallest n such that `word` is in decode(ids[:n])."""
    return next(n for n in range(1, len(ids) + 1) if word in decode(ids[:n]))


def test_stop_words(ar_pipe, reference):
    target, ref, _ = reference
    tok = ar_pipe.tokenizer

    def decode(ids):
        return tok.decode(ids, skip_special_tokens=True)

    full = decode(ref)
    # a stop word spanning two generated tokens, taken from the middle of the output
    words = [decode(ref[j : j + 2]) for j in range(3, N - 3)]
    word = next(w for w in words if w.isprintable() and len(w) >= 2)
    n = first_with(ref, decode, word)
    cut = full.index(word)
    r = ar_pipe(target, GenerationConfig(max_new_tokens=N, stop_words=[word]))
    assert r.finish_reason == "stop"
    assert r.token_ids == ref[:n], "generation ends with the token that completes the stop word"
    assert r.text == decode(ref[:n])[:cut] == full[:cut]
    r2 = ar_pipe(target, GenerationConfig(max_new_tokens=N, stop_words=[word], include_stop_str_in_output=True))
    assert r2.token_ids == ref[:n] and r2.finish_reason == "stop"
    assert r2.text == full[: cut + len(word)]
    # a stop word that never appears changes nothing
    r3 = ar_pipe(target, GenerationConfig(max_new_tokens=N, stop_words=["\u2603 never"], ignore_eos=True))
    assert r3.token_ids == ref and r3.finish_reason == "length" and r3.text == full


def test_min_new_tokens_applies_to_stop_words(ar_pipe, reference):
    """min_new_tokens suppresses every stop condition, stop words included (as vLLM's min_tokens and
    lmdeploy's min_new_tokens do): the output is never shorter than asked."""
    target, ref, _ = reference
    tok = ar_pipe.tokenizer
    words = [tok.decode(ref[j : j + 2]) for j in range(3, N - 3)]
    word = next(w for w in words if w.isprintable() and len(w) >= 2)
    n = first_with(ref, tok.decode, word)
    r = ar_pipe(target, GenerationConfig(max_new_tokens=N, stop_words=[word], min_new_tokens=n + 2))
    assert len(r.token_ids) >= n + 2, f"stop word {word!r} ended generation after {len(r.token_ids)} tokens"


@pytest.fixture(scope="module")
def eos_ckpt(ar_sharp, reference, tmp_path_factory):
    """The same weights, with generation_config.json naming as eos a token greedy produces."""
    _, ref, i = reference
    path = tmp_path_factory.mktemp("eos") / "ckpt"
    shutil.copytree(ar_sharp, path)
    gen_file = path / "generation_config.json"
    gen = json.loads(gen_file.read_text())
    gen["eos_token_id"] = [ref[i]]
    gen_file.write_text(json.dumps(gen))
    return str(path)


@pytest.fixture(scope="module")
def eos_pipe(eos_ckpt):
    """One engine on `eos_ckpt` for the eos tests."""
    with pipeline(eos_ckpt) as pipe:
        yield pipe


def test_eos_stop_and_ignore_eos(eos_pipe, reference):
    target, ref, i = reference
    assert ref[i] in eos_pipe.engine.spec.eos_token_ids
    r = eos_pipe(target, GenerationConfig(max_new_tokens=N))
    assert r.token_ids == ref[: i + 1] and r.finish_reason == "stop"
    assert r.text == eos_pipe.tokenizer.decode(ref[:i], skip_special_tokens=True)
    ign = eos_pipe(target, GenerationConfig(max_new_tokens=N, ignore_eos=True))
    assert ign.token_ids == ref and ign.finish_reason == "length"


def test_min_new_tokens_matches_hf(eos_ckpt, eos_pipe, reference):
    target, ref, i = reference
    m = i + 2
    eos = sorted(eos_pipe.engine.spec.eos_token_ids)
    r = eos_pipe(target, GenerationConfig(max_new_tokens=N, min_new_tokens=m))
    hf = load_hf_reference(eos_ckpt)
    ids = torch.tensor([target])
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N, do_sample=False,
                          min_new_tokens=m, eos_token_id=eos, pad_token_id=eos[0])[0, len(target):].tolist()
    stops = [k for k, t in enumerate(out) if t in eos]
    want = out[: stops[0] + 1] if stops else out
    assert r.token_ids == want
    assert len(r.token_ids) > m - 1 and not set(r.token_ids[:m]) & set(eos)
    assert r.finish_reason == ("stop" if stops else "length")


def test_dllm_stop_token_ids(dllm):
    """DLLM: cut at the first stop id, kept in token_ids, step_map aligned."""
    target = prompt(7, 600)
    with pipeline(dllm, EngineConfig(dllm_block_length=4)) as pipe:
        ref = pipe(target, GenerationConfig(max_new_tokens=12, ignore_eos=True))
        i = next(i for i in range(2, 11) if ref.token_ids[i] not in ref.token_ids[:i])
        stop = ref.token_ids[i]
        r = pipe(target, GenerationConfig(max_new_tokens=12, stop_token_ids=[stop], ignore_eos=True))
    assert r.token_ids == ref.token_ids[: i + 1] and r.finish_reason == "stop"
    assert r.step_map == ref.step_map[: i + 1]
