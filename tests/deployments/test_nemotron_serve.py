"""Nemotron-Labs-Diffusion on every surface, against the release's loops (reference.py) on the tiny checkpoint:

- a tensor-parallel (tp=2: rank 1 a Ray TPWorker, gloo) deployment answers SGLang `/generate` with each
  `sampling_params.dllm_mode` exactly as the in-process tp=1 engine and the loops do (tokens, step maps,
  linear_spec's `nfe` and `acceptance_lengths`), and OpenAI `/v1/chat/completions` through the
  checkpoint's chat template with `dllm_mode` as an extra field;
- weights updated in place (disk at tp=2 over HTTP, tensors in process, the untied `diffusion_head`
  alone too) make every mode decode as the new weights' loops; requests in flight across an update
  finish on the old weights, requests that arrive meanwhile run on the new ones, and
  `abort_all_requests` ends those in flight (as for the other families);
- `engine.lmdeploy` decodes the chat-templated prompt as the diffusion loop; JetEngine refuses the
  family naming its paradigm; `python -m engine.trace` records a diffusion request's step trace.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch
from ray import serve

from engine import EngineConfig, GenerationConfig, pipeline
from engine.async_engine import AsyncEngine
from engine.carrier import Response
from engine.model.checkpoint import iter_weights
from testing.references import nemotron_labs_diffusion as ref
from testing.tiny.nemotron_labs_diffusion import load_ministral3, write_tiny_nemotron_labs_diffusion
from tests.support.async_engine import collect, queue_in_order, run
from tests.support.nemotron import NEW_TOKENS, assert_same, assert_speculated, diffusion, gen, make_prompt, speculation
from tests.support.serve import deploy

ENGINE = {"max_model_len": 128, "kv_block_size": 8, "num_kv_blocks": 64, "logprobs_mode": "raw_logprobs"}
LOGIT_SCALE = 8.0  # several reveals per diffusion step at threshold 0.9
# one request per mode, each its own prompt length (blocks start at different offsets)
MODES = {"diffusion": ({"dllm_confidence_threshold": 0.9}, 7), "ar": ({}, 20), "linear_spec": ({}, 40)}
CHAT = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, str]:
    """Two tiny checkpoints of the same shape whose weights (the diffusion head too) differ."""
    root = tmp_path_factory.mktemp("nld_serve")
    return {k: str(write_tiny_nemotron_labs_diffusion(root / k, seed=seed, logit_scale=LOGIT_SCALE))
            for k, seed in (("a", 5), ("b", 6))}


@pytest.fixture(scope="module")
def ids(ckpts) -> dict:
    cfg = json.loads(Path(ckpts["a"], "config.json").read_text())
    return {"mask_id": cfg["mask_token_id"], "block": cfg["block_size"], "eos": cfg["eos_token_id"]}


@pytest.fixture(scope="module")
def models(ckpts) -> dict:
    return {k: load_ministral3(path) for k, path in ckpts.items()}


@pytest.fixture(scope="module")
def pipe(ckpts):
    """The in-process tp=1 engine on checkpoint a."""
    with pipeline(ckpts["a"], EngineConfig(**ENGINE)) as p:
        yield p


@pytest.fixture(scope="module")
def app(serve_cluster, ckpts):
    served = deploy(serve_cluster, "nemotron_tp2", ckpts["a"], dict(ENGINE, tp=2))
    yield served
    serve.delete(served.name)


def mode_config(mode: str, **fields) -> GenerationConfig:
    return gen(MODES[mode][0].get("dllm_confidence_threshold"), dllm_mode=mode, **fields)


def loop(model, ids: dict, mode: str, prompt: list[int]) -> ref.LoopResult:
    """The release loop of `mode` on `prompt`, greedy, NEW_TOKENS long, no eos."""
    if mode == "ar":
        return ref.ar_generate(model, prompt, max_new_tokens=NEW_TOKENS, eos_ids=set())
    if mode == "linear_spec":
        return speculation(model, ids, prompt)
    return diffusion(model, ids, prompt, MODES[mode][0]["dllm_confidence_threshold"])


def assert_loop(out: Response, want: ref.LoopResult, mode: str) -> None:
    """An engine response is its mode's loop: `ar` has no step map, `linear_spec` the loop's forwards
    and acceptance lengths."""
    if mode == "ar":
        assert out.token_ids == want.token_ids and out.step_map is None
    elif mode == "linear_spec":
        assert_speculated(out, want)
    else:
        assert_same(out, want)


def generate_body(prompts: list[list[int]], modes: list[str]) -> dict:
    """One SGLang /generate batch, greedy, each prompt with its mode's sampling_params."""
    params = [{"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True, "dllm_mode": mode,
               **MODES[mode][0]} for mode in modes]
    return {"input_ids": prompts, "sampling_params": params, "return_logprob": True}


