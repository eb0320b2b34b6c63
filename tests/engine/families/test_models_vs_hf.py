"""AR (qwen3) generation against Hugging Face transformers `Qwen3ForCausalLM`, through the offline pipeline.

Real tiny checkpoints on disk (tied / untied, single file / sharded), the real tokenizer, the real
engine; the oracle is `Qwen3ForCausalLM.generate` (greedy, no eos stop) in float32.
"""

from __future__ import annotations

import pytest
import torch

from engine import EngineConfig, GenerationConfig, pipeline
from testing.tiny_checkpoint import load_hf_reference, write_tiny_checkpoint
from tests.support.lm_head import record_lm_head_rows

# logit_scale 2: distributions are still spread (logprobs are informative) but greedy choices are
# not near-ties, so float32 rounding differences between two implementations cannot flip them.
LOGIT_SCALE = 2.0
PROMPT_LENGTHS = (1, 3, 17, 40)
NEW_TOKENS = 8
TOL = 1e-4

CHECKPOINTS = {
    # name: (tie_word_embeddings, num_shards, seed)
    "untied-single": (False, 1, 0),
    "tied-single": (True, 1, 1),
    "untied-sharded": (False, 3, 2),
    "tied-sharded": (True, 2, 3),
}


def make_prompt(length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(1000 + seed)
    return torch.randint(0, 320, (length,), generator=g).tolist()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for name, (tied, shards, seed) in CHECKPOINTS.items():
        path = write_tiny_checkpoint(tmp_path_factory.mktemp(name), model_type="qwen3",
                                     tie_word_embeddings=tied, num_shards=shards, seed=seed,
                                     logit_scale=LOGIT_SCALE)
        hf = load_hf_reference(path)
        hf.generation_config.eos_token_id = None  # never stop early: compare full greedy runs
        out[name] = (path, hf)
    return out


_hf_cache: dict = {}


def hf_greedy(hf, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """HF greedy tokens and the raw logits [n, vocab] that chose them."""
    key = (id(hf), tuple(prompt), n)
    if key not in _hf_cache:
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                              return_dict_in_generate=True, output_logits=True)
        tokens = out.sequences[0, len(prompt):].tolist()
        assert len(tokens) == n, "HF stopped early: eos must be disabled for the oracle"
        _hf_cache[key] = (tokens, torch.stack(out.logits, 1)[0].float())
    return _hf_cache[key]


def greedy(**kw) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=NEW_TOKENS, ignore_eos=True, **kw)


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_greedy_tokens_equal_hf(checkpoints, name):
    path, hf = checkpoints[name]
    with pipeline(str(path), EngineConfig(max_model_len=128)) as pipe:
        for i, length in enumerate(PROMPT_LENGTHS):
            prompt = make_prompt(length, i)
            want, _ = hf_greedy(hf, prompt, NEW_TOKENS)
            got = pipe(prompt, greedy())
            assert got.token_ids == want, f"{name}, prompt length {length}"
            assert got.finish_reason == "length"
            assert got.input_token_len == length and got.generate_token_len == NEW_TOKENS
            assert got.step_map is None and got.logprobs is None
            assert got.text == pipe.tokenizer.decode(want, skip_special_tokens=True)


def test_text_prompt_equals_hf_on_its_token_ids(checkpoints):
    path, hf = checkpoints["untied-single"]
    with pipeline(str(path)) as pipe:
        text = "Question: what is 12 + 30? Answer:"
        ids = pipe.tokenizer.encode(text, add_special_tokens=False)
        want, _ = hf_greedy(hf, ids, NEW_TOKENS)
        assert pipe(text, greedy()).token_ids == want
        assert pipe(ids, greedy()).token_ids == want


@pytest.mark.parametrize("name", ["tied-sharded"])
def test_batch_of_eight_mixed_lengths_equals_each_alone(checkpoints, name):
    path, hf = checkpoints[name]
    lengths = [1, 40, 3, 17, 9, 2, 25, 5]
    prompts = [make_prompt(n, 50 + i) for i, n in enumerate(lengths)]
    with pipeline(str(path), EngineConfig(max_model_len=128, kv_block_size=8)) as pipe:
        alone = [pipe(p, greedy()).token_ids for p in prompts]
        before = pipe.engine.stats.forwards
        batch = pipe(prompts, greedy())
        forwards = pipe.engine.stats.forwards - before
    assert [r.token_ids for r in batch] == alone
    assert forwards == NEW_TOKENS, "the 8 requests should run in the same forwards (continuous batching)"
    for prompt, tokens in zip(prompts, alone, strict=True):
        assert tokens == hf_greedy(hf, prompt, NEW_TOKENS)[0]


