"""Typed decisions over real HTTP on the shared tiny SDAR (block diffusion) and Qwen3 (autoregressive)
applications: a read over SGLang's /generate (flat and native bodies), the same read in vLLM's names
(`vllm_xargs` on /v1/completions, `extra_args` in `sampling_params`), SGLang's /v1/decisions, and the
refusals, each a 400 naming the field as the client wrote it."""

from __future__ import annotations

import math

import httpx
import pytest

from deployments.errors import ApiError
from deployments.vllm_names import vllm_body
from testing.tiny_checkpoint import build_byte_tokenizer

TOK = build_byte_tokenizer()
A, B, X, Y, Z = (TOK.encode(c, add_special_tokens=False)[0] for c in "ABxyz")
# 16 tokens: the template below fills the SDAR app's next block (block length 4, blocks aligned to it)
PROMPT = TOK.encode("The quick brown fox jumps over", add_special_tokens=False)[:16]
TEMPLATE = [A, -1, B, None]  # pinned, slot, pinned, slot
ALLOWED = [X, Y, Z]
READ = {"dllm_template": TEMPLATE, "dllm_allowed_token_ids": ALLOWED, "dllm_read_only": True}
# the same read in vLLM's names: the seed canvas's unpinned positions are the slots
VLLM_READ = {"diffusion_seed_canvas": [A, 0, B, 0], "diffusion_pinned": [0, 2], "diffusion_constrained": True,
             "logprob_token_ids": ALLOWED, "diffusion_read_only": True}
APPS = ("sdar", "qwen3")


def post(base: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(base + path, json=body, timeout=120)


def ok(base: str, path: str, body: dict) -> dict | list:
    r = post(base, path, body)
    assert r.status_code == 200, (path, r.text)
    return r.json()


def refused(base: str, path: str, body: dict, field: str) -> str:
    """The message of a 400 that names `field` (as its param, and in its message)."""
    r = post(base, path, body)
    assert r.status_code == 400, (path, body, r.text)
    error = r.json()["error"]
    assert error["param"] == field and field.rsplit(".", 1)[-1] in error["message"], (path, body, error)
    return error["message"]


def check_read(body: dict) -> list[int]:
    """A /generate answer to READ: finish reason read, the template's positions, its pins in place, each
    slot's rows the allowed ids best first (its token the best), label_mass at the slots only; on block
    diffusion one step (the template lies inside one block): the slots revealed at step 1, the pins at 0."""
    meta, ids = body["meta_info"], body["output_ids"]
    if meta["step_map"] is not None:
        assert meta["step_map"] == [0, 1, 0, 1] and meta["dllm_num_steps"] == 1
    assert meta["finish_reason"] == {"type": "read"}
    assert len(ids) == len(TEMPLATE) and ids[0] == A and ids[2] == B
    for g in (1, 3):
        rows = meta["output_top_logprobs"][g]
        values = [v for v, _, _ in rows]
        assert {t for _, t, _ in rows} == set(ALLOWED) and values == sorted(values, reverse=True)
        assert ids[g] == rows[0][1]
        assert 0.0 < meta["label_mass"][g] <= 1.0 + 1e-6
    assert meta["label_mass"][0] is None and meta["label_mass"][2] is None
    return ids


@pytest.mark.parametrize("app", APPS)
def test_a_read_over_generate_and_in_vllm_names(served_apps, app):
    base = served_apps[app].url
    flat = check_read(ok(base, "/generate", {"input_ids": PROMPT, "max_tokens": 8, **READ}))
    native = ok(base, "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, **READ}})
    assert check_read(native) == flat
    vllm_native = ok(base, "/generate", {"input_ids": PROMPT, "sampling_params": {
        "max_new_tokens": 8, "extra_args": VLLM_READ}})
    assert check_read(vllm_native) == flat
    completion = ok(base, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "vllm_xargs": VLLM_READ})
    choice = completion["choices"][0]
    assert choice["finish_reason"] == "read" and choice["text"] == TOK.decode(flat)
    assert [set(top) for top in choice["logprobs"]["top_logprobs"][1::2]] == [{"x", "y", "z"}] * 2


def softmax(values: list[float], temperature: float = 1.0) -> list[float]:
    top = max(values)
    exps = [math.exp((v - top) / temperature) for v in values]
    return [e / sum(exps) for e in exps]


DECISION = {"input": "The quick brown fox jumps over the lazy dog.", "return_prompt_token_ids": True,
            "questions": [{"id": "animal", "type": "choice", "question": "Which animal jumps?",
                           "options": [{"name": "fox", "description": "a fox"}, {"name": "dog"}, {"name": "cat"}]},
                          {"id": "speed", "type": "score", "question": "How quick is it?",
                           "levels": ["slow", "average", {"fast": True}]}]}


@pytest.mark.parametrize("app", APPS)
def test_decisions_answers_each_question_from_a_read(served_apps, app):
    base = served_apps[app].url
    got = ok(base, "/v1/decisions", DECISION)
    assert got["object"] == "decisions" and got["prompt_format_version"] == 1 and got["usage"]["prompt_tokens"] > 0
    choice, score = got["answers"]["animal"], got["answers"]["speed"]
    assert choice["type"] == "choice" and list(choice["probabilities"]) == ["fox", "dog", "cat"]
    assert choice["choice"] == max(choice["probabilities"], key=choice["probabilities"].get)
    assert list(score["probabilities"]) == ["0", "1", "2"]
    assert score["score"] == pytest.approx(sum(i * p for i, p in enumerate(score["probabilities"].values())))
    for answer, labels in ((choice, "ABC"), (score, "012")):
        assert sum(answer["probabilities"].values()) == pytest.approx(1.0)
        assert 0.0 < answer["label_mass"] <= 1.0 + 1e-6
        assert answer["label_token_ids"] == [TOK.encode(c, add_special_tokens=False)[0] for c in labels]
        # the same read over /generate: its rows, softmaxed over the labels, are the probabilities
        read = ok(base, "/generate", {"input_ids": answer["prompt_token_ids"], "max_tokens": 1, "dllm_template": [-1],
                                      "dllm_allowed_token_ids": answer["label_token_ids"], "dllm_read_only": True})
        rows = {t: v for v, t, _ in read["meta_info"]["output_top_logprobs"][0]}
        want = softmax([rows[t] for t in answer["label_token_ids"]])
        assert list(answer["probabilities"].values()) == pytest.approx(want, abs=1e-4)
        assert answer["label_mass"] == pytest.approx(read["meta_info"]["label_mass"][0], abs=1e-4)
    hot = ok(base, "/v1/decisions", DECISION | {"temperature": 2.0})["answers"]["animal"]
    logits = [math.log(p) for p in choice["probabilities"].values()]
    assert list(hot["probabilities"].values()) == pytest.approx(softmax(logits, 2.0), abs=1e-4)
    assert hot["label_mass"] == pytest.approx(choice["label_mass"], abs=1e-4)


GENERATE = {"input_ids": PROMPT, "max_tokens": 8}
# (path, body, the field its 400 names)
REFUSALS = [
    ("/generate", GENERATE | READ | {"dllm_template": [10**6, -1]}, "dllm_template"),
    ("/generate", GENERATE | READ | {"max_tokens": 2}, "dllm_template"),
    ("/generate", GENERATE | READ | {"dllm_allowed_token_ids": list(range(257))}, "dllm_allowed_token_ids"),
    ("/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, **READ,
                                                            "dllm_template": [-1] * 9}},
     "sampling_params.dllm_template"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "vllm_xargs": {"diffusion_constrained": True}},
     "vllm_xargs.diffusion_constrained"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "vllm_xargs": VLLM_READ | {
        "diffusion_seed_canvas": [10**6, 0, 0, 0]}}, "vllm_xargs.diffusion_seed_canvas"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "diffusion_read_only": True, "dllm_read_only": False},
     "diffusion_read_only"),
    ("/generate", GENERATE | READ | {"diffusion_seed_canvas": [B, -1]}, "diffusion_seed_canvas"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                              "vllm_xargs": {"diffusion_canvas_length": 4}}, "vllm_xargs.diffusion_canvas_length"),
    ("/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "logprob_token_ids": ALLOWED}},
     "sampling_params.logprob_token_ids"),
    ("/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "extra_args": {
        "diffusion_constrained": True, "logprob_token_ids": list(range(257))}}},
     "sampling_params.extra_args.logprob_token_ids"),
    ("/v1/decisions", DECISION | {"questions": [{"id": "q", "type": "yes_no", "question": "Is it?"}]},
     "questions[0].type"),
    ("/v1/decisions", DECISION | {"questions": [{"id": "q", "type": "choice", "question": "?", "options": [
        {"name": "x"}]}]}, "questions[0].options"),
    ("/v1/decisions", DECISION | {"images": ["data:image/png;base64,AAAA"]}, "images"),
    ("/v1/decisions", DECISION | {"prompt_format_version": 2}, "prompt_format_version"),
    ("/v1/decisions", DECISION | {"top_k": 1}, "top_k"),
]


