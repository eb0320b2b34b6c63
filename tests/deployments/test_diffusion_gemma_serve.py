"""DiffusionGemma served over real HTTP from a tensor-parallel (tp=2) deployment: SGLang's /generate
body and OpenAI's /v1/completions give transformers' seeded `generate()` tokens and the settle steps
of its drafts; `n` samples are seeded seed, seed+1; streams deliver whole canvases; the renoising
knobs are taken per request and the other paradigms' knobs, penalties and scoring are 400s naming
the field."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from ray import serve

from bench.diffusion_gemma import converging_checkpoint
from testing.references.diffusion_gemma import Drafts, load_reference, renoise, settle_steps
from tests.support.serve import deploy
from tests.support.viewer import CHROMEDRIVER, CHROMIUM, browser, cells, console_errors, open_page  # noqa: F401 (a fixture)

pytest.importorskip("transformers.models.diffusion_gemma")
CANVAS = 16
KNOBS = {"dllm_max_denoising_steps": 12, "dllm_stability_threshold": 0, "dllm_stop_entropy": 0.8}
ENGINE = {"max_model_len": 512, "kv_block_size": 4, "num_kv_blocks": 512, "max_batch_size": 16, **KNOBS}
PROMPT = list(range(30, 39))
MAX_NEW = 40
SEEDS = (0, 1)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return converging_checkpoint(tmp_path_factory.mktemp("dg_serve") / "tiny", CANVAS, num_global_key_value_heads=2)


@pytest.fixture(scope="module")
def oracle(ckpt):
    """transformers' generate() per seed: its first MAX_NEW tokens and their settle steps."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model = load_reference(ckpt)
    out = {}
    for seed in SEEDS:
        drafts = Drafts()
        torch.manual_seed(seed)
        seqs = model.generate(torch.tensor([PROMPT]), max_new_tokens=MAX_NEW, streamer=drafts, t_min=0.4, t_max=0.8,
                              max_denoising_steps=12, stability_threshold=0, confidence_threshold=0.8).sequences
        out[seed] = (seqs[0, len(PROMPT):].tolist()[:MAX_NEW], settle_steps(drafts)[:MAX_NEW])
    torch.set_num_threads(threads)
    return out


@pytest.fixture(scope="module")
def app(serve_cluster, ckpt):
    served = deploy(serve_cluster, "dg_tp2", ckpt, dict(ENGINE, tp=2))
    yield served
    serve.delete(served.name)


def test_sglang_body_equals_transformers(app, oracle):
    body = {"input_ids": [PROMPT, PROMPT], "sampling_params": [{"max_new_tokens": MAX_NEW, "sampling_seed": s}
                                                                for s in SEEDS], "return_dllm_replay": True}
    got = httpx.post(app.url + "/generate", json=body, timeout=600)
    assert got.status_code == 200, got.text
    for out, seed in zip(got.json(), SEEDS, strict=True):
        tokens, settle = oracle[seed]
        meta = out["meta_info"]
        assert out["output_ids"] == tokens and meta["step_map"] == settle
        assert meta["finish_reason"]["type"] == "length"
        canvases = meta["dllm_replay_canvases"]
        assert len(canvases) == 3 and {c["stop"] for c in canvases} <= {"stable", "max_steps"}
        assert max(settle) <= sum(c["steps"] for c in canvases) == meta["dllm_num_steps"]


def test_n_samples_are_seeded_seed_and_seed_plus_one(app, oracle):
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": MAX_NEW, "n": 2, "sampling_seed": SEEDS[0]}}
    got = httpx.post(app.url + "/generate", json=body, timeout=600).json()
    assert [o["output_ids"] for o in got] == [oracle[s][0] for s in SEEDS]


def test_openai_completion_and_stream(app, oracle):
    tokens, settle = oracle[SEEDS[1]]
    ref = httpx.post(app.url + "/generate", json={"input_ids": PROMPT, "sampling_params": {
        "max_new_tokens": MAX_NEW, "sampling_seed": SEEDS[1], "skip_special_tokens": True}}, timeout=600).json()
    assert ref["output_ids"] == tokens
    body = {"prompt": PROMPT, "max_tokens": MAX_NEW, "seed": SEEDS[1]}
    choice = httpx.post(app.url + "/v1/completions", json=body, timeout=600).json()["choices"][0]
    assert choice["text"] == ref["text"] and choice["step_map"] == settle
    # a stream's deltas end on canvas boundaries (tokens are final when their canvas ends)
    sizes = []
    with httpx.stream("POST", app.url + "/generate", timeout=600, json={
            "input_ids": PROMPT, "stream": True, "sampling_params": {"max_new_tokens": MAX_NEW,
                                                                     "sampling_seed": SEEDS[1]}}) as r:
        for line in r.iter_lines():
            if line.startswith("data:") and line != "data: [DONE]":
                sizes.append(len(json.loads(line[5:])["output_ids"]))
    assert sizes[-1] == MAX_NEW and set(sizes) <= {0, CANVAS, 2 * CANVAS, MAX_NEW}


def test_per_request_knobs_change_the_schedule(app, oracle):
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": CANVAS, "sampling_seed": 0,
                                                     "dllm_max_denoising_steps": 3, "dllm_t_max": 0.9},
            "return_dllm_replay": True}
    meta = httpx.post(app.url + "/generate", json=body, timeout=600).json()["meta_info"]
    assert meta["dllm_replay_canvases"][0]["steps"] <= 3 and max(meta["step_map"]) <= 3


