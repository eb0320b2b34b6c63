"""Every validation error path raises ValueError naming the field."""

from __future__ import annotations

import pytest
import torch

from engine import EngineConfig, GenerationConfig, pipeline
from engine.errors import RequestError
from testing.tiny_checkpoint import write_tiny_checkpoint

# ---- configs ----------------------------------------------------------------------------------

GEN_ERRORS = [
    ({"max_new_tokens": -1}, "max_new_tokens"),
    ({"min_new_tokens": -1}, "min_new_tokens"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": -0.1}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_p": -0.1}, "min_p"),
    ({"temperature": -0.5}, "temperature"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"logprobs": -1}, "logprobs"),
    ({"logprob_start_len": -2}, "logprob_start_len"),
    ({"stop_token_ids": [-3]}, "stop_token_ids"),
    ({"stop_words": [""]}, "stop_words"),
    ({"max_new_tokens": "many"}, "max_new_tokens"),
    ({"do_sample": "maybe"}, "do_sample"),
    ({"min_new_tokens": 10, "max_new_tokens": 5}, "min_new_tokens"),
    ({"not_a_field": 1}, "not_a_field"),
    ({"max_tokens": 5}, "max_tokens"),  # an HTTP name is not a GenerationConfig field
]


@pytest.mark.parametrize("kwargs, field", GEN_ERRORS, ids=[f for _, f in GEN_ERRORS])
def test_generation_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        GenerationConfig(**kwargs)


def test_generation_config_assignment_is_validated():
    g = GenerationConfig()
    with pytest.raises(ValueError, match="top_p"):
        g.top_p = 2.0
    with pytest.raises(ValueError, match="max_new_tokens"):
        g.max_new_tokens = -5


def test_generation_config_valid_edges():
    GenerationConfig(top_p=1.0, min_p=1.0, min_new_tokens=4, max_new_tokens=4, temperature=0.0, logprobs=0)
    GenerationConfig(max_new_tokens=0, logprob_start_len=0, logprobs=0)


ENGINE_ERRORS = [
    ({"dtype": "float64"}, "dtype"),
    ({"dtype": "fp32"}, "dtype"),
    ({"device": "tpu"}, "device"),
    ({"dllm_unmasking_strategy": "shuffled"}, "dllm_unmasking_strategy"),
    ({"dllm_edit_threshold": 1.5}, "dllm_edit_threshold"),
    ({"dllm_max_post_edit_steps": -1}, "dllm_max_post_edit_steps"),
    ({"dllm_penalty_lambda": float("nan")}, "dllm_penalty_lambda"),
    ({"dllm_sub_block_length": 0}, "dllm_sub_block_length"),
    ({"dllm_block_length": 0}, "dllm_block_length"),
    ({"dllm_denoising_steps": 0}, "dllm_denoising_steps"),
    ({"dllm_confidence_threshold": 1.5}, "dllm_confidence_threshold"),
    ({"logprobs_mode": "processed"}, "logprobs_mode"),
    ({"attention_backend": "xformers"}, "attention_backend"),
    ({"tp": 0}, "tp"),
    ({"max_batch_size": 0}, "max_batch_size"),
    ({"max_model_len": 0}, "max_model_len"),
    ({"kv_block_size": 0}, "kv_block_size"),
    ({"num_kv_blocks": 0}, "num_kv_blocks"),
    ({"num_kv_blocks": 1.5}, "num_kv_blocks"),
    ({"num_kv_blocks": 0.0}, "num_kv_blocks"),
    ({"max_prefill_token_num": 0}, "max_prefill_token_num"),
    ({"logprobs_chunk_rows": 0}, "logprobs_chunk_rows"),
    ({"unknown_knob": True}, "unknown_knob"),
]


@pytest.mark.parametrize("kwargs, field", ENGINE_ERRORS, ids=[f"{f}-{i}" for i, (_, f) in enumerate(ENGINE_ERRORS)])
def test_engine_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**kwargs)


def test_engine_config_valid_values():
    for strategy in ("low_confidence_dynamic", "low_confidence_static", "sequential", "entropy_bounded"):
        EngineConfig(dllm_unmasking_strategy=strategy)
    for dtype in ("auto", "float32", "bfloat16", "float16"):
        EngineConfig(dtype=dtype)
    EngineConfig(num_kv_blocks=0.5, logprobs_mode="raw_logits")
    EngineConfig(num_kv_blocks=1.0, logprobs_mode="raw_logprobs")
    EngineConfig(logprobs_mode=None)
    EngineConfig(logprobs_mode="processed_logprobs")
    EngineConfig(logprobs_mode="processed_logits")


# ---- requests ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(write_tiny_checkpoint(tmp_path_factory.mktemp("ar"), model_type="qwen3", seed=20))


