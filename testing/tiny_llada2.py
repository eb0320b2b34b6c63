"""The short import path tests, benches and the docs use for LLaDA2's tiny checkpoints; the writer is
testing/tiny/llada2_moe.py."""

from testing.tiny.llada2_moe import MASK_TEXT, write_tiny_llada2

__all__ = ["MASK_TEXT", "write_tiny_llada2"]
