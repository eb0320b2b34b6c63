"""The import path tests and benches use for Fast-dLLM v2's tiny checkpoints; the writer lives with
its family (engine/model/families/fast_dllm_qwen/tiny.py)."""

from engine.model.families.fast_dllm_qwen.tiny import (
    FAST_DLLM_TEST_LOGIT_SCALE,
    MASK_TEXT,
    load_hf_qwen2,
    write_tiny_fast_dllm,
)

__all__ = ["FAST_DLLM_TEST_LOGIT_SCALE", "MASK_TEXT", "load_hf_qwen2", "write_tiny_fast_dllm"]
