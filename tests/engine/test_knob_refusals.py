"""The knob table (`configs.knobs`) decides, for every (model family, decoding knob) pair, whether the
model reads the knob; every pair it cannot use is refused naming the field: per request (a
RequestError, a 400 over HTTP) on real tiny checkpoints of every family, and engine-wide at engine
start on the block-diffusion families. The table is also the one source of the knob fields of the
config models, the HTTP request models and the adapters' field maps."""

from __future__ import annotations

import pytest

from configs import EngineConfig, GenerationConfig
from configs.generation_config import DllmOverrides
from configs.knobs import (
    ENGINE_WIDE_IGNORED,
    KNOBS,
    PARADIGMS,
    RULE_SPECS,
    request_knobs,
    rules_of,
    unusable,
    upstream_names,
)
from deployments.openai.protocol import ChatCompletionRequest, CompletionRequest
from deployments.sglang.protocol import GenerateRequest, SamplingParams
from engine.core.decoding import paradigm_of
from engine.core.decoding.rules import RULES
from engine.core.llm_engine import LLMEngine
from engine.errors import RequestError
from engine.jetengine.params import Config as JetConfig
from engine.jetengine.params import SamplingParams as JetSamplingParams
from engine.lmdeploy.configs import PytorchEngineConfig
from engine.model.families import FAMILIES, family_of
from testing.tiny.diffusion_gemma import write_tiny_diffusion_gemma
from testing.tiny.nemotron_labs_diffusion import write_tiny_nemotron_labs_diffusion
from testing.tiny_checkpoint import write_tiny_checkpoint
from testing.tiny_fast_dllm import write_tiny_fast_dllm
from testing.tiny_llada2 import write_tiny_llada2

pytest.importorskip("transformers.models.diffusion_gemma")  # writes the DiffusionGemma checkpoint
# a valid value other than the default of every knob (a new knob needs one here)
SET = {"dllm_block_length": 4, "dllm_unmasking_strategy": "sequential", "dllm_denoising_steps": 2,
       "dllm_confidence_threshold": 0.5, "dllm_entropy_threshold": 1.0, "dllm_edit_threshold": 0.5,
       "dllm_max_post_edit_steps": 2, "dllm_penalty_lambda": 1.0, "dllm_sub_block_length": 4,
       "dllm_commit_fusion": False, "dllm_mask_token_id": 3, "dllm_max_denoising_steps": 4,
       "dllm_entropy_bound": 0.5, "dllm_t_min": 0.3, "dllm_t_max": 0.7, "dllm_stability_threshold": 2,
       "dllm_stop_entropy": 0.01, "dllm_delete_token_id": 5, "dllm_split_token_id": 6, "dllm_mode": "ar",
       "dllm_draft_lora": True, "dllm_canvas_length": 4}
ENGINE = dict(max_model_len=64, num_kv_blocks=64, kv_block_size=16, device="cpu", dtype="float32")

WRITERS = {
    **{t: (lambda path, t=t: write_tiny_checkpoint(path, model_type=t, seed=0)) for t in
       ("qwen3", "qwen3_moe", "sdar", "sdar_moe")},
    "llada2_moe": lambda path: write_tiny_llada2(path, seed=0),
    "Fast_dLLM_Qwen": lambda path: write_tiny_fast_dllm(path, seed=0),
    "diffusion_gemma": lambda path: write_tiny_diffusion_gemma(path / "tiny"),
    "nemotron_labs_diffusion": lambda path: write_tiny_nemotron_labs_diffusion(path, seed=0),
}


def _paradigm(model_type: str) -> str:
    return paradigm_of(family_of(model_type))


# the families the engine's decoding strategies run (the table's paradigms)
SERVED = [t for t in FAMILIES if _paradigm(t) in PARADIGMS]


def _request_pairs() -> list[tuple[str, str]]:
    return [(t, k.name) for t in SERVED for k in unusable(_paradigm(t)) if k.per_request]


def _engine_pairs() -> list[tuple[str, str]]:
    return [(t, k.name) for t in SERVED if _paradigm(t) not in ENGINE_WIDE_IGNORED for k in unusable(_paradigm(t))]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    def path(model_type: str) -> str:
        return str(WRITERS[model_type](tmp_path_factory.mktemp(model_type)))
    return {t: path(t) for t in SERVED}


@pytest.fixture(scope="module")
def engines(checkpoints):
    return {t: LLMEngine(p, EngineConfig(**ENGINE)) for t, p in checkpoints.items()}


def _refused(engine: LLMEngine, field: str, **fields) -> None:
    with pytest.raises(RequestError) as err:
        engine.add_request([1, 2, 3], GenerationConfig(max_new_tokens=4, **fields))
    assert err.value.param == field and field in str(err.value), str(err.value)
    assert not engine.has_unfinished()


def test_every_family_has_a_writer_and_every_knob_a_value():
    assert set(WRITERS) == set(SERVED) and set(SET) == set(KNOBS)
    assert {t for t, _ in _request_pairs()} | {t for t, _, _ in _rule_pairs()} == set(SERVED)


@pytest.mark.parametrize(("model_type", "field"), _request_pairs(), ids=[f"{t}-{k}" for t, k in _request_pairs()])
def test_a_knob_the_model_does_not_read_is_refused_by_name(engines, model_type, field):
    """Every (family, knob) pair the table says the family cannot use: the request is refused naming it."""
    _refused(engines[model_type], field, **{field: SET[field]})


