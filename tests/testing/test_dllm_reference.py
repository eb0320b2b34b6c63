"""Self-checks of the DLLM oracle (`testing/references/sdar.py`) and of the tiny checkpoints it runs on."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors import safe_open

from testing.references import sdar as dllm_reference
from testing.references.sdar import block_causal_logits, reference_dllm_generate
from testing.tiny_checkpoint import (
    DLLM_TEST_LOGIT_SCALE,
    SPECIAL_TOKENS,
    build_byte_tokenizer,
    load_hf_reference,
    write_tiny_checkpoint,
)

B = 4
PROMPTS = ["Hello, world!", "12 + 30 =", "The quick brown fox", "Q"]  # prompt lengths 10, 6, 14, 1


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tok() -> transformers.PreTrainedTokenizerFast:
    return build_byte_tokenizer()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("sdar")
    return write_tiny_checkpoint(path, model_type="sdar", block_size=B, logit_scale=DLLM_TEST_LOGIT_SCALE)


@pytest.fixture(scope="module")
def model(ckpt) -> transformers.Qwen3ForCausalLM:
    return load_hf_reference(ckpt)


@pytest.fixture(scope="module")
def mask_id(ckpt) -> int:
    return json.loads((ckpt / "config.json").read_text())["mask_token_id"]


def generate(model, tok, mask_id, prompt, **overrides):
    kwargs = dict(
        block_length=B,
        mask_id=mask_id,
        max_new_tokens=12,
        stop_ids=set(),
        strategy="low_confidence_dynamic",
        denoising_steps=B,
        threshold=0.85,
    )
    kwargs.update(overrides)
    ids = prompt if isinstance(prompt, list) else tok.encode(prompt)
    return reference_dllm_generate(model, ids, **kwargs)


# ---- the checkpoint ---------------------------------------------------------------------------


def test_sdar_checkpoint_files(ckpt, tok):
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["model_type"] == "sdar" and cfg["architectures"] == ["SDARForCausalLM"]
    assert cfg["block_size"] == B
    assert cfg["mask_token_id"] == tok.mask_token_id == tok.convert_tokens_to_ids("<|MASK|>")
    assert cfg["eos_token_id"] == tok.convert_tokens_to_ids("<|endoftext|>")
    assert cfg["vocab_size"] % 64 == 0 and cfg["vocab_size"] >= len(tok)
    gen = json.loads((ckpt / "generation_config.json").read_text())
    assert gen["eos_token_id"] == tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert {"lm_head.weight", "model.embed_tokens.weight", "model.layers.1.self_attn.q_proj.weight"} <= names


def test_tokenizer_loads_and_round_trips(ckpt):
    loaded = transformers.AutoTokenizer.from_pretrained(ckpt)
    assert loaded.mask_token == "<|MASK|>" and loaded.eos_token == "<|endoftext|>"
    assert all(t in loaded.all_special_tokens for t in SPECIAL_TOKENS)
    for text in ["Hello, world! 12 + 30 = 42", "héllo 日本語 🎉\r\n\t  x ", "<|im_start|>user\nhi<|im_end|>", ""]:
        assert loaded.decode(loaded.encode(text)) == text
    chat = loaded.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_tied_and_sharded_checkpoint_loads(tmp_path):
    path = write_tiny_checkpoint(tmp_path, model_type="sdar", tie_word_embeddings=True, num_shards=3)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
    assert "lm_head.weight" not in index["weight_map"]
    assert not (path / "model.safetensors").exists()
    stored = {}
    for file in files:
        with safe_open(str(path / file), framework="pt") as f:
            keys = f.keys()
            stored.update({name: f.get_tensor(name) for name in keys})
    assert set(stored) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in stored.values())
    tied = load_hf_reference(path)
    assert tied.lm_head.weight.data_ptr() == tied.model.embed_tokens.weight.data_ptr()
    loaded = tied.state_dict()
    for name, tensor in stored.items():
        torch.testing.assert_close(loaded[name], tensor, rtol=0, atol=0)


# ---- the block-causal mask --------------------------------------------------------------------


def test_block_causal_mask_isolates_later_blocks(model, tok):
    ids = tok.encode("The quick brown fox")[:12]  # three full blocks
    base = block_causal_logits(model, ids, B)
    later = list(ids)
    later[9] = (later[9] + 1) % len(tok)  # a token of block 2
    changed = block_causal_logits(model, later, B)
    torch.testing.assert_close(changed[:8], base[:8], rtol=0, atol=1e-5)
    assert not torch.allclose(changed[8:], base[8:])
    # Inside a block attention is bidirectional: position 4 sees position 6 (plain causal would not).
    same_block = list(ids)
    same_block[6] = (same_block[6] + 1) % len(tok)
    changed = block_causal_logits(model, same_block, B)
    torch.testing.assert_close(changed[:4], base[:4], rtol=0, atol=1e-5)
    assert not torch.allclose(changed[4], base[4])
    # With B = 1 the block-causal mask is the plain causal one the model builds by itself.
    with torch.inference_mode():
        causal = model(input_ids=torch.tensor([ids])).logits[0]
    torch.testing.assert_close(block_causal_logits(model, ids, 1), causal, rtol=1e-5, atol=1e-4)
    assert not torch.allclose(base, causal)


def test_logits_of_a_block_do_not_depend_on_later_blocks(model, tok):
    ids = tok.encode("Once upon a time there")
    full = block_causal_logits(model, ids, B)
    prefix = block_causal_logits(model, ids[:8], B)
    torch.testing.assert_close(full[:8], prefix, rtol=1e-5, atol=1e-5)


# ---- the decoding rules -----------------------------------------------------------------------


@pytest.mark.parametrize("strategy", dllm_reference.STRATEGIES)
@pytest.mark.parametrize("prompt", PROMPTS)
def test_step_map_invariants(model, tok, mask_id, prompt, strategy):
    res = generate(model, tok, mask_id, prompt, strategy=strategy, max_new_tokens=11)
    assert res.finish_reason == "length"
    assert len(res.token_ids) == len(res.step_map) == len(res.logprobs) == 11
    assert mask_id not in res.token_ids
    assert all(lp <= 0 for lp in res.logprobs)
    assert min(res.step_map) == 1
    prompt_len = len(tok.encode(prompt))
    blocks: dict[int, list[int]] = {}
    for j, step in enumerate(res.step_map):
        blocks.setdefault((prompt_len + j) // B, []).append(step)
    previous_max = 0
    for k in sorted(blocks):
        steps = blocks[k]
        assert min(steps) > previous_max  # a later block's steps all come after an earlier one's
        if (k + 1) * B <= prompt_len + 11:  # a complete block: numbering carries on, no gaps
            assert sorted(set(steps)) == list(range(previous_max + 1, max(steps) + 1))
        previous_max = max(steps)


def test_sequential_unmasks_left_to_right(model, tok, mask_id):
    for prompt in PROMPTS:
        res = generate(model, tok, mask_id, prompt, strategy="sequential", max_new_tokens=10)
        assert res.step_map == list(range(1, 11))
    # S = 2 on full blocks: two tokens per step, still left to right.
    res = generate(model, tok, mask_id, tok.encode("Hello, world")[:8], strategy="sequential", denoising_steps=2)
    assert res.step_map == [1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6]


QUOTA_STRATEGIES = [s for s in dllm_reference.STRATEGIES if s != "entropy_bounded"]  # the quota n_s decides


def _one_step_per_block(prompt_len: int) -> list[int]:
    first = prompt_len // B
    return [(prompt_len + j) // B - first + 1 for j in range(12)]


@pytest.mark.parametrize("strategy", QUOTA_STRATEGIES)
def test_one_step_unmasks_a_whole_block(model, tok, mask_id, strategy):
    for prompt in PROMPTS:
        res = generate(model, tok, mask_id, prompt, strategy=strategy, denoising_steps=1)
        assert res.step_map == _one_step_per_block(len(tok.encode(prompt)))


def test_entropy_bound_extremes(model, tok, mask_id):
    """entropy_bounded ignores the step quota: an unreachable bound reveals a whole block per step,
    a bound below any entropy one token per step (the lowest-entropy one)."""
    for prompt in PROMPTS:
        loose = generate(model, tok, mask_id, prompt, strategy="entropy_bounded", entropy_threshold=1e9)
        assert loose.step_map == _one_step_per_block(len(tok.encode(prompt)))
        tight = generate(model, tok, mask_id, prompt, strategy="entropy_bounded", entropy_threshold=1e-12)
        assert len(set(tight.step_map)) == 12, "one token per step"


def test_dynamic_threshold_extremes(model, tok, mask_id):
    for prompt in PROMPTS:
        static = generate(model, tok, mask_id, prompt, strategy="low_confidence_static")
        never = generate(model, tok, mask_id, prompt, threshold=2.0)  # nothing is that confident
        assert never == static
        one_step = generate(model, tok, mask_id, prompt, strategy="low_confidence_static", denoising_steps=1)
        always = generate(model, tok, mask_id, prompt, threshold=0.0)  # everything is
        assert always == one_step


def test_calibrated_scale_exercises_both_dynamic_paths(model, tok, mask_id):
    """With DLLM_TEST_LOGIT_SCALE, threshold 0.85 sometimes unmasks several tokens in one step and
    sometimes falls back to n_s = 1 for a whole block."""
    multi = fallback = 0
    for prompt in ["Hello, world", "12 + 30 = 42", "The quick brown fox jumps"]:
        ids = tok.encode(prompt)
        ids = ids[: len(ids) // B * B]
        res = generate(model, tok, mask_id, ids, max_new_tokens=24)
        for k in range(0, 24, B):
            distinct = len(set(res.step_map[k : k + B]))
            multi += distinct < B
            fallback += distinct == B
    assert multi and fallback


def test_cut_equals_whole_blocks_then_cut(model, tok, mask_id):
    for prompt in PROMPTS:
        full = generate(model, tok, mask_id, prompt, max_new_tokens=16)
        for n in (1, 5, 8):
            short = generate(model, tok, mask_id, prompt, max_new_tokens=n)
            assert short.finish_reason == "length"
            assert short.token_ids == full.token_ids[:n]
            assert short.step_map == full.step_map[:n]
            assert short.logprobs == full.logprobs[:n]
        # Stop at the first occurrence of a token that shows up in the second half.
        stop = full.token_ids[9]
        j = full.token_ids.index(stop)
        stopped = generate(model, tok, mask_id, prompt, max_new_tokens=16, stop_ids={stop, -1})
        assert stopped.finish_reason == "stop"
        assert stopped.token_ids == full.token_ids[: j + 1]
        assert stopped.step_map == full.step_map[: j + 1]
        # A stop id beyond max_new_tokens does not count.
        late = generate(model, tok, mask_id, prompt, max_new_tokens=j, stop_ids={stop})
        assert late.finish_reason == "length" and late.token_ids == full.token_ids[:j]


def test_never_opens_a_block_past_the_budget(model, tok, mask_id, monkeypatch):
    lengths: list[int] = []

    def spy(model_, token_ids, block_length):
        lengths.append(len(token_ids))
        return block_causal_logits(model_, token_ids, block_length)

    monkeypatch.setattr(dllm_reference, "block_causal_logits", spy)
    ids = tok.encode("Hello, world")[:6]  # prompt ends mid-block
    res = generate(model, tok, mask_id, ids, max_new_tokens=2)  # exactly fills block 1
    assert len(res.token_ids) == 2 and max(lengths) == 8
    lengths.clear()
    res = generate(model, tok, mask_id, ids, max_new_tokens=3)
    assert len(res.token_ids) == 3 and max(lengths) == 12
    lengths.clear()
    res = generate(model, tok, mask_id, ids, max_new_tokens=0)
    assert res.token_ids == [] and res.finish_reason == "length" and lengths == []


def test_prompt_tokens_equal_to_mask_id_are_not_decoded(model, tok, mask_id):
    ids = [*tok.encode("Hi"), mask_id]  # a literal <|MASK|> in the prompt stays a prompt token
    res = generate(model, tok, mask_id, ids, max_new_tokens=5)
    assert len(res.token_ids) == 5 and res.step_map[0] == 1