@pytest.mark.parametrize("mode", ["raw_logprobs", "raw_logits"])
@pytest.mark.parametrize("name", ["untied-single", "tied-sharded"])
def test_output_logprobs_match_hf(checkpoints, name, mode):
    path, hf = checkpoints[name]
    k = 5
    with pipeline(str(path), EngineConfig(max_model_len=128, logprobs_mode=mode)) as pipe:
        prompts = [make_prompt(n, 70 + i) for i, n in enumerate((3, 17))]
        outs = pipe(prompts, greedy(logprobs=k))
        zero = pipe(prompts[0], greedy(logprobs=0))
    for prompt, out in zip(prompts, outs, strict=True):
        want_tokens, logits = hf_greedy(hf, prompt, NEW_TOKENS)
        assert out.token_ids == want_tokens
        values = logits if mode == "raw_logits" else logits.log_softmax(-1)
        assert out.logprobs is not None and len(out.logprobs) == NEW_TOKENS
        for step, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
            top_v, top_i = torch.topk(values[step], k)
            # greedy: the chosen token is the top-1, so the entry is exactly the top-k, in order
            assert list(entry) == top_i.tolist(), f"step {step}"
            assert list(entry)[0] == tok
            got = torch.tensor(list(entry.values()))
            torch.testing.assert_close(got, top_v, atol=TOL, rtol=0)
            assert abs(entry[tok] - float(values[step, tok])) < TOL
    # logprobs=0: the chosen token only
    want_tokens, logits = hf_greedy(hf, prompts[0], NEW_TOKENS)
    values = logits if mode == "raw_logits" else logits.log_softmax(-1)
    assert zero.token_ids == want_tokens
    for step, (tok, entry) in enumerate(zip(zero.token_ids, zero.logprobs, strict=True)):
        assert list(entry) == [tok]
        assert abs(entry[tok] - float(values[step, tok])) < TOL


@pytest.mark.parametrize("budget", [1, 7])
def test_chunked_prefill_gives_identical_outputs(checkpoints, budget):
    path, hf = checkpoints["untied-sharded"]
    prompts = [make_prompt(n, 90 + i) for i, n in enumerate((40, 17, 3))]
    if budget == 1:
        prompts = prompts[1:2]  # one token per forward: keep it short
    cfg = dict(max_model_len=128, kv_block_size=4, logprobs_mode="raw_logprobs")
    with pipeline(str(path), EngineConfig(**cfg)) as pipe:
        full = pipe(prompts, greedy(logprobs=3))
    with pipeline(str(path), EngineConfig(max_prefill_token_num=budget, **cfg)) as pipe:
        alone = pipe(prompts[0], greedy(logprobs=3))
        prefill_forwards = pipe.engine.stats.forwards - (NEW_TOKENS - 1)
        chunked = pipe(prompts, greedy(logprobs=3)) if len(prompts) > 1 else [alone]
    assert prefill_forwards == -(-len(prompts[0]) // budget), "the prompt must be prefilled in chunks"
    assert alone.token_ids == full[0].token_ids
    for a, b, prompt in zip(chunked, full, prompts, strict=True):
        assert a.token_ids == b.token_ids == hf_greedy(hf, prompt, NEW_TOKENS)[0]
        for ea, eb in zip(a.logprobs, b.logprobs, strict=True):
            assert list(ea) == list(eb)
            for t in ea:
                assert abs(ea[t] - eb[t]) < TOL


def test_lm_head_projects_only_sampled_rows(checkpoints):
    """Prefill chunks that sample nothing project no rows; each step projects one row per sequence."""
    path, hf = checkpoints["untied-single"]
    prompt = make_prompt(17, 120)
    with pipeline(str(path), EngineConfig(max_prefill_token_num=4, kv_block_size=4)) as pipe:
        rows = record_lm_head_rows(pipe)
        out = pipe(prompt, greedy())
    assert out.token_ids == hf_greedy(hf, prompt, NEW_TOKENS)[0]
    assert [r for r in rows if r] == [1] * NEW_TOKENS