@pytest.mark.parametrize(("field", "value"), [("dllm_confidence_threshold", 0.5), ("dllm_block_length", 16),
                                              ("repetition_penalty", 1.2), ("min_new_tokens", 2),
                                              ("dllm_t_min", 0.95)])
def test_refusals_name_the_field(app, field, value):
    for path, body in (("/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4, field: value}}),
                       ("/v1/completions", {"prompt": "hi", "max_tokens": 4, field: value})):
        if path == "/v1/completions" and field in ("min_new_tokens",):
            body = {"prompt": "hi", "max_tokens": 4, "min_tokens": value}
        r = httpx.post(app.url + path, json=body, timeout=120)
        assert r.status_code == 400, (path, r.text)
        assert field in r.json()["error"]["message"] or "min_tokens" in r.json()["error"]["message"], (path, r.text)


def test_a_vllm_client_narrows_and_seeds_the_canvas(app, ckpt):
    """vLLM's names as a vLLM client sends them (`extra_args` / `vllm_xargs`): a seed canvas with two
    pinned positions on a 6-position canvas gives the reference loop's tokens on canvases of 6 under
    the request's seed, over /generate and /v1/completions alike; a canvas wider than the model's is a
    400 in the client's name."""
    pins, width = (PROMPT[0], PROMPT[1]), 6
    xargs = {"diffusion_seed_canvas": [pins[0], 0, 0, 0, pins[1], 0], "diffusion_pinned": [0, 4],
             "diffusion_canvas_length": width}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(SEEDS[0])
    want = renoise(load_reference(ckpt), PROMPT, MAX_NEW, max_denoising_steps=12, t_min=0.4, t_max=0.8,
                   entropy_bound=0.1, stability_threshold=0, confidence_threshold=0.8,
                   template=[pins[0], None, None, None, pins[1], None], canvas_length=width)
    torch.set_num_threads(threads)
    body = {"input_ids": PROMPT, "return_dllm_replay": True, "sampling_params": {
        "max_new_tokens": MAX_NEW, "sampling_seed": SEEDS[0], "skip_special_tokens": True, "extra_args": xargs}}
    got = httpx.post(app.url + "/generate", json=body, timeout=600)
    assert got.status_code == 200, got.text
    out = got.json()
    assert out["output_ids"] == want.tokens and out["meta_info"]["step_map"] == want.settle
    assert len(out["meta_info"]["dllm_replay_canvases"]) == -(-MAX_NEW // width)
    completion = {"prompt": PROMPT, "max_tokens": MAX_NEW, "seed": SEEDS[0], "vllm_xargs": xargs}
    choice = httpx.post(app.url + "/v1/completions", json=completion, timeout=600).json()["choices"][0]
    assert choice["text"] == out["text"] and choice["step_map"] == want.settle
    wide = {**completion, "vllm_xargs": {"diffusion_canvas_length": CANVAS + 1}}
    r = httpx.post(app.url + "/v1/completions", json=wide, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["param"] == "vllm_xargs.diffusion_canvas_length", r.text


def test_chat_completion_uses_the_tokenizer_template(app):
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": CANVAS, "seed": 5,
            "return_dllm_replay": True}
    got = httpx.post(app.url + "/v1/chat/completions", json=body, timeout=600)
    assert got.status_code == 200, got.text
    choice = got.json()["choices"][0]
    assert choice["message"]["role"] == "assistant" and len(choice["step_map"]) >= 1
    again = httpx.post(app.url + "/v1/chat/completions", json=body, timeout=600).json()["choices"][0]
    assert again["message"] == choice["message"] and again["step_map"] == choice["step_map"]


def test_the_viewer_draws_the_canvases(browser, app, oracle):  # noqa: F811 (the imported fixture)
    """The viewer in headless Chromium: the cells are the seeded output with each token's settle step,
    grouped by canvas (three of 16 after a 9-token prompt), and a canvas's rewrites are edits."""
    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.skip("the viewer's browser test needs Debian's chromium and chromium-driver")
    query = f"input_ids={','.join(map(str, PROMPT))}&max_new_tokens={MAX_NEW}&seed={SEEDS[0]}"
    assert open_page(browser, f"{app.url}/viewer?{query}") == "done", browser.find_element("id", "error").text
    tokens, settle = oracle[SEEDS[0]]
    assert cells(browser, "a") == [(p, t, s) for p, (t, s) in enumerate(zip(tokens, settle, strict=True))]
    groups = browser.execute_script(
        "return [...document.querySelectorAll(\"section.run[data-run='a'] .block\")].map(b => "
        "b.querySelectorAll('[data-position]').length)")
    assert groups == [CANVAS, CANVAS, MAX_NEW - 2 * CANVAS]
    assert "renoising" in browser.find_element("id", "server").text
    # every argmax change after a position's first is drawn as an edit
    body = {"input_ids": PROMPT, "return_step_trace": True, "sampling_params": {
        "max_new_tokens": MAX_NEW, "sampling_seed": SEEDS[0]}}
    trace = httpx.post(app.url + "/generate", json=body, timeout=600).json()["meta_info"]["step_trace"]
    writes = sum(len(event["positions"]) for event in trace)
    edits = browser.execute_script("return [...document.querySelectorAll(\"section.run[data-run='a'] "
                                   "[data-position]\")].reduce((n, c) => n + Number(c.dataset.edits || 0), 0)")
    assert edits == writes - MAX_NEW > 0
    assert console_errors(browser) == []
