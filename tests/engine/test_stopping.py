"""The one stop rule: an output ends at the token that completes the first stop (stop id or stop
string) or at max_new_tokens, and text, token_ids, step_map, logprobs, finish_reason and the matched
stop all describe that same prefix -- streamed or not.

Each scenario is found in a real greedy run without stops (the tiny checkpoints have random
weights), then replayed with stops chosen from it and compared with "decode everything, cut
afterwards" computed here by brute force.
"""

from __future__ import annotations

import pytest

from engine import EngineConfig, GenerationConfig, Response, pipeline
from testing.tiny_checkpoint import DLLM_TEST_LOGIT_SCALE, write_tiny_checkpoint

B = 4
MAX_NEW = 40


@pytest.fixture(scope="module")
def sdar_pipe(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("sdar_stop"), model_type="sdar", seed=21,
                                 logit_scale=DLLM_TEST_LOGIT_SCALE)
    cfg = EngineConfig(max_model_len=256, num_kv_blocks=128, kv_block_size=8, dllm_block_length=B,
                       logprobs_mode="raw_logprobs", dllm_unmasking_strategy="low_confidence_dynamic",
                       dllm_confidence_threshold=0.5)
    with pipeline(str(path), cfg) as pipe:
        yield pipe


@pytest.fixture(scope="module")
def ar_pipe(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("ar_stop"), model_type="qwen3", seed=22)
    with pipeline(str(path), EngineConfig(max_model_len=256, logprobs_mode="raw_logprobs")) as pipe:
        yield pipe


def _prompts(n: int) -> list[list[int]]:
    return [[(13 * i + 7 * k) % 300 + 5 for i in range(3 + k % 6)] for k in range(n)]


def _decode(pipe, ids: list[int]) -> str:
    return pipe.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def _clean(text: str) -> bool:
    return bool(text.strip()) and "\ufffd" not in text


def _expected_cut(pipe, ids: list[int], stop_ids: set[int], words: list[str], max_new: int):
    """(n, finish_reason, matched, text) by brute force over prefixes."""
    for n in range(1, len(ids) + 1):
        if ids[n - 1] in stop_ids:
            return n, "stop", ids[n - 1], _decode(pipe, ids[: n - 1])
        text = _decode(pipe, ids[:n])
        hits = [(text.find(w), w) for w in words if w in text]
        if hits:
            start, word = min(hits)
            return n, "stop", word, text[:start]
        if n == max_new:
            return n, "length", None, text
    raise AssertionError("the unstopped run is too short")


def _full(pipe, prompt, **kw) -> Response:
    gen = GenerationConfig(max_new_tokens=MAX_NEW, ignore_eos=True, logprobs=0, **kw)
    return pipe(prompt, gen)


def _check(pipe, prompt, full: Response, *, stop_ids=(), words=(), max_new=MAX_NEW):
    """The stopped run equals the unstopped run cut by brute force, unary and streamed."""
    n, reason, matched, text = _expected_cut(pipe, full.token_ids, set(stop_ids), list(words), max_new)
    gen = GenerationConfig(max_new_tokens=max_new, ignore_eos=True, logprobs=0, stop_token_ids=list(stop_ids) or None,
                           stop_words=list(words) or None, return_step_trace=True)
    got = pipe(prompt, gen)
    streamed = Response.from_chunks(list(pipe.stream(prompt, gen)))
    for out in (got, streamed):
        assert out.token_ids == full.token_ids[:n]
        assert out.finish_reason == reason and out.matched == matched
        assert out.text == text
        assert out.logprobs == full.logprobs[:n]
        if full.step_map is not None:
            assert out.step_map == full.step_map[:n]
            assert all(p < n for event in out.step_trace for p in event["positions"]), "trace past the output"
        assert out.generate_token_len == n
    return n


def _dllm_runs(pipe, count=12):
    for prompt in _prompts(count):
        yield prompt, _full(pipe, prompt)


