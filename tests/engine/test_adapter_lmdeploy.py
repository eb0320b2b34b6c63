"""engine.lmdeploy: SDAR's README lmdeploy example runs by changing its import; outputs have lmdeploy's
fields and equal engine.pipeline on the chat-templated prompts; the other PytorchEngineConfig names
change only what they name. One adapter pipeline and one reference pipeline serve the module."""

from __future__ import annotations

import dataclasses
import warnings

import pytest

from engine import EngineConfig
from engine import GenerationConfig as EngineGenerationConfig
from engine import pipeline as engine_pipeline
from engine.lmdeploy import ChatTemplateConfig, GenerationConfig, PytorchEngineConfig, Response, pipeline

# SDAR's README example, with the dtype, length and KV share (of the CPU KV budget) a test machine affords
README_BACKEND = dict(tp=1, dtype="float16", max_prefill_token_num=4096, cache_max_entry_count=0.05,
                      dllm_block_length=4, dllm_denoising_steps=4, dllm_unmasking_strategy="low_confidence_dynamic",
                      dllm_confidence_threshold=0.9, session_len=512)
PROMPTS = [[{"role": "user", "content": "Solve the problem step by step."}],
           [{"role": "user", "content": "Find the sum of all integer bases."}],
           [{"role": "user", "content": "Find the number of ordered pairs."}]]
LMDEPLOY_FIELDS = ("text", "generate_token_len", "input_token_len", "finish_reason", "token_ids", "logprobs",
                   "logits", "last_hidden_state", "index", "routed_experts", "cached_tokens", "error_code",
                   "error_message")


@pytest.fixture(scope="module")
def lm(dllm_ckpt):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipe = pipeline(dllm_ckpt, backend_config=PytorchEngineConfig(**README_BACKEND))
    pipe.dtype_warnings = [str(w.message) for w in caught if "half precision" in str(w.message)]
    with pipe:
        yield pipe


@pytest.fixture(scope="module")
def ref(dllm_ckpt):
    """engine.pipeline with what the README's PytorchEngineConfig means."""
    config = EngineConfig(dtype="float32", max_model_len=512, kv_block_size=64, num_kv_blocks=0.05,
                          max_prefill_token_num=4096, enable_prefix_caching=False, dllm_block_length=4,
                          dllm_denoising_steps=4, dllm_unmasking_strategy="low_confidence_dynamic",
                          dllm_confidence_threshold=0.9)
    with engine_pipeline(dllm_ckpt, config) as pipe:
        yield pipe


def templated(pipe, messages) -> str:
    return pipe.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def same(out: Response, want, cut: int = 0) -> None:
    """`out` (lmdeploy's shape) is the engine's `want`, less its last `cut` tokens (a dropped stop id)."""
    n = len(want.token_ids) - cut
    assert (out.text, out.token_ids, out.step_map, out.finish_reason, out.input_token_len, out.generate_token_len) \
        == (want.text, want.token_ids[:n], want.step_map[:n], want.finish_reason, want.input_token_len, n)


def test_readme_example_equals_engine_pipeline_on_templated_prompts(lm, ref):
    gen_config = GenerationConfig(top_p=0.95, top_k=50, temperature=1.0, do_sample=False, max_new_tokens=16)
    outputs = lm(PROMPTS, gen_config=gen_config)
    assert lm.dtype_warnings and len(lm.dtype_warnings) == 1  # float16 on CPU: float32, said once
    assert lm.engine_config.dtype == "float32"
    want = ref([templated(ref, p) for p in PROMPTS], EngineGenerationConfig(max_new_tokens=16))
    assert len(outputs) == 3
    for i, (out, w) in enumerate(zip(outputs, want)):
        assert isinstance(out, Response) and out.index == i
        assert set(LMDEPLOY_FIELDS) <= {f.name for f in dataclasses.fields(out)}
        assert out.logprobs is None and out.logits is None and out.error_code is None
        assert out.finish_reason in ("stop", "length")
        same(out, w, cut=1 if out.finish_reason == "stop" else 0)
    single = lm(PROMPTS[0], gen_config=gen_config)  # one message list is ONE prompt
    assert isinstance(single, Response) and single.token_ids == outputs[0].token_ids
    assert lm.batch_infer(PROMPTS[:1], gen_config=gen_config)[0].token_ids == outputs[0].token_ids


def test_str_prompt_gets_chat_template_unless_do_preprocess_false(lm, ref):
    gen = GenerationConfig(max_new_tokens=8)
    as_str = lm("Hello", gen_config=gen)
    assert as_str.token_ids == lm([{"role": "user", "content": "Hello"}], gen_config=gen).token_ids
    raw = lm("Hello", gen_config=gen, do_preprocess=False)
    same(raw, ref("Hello", EngineGenerationConfig(max_new_tokens=8)))
    assert as_str.input_token_len > raw.input_token_len


