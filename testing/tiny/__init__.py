"""Tiny random checkpoints in each family's real on-disk format, one writer module per family (named as
its package under engine/model/families; `qwen3` writes all four Qwen3-layer families), plus the
byte-level tokenizer and shard layout they share (`tokenizer`). Built offline and deterministically:
nothing is downloaded, and a seed gives the same files."""
