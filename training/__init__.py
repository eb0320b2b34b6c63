"""Training and evaluation of the tiny default models shipped in `models/` (see docs/training.md)."""
