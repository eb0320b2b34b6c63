"""AR: the first generated token may be a stop id (min_new_tokens=0), as in HF generate().

The logits of an AR row at position p decide token p + 1; suppressing stop ids by p (not p + 1)
once masked the stop ids for the first token and one token past min_new_tokens."""

from __future__ import annotations

from engine import EngineConfig, GenerationConfig, pipeline
from testing.tiny_checkpoint import write_tiny_checkpoint


def test_first_token_can_be_a_stop_id(tmp_path):
    path = write_tiny_checkpoint(tmp_path, model_type="qwen3", seed=3)
    with pipeline(str(path), EngineConfig(num_kv_blocks=64)) as pipe:
        free = pipe([5, 6, 7, 8], GenerationConfig(max_new_tokens=4, ignore_eos=True))
        first = free.token_ids[0]
        r = pipe([5, 6, 7, 8], GenerationConfig(max_new_tokens=4, ignore_eos=True, stop_token_ids=[first]))
        assert r.token_ids == [first] and r.finish_reason == "stop"
        # min_new_tokens=m suppresses stop ids for exactly the first m tokens
        second = free.token_ids[1]
        r = pipe([5, 6, 7, 8], GenerationConfig(max_new_tokens=4, ignore_eos=True, stop_token_ids=[second],
                                                min_new_tokens=1))
        assert r.token_ids == free.token_ids[:2] and r.finish_reason == "stop"
