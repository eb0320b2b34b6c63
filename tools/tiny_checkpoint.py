"""The import path tests, benches and training use for the Qwen3-layer families' tiny checkpoints
(qwen3, qwen3_moe, sdar, sdar_moe) and the shared tiny tokenizer. The writer lives with its family
(engine/model/families/qwen3/tiny.py); the tokenizer beside the families
(engine/model/families/tiny_tokenizer.py)."""

from engine.model.families.qwen3.tiny import (
    DLLM_TEST_LOGIT_SCALE,
    MODEL_TYPES,
    load_hf_reference,
    write_tiny_checkpoint,
)
from engine.model.families.tiny_tokenizer import SPECIAL_TOKENS, build_byte_tokenizer, write_tokenizer

__all__ = ["DLLM_TEST_LOGIT_SCALE", "MODEL_TYPES", "SPECIAL_TOKENS", "build_byte_tokenizer", "load_hf_reference",
           "write_tiny_checkpoint", "write_tokenizer"]