def assert_body(body: dict, want: Response) -> None:
    """A /generate answer carries the engine response's tokens, step map, forwards, acceptance lengths
    and logprobs (tp=2 sums in another order: within 1e-4)."""
    meta = body["meta_info"]
    assert body["output_ids"] == want.token_ids and meta["step_map"] == want.step_map
    assert meta["finish_reason"]["type"] == want.finish_reason
    assert meta.get("nfe") == want.nfe and meta.get("acceptance_lengths") == want.acceptance_lengths
    assert [r[0] for r in meta["output_token_logprobs"]] == pytest.approx(
        [next(iter(e.values())) for e in want.logprobs], abs=1e-4)


def every_mode_over_http(app, models: dict, ids: dict, key: str, tp1: list[Response] | None = None) -> None:
    """Each mode's request in one /generate batch decodes as checkpoint `key`'s loops (and as `tp1`)."""
    prompts = [make_prompt(length) for _, length in MODES.values()]
    got = httpx.post(app.url + "/generate", json=generate_body(prompts, list(MODES)), timeout=300)
    assert got.status_code == 200, got.text
    for body, mode, prompt, i in zip(got.json(), MODES, prompts, range(len(MODES)), strict=True):
        served = Response(token_ids=body["output_ids"], step_map=body["meta_info"]["step_map"],
                          num_steps=body["meta_info"].get("dllm_num_steps"), nfe=body["meta_info"].get("nfe"),
                          acceptance_lengths=body["meta_info"].get("acceptance_lengths"),
                          logprobs=[{t: v} for v, t, *_ in body["meta_info"]["output_token_logprobs"]])
        assert_loop(served, loop(models[key], ids, mode, prompt), mode)
        if tp1 is not None:
            assert_body(body, tp1[i])


def test_the_two_checkpoints_decode_differently_in_every_mode(models, ids):
    """What makes the update tests tell the weights apart."""
    for mode, (_, length) in MODES.items():
        prompt = make_prompt(length)
        assert loop(models["a"], ids, mode, prompt).token_ids != loop(models["b"], ids, mode, prompt).token_ids, mode


# ---- tp=2 over HTTP ------------------------------------------------------------------------------------
def test_tp2_generate_equals_tp1_in_every_mode(app, pipe, models, ids):
    stats = serve.get_app_handle(app.name).engine_stats.remote().result()
    assert [(s["tp"], s["executor"]) for s in stats] == [(2, "ray_tp")]
    prompts = [make_prompt(length) for _, length in MODES.values()]
    tp1 = pipe(prompts, [mode_config(mode) for mode in MODES])
    every_mode_over_http(app, models, ids, "a", tp1)


def chat_ids(tokenizer) -> list[int]:
    text = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