@pytest.fixture(scope="module")
def pipe(ckpt):
    with pipeline(ckpt, EngineConfig(max_model_len=40, kv_block_size=4, num_kv_blocks=16)) as p:
        yield p


def refused(pipe, prompt, gen: GenerationConfig, field: str, match: str | None = None) -> RequestError:
    free = pipe.engine.kv.num_free_pages
    with pytest.raises(ValueError, match=match or field) as e:
        pipe(prompt, gen)
    err = e.value
    assert isinstance(err, RequestError), f"expected a RequestError, got {type(err).__name__}: {err}"
    assert err.param == field
    assert not pipe.engine.has_unfinished(), "a refused request must leave nothing queued"
    assert pipe.engine.kv.num_free_pages == free
    return err


def test_empty_prompts(pipe):
    refused(pipe, "", GenerationConfig(max_new_tokens=2), "prompt", "empty")
    with pytest.raises(ValueError, match="empty"):
        pipe([], GenerationConfig(max_new_tokens=2))
    with pytest.raises(ValueError, match="input_ids"):
        pipe.engine.add_request([], GenerationConfig(max_new_tokens=2))
    with pytest.raises(ValueError, match="empty"):
        pipe([[1, 2], []], GenerationConfig(max_new_tokens=2))
    assert not pipe.engine.has_unfinished()


def test_out_of_vocab_and_malformed_ids(pipe):
    vocab = pipe.engine.spec.vocab_size
    err = refused(pipe, [1, 2, vocab], GenerationConfig(max_new_tokens=2), "input_ids", "vocab")
    assert str(vocab) in str(err)
    refused(pipe, [5, -1], GenerationConfig(max_new_tokens=2), "input_ids")
    with pytest.raises(ValueError, match="input_ids"):
        pipe.engine.add_request([1, 2.5], GenerationConfig(max_new_tokens=2))
    with pytest.raises(ValueError, match="input_ids"):
        pipe.engine.add_request([1, True], GenerationConfig(max_new_tokens=2))
    # in a batch: the whole call is refused, nothing left running
    refused(pipe, [[1, 2, 3], [4, vocab + 7]], GenerationConfig(max_new_tokens=2), "input_ids")


def test_too_long_for_max_model_len(pipe):
    err = refused(pipe, list(range(30)), GenerationConfig(max_new_tokens=11), "max_new_tokens", "max_model_len")
    assert "41" in str(err) and "40" in str(err)
    refused(pipe, list(range(41)), GenerationConfig(max_new_tokens=1), "max_new_tokens", "max_model_len")
    pipe(list(range(30)), GenerationConfig(max_new_tokens=10, ignore_eos=True))  # exactly 40 is fine


def test_larger_than_kv_cache(ckpt):
    with pipeline(ckpt, EngineConfig(max_model_len=64, kv_block_size=4, num_kv_blocks=6)) as small:
        # 6 pages of 4 = 24 tokens
        err = refused(small, list(range(20)), GenerationConfig(max_new_tokens=5), "max_new_tokens", "num_kv_blocks")
        assert "7" in str(err) and "6" in str(err)
        small(list(range(20)), GenerationConfig(max_new_tokens=4, ignore_eos=True))


def test_logprobs_larger_than_vocab(pipe):
    vocab = pipe.engine.spec.vocab_size
    refused(pipe, [1, 2], GenerationConfig(max_new_tokens=2, logprobs=vocab + 1), "logprobs")
    out = pipe([1, 2], GenerationConfig(max_new_tokens=1, logprobs=vocab, ignore_eos=True))
    assert len(out.logprobs[0]) == vocab


def test_stop_token_ids_outside_vocab(pipe):
    vocab = pipe.engine.spec.vocab_size
    refused(pipe, [1, 2], GenerationConfig(max_new_tokens=2, stop_token_ids=[vocab]), "stop_token_ids")


def test_duplicate_request_id(pipe):
    engine = pipe.engine
    rid = engine.add_request([1, 2, 3], GenerationConfig(max_new_tokens=2), request_id="same")
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request([1, 2, 3], GenerationConfig(max_new_tokens=2), request_id="same")
    engine.abort(rid)
    assert not engine.has_unfinished()


def test_engine_level_config_errors(ckpt):
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="cuda"):
            pipeline(ckpt, EngineConfig(device="cuda"))
        with pytest.raises(ValueError, match="flash"):
            pipeline(ckpt, EngineConfig(attention_backend="flash"))


def test_tensor_parallel_size_that_cannot_shard_the_model(ckpt):
    """tp must divide the heads (4 query, 2 kv heads): a clear ValueError naming tp, not a crash."""
    with pytest.raises(ValueError, match="tp"):
        pipeline(ckpt, EngineConfig(tp=3))