def test_stop_token_dropped_unless_include_stop_str_in_output(lm, ref):
    text = templated(ref, PROMPTS[1])
    free = ref(text, EngineGenerationConfig(max_new_tokens=16))
    stop_id = free.token_ids[5]
    want = ref(text, EngineGenerationConfig(max_new_tokens=16, stop_token_ids=[stop_id], logprobs=0))
    assert want.finish_reason == "stop" and want.token_ids[-1] == stop_id  # the engine keeps the stop id
    out = lm(PROMPTS[1], gen_config=GenerationConfig(max_new_tokens=16, stop_token_ids=[stop_id], logprobs=0))
    same(out, want, cut=1)
    assert out.logprobs == want.logprobs[:-1]
    kept = lm(PROMPTS[1], gen_config=GenerationConfig(max_new_tokens=16, stop_token_ids=[stop_id],
                                                      include_stop_str_in_output=True))
    assert kept.token_ids == want.token_ids and kept.step_map == want.step_map

    # stream_infer: deltas per prompt index; concatenated they are the unary responses
    configs = [GenerationConfig(max_new_tokens=16, stop_token_ids=[stop_id]), GenerationConfig(max_new_tokens=12)]
    unary = lm(PROMPTS[1:], gen_config=configs)
    streamed: dict[int, list[int]] = {0: [], 1: []}
    steps: dict[int, list[int]] = {0: [], 1: []}
    last: dict[int, Response] = {}
    order = []
    for delta in lm.stream_infer(PROMPTS[1:], gen_config=configs):
        order.append(delta.index)
        streamed[delta.index] += delta.token_ids
        steps[delta.index] += delta.step_map
        last[delta.index] = delta
    assert order.index(1) < len(order) - order[::-1].index(0) - 1, "the prompts are decoded together, not in turn"
    for i, u in enumerate(unary):
        assert streamed[i] == u.token_ids and steps[i] == u.step_map
        assert last[i].finish_reason == u.finish_reason and last[i].generate_token_len == u.generate_token_len
    whole = list(lm.stream_infer(PROMPTS[1:], gen_config=configs, stream_response=False))
    assert [w.token_ids for w in whole] == [u.token_ids for u in unary]


def test_engine_config_names_change_only_what_they_name(dllm_ckpt, lm):
    backend = PytorchEngineConfig(**dict(README_BACKEND, dtype="auto", block_size=8, session_len=64,
                                         enable_prefix_caching=True, max_batch_size=4))
    gen = GenerationConfig(max_new_tokens=16)
    with pipeline(dllm_ckpt, backend_config=backend) as small:
        assert (small.engine_config.kv_block_size, small.engine_config.max_model_len,
                small.engine_config.max_batch_size, small.engine_config.enable_prefix_caching) == (8, 64, 4, True)
        assert [o.token_ids for o in small(PROMPTS, gen_config=gen)] == [o.token_ids for o in lm(PROMPTS, gen)]
        with pytest.raises(ValueError, match="max_model_len|64"):  # session_len bounds prompt + output
            small("word " * 80, gen_config=gen, do_preprocess=False)


def test_chat_template_config_meta_instruction_is_the_system_message(dllm_ckpt, ref):
    with pipeline(dllm_ckpt, backend_config=PytorchEngineConfig(session_len=512, dllm_block_length=4),
                  chat_template_config=ChatTemplateConfig(model_name="sdar", meta_instruction="Be brief.")) as pipe:
        out = pipe("Hello", gen_config=GenerationConfig(max_new_tokens=4))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    assert out.input_token_len == len(ref.tokenizer.encode(templated(ref, messages), add_special_tokens=False))


def test_refusals_name_lmdeploys_field(dllm_ckpt, lm):
    with pytest.raises(TypeError, match="no_such_field"):
        PytorchEngineConfig(no_such_field=1)
    with pytest.raises(TypeError, match="no_such_field"):
        GenerationConfig(no_such_field=1)
    with pytest.raises(ValueError, match="quant_policy"):
        pipeline(dllm_ckpt, backend_config=PytorchEngineConfig(quant_policy=8))
    with pytest.raises(ValueError, match="ChatTemplateConfig.user"):
        pipeline(dllm_ckpt, chat_template_config=ChatTemplateConfig(user="<u>"))
    with pytest.raises(ValueError, match="GenerationConfig.bad_words"):
        lm("Hi", gen_config=GenerationConfig(bad_words=["x"]))
    with pytest.raises(ValueError, match="GenerationConfig.top_p"):
        lm("Hi", gen_config=GenerationConfig(top_p=0.0))
    with pytest.raises(ValueError, match="PytorchEngineConfig.block_size"):
        pipeline(dllm_ckpt, backend_config=PytorchEngineConfig(block_size=0))
    with pytest.raises(ValueError, match="one GenerationConfig per prompt"):
        lm(PROMPTS, gen_config=[GenerationConfig()])
    with pytest.raises(ValueError, match="image"):
        lm(("describe this image", "img.png"))
    with pytest.raises(TypeError, match="not_a_kwarg"):
        pipeline(dllm_ckpt, not_a_kwarg=True)