def test_chat_completions_take_dllm_mode(app, pipe, models, ids):
    """The chat template renders the prompt (ending `<think></think>`); each mode's choice is the
    tp=1 engine's on those ids, stopped at the checkpoint's eos; linear_spec's carries its forwards."""
    prompt = chat_ids(pipe.tokenizer)
    assert pipe.tokenizer.decode(prompt).endswith("<|im_start|>assistant\n<think></think>")
    for mode, (knobs, _) in MODES.items():
        body = {"messages": CHAT, "max_tokens": 16, "temperature": 0, "dllm_mode": mode, **knobs}
        got = httpx.post(app.url + "/v1/chat/completions", json=body, timeout=300)
        assert got.status_code == 200, got.text
        choice = got.json()["choices"][0]
        want = pipe(prompt, GenerationConfig(max_new_tokens=16, temperature=0, dllm_mode=mode, **knobs))
        assert choice["message"] == {"role": "assistant", "content": want.text}, mode
        assert choice["step_map"] == want.step_map and choice["finish_reason"] == want.finish_reason, mode
        assert choice.get("nfe") == want.nfe and choice.get("acceptance_lengths") == want.acceptance_lengths, mode
    spec = ref.linear_spec_generate(models["a"], prompt, max_new_tokens=16, block_length=ids["block"],
                                    mask_id=ids["mask_id"], eos_ids={ids["eos"]})
    assert want.token_ids == spec.token_ids and want.nfe == spec.nfe


def test_tp2_update_from_disk_reaches_every_rank(app, ckpts, models, ids):
    """Both ranks load checkpoint b (each its slice of the vocabulary-split diffusion head): every mode
    decodes as b's loops; back on a, as a's."""
    for key in ("b", "a"):
        r = httpx.post(app.url + "/update_weights_from_disk", json={"model_path": ckpts[key], "weight_version": key},
                       timeout=300)
        assert r.status_code == 200 and r.json()["success"], r.text
        every_mode_over_http(app, models, ids, key)


# ---- weight updates in process ------------------------------------------------------------------------
@pytest.fixture
def engine(ckpts):
    eng = AsyncEngine(ckpts["a"], EngineConfig(**ENGINE))
    yield eng
    eng.shutdown()


def named_tensors(path: str) -> list[tuple[str, torch.Tensor]]:
    return [(name, weight[...]) for name, weight in iter_weights(path)]


def each_mode(eng: AsyncEngine) -> dict[str, Response]:
    async def main():
        return {mode: await collect(eng, make_prompt(length), mode_config(mode)) for mode, (_, length) in MODES.items()}

    return run(main())


def test_tensor_updates_the_whole_model_and_the_head_alone(engine, ckpts, models, ids):
    """b's tensors: b's loops; then a's `diffusion_head.weight` alone: the loops of b's decoder under a's head."""
    run(engine.update_weights_from_tensor(named_tensors(ckpts["b"]), weight_version="b"))
    for mode, out in each_mode(engine).items():
        assert_loop(out, loop(models["b"], ids, mode, make_prompt(MODES[mode][1])), mode)
        assert out.weight_version == "b"
    head = [(n, t) for n, t in named_tensors(ckpts["a"]) if n == "diffusion_head.weight"]
    run(engine.update_weights_from_tensor(head, weight_version="head"))
    hybrid = load_ministral3(ckpts["b"])
    hybrid.lm_head.weight.data.copy_(head[0][1])
    for mode, out in each_mode(engine).items():
        prompt = make_prompt(MODES[mode][1])
        assert_loop(out, loop(hybrid, ids, mode, prompt), mode)
        assert out.token_ids != loop(models["b"], ids, mode, prompt).token_ids, mode


def test_an_update_waits_for_requests_in_flight_and_holds_new_ones(engine, ckpts, models, ids):
    """diffusion and linear_spec requests in flight finish on a's weights; an `ar` request that arrives
    during the update runs on b's."""
    prompts = {mode: make_prompt(length) for mode, (_, length) in MODES.items()}
    spec, blocks, update, new = run(queue_in_order(
        engine, collect(engine, prompts["linear_spec"], mode_config("linear_spec")),
        collect(engine, prompts["diffusion"], mode_config("diffusion")),
        engine.update_weights_from_disk(ckpts["b"], weight_version="new"),
        collect(engine, prompts["ar"], mode_config("ar"))))
    for out, mode in ((spec, "linear_spec"), (blocks, "diffusion")):  # generated entirely by the old weights
        assert_loop(out, loop(models["a"], ids, mode, prompts[mode]), mode)
        assert out.weight_version == "default"
    assert update.weight_version == "new"
    assert_loop(new, loop(models["b"], ids, "ar", prompts["ar"]), "ar")  # held until the update was done
    assert new.weight_version == "new"


