"""Helpers outside the runtime: tiny checkpoints in the real on-disk format for tests and benches."""
