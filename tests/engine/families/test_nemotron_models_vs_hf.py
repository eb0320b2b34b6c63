"""Nemotron-Labs-Diffusion served autoregressively (`dllm_mode="ar"`), against transformers'
`Ministral3ForCausalLM` built from the same tiny checkpoint (released names mapped: `encoder.` ->
`model.`, `diffusion_head` -> `lm_head`), float32 on the CPU.

The tiny checkpoint's original context is 32 positions (YaRN factor 8), so prompts and continuations
past it exercise the YaRN frequencies and the Llama-4 query factor, which changes at 32, 64 and 96.
"""

from __future__ import annotations

import pytest
import torch

from configs import EngineConfig
from engine import GenerationConfig, pipeline
from engine.model.checkpoint import load_model_spec
from engine.worker.forward_batch import ForwardBatch, page_table_array
from engine.worker.runner import ModelRunner
from testing.tiny.nemotron_labs_diffusion import load_ministral3, write_tiny_nemotron_labs_diffusion

TOL = 1e-4
PAGE = 4
NEW_TOKENS = 12
LOGIT_SCALE = 2.0  # spread distributions, greedy choices far from ties


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_nemotron_labs_diffusion(tmp_path_factory.mktemp("nld"), seed=3, logit_scale=LOGIT_SCALE)


@pytest.fixture(scope="module")
def hf(ckpt):
    model = load_ministral3(ckpt)
    model.generation_config.eos_token_id = None  # never stop early: compare full greedy runs
    return model


def make_prompt(length: int, seed: int) -> list[int]:
    return torch.randint(0, 320, (length,), generator=torch.Generator().manual_seed(500 + seed)).tolist()


def test_runner_logits_equal_transformers_across_chunks(ckpt, hf):
    """A 70-token prefill, then chunks of 5 and 35 over the paged cache: every row's full-vocabulary
    logits equal one transformers forward over the 110 tokens."""
    runner = ModelRunner(load_model_spec(ckpt), EngineConfig(device="cpu", dtype="float32", kv_block_size=PAGE,
                                                             num_kv_blocks=64))
    ids, pages = make_prompt(110, 0), list(range(1, 29))  # pages out of order: page 0 unused

    def forward(start: int, tokens: list[int]) -> torch.Tensor:
        n = len(tokens)
        batch = ForwardBatch(input_ids=tokens, positions=list(range(start, start + n)), q_lens=[n],
                             kv_lens=[start + n], page_tables=page_table_array([pages[::-1]]),
                             sample_rows=list(range(n)),
                             slot_mapping=[pages[::-1][i // PAGE] * PAGE + i % PAGE for i in range(start, start + n)])
        return runner.execute(batch).logits

    got = torch.cat([forward(0, ids[:70]), forward(70, ids[70:75]), forward(75, ids[75:])])
    with torch.inference_mode():
        want = hf(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(got, want, atol=TOL, rtol=0)


def test_query_scaling_matters_past_the_original_context(ckpt, hf):
    """Without the Llama-4 factor the rows before position 32 still agree and the later ones do not: the
    parity above checks the factor, not a no-op."""
    runner = ModelRunner(load_model_spec(ckpt), EngineConfig(device="cpu", dtype="float32", kv_block_size=PAGE,
                                                             num_kv_blocks=64))
    runner.model.query_beta = 0.0
    ids = make_prompt(48, 1)
    batch = ForwardBatch(input_ids=ids, positions=list(range(48)), q_lens=[48], kv_lens=[48],
                         slot_mapping=list(range(48)), page_tables=page_table_array([list(range(12))]),
                         sample_rows=list(range(48)))
    got = runner.execute(batch).logits
    with torch.inference_mode():
        want = hf(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(got[:32], want[:32], atol=TOL, rtol=0)
    assert (got[32:] - want[32:]).abs().max() > 0.1


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def test_pipeline_greedy_equals_transformers_generate(ckpt, hf):
    """Greedy tokens through the offline pipeline equal `generate()`'s, alone and batched, for prompts
    of 1, 7 and 40 tokens (the last crosses the original context while it decodes)."""
    prompts = [make_prompt(n, 10 + i) for i, n in enumerate((1, 7, 40))]
    want = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    gen = GenerationConfig(max_new_tokens=NEW_TOKENS, ignore_eos=True, dllm_mode="ar")
    with pipeline(str(ckpt), EngineConfig(max_model_len=128, kv_block_size=8)) as pipe:
        alone = [pipe(p, gen) for p in prompts]
        batch = pipe(prompts, gen)
    for prompt, out, together, tokens in zip(prompts, alone, batch, want, strict=True):
        assert out.token_ids == tokens == together.token_ids, f"prompt length {len(prompt)}"
        assert out.finish_reason == "length" and out.step_map is None


def test_raw_logprobs_equal_transformers(ckpt, hf):
    prompt = make_prompt(30, 20)  # decodes across position 32
    gen = GenerationConfig(max_new_tokens=NEW_TOKENS, ignore_eos=True, logprobs=3, dllm_mode="ar")
    with pipeline(str(ckpt), EngineConfig(max_model_len=128, logprobs_mode="raw_logprobs")) as pipe:
        out = pipe(prompt, gen)
    ids = torch.tensor([prompt + out.token_ids])
    with torch.inference_mode():
        logprobs = hf(ids).logits[0, len(prompt) - 1:-1].float().log_softmax(-1)
    assert out.token_ids == hf_greedy(hf, prompt, NEW_TOKENS)
    for row, (token, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        top_v, top_i = torch.topk(logprobs[row], 3)
        assert list(entry) == top_i.tolist() and list(entry)[0] == token
        torch.testing.assert_close(torch.tensor(list(entry.values())), top_v, atol=TOL, rtol=0)


def test_chat_template_is_the_release_layout(ckpt):
    with pipeline(str(ckpt)) as pipe:
        text = pipe.tokenizer.apply_chat_template([{"role": "user", "content": "2+2?"}], tokenize=False,
                                                  add_generation_prompt=True)
        thinking = pipe.tokenizer.apply_chat_template([{"role": "user", "content": "2+2?"}], tokenize=False,
                                                      add_generation_prompt=True, enable_thinking=True)
    head = "<|im_start|>system\n<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    assert text == head + "<think></think>"
    assert thinking == head + "<think>\n"


def test_input_token_scoring_in_ar_mode_equals_transformers(ckpt, hf):
    """A request decoded with dllm_mode='ar' is an autoregressive model's: it may score its input tokens
    (max_new_tokens=0, logprob_start_len), the values transformers' log_softmax gives; a diffusion-mode
    request may not, naming the field."""
    prompt = make_prompt(30, 7)
    gen = GenerationConfig(max_new_tokens=0, logprob_start_len=4, logprobs=2, dllm_mode="ar")
    with pipeline(str(ckpt), EngineConfig(max_model_len=128, kv_block_size=PAGE, logprobs_mode="raw_logprobs")) as pipe:
        out = pipe(prompt, gen)
        with pytest.raises(ValueError, match="logprob_start_len"):
            pipe(prompt, gen.model_copy(update={"dllm_mode": "diffusion", "max_new_tokens": 8}))
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    rows = out.input_token_logprobs
    assert [t for _, t in rows] == prompt[5:]
    got = torch.tensor([v for v, _ in rows])
    want = torch.stack([expected[p, prompt[p + 1]] for p in range(4, len(prompt) - 1)])
    torch.testing.assert_close(got, want, atol=TOL, rtol=0)