@pytest.mark.parametrize(("path", "body", "field"), REFUSALS, ids=[f"{p}-{f}" for p, _, f in REFUSALS])
def test_refusals_name_the_field(served_apps, path, body, field):
    refused(served_apps["sdar"].url, path, body, field)


def test_vllm_names_map_in_one_place():
    """The mapping alone (no server): the seed canvas with and without pins, twins that agree, and a
    name given twice with different values."""
    body, names = vllm_body({"vllm_xargs": VLLM_READ, "dllm_read_only": True})
    assert body == READ | {"dllm_template": [A, -1, B, -1]}
    assert names.given["dllm_template"] == "vllm_xargs.diffusion_seed_canvas"
    assert vllm_body({"diffusion_seed_canvas": [A, 0]})[0] == {"dllm_template": [A, 0]}
    native, _ = vllm_body({"text": "hi", "sampling_params": [{"diffusion_max_steps": 2}, {}]}, "sampling_params")
    assert native["sampling_params"] == [{"dllm_max_steps": 2}, {}]
    with pytest.raises(ApiError) as e:
        vllm_body({"diffusion_max_steps": 2, "extra_args": {"diffusion_max_steps": 3}})
    assert e.value.param == "extra_args.diffusion_max_steps"
    with pytest.raises(ApiError) as e:
        vllm_body({"diffusion_pinned": [0]})
    assert e.value.param == "diffusion_pinned"


def test_canvas_length_is_the_renoising_knob():
    """vLLM's narrower DiffusionGemma canvas is the engine's `dllm_canvas_length` (a model without a
    canvas refuses it, in the client's name: REFUSALS above)."""
    body, names = vllm_body({"vllm_xargs": {"diffusion_canvas_length": 8}})
    assert body == {"dllm_canvas_length": 8}
    assert names.given["dllm_canvas_length"] == "vllm_xargs.diffusion_canvas_length"
