"""The short import path tests, benches, training and the docs use for the Qwen3-layer families' tiny
checkpoints (qwen3, qwen3_moe, sdar, sdar_moe) and the shared tiny tokenizer: the writer is
testing/tiny/qwen3.py, the tokenizer testing/tiny/tokenizer.py."""

from testing.tiny.qwen3 import (
    DLLM_TEST_LOGIT_SCALE,
    MODEL_TYPES,
    load_hf_reference,
    write_tiny_checkpoint,
)
from testing.tiny.tokenizer import SPECIAL_TOKENS, build_byte_tokenizer, write_tokenizer

__all__ = ["DLLM_TEST_LOGIT_SCALE", "MODEL_TYPES", "SPECIAL_TOKENS", "build_byte_tokenizer", "load_hf_reference",
           "write_tiny_checkpoint", "write_tokenizer"]
