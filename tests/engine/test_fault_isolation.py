"""One request's parameters never fail another request.

A batch of 7 ordinary requests plus one with extreme sampling parameters: the 7 finish exactly as
they do alone, the odd one succeeds or is refused with an error naming its field -- in the engine
and over HTTP. A step that does raise (a fault injected into the sampler for one request) is
re-run request by request and ends only that request.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

import engine.core.step_sampling as sampling_module
from engine import EngineConfig, GenerationConfig, pipeline

ODD = {  # each must neither fail its batch mates nor raise a 5xx
    "top_p_underflow": {"do_sample": True, "top_p": 5e-324},
    "min_p_one": {"do_sample": True, "min_p": 1.0},
    "tiny_temperature_top_k_1": {"do_sample": True, "temperature": 1e-7, "top_k": 1},
}


def _normal(i: int) -> GenerationConfig:
    if i % 2:
        return GenerationConfig(max_new_tokens=12, ignore_eos=True)
    return GenerationConfig(max_new_tokens=12, ignore_eos=True, do_sample=True, temperature=0.8, top_p=0.9,
                            random_seed=100 + i)


def _prompt(i: int) -> list[int]:
    return [(17 * i + 3 * k) % 250 + 4 for k in range(3 + i)]


def _key(out):
    return out.token_ids, out.step_map, out.finish_reason


@pytest.fixture(scope="module", params=["qwen3", "sdar"])
def pipe(request, ar_ckpt, dllm_ckpt):
    path = ar_ckpt if request.param == "qwen3" else dllm_ckpt
    with pipeline(path, EngineConfig(max_model_len=128, dllm_block_length=4)) as p:
        yield p


@pytest.fixture(scope="module")
def alone(pipe):
    return [_key(pipe(_prompt(i), _normal(i))) for i in range(7)]


@pytest.mark.parametrize("odd", list(ODD))
def test_extreme_parameters_leave_the_batch_alone(pipe, alone, odd):
    gens = [_normal(i) for i in range(7)] + [GenerationConfig(max_new_tokens=12, ignore_eos=True, random_seed=1,
                                                              **ODD[odd])]
    outs = pipe([_prompt(i) for i in range(8)], gens)
    assert [_key(o) for o in outs[:7]] == alone
    assert outs[7].finish_reason == "length" and len(outs[7].token_ids) == 12
    if not pipe.engine.is_dllm:  # (block diffusion ranks by the filtered probability: 1.0 here)
        greedy = pipe(_prompt(7), GenerationConfig(max_new_tokens=12, ignore_eos=True))
        assert outs[7].token_ids == greedy.token_ids, "every filter keeps the most likely token: greedy"


def test_out_of_range_penalty_is_refused_naming_its_field():
    with pytest.raises(ValueError, match="repetition_penalty"):
        GenerationConfig(repetition_penalty=1e6)


def test_a_failing_step_ends_only_its_request(pipe, alone, monkeypatch):
    real = sampling_module.pick_tokens

    def faulty(logits, groups, *args, **kwargs):  # fault injection: this seed's sampling raises
        if any(g.seed == 666 for _, _, g in groups):
            raise RuntimeError("injected sampler fault")
        return real(logits, groups, *args, **kwargs)

    monkeypatch.setattr(sampling_module, "pick_tokens", faulty)
    gens = [_normal(i) for i in range(7)] + [GenerationConfig(max_new_tokens=12, do_sample=True, top_k=3,
                                                              random_seed=666)]
    outs = pipe([_prompt(i) for i in range(8)], gens)
    assert [_key(o) for o in outs[:7]] == alone
    bad = outs[7]
    assert bad.finish_reason == "error" and "injected sampler fault" in bad.error
    assert "random_seed=666" in bad.error and "top_k=3" in bad.error
    assert pipe.engine.stats.isolated_failures >= 1
    assert not pipe.engine.has_unfinished() and pipe.engine.kv.num_free_pages == pipe.engine.kv.num_pages


# ---- over HTTP ------------------------------------------------------------------------------
def _body(i: int) -> dict:
    body = {"input_ids": _prompt(i), "max_tokens": 12, "ignore_eos": True}
    if i % 2:
        return body | {"temperature": 0}
    return body | {"temperature": 0.8, "top_p": 0.9, "seed": 100 + i}


HTTP_ODD = {
    "top_p_underflow": ({"temperature": 1.0, "top_p": 5e-324}, 200),
    "min_p_one": ({"temperature": 1.0, "min_p": 1.0}, 200),
    "tiny_temperature_top_k_1": ({"temperature": 1e-7, "top_k": 1}, 200),
    "huge_repetition_penalty": ({"repetition_penalty": 1e6}, 400),
}


@pytest.mark.parametrize("app", ["qwen3", "sdar"])
def test_http_batch_with_one_odd_request(served_apps, app):
    url = f"{served_apps[app].url}/generate"

    async def run(bodies):
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(client.post(url, json=b) for b in bodies))

    alone_http = [asyncio.run(run([_body(i)]))[0].json() for i in range(7)]
    for name, (extra, status) in HTTP_ODD.items():
        odd = {"input_ids": _prompt(7), "max_tokens": 12, "ignore_eos": True, "seed": 1, **extra}
        replies = asyncio.run(run([_body(i) for i in range(7)] + [odd]))
        assert [r.status_code for r in replies[:7]] == [200] * 7, name
        assert [r.json()["output_ids"] for r in replies[:7]] == [a["output_ids"] for a in alone_http], name
        assert replies[7].status_code == status, (name, replies[7].text)
        if status == 400:
            assert replies[7].json()["error"]["param"] == "repetition_penalty"
        else:
            assert replies[7].json()["meta_info"]["finish_reason"]["type"] == "length"
