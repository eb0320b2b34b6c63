"""The model: one package per model family (engine.model.families, keyed by `model_type`), the shared
building blocks their networks are made of (engine.model.layers), checkpoint reading, and the one
checked loop that loads or stages weights. Runs on any rank; imports nothing above it."""