def test_abort_all_requests_ends_the_requests_in_flight_before_the_update(engine, ckpts, models, ids):
    prompt = make_prompt(MODES["diffusion"][1])
    blocks, update = run(queue_in_order(
        engine, collect(engine, prompt, mode_config("diffusion")),
        engine.update_weights_from_disk(ckpts["b"], weight_version="b", abort_all_requests=True)))
    assert blocks.finish_reason == "abort" and blocks.weight_version == "default"
    assert update.weight_version == "b"
    out = run(collect(engine, prompt, mode_config("diffusion")))
    assert_loop(out, loop(models["b"], ids, "diffusion", prompt), "diffusion")


# ---- the adapters and the trace -------------------------------------------------------------------
def test_lmdeploy_decodes_the_chat_template_as_the_diffusion_loop(ckpts, models, ids):
    """lmdeploy's pipeline renders a str prompt with the chat template and decodes it in the family's
    default mode (diffusion) under lmdeploy's default threshold (0.85); the eos that ends it is dropped,
    as lmdeploy drops it. lmdeploy's default top_k (50) is a sampling filter, left out of a greedy request."""
    from engine.lmdeploy import GenerationConfig as LmdeployGeneration
    from engine.lmdeploy import PytorchEngineConfig
    from engine.lmdeploy import pipeline as lmdeploy_pipeline

    backend = PytorchEngineConfig(session_len=128, block_size=8, cache_max_entry_count=0.05)
    with lmdeploy_pipeline(ckpts["a"], backend) as lm:
        out = lm("hello", LmdeployGeneration(max_new_tokens=16))
        prompt = chat_ids(lm.tokenizer)
    want = diffusion(models["a"], ids, prompt, backend.dllm_confidence_threshold, eos={ids["eos"]}, new_tokens=16)
    kept = len(want.token_ids) - (want.finish_reason == "stop")
    assert out.input_token_len == len(prompt) and out.finish_reason == want.finish_reason
    assert (out.token_ids, out.step_map) == (want.token_ids[:kept], want.step_map[:kept])


def test_jetengine_refuses_the_family_naming_its_paradigm(ckpts):
    from engine.jetengine import LLM

    with pytest.raises(ValueError, match="model_type 'nemotron_labs_diffusion'.*seeded_block decoding"):
        LLM(ckpts["a"])


def test_trace_records_a_diffusion_requests_steps(ckpts, models, ids, tmp_path, capsys):
    """`python -m engine.trace` decodes in the family's default mode: the step map is the diffusion
    loop's, and each step of the trace wrote exactly the positions that step revealed."""
    from engine.trace import main

    path = tmp_path / "trace.json"
    assert main([ckpts["a"], "hello", "--max-new-tokens", "16", "--no-colour", "--json", str(path)]) == 0
    body = json.loads(path.read_text())
    with pipeline(ckpts["a"], EngineConfig(**ENGINE)) as p:
        prompt = list(p.tokenizer.encode("hello", add_special_tokens=False))
    want = diffusion(models["a"], ids, prompt, eos={ids["eos"]}, new_tokens=16)
    meta = body["meta_info"]
    assert body["output_ids"] == want.token_ids and meta["step_map"] == want.step_map
    assert body["trace"]["paradigm"] == "seeded_block" and body["trace"]["block_length"] == ids["block"]
    for event in meta["step_trace"]:
        revealed = [i for i, s in enumerate(want.step_map) if s == event["step"]]
        assert event["positions"] == revealed
        assert event["token_ids"] == [want.token_ids[i] for i in revealed]
    assert sorted(i for e in meta["step_trace"] for i in e["positions"]) == list(range(len(want.token_ids)))
    assert f"{len(want.token_ids)} tokens in {meta['dllm_num_steps']} steps" in capsys.readouterr().out