def _rule_pairs() -> list[tuple[str, str, str]]:
    """(family, rule, knob): a knob only editing rules read, in a request whose rule does not edit, and a
    rule the family's paradigm does not decode with."""
    out = []
    for t in SERVED:
        rules = rules_of(_paradigm(t))
        for k in request_knobs():
            if k.strict_rules and _paradigm(t) in k.used_by:
                out += [(t, r, k.name) for r in rules if r not in k.rules]
        out += [(t, r, "dllm_unmasking_strategy") for r in RULE_SPECS if rules and r not in rules]
    return out


@pytest.mark.parametrize(("model_type", "rule", "field"), _rule_pairs(), ids=["-".join(p) for p in _rule_pairs()])
def test_a_knob_or_rule_the_request_cannot_combine_is_refused_by_name(engines, model_type, rule, field):
    fields = {"dllm_unmasking_strategy": rule}
    if field != "dllm_unmasking_strategy":
        fields[field] = SET[field]
    _refused(engines[model_type], field, **fields)


@pytest.mark.parametrize(("model_type", "field"), _engine_pairs(), ids=[f"{t}-{k}" for t, k in _engine_pairs()])
def test_an_engine_wide_knob_the_model_does_not_read_is_refused_at_start(checkpoints, model_type, field):
    with pytest.raises(ValueError, match=field):
        LLMEngine(checkpoints[model_type], EngineConfig(**ENGINE, **{field: SET[field]}))


def test_autoregressive_engines_ignore_engine_wide_knobs_and_log_them(checkpoints, caplog):
    """One engine config serves whichever checkpoint a deployment loads: an AR engine logs what it ignores."""
    knobs = {k.name: SET[k.name] for k in unusable("autoregressive")}
    engine = LLMEngine(checkpoints["qwen3"], EngineConfig(**ENGINE, **knobs))
    assert engine.block_length is None
    assert all(name in caplog.text for name in knobs)


def test_the_knobs_a_family_reads_are_accepted(engines):
    """The other side of the table: every knob a block-diffusion family reads is taken (with a rule that reads it)."""
    engine = engines["llada2_moe"]
    engine.add_request([1, 2, 3], GenerationConfig(
        max_new_tokens=4, dllm_unmasking_strategy="joint_threshold", dllm_block_length=engine.block_length,
        **{k: SET[k] for k in ("dllm_confidence_threshold", "dllm_edit_threshold", "dllm_max_post_edit_steps",
                               "dllm_penalty_lambda")}))
    while engine.has_unfinished():
        engine.step()


# a value other than the default of every request field a rule's spec refuses
REFUSED_VALUES = {"dllm_trajectory": {"output_ids": [5, 6], "step_map": [1, 2]}, "repetition_penalty": 1.2,
                  "min_new_tokens": 2, "dllm_allowed_token_ids": [7, 8], "dllm_read_only": True}


@pytest.fixture(scope="module")
def editing_engine(checkpoints) -> LLMEngine:
    """LLaDA2 with edit tokens, so that every editing rule is served."""
    return LLMEngine(checkpoints["llada2_moe"], EngineConfig(**ENGINE, dllm_delete_token_id=SET["dllm_delete_token_id"],
                                                             dllm_split_token_id=SET["dllm_split_token_id"]))


@pytest.mark.parametrize(("rule", "field"), [(r.name, f) for r in RULE_SPECS.values() for f in r.refuses])
def test_what_a_rule_spec_refuses_is_refused_by_name(editing_engine, rule, field):
    """`RuleSpec.refuses`, declared once in the table, is what a request under the rule is refused."""
    params = GenerationConfig(max_new_tokens=0 if field == "dllm_trajectory" else 4, dllm_unmasking_strategy=rule,
                              logprobs=0, **{field: REFUSED_VALUES[field]})
    with pytest.raises(RequestError, match=f"does not apply to {rule}") as err:
        editing_engine.add_request([1, 2, 3], params)
    assert err.value.param == field
    assert not editing_engine.has_unfinished()


def test_every_rule_of_the_table_is_one_rule_object():
    assert set(RULES) == set(RULE_SPECS)
    for name, rule in RULES.items():
        assert rule.spec is RULE_SPECS[name] and rule.edits == RULE_SPECS[name].edits
    assert set(RULES["joint_threshold"].knobs) == {"dllm_confidence_threshold", "dllm_edit_threshold",
                                                   "dllm_max_post_edit_steps", "dllm_penalty_lambda"}
    assert RULES["entropy_bounded"].needs_entropy and RULES["entropy_bounded"].knobs == ("dllm_entropy_threshold",)


def test_config_and_http_models_are_derived_from_the_table():
    request = [k.name for k in request_knobs()]
    assert list(DllmOverrides.model_fields) == request
    assert set(KNOBS) <= set(EngineConfig.model_fields)
    for model in (GenerationConfig, GenerateRequest, SamplingParams, CompletionRequest, ChatCompletionRequest):
        assert set(request) <= set(model.model_fields), model.__name__
    for name, knob in KNOBS.items():
        engine_field = EngineConfig.model_fields[name]
        assert engine_field.default == knob.default and engine_field.description == knob.doc
        if knob.per_request:
            assert DllmOverrides.model_fields[name].metadata == engine_field.metadata, name
    for api, dataclass_ in (("lmdeploy", PytorchEngineConfig), ("jetengine.sampling", JetSamplingParams),
                            ("jetengine.config", JetConfig)):
        assert set(upstream_names(api).values()) <= set(dataclass_.__dataclass_fields__), api
