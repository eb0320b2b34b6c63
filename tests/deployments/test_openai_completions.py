"""/v1/completions as evaluation harnesses and the official `openai` client use it: echo with prompt
logprobs, token-id and list prompts, n. The loglikelihood flow is lm-eval-harness's `local-completions`
(its request body and its parsing), checked against Hugging Face forward + log_softmax."""

from __future__ import annotations

import random
from operator import itemgetter

import httpx
import openai
import pytest
import torch

from testing.tiny_checkpoint import load_hf_reference

TOL = 1e-4
ITEMS = 100
# Two requests with the same tokens agree on their logprobs up to float32 rounding, not bit for bit:
# one may reuse prefix-cached K/V another forward computed, or share its forward with other rows.
FLOAT32_NOISE = 1e-5


def lm_eval_parse_logprobs(outputs: list[dict], ctxlens: list[int]) -> list[tuple[float, bool]]:
    """lm-eval-harness's `LocalCompletionsAPI.parse_logprobs`, as it reads a completions answer."""
    res = []
    for out in outputs:
        for choice, ctxlen in zip(sorted(out["choices"], key=itemgetter("index")), ctxlens):
            assert ctxlen > 0
            logprobs = sum(choice["logprobs"]["token_logprobs"][ctxlen:-1])
            tokens_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
            top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:-1]
            is_greedy = all(tok == max(top.values()) for tok, top in zip(tokens_logprobs, top_logprobs))
            res.append((logprobs, is_greedy))
    return res


@pytest.fixture(scope="module")
def hf(tiny_checkpoints):
    return load_hf_reference(tiny_checkpoints["qwen3"])


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)


@pytest.fixture(scope="module")
def items(hf) -> list[tuple[list[int], list[int]]]:
    """(context, continuation) token-id pairs of assorted lengths; every third continuation is the
    model's own greedy one (so both greedy verdicts occur)."""
    rng = random.Random(11)
    out = []
    for i in range(ITEMS):
        ctx = [rng.randrange(5, 300) for _ in range(rng.randrange(1, 14))]
        cont = [rng.randrange(5, 300) for _ in range(rng.randrange(1, 6))]
        if i % 3 == 0:
            for j in range(len(cont)):
                cont[j] = int(hf_logprobs(hf, ctx + cont[:j])[-1].argmax())
        out.append((ctx, cont))
    return out


@pytest.fixture(scope="module")
def hf_reference(hf, items) -> list[tuple[float, bool]]:
    """HF forward + log_softmax: sum of the continuation's logprobs, and whether each is the argmax."""
    out = []
    for ctx, cont in items:
        logprobs = hf_logprobs(hf, ctx + cont)[len(ctx) - 1:-1]
        target = torch.tensor(cont)
        out.append((logprobs.gather(1, target[:, None]).sum().item(), bool((logprobs.argmax(-1) == target).all())))
    return out


@pytest.mark.parametrize("per_request", [1, 8])
def test_loglikelihood_flow_matches_hf(served_apps, items, hf_reference, per_request):
    url = served_apps["qwen3"].url + "/v1/completions"
    got = []
    with httpx.Client(timeout=120) as client:
        for start in range(0, len(items), per_request):
            chunk = items[start:start + per_request]
            # lm-eval's body for loglikelihood requests
            body = {"model": "qwen3", "prompt": [ctx + cont for ctx, cont in chunk], "max_tokens": 1,
                    "temperature": 0, "logprobs": 1, "seed": 1234, "echo": True}
            r = client.post(url, json=body)
            assert r.status_code == 200, r.text
            assert [c["index"] for c in r.json()["choices"]] == list(range(len(chunk)))
            got += lm_eval_parse_logprobs([r.json()], [len(ctx) for ctx, _ in chunk])
    assert len(got) == ITEMS
    for i, ((value, greedy), (want, want_greedy)) in enumerate(zip(got, hf_reference)):
        assert value == pytest.approx(want, abs=TOL), i
        assert greedy == want_greedy, i
    assert 0 < sum(g for _, g in got) < ITEMS  # both verdicts occur


