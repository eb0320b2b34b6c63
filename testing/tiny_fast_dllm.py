"""The short import path tests, benches and the docs use for Fast-dLLM v2's tiny checkpoints; the
writer is testing/tiny/fast_dllm_qwen.py."""

from testing.tiny.fast_dllm_qwen import (
    FAST_DLLM_TEST_LOGIT_SCALE,
    MASK_TEXT,
    load_hf_qwen2,
    write_tiny_fast_dllm,
)

__all__ = ["FAST_DLLM_TEST_LOGIT_SCALE", "MASK_TEXT", "load_hf_qwen2", "write_tiny_fast_dllm"]
