"""The import path tests and benches use for LLaDA2's tiny checkpoints; the writer lives with its
family (engine/model/families/llada2_moe/tiny.py)."""

from engine.model.families.llada2_moe.tiny import MASK_TEXT, write_tiny_llada2

__all__ = ["MASK_TEXT", "write_tiny_llada2"]