def test_echo_rows_are_the_prompt_then_the_completion(served_apps, tiny_checkpoints):
    """First entry null, one entry per prompt token then per generated token, offsets cumulative;
    max_tokens=0 echoes the scored prompt alone."""
    app = served_apps["qwen3"]
    ids = [17, 40, 41, 90, 200, 33]
    body = {"prompt": ids, "max_tokens": 3, "temperature": 0, "logprobs": 2, "echo": True, "ignore_eos": True}
    choice = httpx.post(app.url + "/v1/completions", json=body, timeout=120).json()["choices"][0]
    plain = httpx.post(app.url + "/v1/completions", json={**body, "echo": False}, timeout=120).json()["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 3 == len(lp["token_logprobs"]) == len(lp["top_logprobs"])
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["tokens"][len(ids):] == plain["logprobs"]["tokens"]
    assert lp["token_logprobs"][len(ids):] == pytest.approx(plain["logprobs"]["token_logprobs"], abs=FLOAT32_NOISE)
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
    assert choice["text"].endswith(plain["text"]) and len(choice["text"]) > len(plain["text"])
    assert all(1 <= len(top) <= 2 for top in lp["top_logprobs"][1:])  # keyed by text: equal texts merge
    scored = httpx.post(app.url + "/v1/completions", json={**body, "max_tokens": 0}, timeout=120).json()
    lp0 = scored["choices"][0]["logprobs"]
    assert lp0["tokens"] == lp["tokens"][:len(ids)] and lp0["token_logprobs"][0] is None
    assert lp0["token_logprobs"][1:] == pytest.approx(lp["token_logprobs"][1:len(ids)], abs=FLOAT32_NOISE)
    assert scored["usage"]["completion_tokens"] == 0


def test_openai_client_parses_echo_n_and_list_prompts(served_apps):
    app = served_apps["qwen3"]
    client = openai.OpenAI(base_url=app.url + "/v1", api_key="unused", timeout=120, max_retries=0)
    prompts = [[17, 40, 41, 90], [50, 51, 52, 53, 54]]
    kw = dict(model="qwen3", prompt=prompts, max_tokens=4, n=2, temperature=0.9, seed=5, echo=True, logprobs=1,
              extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    assert [c.index for c in full.choices] == [0, 1, 2, 3]  # prompt-major: choice i*n + j
    for c in full.choices:
        n_prompt = len(prompts[c.index // 2])
        assert len(c.logprobs.tokens) == n_prompt + 4 and c.logprobs.token_logprobs[0] is None
    assert full.choices[0].text != full.choices[1].text  # seeds 5 and 6
    assert full.usage.prompt_tokens == 9 and full.usage.completion_tokens == 16
    texts: dict[int, str] = {}
    tokens: dict[int, list] = {}
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            tokens[c.index] = tokens.get(c.index, []) + (c.logprobs.token_logprobs if c.logprobs else [])
    assert texts == {c.index: c.text for c in full.choices}
    for c in full.choices:  # the stream shared other forwards
        assert [v is None for v in tokens[c.index]] == [v is None for v in c.logprobs.token_logprobs]
        assert [v for v in tokens[c.index] if v is not None] == pytest.approx(
            [v for v in c.logprobs.token_logprobs if v is not None], abs=FLOAT32_NOISE)
    assert chunks[-1].usage.completion_tokens == 16

    sdar = openai.OpenAI(base_url=served_apps["sdar"].url + "/v1", api_key="unused", timeout=120, max_retries=0)
    echoed = sdar.completions.create(model="sdar", prompt="Hello", max_tokens=4, echo=True, temperature=0)
    assert echoed.choices[0].text.startswith("Hello")
    with pytest.raises(openai.BadRequestError) as refused:  # prompt scoring is for AR models
        sdar.completions.create(model="sdar", prompt="Hello", max_tokens=4, echo=True, logprobs=1)
    assert refused.value.body["param"] == "echo" and "not autoregressive" in refused.value.body["message"]