def test_dllm_stop_string_and_later_stop_id_in_one_step(sdar_pipe):
    """One step reveals positions i < j: a stop string completed at i and a stop id at j. The output
    ends at i (the first stop), not at j."""
    for prompt, full in _dllm_runs(sdar_pipe):
        ids, steps = full.token_ids, full.step_map
        for i in range(len(ids)):
            word = _decode(sdar_pipe, [ids[i]])
            if not _clean(word) or word in _decode(sdar_pipe, ids[:i]):
                continue
            later = [j for j in range(i + 1, len(ids)) if steps[j] == steps[i] and ids[j] not in ids[: j]]
            if later:
                n = _check(sdar_pipe, prompt, full, stop_ids=[ids[later[0]]], words=[word])
                assert n == i + 1
                return
    pytest.fail("no step revealed two tokens usable for this scenario")


def test_dllm_stop_string_spanning_two_blocks(sdar_pipe):
    for prompt, full in _dllm_runs(sdar_pipe):
        ids = full.token_ids
        first_gen_block_end = B - len(prompt) % B  # generated index where the second block starts
        for g in range(first_gen_block_end, len(ids), B):
            left, right = _decode(sdar_pipe, [ids[g - 1]]), _decode(sdar_pipe, [ids[g]])
            if not (_clean(left) and _clean(right)):
                continue
            word = left[-1] + right[0]
            if word in _decode(sdar_pipe, ids[:g]):
                continue
            n = _check(sdar_pipe, prompt, full, words=[word])
            assert n == g + 1
            return
    pytest.fail("no block boundary usable for this scenario")


def test_dllm_stop_string_revealed_before_earlier_positions(sdar_pipe):
    """Token j (a stop string) is revealed while an earlier position of its block is still masked:
    nothing ends until the earlier positions are revealed, then the output ends at j."""
    for prompt, full in _dllm_runs(sdar_pipe):
        ids, steps = full.token_ids, full.step_map
        for j in range(1, len(ids)):
            word = _decode(sdar_pipe, [ids[j]])
            if not _clean(word) or word in _decode(sdar_pipe, ids[:j]):
                continue
            if any(steps[i] > steps[j] for i in range(max(0, j - B + 1), j)):
                n = _check(sdar_pipe, prompt, full, words=[word])
                assert n == j + 1
                return
    pytest.fail("no out-of-order reveal usable for this scenario")


def test_dllm_stop_id_inside_block_and_max_new_tokens(sdar_pipe):
    prompt, full = next(_dllm_runs(sdar_pipe, 1))
    ids = full.token_ids
    j = next(j for j in range(5, len(ids)) if ids[j] not in ids[:j])
    assert _check(sdar_pipe, prompt, full, stop_ids=[ids[j]]) == j + 1
    for max_new in (1, B + 1, 2 * B + 3):  # cut inside a block
        assert _check(sdar_pipe, prompt, full, max_new=max_new) == max_new


def test_ar_stop_string_completed_by_last_allowed_token(ar_pipe):
    for prompt in _prompts(12):
        full = _full(ar_pipe, prompt)
        ids = full.token_ids
        for n in range(4, len(ids)):
            word = _decode(ar_pipe, [ids[n - 1]])
            if _clean(word) and word not in _decode(ar_pipe, ids[: n - 1]):
                got = _check(ar_pipe, prompt, full, words=[word], max_new=n)
                assert got == n
                out = ar_pipe(prompt, GenerationConfig(max_new_tokens=n, ignore_eos=True, stop_words=[word]))
                assert out.finish_reason == "stop" and out.matched == word, "not 'length'"
                return
    pytest.fail("no usable token")


def test_ar_stop_id_and_include_stop_str(ar_pipe):
    prompt = _prompts(1)[0]
    full = _full(ar_pipe, prompt)
    ids = full.token_ids
    j = next(j for j in range(3, len(ids)) if ids[j] not in ids[:j] and _clean(_decode(ar_pipe, [ids[j]])))
    assert _check(ar_pipe, prompt, full, stop_ids=[ids[j]]) == j + 1
    word = _decode(ar_pipe, [ids[j]])
    out = ar_pipe(prompt, GenerationConfig(max_new_tokens=MAX_NEW, ignore_eos=True, stop_token_ids=[ids[j]],
                                           include_stop_str_in_output=True))
    assert out.text == _decode(ar_pipe, ids[: j + 1]) and out.text.endswith(word)
